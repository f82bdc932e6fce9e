"""What `engine.builtin.weights: auto` resolves to on this machine, and the reason in one line.

The default precision is the one that decodes fastest here without changing what is measured
against what is served. FP8 where the deployment serves FP8 (trials then rank by the acceptance of
the served weights). fp32 where a rule decides it: on CUDA (engine.builtin.dtype decides), for
models too small to be bound by reading their weights, and where the native step that reads bf16
at 2 bytes a weight cannot run. Elsewhere fp32 and bf16 (the served checkpoint's dtype) are both
candidates and a measurement decides, not a list of CPU flags: a short timed decode step of each
(engine.models.autoweights, once per machine and model, cached), because the flags mispredicted it:
on a 2-core AVX2 EPYC, without native bf16, bf16 weights still decoded 1.6x faster than fp32 (the
step is bound by reading the weights, and bf16 reads half the bytes; docs/results.md, issue 40).
Pure: reads the machine's memory, no torch.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Mapping

# head sizes the native step's attention is built for (engine.models.attention)
NATIVE_HEAD_DIMS = (16, 32, 64, 128)
# smaller models (billions of parameters) keep fp32: their steps are not bound by reading the weights,
# so a timing between formats would be decided by noise
AUTO_BF16_MIN_B = 0.1
# the formats auto times against each other where no rule decides (fp8 only where it is served)
TIMED_FORMATS = ("fp32", "bf16")
# a rounded format is taken only when its timed steps are at least this much faster than fp32's:
# fp32 is exact against HF, and a smaller gap is within what a shared machine's timing can tell
AUTO_MARGIN = 0.05


def packed_copies(fp32_bytes: float, memory_bytes: float) -> tuple[bool, bool]:
    """Whether CPU fp32 weights of `fp32_bytes` get (oneDNN's packed copy, the native step's packed copy)
    on a machine of `memory_bytes`: each copy only while the copies take at most a quarter of it
    (engine.models.kernels.pack_weights follows this rule; the memory estimate counts it)."""
    return fp32_bytes <= memory_bytes / 4, 2 * fp32_bytes <= memory_bytes / 4


def auto_candidates(*, quantization: str | None, device: str, accelerator: str, dtype: str, forward: str,
                    native_step: bool | str, params_b: float, head_dim: int) -> tuple[tuple[str, ...], str]:
    """(the formats engine.builtin.weights=auto chooses among for these settings here, why in one
    line): one format where a rule decides, else TIMED_FORMATS, which `timed_choice` decides between."""
    if quantization == "fp8":
        return ("fp8",), "deploy.quantization=fp8: trials measure the acceptance of the served FP8 weights"
    if device == "cuda" or (device == "auto" and accelerator == "cuda"):
        return ("fp32",), f"on CUDA the engine computes at engine.builtin.dtype={dtype}"
    if dtype != "float32" or forward != "lean" or native_step is False:
        return ("fp32",), ("only the native step (lean forward, dtype float32, native_step auto or true) reads bf16 "
                           "weights at 2 bytes a weight")
    if params_b < AUTO_BF16_MIN_B:
        return ("fp32",), f"a model under {AUTO_BF16_MIN_B:g}B parameters is not bound by reading its weights"
    if head_dim not in NATIVE_HEAD_DIMS:
        return ("fp32",), f"the native step that reads bf16 weights is not built for head size {head_dim}"
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if not packed_copies(params_b * 4e9, memory)[1]:
        return ("fp32",), "this machine's memory is too small for the native step's packed copy of the weights"
    if shutil.which("g++") is None:
        return ("fp32",), "no g++ here to build the native step that reads bf16 weights"
    return TIMED_FORMATS, "fp32 and bf16 both run in the native step here: a timed decode step of each decides"


def timed_choice(ms: Mapping[str, Mapping[str, float]], what: str = "decode step") -> tuple[str, str]:
    """(format, reason in one line) from each candidate's timed steps (format -> {what was timed,
    e.g. "1 seq": milliseconds}, the same keys for every format; `what` names the step: a decode step,
    or a training step for train.precision): the format of the lowest geometric mean over them, fp32
    unless another is at least AUTO_MARGIN faster. The reason carries every figure."""
    if not ms:
        raise ValueError("timed_choice: no format was timed")
    points = list(next(iter(ms.values())))
    mean = {f: math.exp(sum(math.log(t[p]) for p in points) / len(points)) for f, t in ms.items()}
    best = min(mean, key=mean.__getitem__)
    if best != "fp32" and "fp32" in mean and mean[best] > mean["fp32"] * (1 - AUTO_MARGIN):
        best = "fp32"
    figures = ", ".join(f"{f} " + " / ".join(f"{ms[f][p]:.2f}" for p in points) for f in ms)
    gain = "" if best == "fp32" else f", {mean['fp32'] / mean[best]:.2f}x fp32's" if "fp32" in mean else ""
    rule = "" if best != "fp32" or len(ms) == 1 else f" (another format must be {AUTO_MARGIN:.0%} faster)"
    return best, (f"a timed {what} measured it fastest here{gain}{rule}: ms per step at "
                  f"{' / '.join(points)}: {figures}")
