"""What `engine.builtin.weights: auto` resolves to on this machine, and the reason in one line.

The default precision is the one that decodes fastest here without changing what is measured
against what is served: FP8 where the deployment serves FP8 (trials then rank by the acceptance of
the served weights); bf16 where the engine runs the native step on a CPU with native bf16
(`avx512_bf16`, AMX), whose decode steps read half the bytes of fp32 and were measured faster there
(docs/results.md); fp32 elsewhere: on CUDA (engine.builtin.dtype decides), on CPUs without native
bf16, for models too small to be bound by reading their weights, and where the native step that
reads bf16 at 2 bytes a weight cannot run. Pure: reads /proc/cpuinfo and the machine's memory, no torch.
"""

from __future__ import annotations

import os
import shutil
from functools import lru_cache
from pathlib import Path

# CPU flags of native bf16 arithmetic: where bf16 weights measured faster than fp32 (docs/results.md)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
# head sizes the native step's attention is built for (engine.models.attention)
NATIVE_HEAD_DIMS = (16, 32, 64, 128)
# smaller models (billions of parameters) keep fp32: their steps are not bound by reading the weights
AUTO_BF16_MIN_B = 0.1


def packed_copies(fp32_bytes: float, memory_bytes: float) -> tuple[bool, bool]:
    """Whether CPU fp32 weights of `fp32_bytes` get (oneDNN's packed copy, the native step's packed copy)
    on a machine of `memory_bytes`: each copy only while the copies take at most a quarter of it
    (engine.models.kernels.pack_weights follows this rule; the memory estimate counts it)."""
    return fp32_bytes <= memory_bytes / 4, 2 * fp32_bytes <= memory_bytes / 4


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def auto_weights(*, quantization: str | None, device: str, accelerator: str, dtype: str, forward: str,
                 native_step: bool | str, params_b: float, head_dim: int) -> tuple[str, str]:
    """(format, reason in one line) that engine.builtin.weights=auto takes for these settings here."""
    if quantization == "fp8":
        return "fp8", "deploy.quantization=fp8: trials measure the acceptance of the served FP8 weights"
    if device == "cuda" or (device == "auto" and accelerator == "cuda"):
        return "fp32", f"on CUDA the engine computes at engine.builtin.dtype={dtype}"
    if dtype != "float32" or forward != "lean" or native_step is False:
        return "fp32", ("only the native step (lean forward, dtype float32, native_step auto or true) reads bf16 "
                        "weights at 2 bytes a weight")
    if params_b < AUTO_BF16_MIN_B:
        return "fp32", f"a model under {AUTO_BF16_MIN_B:g}B parameters is not bound by reading its weights"
    if head_dim not in NATIVE_HEAD_DIMS:
        return "fp32", f"the native step that reads bf16 weights is not built for head size {head_dim}"
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if not packed_copies(params_b * 4e9, memory)[1]:
        return "fp32", "this machine's memory is too small for the native step's packed copy of the weights"
    if shutil.which("g++") is None:
        return "fp32", "no g++ here to build the native step that reads bf16 weights"
    native = [f for f in BF16_CPU_FLAGS if f in cpu_flags()]
    if not native:
        return "fp32", ("this CPU has no native bf16 (avx512_bf16, amx_bf16), where bf16 weights were measured "
                        "faster than fp32")
    return "bf16", f"this CPU has {native[0]}: bf16 weights halve the bytes a decode step reads, measured faster than fp32"
