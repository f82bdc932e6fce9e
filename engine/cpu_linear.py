"""fp32 linear layers on CPU through oneDNN where MKL's small-batch GEMM is slow.

Measured on the development machine (AMD EPYC, AVX2, torch 2.13 CPU wheel, 2 threads) for
SmolLM2's shapes: MKL (`F.linear`) takes 9.4 ms for the 49152x576 lm_head on one row and about
2x that for 2-16 rows; oneDNN (`torch.ops.mkldnn._linear_pointwise`, the op Inductor emits for
CPU linears) takes 4.4 ms and 10 ms. For the 576-wide decoder projections oneDNN is ~15% faster
from 2 rows on and no faster on one row. Speculative verification runs 2-16 rows per forward,
so this moves the cost of a verification step closer to that of an autoregressive one.

Only inference goes through oneDNN (that op has no autograd formula): with gradients enabled
(EAGLE head training back-propagates through the frozen lm_head) the layer is a plain nn.Linear.
Results agree with MKL to ~1e-6 (fp32 summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The lm_head-sized layers (vocabulary rows) win on a single row too.
_WIDE = 8192


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN linear op (CPU wheels with MKLDNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnLinear(torch.nn.Linear):
    """nn.Linear whose inference forward uses oneDNN for multi-row inputs and wide layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32 or (
                self.out_features < _WIDE and x.numel() <= self.in_features):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Switch every plain nn.Linear of a CPU fp32 model to OneDnnLinear in place (weights, state
    dict and checkpoints unchanged). Returns how many layers were switched (0 without oneDNN)."""
    if not onednn_available():
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:  # exactly nn.Linear: FP8 and other custom layers keep theirs
            mod.__class__ = OneDnnLinear
            n += 1
    return n
