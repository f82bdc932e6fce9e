"""FP8 weight emulation: e4m3 weights with one scale per output channel.

`--quantization fp8` in vLLM/SGLang stores the decoder's linear weights as float8_e4m3fn with
per-channel scales; the embedding and lm_head stay in high precision. Acceptance rates depend on
that rounding (it changes greedy output after a few dozen tokens), so the tuner measures under
the same weights. The emulation stores the dequantized values (w8 * scale) in the model's dtype:
numerically the same matmul inputs as an fp8 kernel that dequantizes, at full-precision speed.
"""

from __future__ import annotations

import torch

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_e4m3(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (float8_e4m3fn weight, fp32 scale [out, 1]) with absmax per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_e4m3(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an fp8 kernel multiplies with."""
    return (w8.float() * scale).to(dtype)


@torch.no_grad()
def apply_fp8_weights(model: torch.nn.Module) -> int:
    """Round every nn.Linear inside the decoder layers through e4m3 (in place). Returns how many."""
    n = 0
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.layers
    for layer in layers:
        for mod in layer.modules():
            if isinstance(mod, torch.nn.Linear):
                w8, scale = quantize_e4m3(mod.weight)
                mod.weight.copy_(dequantize_e4m3(w8, scale, mod.weight.dtype))
                n += 1
    return n
