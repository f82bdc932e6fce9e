"""The command line of a launched vLLM / SGLang server, as the launcher runs it: the engine's
command (tuner.schema.engine_command, the one the manifests carry too) with the program resolved to the
local environment's executable.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Literal

from tuner.schema.engine_command import PROGRAMS, Place, ServerSettings, engine_command, launched_env
from tuner.schema.config import LaunchedEngineConfig, SpecConfig, UserError

Kind = Literal["vllm", "sglang"]
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # engine/launch/command.py -> the checkout
SETUP_HINT = {"vllm": "make vllm", "sglang": "make sglang"}


def resolve_executable(executable: str) -> str:
    """An absolute path for `executable`: as given (relative to the working directory), else
    relative to the project root (where `make vllm` puts .venv-vllm), else on PATH; '' if none."""
    for cand in (Path(executable).expanduser(), PROJECT_ROOT / executable):
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand.absolute())
    if os.sep not in executable and (found := shutil.which(executable)):
        return found
    return ""


def local_program(kind: Kind, ecfg: LaunchedEngineConfig, strict: bool = True) -> list[str]:
    """What runs PROGRAMS[kind] from the local environment engine.<kind>.executable (strict=False:
    the path as configured when it is not installed, for a command that is only printed)."""
    exe = resolve_executable(ecfg.executable) or ("" if strict else ecfg.executable)
    if not exe:
        raise UserError(
            f"engine.{kind}.executable={ecfg.executable}: not found (create the environment with "
            f"`{SETUP_HINT[kind]}`, or point engine.{kind}.executable at an installed {kind})"
        )
    if kind == "vllm":
        # A python interpreter runs vLLM's CLI module; anything else is the `vllm` script itself.
        return [exe, "-m", "vllm.entrypoints.cli.main", "serve"] if Path(exe).name.startswith("python") else [exe, "serve"]
    return [exe, "-m", "sglang.launch_server"]


def trial_place(ecfg: LaunchedEngineConfig, model_ref: str) -> Place:
    """A trial's Place: engine.<kind>.host/port and the local checkpoint (never the hub, when local)."""
    return Place(host=ecfg.host, port=ecfg.port, model=model_ref,
                 env={"HF_HUB_OFFLINE": "1"} if Path(model_ref).is_dir() else {})


def settings_for(
    kind: Kind,
    ecfg: LaunchedEngineConfig,
    *,
    served_model_name: str | None = None,
    accelerator: str = "cpu",
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
) -> ServerSettings:
    """ServerSettings given piece by piece (a launcher opened without a config; a study's launcher
    gets tuner.schema.engine_command.server_settings(cfg, kind))."""
    return ServerSettings(kind=kind, tp=tensor_parallel_size, context_length=ecfg.max_model_len, dtype=ecfg.dtype,
                          quantization=None if quantization == "none" else quantization, kv_cache_dtype=kv_cache_dtype,
                          memory_fraction=gpu_memory_utilization,
                          served_names=(served_model_name,) if served_model_name else (),
                          enforce_eager=ecfg.enforce_eager, extra_args=tuple(ecfg.extra_args),
                          env=launched_env(kind, ecfg, accelerator == "cuda", tuple(ecfg.extra_args)))


def local_command(kind: Kind, ecfg: LaunchedEngineConfig, settings: ServerSettings, model_ref: str,
                  spec: SpecConfig, strict: bool = True) -> tuple[list[str], dict[str, str]]:
    """argv and variables (set on top of the inherited environment) of the local server for `spec`."""
    argv, env = engine_command(settings, spec, trial_place(ecfg, model_ref))
    return local_program(kind, ecfg, strict) + argv[len(PROGRAMS[kind]):], env


def server_command(kind: Kind, ecfg: LaunchedEngineConfig, model_ref: str, spec: SpecConfig, **kw: object) -> list[str]:
    """The full argv that starts `kind` serving `model_ref` under `spec` on ecfg.host:ecfg.port
    (keywords: those of settings_for)."""
    if kind not in ("vllm", "sglang"):
        raise UserError(f"engine.kind={kind}: not a launched engine (allowed: vllm, sglang)")
    return local_command(kind, ecfg, settings_for(kind, ecfg, **kw), model_ref, spec)[0]  # type: ignore[arg-type]


def server_env(kind: Kind, ecfg: LaunchedEngineConfig, model_ref: str, accelerator: str) -> dict[str, str]:
    """The variables the launcher sets on top of the inherited environment (no spec: no drafter)."""
    settings = settings_for(kind, ecfg, accelerator=accelerator)
    return engine_command(settings, SpecConfig(method="off"), trial_place(ecfg, model_ref))[1]


def engine_version(kind: Kind, ecfg: LaunchedEngineConfig) -> str | None:
    """The release of `kind` installed in the virtual environment of engine.<kind>.executable, read
    from its package metadata (nothing is run); None when there is none to read."""
    exe = resolve_executable(ecfg.executable)
    if not exe:
        return None
    venv = Path(exe).parent.parent  # <venv>/bin/<executable>
    for meta in sorted(venv.glob(f"lib/python3*/site-packages/{kind}-*.dist-info/METADATA")):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None
