"""Fit check: how many GPUs a model needs in FP8 on a hardware profile (pure arithmetic)."""

from __future__ import annotations

from tuner.schema import DeployConfig, HardwareConfig, ModelConfig, UserError

GIB = 1024**3
# FP8 checkpoints keep embeddings, lm_head, norms and scales in 16 bit: a few percent over 1 byte/param.
FP8_OVERHEAD = 1.05


def fp8_weight_gib(model: ModelConfig) -> float:
    """Weight bytes of the model served with FP8 weights, in GiB."""
    return model.params_b * 1e9 * FP8_OVERHEAD / GIB


def tensor_parallel_size(model: ModelConfig, hardware: HardwareConfig, deploy: DeployConfig) -> int:
    """Smallest tensor-parallel size whose per-GPU share of FP8 weights plus KV headroom fits.

    TP must divide the attention heads and be at most the GPU count. Raises UserError (one line)
    when even all GPUs of the profile cannot hold the model.
    """
    if hardware.accelerator == "cpu":
        return 1
    usable = hardware.gpu_memory_gib * deploy.gpu_memory_utilization
    headroom = hardware.gpu_memory_gib * deploy.kv_headroom_frac
    weights = fp8_weight_gib(model) if deploy.quantization == "fp8" else model.params_b * 2e9 / GIB
    tp = 1
    while tp <= hardware.gpu_count:
        if model.num_attention_heads % tp == 0 and weights / tp + headroom <= usable:
            return tp
        tp *= 2
    precision = "FP8" if deploy.quantization == "fp8" else "16-bit"
    raise UserError(
        f"model {model.name} does not fit hardware {hardware.name}: {weights:.1f} GiB of {precision} weights "
        f"+ {headroom:.1f} GiB KV headroom per GPU exceed {hardware.gpu_count} x {hardware.gpu_memory_gib:g} GiB "
        f"at gpu_memory_utilization={deploy.gpu_memory_utilization} (choose hardware with more or larger GPUs)"
    )
