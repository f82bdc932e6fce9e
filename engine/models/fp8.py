"""The weights the built-in engine computes with (`engine.builtin.weights`): fp32, bf16 or FP8.

- bf16: every parameter rounded to bfloat16, the dtype the served checkpoint is in.
- fp8: vLLM's online `--quantization fp8`: the bf16 weights of each decoder linear quantized to
  float8_e4m3fn with ONE scale per tensor, absmax / 448, where the tensor is the one vLLM's kernel
  sees: q/k/v fused into one, gate/up fused into one, o and down alone. Embeddings, norms and the
  lm_head stay bf16.
Acceptance rates depend on that rounding (it changes greedy output after a few dozen tokens), so the
tuner measures under the weights that will be served. The model keeps its dtype and holds the
rounded values (every form of the forward computes with them); the native step
(engine.models.decode_step) reads a packed copy in the format itself (2 or 1 bytes per weight).
"""

from __future__ import annotations

import torch

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
WEIGHTS = ("fp32", "bf16", "fp8")


def quantize_e4m3(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (float8_e4m3fn weight, fp32 scalar scale): absmax over the whole tensor."""
    w = weight.detach().float()
    scale = w.abs().amax().clamp(min=1e-12) / E4M3_MAX
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_e4m3(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an fp8 kernel multiplies with."""
    return (w8.float() * scale).to(dtype)


def _fused_groups(layer: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """A decoder layer's linears grouped as vLLM fuses them (one scale per group)."""
    a, m = layer.self_attn, layer.mlp
    return [[a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj]]


def head_weights(target_weights: str) -> str:
    """The format a draft head computes in beside a target at `target_weights`: the served dtype, bf16
    under bf16 and fp8 (vLLM's --quantization fp8 quantizes the target only: a draft head of its own
    checkpoint keeps speculative_config.quantization unset), fp32 at fp32."""
    return "fp32" if target_weights == "fp32" else "bf16"


@torch.no_grad()
def apply_weights(model: torch.nn.Module, weights: str) -> int:
    """Round the model's parameters (in place) to `weights` (fp32: unchanged) and record it in
    `model.spectune_weights`. Returns how many linears went through e4m3 (0 unless fp8)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: allowed {', '.join(WEIGHTS)}")
    n = 0
    if weights != "fp32":
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(torch.bfloat16))
    if weights == "fp8":
        layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.layers
        for layer in layers:
            for group in _fused_groups(layer):
                w8, scale = quantize_e4m3(torch.cat([mod.weight for mod in group]))
                at = 0
                for mod in group:
                    rows = mod.weight.shape[0]
                    mod.weight.copy_(dequantize_e4m3(w8[at:at + rows], scale, mod.weight.dtype))
                    at += rows
                    n += 1
    model.spectune_weights = weights
    return n
