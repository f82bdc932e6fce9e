"""The decoder layer of an EAGLE-1 or EAGLE-3 draft head on the target's lean blocks (engine.models.llama).

The head modules (engine.models.eagle_head, engine.models.eagle3_head) stay what training and checkpoints use. For
drafting, their q/k/v and gate/up weights are fused into one tensor each (the modules' weights
become views of them, as the target's are), RoPE comes from a table, every linear goes through
`engine.models.kernels.linear` (oneDNN on CPU fp32, where MKL's small-batch GEMM costs several
times more for the draft lm_head over a tree level's rows: docs/results.md, "Figures behind the
code"), and the KV cache is engine.models.kvpool.KVCache:
written by index, a rollback is a length change, doubling when full.

One forward may carry several drafts (`step_batch`, continuous batching): their rows are
concatenated so every linear reads the head's weights once, and each draft attends over its own
cache with its own mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.cache import KVBuffer
from engine.models.eagle_head import EagleHead
from engine.models.eagle3_head import Eagle3Head
from engine.models.kernels import linear, pack_weights
from engine.models.forward import visibility_mask
from engine.models.kvpool import KVCache
from engine.models.llama import Block, _attend, _fuse, _fuse_bias, _out_mlp, _qkv, rms_norm, rope_table


def supports(head: torch.nn.Module) -> bool:
    """Whether `head` runs on the lean layer: no biases outside q/k/v and fc (some public heads have them)."""
    layer = head.midlayer if isinstance(head, Eagle3Head) else head.layers[0]
    return layer.self_attn.o_proj.bias is None and all(
        getattr(layer.mlp, n).bias is None for n in ("gate_proj", "up_proj", "down_proj"))


@dataclass
class HeadRows:
    """One draft's share of a head forward: n new positions appended to its own cache."""

    cache: KVCache | KVBuffer
    embeds: torch.Tensor  # [n, h] token embeddings
    feats: torch.Tensor  # [n, h] input features; with `fuse`, the target's aux states [n, 3h] (EAGLE-3)
    positions: torch.Tensor  # [n] rotary positions
    visible: torch.Tensor | None  # bool [n, cache.length + n] over the cached and new positions; None: causal
    fuse: bool = False  # the features still go through the head's fc (an EAGLE-3 catch-up)


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


class LeanHead:
    """One draft step of a head over n new positions: `step(cache, embeds, feats, positions, mask)`,
    or of several drafts at once: `step_batch(rows)`."""

    def __init__(self, head: EagleHead | Eagle3Head) -> None:
        self.eagle3 = isinstance(head, Eagle3Head)
        layer = head.midlayer if self.eagle3 else head.layers[0]
        a, m = layer.self_attn, layer.mlp
        cfg = head.config
        with torch.no_grad():
            self.block = Block(ln1=None, wqkv=_fuse([a.q_proj, a.k_proj, a.v_proj]),
                               bqkv=_fuse_bias([a.q_proj, a.k_proj, a.v_proj]), wo=a.o_proj.weight.detach(),
                               ln2=layer.post_attention_layernorm.weight.detach(),
                               w13=_fuse([m.gate_proj, m.up_proj]), w2=m.down_proj.weight.detach())
        self.blocks = [self.block]  # what KVCache reads: one layer
        self.fc_w = head.fc.weight.detach()
        self.fc_b = None if head.fc.bias is None else head.fc.bias.detach()
        if self.eagle3:
            self.embed_norm = layer.input_layernorm.weight.detach()
            self.hidden_norm = layer.hidden_norm.weight.detach()
            self.norm_before_residual = head.norm_before_residual
            self.final_norm, self.lm_w = head.norm.weight.detach(), head.lm_head.weight.detach()
        # the target's packed copies at the head's format (engine.models.fp8.head_weights): its linears
        # take the forms the target's do (the few-row kernel reads 2 bytes a weight beside a bf16 target)
        self.weights = getattr(head, "spectune_weights", "fp32")
        linears = [self.fc_w, self.block.wqkv, self.block.wo, self.block.w13, self.block.w2]
        pack_weights(linears + ([self.lm_w] if self.eagle3 else []), [self.weights] * (len(linears) + self.eagle3))
        self.n_heads, self.n_kv, self.head_dim = a.n_heads, a.n_kv, a.head_dim
        self.eps = cfg.rms_norm_eps
        self.device, self.dtype = self.fc_w.device, self.fc_w.dtype
        self.inv_freq = head.rotary_emb.inv_freq.detach()
        self.rope_scale = float(head.rotary_emb.attention_scaling)
        self.cos, self.sin = rope_table(self.inv_freq, self.rope_scale, 1, self.device, self.dtype)

    def new_cache(self) -> KVCache:
        return KVCache(self, 256)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: target aux states [n, 3h] -> first-step features [n, h] (the head's fc)."""
        return linear(aux, self.fc_w, self.fc_b)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Draft logits of output features [.., h]: EAGLE-3 through its final norm and own lm_head,
        EAGLE-1 through `rows` (the target's lm_head rows of the draft vocabulary)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = linear(rms_norm(flat, self.final_norm, self.eps), self.lm_w) if self.eagle3 else linear(flat, rows)
        return out.reshape(*hidden.shape[:-1], out.shape[-1])

    def step(self, cache: KVCache, embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """embeds, feats [n, h]; positions [n]; mask bool [n, cache.length + n] over the cached and
        new positions (None: causal). Appends the n keys/values; returns the output features [n, h]."""
        return self.step_batch([HeadRows(cache, embeds, feats, positions, mask)])[0]

    def step_batch(self, rows: list[HeadRows]) -> list[torch.Tensor]:
        """`step` for several drafts in ONE forward: their rows concatenated (ragged), fc, q/k/v, o
        and the MLP run once over all of them; each draft writes and attends over its own cache
        through its own mask. Returns each draft's output features [n_i, h]."""
        sizes = [r.embeds.shape[0] for r in rows]
        raw = [r.feats for r in rows if r.fuse]
        fused = iter(self.fuse(_cat(raw)).split([f.shape[0] for f in raw]) if raw else ())
        feats = _cat([next(fused) if r.fuse else r.feats for r in rows])
        embeds, positions = _cat([r.embeds for r in rows]), _cat([r.positions for r in rows])
        if int(positions.max()) >= self.cos.shape[0]:
            self.cos, self.sin = rope_table(self.inv_freq, self.rope_scale, int(positions.max()) + 1, self.device, self.dtype)
        cos, sin = self.cos[positions], self.sin[positions]
        if self.eagle3:
            f = rms_norm(feats, self.hidden_norm, self.eps)
            attn_in = torch.cat([rms_norm(embeds, self.embed_norm, self.eps), f], dim=-1)
            x = f if self.norm_before_residual else feats
        else:
            x = attn_in = linear(torch.cat([embeds, feats], dim=-1), self.fc_w, self.fc_b)
        b = self.block
        q, k, v = _qkv(x, b.ln1, b.wqkv, b.bqkv, cos, sin, self.n_heads, self.n_kv, self.head_dim, self.eps, attn_in)
        outs, at = [], 0
        for r, n in zip(rows, sizes):  # attention is per draft: each has its own cache and tree
            cache, p = r.cache, r.cache.length
            length = p + n
            cache.reserve(length)
            add = visibility_mask(r.visible, n, p, self.device, self.dtype)
            outs.append(_attend(q[:, at:at + n], k[:, at:at + n], v[:, at:at + n], cache.k[0], cache.v[0],
                                torch.arange(p, length, device=self.device), add, length, self.n_heads != self.n_kv))
            cache.length = length
            at += n
        out = _out_mlp(x, outs[0] if len(outs) == 1 else torch.cat(outs, dim=1), b.wo, b.ln2, b.w13, b.w2, self.eps)
        return list(out.split(sizes)) if len(rows) > 1 else [out]


def lean_head(head: EagleHead | Eagle3Head) -> LeanHead | None:
    """The head's LeanHead, built once per head module (heads are cached per process and shared by
    every drafter of that head), or None when the head has biases the lean layer does not carry."""
    if not supports(head):
        return None
    if getattr(head, "_lean", None) is None:
        head._lean = LeanHead(head)
    return head._lean
