"""The engine's own Llama model (the "lean" path): its weights and the math of one decoder layer.

Built from a loaded HF causal LM (Llama, or Qwen2 with its q/k/v biases) without copying weights:
q/k/v and gate/up are fused into one weight each, and the HF modules' weights become views of the
fused tensors, so the HF model (the reference, EAGLE training, `forward: hf`) keeps working on the
same memory. `layer_forward` runs N new tokens (a decode step, a chain or a branching tree) of one
layer against the committed prefix of a KV cache (engine.models.kvpool); the tree's ancestor mask
enters SDPA as an additive mask. engine.models.forward drives the layers (`LeanForward`),
engine.models.batchplan plans a step of several sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.kernels import pack_weights, linear
from tuner.schema.config import UserError

# model_type -> whether q/k/v carry a bias; anything else is refused in one line
SUPPORTED = {"llama": False, "qwen2": True}
# RoPE variants whose frequencies are fixed (a table computed once is exact); "dynamic" rescales with length
_STATIC_ROPE = ("default", "llama3", "linear", "yarn", "longrope")


def check_supported(config) -> None:
    """Raise UserError (one line) when the lean forward cannot run this architecture exactly."""
    mt = getattr(config, "model_type", "?")
    if mt not in SUPPORTED:
        raise UserError(f"engine.builtin.forward=lean: model type {mt} is not supported "
                        f"(supported: {', '.join(SUPPORTED)}); use engine.builtin.forward=hf")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE:
        raise UserError(f"engine.builtin.forward=lean: rope_type {rope} is not supported "
                        f"({', '.join(_STATIC_ROPE)}); use engine.builtin.forward=hf")
    if getattr(config, "use_sliding_window", False):
        raise UserError("engine.builtin.forward=lean: sliding-window attention is not supported; "
                        "use engine.builtin.forward=hf")
    if getattr(config, "mlp_bias", False) or (mt == "llama" and getattr(config, "attention_bias", False)):
        raise UserError("engine.builtin.forward=lean: linear biases outside q/k/v are not supported; "
                        "use engine.builtin.forward=hf")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserError(f"engine.builtin.forward=lean: hidden_act {config.hidden_act} is not supported (silu); "
                        "use engine.builtin.forward=hf")


@dataclass
class Block:
    """One decoder layer's weights: fused qkv [(H+2K)*d, h] (+ bias), o [h, H*d], fused gate/up [2I, h], down."""

    ln1: torch.Tensor | None  # None: no input norm (an EAGLE-1 head's layer)
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    ln2: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor


def _fuse(mods: list[torch.nn.Linear], name: str = "weight") -> torch.Tensor:
    """Concatenate the `name` parameters of `mods` (same input) and point each module's at its rows."""
    fused = torch.cat([getattr(m, name).detach() for m in mods], dim=0).contiguous()
    at = 0
    for m in mods:
        n = getattr(m, name).shape[0]
        setattr(m, name, torch.nn.Parameter(fused[at:at + n], requires_grad=False))
        at += n
    return fused


def _fuse_bias(mods: list[torch.nn.Linear]) -> torch.Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    return _fuse(mods, "bias")


class LeanLlama:
    """Weights and shapes of a Llama-family decoder, read from (and shared with) an HF model."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        check_supported(cfg)
        inner = hf_model.model
        self.config = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.lm_head = hf_model.lm_head.weight.detach()  # the embedding itself when tied
        self.blocks: list[Block] = []
        with torch.no_grad():
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                self.blocks.append(Block(
                    ln1=layer.input_layernorm.weight.detach(),
                    wqkv=_fuse([a.q_proj, a.k_proj, a.v_proj]), bqkv=_fuse_bias([a.q_proj, a.k_proj, a.v_proj]),
                    wo=a.o_proj.weight.detach(), ln2=layer.post_attention_layernorm.weight.detach(),
                    w13=_fuse([m.gate_proj, m.up_proj]), w2=m.down_proj.weight.detach()))
        self.inv_freq, self.rope_scale = inner.rotary_emb.inv_freq.detach().float(), float(inner.rotary_emb.attention_scaling)
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self._rope_len = 0
        self.cos = self.sin = torch.empty(0)
        # the weights' format (engine.models.fp8.apply_weights): the packed copies hold it, the lm_head in bf16 under fp8
        self.weights = getattr(hf_model, "spectune_weights", "fp32")
        lm = "bf16" if self.weights == "fp8" else self.weights
        self.packed = pack_weights([self.lm_head] + [w for b in self.blocks for w in (b.wqkv, b.wo, b.w13, b.w2)],
                                   [lm] + [self.weights] * 4 * len(self.blocks))

    def weight_bytes(self) -> int:
        """Bytes a decode step reads: every decoder weight, the final norm and the lm_head; a weight
        with a few-row packed copy counts that copy (what the native step reads: 2 or 1 bytes a
        weight at bf16 or fp8, padding included)."""
        ts = [self.norm, self.lm_head] + [t for b in self.blocks for t in (b.ln1, b.wqkv, b.bqkv, b.wo, b.ln2, b.w13, b.w2)
                                          if t is not None]
        ts = [getattr(t, "_smallm_packed", None) if getattr(t, "_smallm_packed", None) is not None else t for t in ts]
        return sum(t.numel() * t.element_size() for t in ts)

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [>= length, d] (HF's layout: the half-frequencies repeated)."""
        if length > self._rope_len:
            self.cos, self.sin = rope_table(self.inv_freq, self.rope_scale, length, self.device, self.dtype)
            self._rope_len = self.cos.shape[0]
        return self.cos, self.sin


def rope_table(inv_freq: torch.Tensor, scale: float, length: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, d] for positions 0..n-1, n the next power of two >= length (at least 256), so a
    growing sequence recomputes the table a handful of times, never per step."""
    n = 1 << max(8, math.ceil(math.log2(max(length, 1))))
    freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq.float().to(device)[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)



def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused kernel, bit-identical to the form below in fp32
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _qkv(x: torch.Tensor, ln1: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None, cos: torch.Tensor,
         sin: torch.Tensor, n_heads: int, n_kv: int, d: int, eps: float,
         attn_in: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated q [H, n, d], k [K, n, d] and v [K, n, d] of rows x [n, h]."""
    n = x.shape[0]
    qkv = linear(rms_norm(x, ln1, eps) if attn_in is None else attn_in, wqkv, bqkv)
    q, k, v = qkv.split((n_heads * d, n_kv * d, n_kv * d), dim=-1)
    q = _rotate(q.view(n, n_heads, d).transpose(0, 1), cos, sin)
    k = _rotate(k.view(n, n_kv, d).transpose(0, 1), cos, sin)
    return q, k, v.view(n, n_kv, d).transpose(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, slots: torch.Tensor,
            mask: torch.Tensor | None, length: int, gqa: bool) -> torch.Tensor:
    """Write k/v at `slots` of one sequence's layer cache ck/cv [K, C, d], attend over its first
    `length` positions: o [H, n, d]."""
    ck.index_copy_(1, slots, k)
    cv.index_copy_(1, slots, v)
    return F.scaled_dot_product_attention(q[None], ck[None, :, :length], cv[None, :, :length],
                                          attn_mask=mask, enable_gqa=gqa)[0]


def _out_mlp(x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, ln2: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[0]
    x = x + linear(o.transpose(0, 1).reshape(n, -1), wo)
    gate, up = linear(rms_norm(x, ln2, eps), w13).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w2)


def layer_forward(x: torch.Tensor, ln1: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None,
                  wo: torch.Tensor, ln2: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  ck: torch.Tensor, cv: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  mask: torch.Tensor | None, length: int, n_heads: int, n_kv: int, eps: float,
                  attn_in: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder layer over x [n, h]. Writes this step's keys/values at `slots` of the layer's cache
    ck/cv [K, C, d] and attends over its first `length` positions through the additive `mask`
    [n, length] (None: every row sees all of them, a single decode row). `attn_in` replaces
    rms_norm(x, ln1) as the input of q/k/v (draft heads: EAGLE-1 feeds x unnormed, EAGLE-3 the
    2h-wide normed embedding and feature), x staying the residual."""
    q, k, v = _qkv(x, ln1, wqkv, bqkv, cos, sin, n_heads, n_kv, ck.shape[-1], eps, attn_in)
    o = _attend(q, k, v, ck, cv, slots, mask, length, n_heads != n_kv)
    return _out_mlp(x, o, wo, ln2, w13, w2, eps)
