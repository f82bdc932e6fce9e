"""SpecConfig -> engine command-line flags: the one mapping used by the manifests AND the live launchers.

Pure functions over `tuner.schema.config` types (no torch, nothing from `engine`). `engine`'s vLLM /
SGLang launchers call `vllm_args` / `sglang_args` with a local host and port; the renderer calls
them with the pod's. Both therefore serve exactly the configuration that was tuned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tuner.schema.config import SpecConfig, UserError
from tuner.schema.methods import METHODS, engine_methods, engine_refusal


def _draft_ref(spec: SpecConfig, draft_ref: str | None) -> str:
    """The drafter checkpoint: an explicit override (e.g. the path inside a pod) or the spec's own."""
    field = METHODS[spec.method].draft_field
    ref = draft_ref or getattr(spec, field)
    if not ref:
        raise UserError(
            f"spec.{field} is required for spec.method={spec.method} (a local checkpoint dir or HF id of the drafter)"
        )
    return ref


# vLLM's adaptive verification (`enable_adaptive_verification`, vllm#47808 / #52228) by release: the
# vLLM methods it runs for. 0.32's config documents it "only supported for method=dspark".
VLLM_ADAPTIVE_METHODS: dict[str, frozenset[str]] = {"0.32": frozenset({"dspark"})}


def vllm_adaptive_methods(version: str | None) -> frozenset[str]:
    """The vLLM method names whose drafts vLLM `version` verifies adaptively (none when unknown)."""
    if version is None:
        return frozenset()
    return VLLM_ADAPTIVE_METHODS.get(".".join(version.split("+")[0].split(".")[:2]), frozenset())


@dataclass(frozen=True)
class SglangAdaptive:
    """How one SGLang release runs `--speculative-adaptive` (sgl#21599): its knobs come from the JSON
    file `--speculative-adaptive-config` names."""

    overlap_off: bool  # adaptive runs only with the overlap scheduler off (else it silently stays static)
    by_batch_size: bool  # the file maps the smallest batch size of a range to its knobs (sgl#24055)
    zero_steps: bool  # a candidate of 0 steps (no draft) is allowed


# Read from each wheel's server_args.py and speculative/adaptive_spec_params.py: no flag up to 0.5.10;
# EAGLE / EAGLE-3 chains only in every release since.
SGLANG_ADAPTIVE: tuple[tuple[tuple[int, ...], SglangAdaptive], ...] = (
    ((0, 5, 11), SglangAdaptive(overlap_off=True, by_batch_size=False, zero_steps=False)),
    ((0, 5, 12), SglangAdaptive(overlap_off=False, by_batch_size=False, zero_steps=False)),
    ((0, 5, 13), SglangAdaptive(overlap_off=False, by_batch_size=True, zero_steps=False)),
    ((0, 5, 14), SglangAdaptive(overlap_off=False, by_batch_size=True, zero_steps=True)),
)
SGLANG_ADAPTIVE_FIRST = ".".join(map(str, SGLANG_ADAPTIVE[0][0]))
SGLANG_ADAPTIVE_METHODS = ("eagle", "eagle3")


def _release(version: str) -> tuple[int, ...] | None:
    parts = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in parts.group(1).split(".")) if parts else None


def sglang_adaptive(version: str | None) -> SglangAdaptive | None:
    """How SGLang `version` runs adaptive speculation, or None when it has no `--speculative-adaptive`
    (or the version is unknown)."""
    release = _release(version) if version else None
    if release is None:
        return None
    found = None
    for since, how in SGLANG_ADAPTIVE:
        if release >= since:
            found = how
    return found


def adaptive_steps(depth: int, zero_steps: bool) -> list[int]:
    """The step counts SGLang may switch between for a depth bound: 1, about half the bound and the
    bound (each is a captured runtime state, so a few), 0 (no draft) where the release allows it."""
    return sorted({1, (depth + 1) // 2, depth} | ({0} if zero_steps else set()))


def sglang_adaptive_config(spec: SpecConfig, how: SglangAdaptive) -> dict:
    """The JSON object of `--speculative-adaptive-config` for an adaptive spec: its candidate steps
    within spec.depth, for every batch size."""
    knobs = {"candidate_steps": adaptive_steps(spec.depth, how.zero_steps)}
    return {"1": knobs} if how.by_batch_size else knobs


def vllm_speculative_config(spec: SpecConfig, draft_ref: str | None = None, version: str | None = None) -> dict | None:
    """The `--speculative-config` JSON object for vLLM, or None when speculation is off.

    vLLM verifies chains only (tree attention was removed), so topk > 1 is a user error: render
    the study's `chain_spec` instead. `num_speculative_tokens_per_batch_size` carries the tuned
    per-batch-size K schedule when the spec has one; an adaptive spec turns on
    `enable_adaptive_verification`, which vLLM `version` runs for a few methods only
    (VLLM_ADAPTIVE_METHODS; deploy.winner serves the study's static schedule elsewhere).
    """
    if spec.method == "off":
        return None
    if spec.topk != 1:
        raise UserError(
            f"spec.topk={spec.topk} cannot be served by vLLM: it verifies chains only (topk must be 1; "
            "use the study's chain_spec or target sglang)"
        )
    name = METHODS[spec.method].vllm
    if name is None:
        raise UserError(f"spec.method={spec.method} cannot be served by vLLM (allowed: {', '.join(engine_methods('vllm'))})")
    conf: dict = {"method": name, "num_speculative_tokens": spec.depth}
    if spec.method == "ngram":
        conf["prompt_lookup_min"] = spec.ngram_min
        conf["prompt_lookup_max"] = spec.ngram_max
    elif spec.method == "suffix":  # arctic-inference's SuffixDecoding (vLLM verifies its best path)
        conf["suffix_decoding_max_tree_depth"] = spec.suffix_tree_depth
        conf["suffix_decoding_max_cached_requests"] = spec.suffix_max_requests
        conf["suffix_decoding_max_spec_factor"] = spec.suffix_spec_factor
        conf["suffix_decoding_min_token_prob"] = spec.suffix_min_prob
    else:
        conf["model"] = _draft_ref(spec, draft_ref)
    if spec.k_per_batch_size:
        conf["num_speculative_tokens_per_batch_size"] = [list(r) for r in spec.k_per_batch_size]
    if spec.adaptive:
        if name not in vllm_adaptive_methods(version):
            raise UserError(f"spec.adaptive=true with spec.method={spec.method}: vLLM {version or '(version unknown)'} "
                            "verifies adaptively only for method "
                            f"{', '.join(sorted(vllm_adaptive_methods(version))) or 'none known'}; give spec.adaptive=false")
        conf["enable_adaptive_verification"] = True
    return conf


def vllm_args(
    model_ref: str,
    spec: SpecConfig,
    *,
    dtype: str = "auto",
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    gpu_memory_utilization: float | None = None,
    served_model_name: str | Sequence[str] | None = None,
    host: str = "0.0.0.0",
    port: int = 8000,
    enforce_eager: bool = False,
    draft_ref: str | None = None,
    extra_args: Sequence[str] = (),
    version: str | None = None,
) -> list[str]:
    """Arguments after `vllm serve` (the model first, then flags in a fixed order).

    quantization / kv_cache_dtype of None, "none" or "auto" leave vLLM's default. Several
    served_model_name values are all accepted in requests (vLLM's flag takes a list; the first
    one names the metrics' model_name label).
    """
    args = [model_ref, "--host", host, "--port", str(port), "--dtype", dtype]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    if tensor_parallel_size != 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if quantization not in (None, "none"):
        args += ["--quantization", quantization]
    if kv_cache_dtype not in (None, "auto"):
        args += ["--kv-cache-dtype", kv_cache_dtype]
    if gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    if served_model_name:
        names = [served_model_name] if isinstance(served_model_name, str) else list(dict.fromkeys(served_model_name))
        args += ["--served-model-name", *names]
    if enforce_eager:
        args.append("--enforce-eager")
    conf = vllm_speculative_config(spec, draft_ref, version)
    if conf is not None:
        # Compact and key-sorted: the same spec always yields the same bytes (diffable manifests).
        args += ["--speculative-config", json.dumps(conf, sort_keys=True, separators=(",", ":"))]
    return args + list(extra_args)


def sglang_args(
    model_ref: str,
    spec: SpecConfig,
    *,
    tp: int = 1,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    host: str = "0.0.0.0",
    port: int = 8000,
    dtype: str | None = None,
    context_length: int | None = None,
    mem_fraction_static: float | None = None,
    served_model_name: str | None = None,
    draft_ref: str | None = None,
    disable_cuda_graph: bool = False,
    extra_args: Sequence[str] = (),
    version: str | None = None,
    adaptive_config: str | None = None,
) -> list[str]:
    """Arguments after `python -m sglang.launch_server`.

    kv_cache_dtype "fp8" is written as SGLang's `fp8_e4m3`. SGLang forces draft tokens =
    steps + 1 when topk is 1; the SpecConfig rules already guarantee budget == depth + 1 there,
    and this function re-checks it so a launcher never starts a server that silently differs.
    `--enable-metrics` is always on: SGLang serves no /metrics without it, and both the trial
    load generator (tau from `sglang:spec_accept_length`) and the rendered ServiceMonitor/HPA
    (`sglang:num_queue_reqs`) read that page. An adaptive spec (an EAGLE / EAGLE-3 chain, SGLang
    `version` from SGLANG_ADAPTIVE_FIRST) adds `--speculative-adaptive` with the file
    `adaptive_config` (sglang_adaptive_config's JSON; the pod mounts it), its depth the bound.
    """
    args = ["--model-path", model_ref, "--host", host, "--port", str(port), "--enable-metrics"]
    if tp != 1:
        args += ["--tp-size", str(tp)]
    if dtype is not None:
        args += ["--dtype", dtype]
    if quantization not in (None, "none"):
        args += ["--quantization", quantization]
    if kv_cache_dtype not in (None, "auto"):
        args += ["--kv-cache-dtype", "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype]
    if context_length is not None:
        args += ["--context-length", str(context_length)]
    if mem_fraction_static is not None:
        args += ["--mem-fraction-static", f"{mem_fraction_static:g}"]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    if disable_cuda_graph:  # SGLang's counterpart of vLLM's --enforce-eager
        args.append("--disable-cuda-graph")
    if spec.method != "off":
        algo = METHODS[spec.method].sglang
        if algo is None:
            raise UserError(
                f"spec.method={spec.method} cannot be served by SGLang here (allowed: {', '.join(engine_methods('sglang'))})"
            )
        refusal = engine_refusal(spec.method, spec.topk, "sglang")
        if refusal:
            raise UserError(refusal)
        if spec.topk == 1 and spec.budget != spec.depth + 1:
            raise UserError(f"spec.budget={spec.budget} with spec.topk=1 must be spec.depth+1={spec.depth + 1} for SGLang")
        if spec.method == "ngram":
            # SGLang's NGRAM (0.5.9 names) matches a suffix of ngram_min..ngram_max tokens; a trie branch
            # holds the match plus the draft (branch length ngram_max + depth, which SGLang requires to
            # exceed the match window); its BFS breadth is the tree's topk, its draft tokens the budget
            return args + [
                "--speculative-algorithm", algo,
                "--speculative-num-draft-tokens", str(spec.budget),
                "--speculative-ngram-max-bfs-breadth", str(spec.topk),
                "--speculative-ngram-min-match-window-size", str(spec.ngram_min),
                "--speculative-ngram-max-match-window-size", str(spec.ngram_max),
                "--speculative-ngram-branch-length", str(spec.ngram_max + spec.depth),
                "--speculative-ngram-match-type", spec.ngram_match.upper(),
            ] + list(extra_args)
        args += [
            "--speculative-algorithm", algo,
            "--speculative-draft-model-path", _draft_ref(spec, draft_ref),
            "--speculative-num-steps", str(spec.depth),
            "--speculative-eagle-topk", str(spec.topk),
            "--speculative-num-draft-tokens", str(spec.budget),
        ]
        if spec.adaptive:
            args += _sglang_adaptive_args(spec, version, adaptive_config)
    return args + list(extra_args)


def _sglang_adaptive_args(spec: SpecConfig, version: str | None, adaptive_config: str | None) -> list[str]:
    """`--speculative-adaptive` and what SGLang `version` needs with it; a one-line refusal where that
    release cannot run it (SGLang would fall back to static steps without saying so)."""
    how = sglang_adaptive(version)
    if how is None:
        raise UserError(f"spec.adaptive=true: SGLang {version or '(version unknown)'} has no --speculative-adaptive "
                        f"(from {SGLANG_ADAPTIVE_FIRST}); give spec.adaptive=false")
    if spec.method not in SGLANG_ADAPTIVE_METHODS or spec.topk != 1:
        raise UserError(f"spec.adaptive=true with '{spec.key()}': SGLang adapts EAGLE / EAGLE-3 chains only (topk=1); "
                        "give spec.adaptive=false")
    if not adaptive_steps(spec.depth, how.zero_steps)[1:]:
        raise UserError(f"spec.adaptive=true with spec.depth={spec.depth}: SGLang {version} needs two step counts "
                        "to switch between; give spec.depth >= 2")
    if adaptive_config is None:
        raise UserError("spec.adaptive=true: SGLang reads its adaptive knobs from a file, which only the rendered "
                        "manifests provide (a trial measures adaptive speculation on the built-in engine)")
    args = ["--speculative-adaptive", "--speculative-adaptive-config", adaptive_config]
    return args + (["--disable-overlap-schedule"] if how.overlap_off else [])


_HYDRA_PLAIN = re.compile(r"[A-Za-z0-9_./:@+-]+")


def _hydra_value(v: object) -> str:
    """One override value in Hydra's grammar (quote strings with unusual characters)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_hydra_value(x) for x in v) + "]"
    s = str(v)
    if isinstance(v, str) and not _HYDRA_PLAIN.fullmatch(s):
        return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return s


def builtin_args(
    model: str,
    spec: SpecConfig,
    *,
    host: str = "0.0.0.0",
    port: int = 8000,
    dtype: str | None = None,
    weights: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Hydra overrides after `tuner serve`: model and engine groups, every spec.* field, serve.host/port.

    All spec fields are written (not only non-defaults) so the served config never depends on
    the image's conf/ defaults.
    """
    args = [f"model={model}", "engine=builtin"]
    for name, value in spec.model_dump(mode="python").items():
        args.append(f"spec.{name}={_hydra_value(value)}")
    if dtype is not None:
        args.append(f"engine.builtin.dtype={dtype}")
    if weights is not None:
        args.append(f"engine.builtin.weights={weights}")
    args += [f"serve.host={_hydra_value(host)}", f"serve.port={port}"]
    return args + list(extra_args)
