"""The command line of a launched vLLM / SGLang server: the executable, its argv for a SpecConfig
(the flags come from `tuner.schema.flags`, the one mapping the manifests use too) and the variables set
on top of the inherited environment.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Literal

from tuner.schema.flags import sglang_args, vllm_args
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


def server_command(
    kind: Kind,
    ecfg: LaunchedEngineConfig,
    model_ref: str,
    spec: SpecConfig,
    *,
    served_model_name: str | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
) -> list[str]:
    """The full argv that starts `kind` serving `model_ref` under `spec` on ecfg.host:ecfg.port."""
    exe = resolve_executable(ecfg.executable)
    if not exe:
        raise UserError(
            f"engine.{kind}.executable={ecfg.executable}: not found (create the environment with "
            f"`{SETUP_HINT[kind]}`, or point engine.{kind}.executable at an installed {kind})"
        )
    if kind == "vllm":
        # A python interpreter runs vLLM's CLI module; anything else is the `vllm` script itself.
        head = [exe, "-m", "vllm.entrypoints.cli.main", "serve"] if Path(exe).name.startswith("python") else [exe, "serve"]
        return head + vllm_args(
            model_ref, spec, dtype=ecfg.dtype, max_model_len=ecfg.max_model_len,
            tensor_parallel_size=tensor_parallel_size, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=gpu_memory_utilization, served_model_name=served_model_name,
            host=ecfg.host, port=ecfg.port, enforce_eager=ecfg.enforce_eager, extra_args=ecfg.extra_args,
        )
    if kind == "sglang":
        return [exe, "-m", "sglang.launch_server"] + sglang_args(
            model_ref, spec, tp=tensor_parallel_size, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            host=ecfg.host, port=ecfg.port, dtype=ecfg.dtype, context_length=ecfg.max_model_len,
            mem_fraction_static=gpu_memory_utilization, served_model_name=served_model_name,
            disable_cuda_graph=ecfg.enforce_eager, extra_args=ecfg.extra_args,
        )
    raise UserError(f"engine.kind={kind}: not a launched engine (allowed: vllm, sglang)")


def server_env(kind: Kind, ecfg: LaunchedEngineConfig, model_ref: str, accelerator: str) -> dict[str, str]:
    """The variables the launcher sets on top of the inherited environment (ecfg.env wins)."""
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if Path(model_ref).is_dir():
        env["HF_HUB_OFFLINE"] = "1"  # a local checkpoint: never reach for the hub
    if kind == "vllm" and accelerator == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"  # GiB of KV cache; vLLM-cpu's default is sized for servers
    env.update(ecfg.env)
    return env
