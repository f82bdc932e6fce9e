"""The engine's own Llama forward (the "lean" path): small direct PyTorch over a static KV cache.

Built from a loaded HF causal LM (Llama, or Qwen2 with its q/k/v biases) without copying weights:
q/k/v and gate/up are fused into one weight each, and the HF modules' weights become views of the
fused tensors, so the HF model (the reference, EAGLE training, `forward: hf`) keeps working on the
same memory. One forward runs N new tokens (a decode step, a chain or a branching tree) against
the committed prefix in `KVCache`; the tree's ancestor mask enters SDPA as an additive mask.

`LeanForward.step` is what the decode loop calls. Decoder layers run either eagerly or through
`torch.compile` (inductor) of one layer function shared by all layers, with the cache length
dynamic; compiled artifacts go to inductor's on-disk cache under the spectune cache dir. On CUDA
every step is compiled at bucketed token counts (padded to the bucket) under CUDA graphs
("reduce-overhead"), where launch overhead is what compiling removes. On CPU only the one-row
decode step is compiled: there inductor's fused GEMV beats oneDNN, while for several rows the
eager kernels are as fast and padding a tree to its bucket would only add rows.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models import attention, decode_step
from engine.models.eagle3_head import aux_features
from engine.models.kernels import CALIBRATE_MIN_BYTES, LinearPlan, set_linear_plan, pack_weights, linear, calibrate_linears
from tuner.schema.config import UserError

# model_type -> whether q/k/v carry a bias; anything else is refused in one line
SUPPORTED = {"llama": False, "qwen2": True}
# RoPE variants whose frequencies are fixed (a table computed once is exact); "dynamic" rescales with length
_STATIC_ROPE = ("default", "llama3", "linear", "yarn", "longrope")
# token-count buckets of the compiled layer: a step of n tokens runs padded to the next bucket
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_NEG = float("-inf")


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


class KVCache:
    """Static keys/values [layers, kv_heads, capacity, d] written by index; `length` positions are valid.

    A forward of N tokens writes slots length..length+N-1 (padding rows of a bucket write past them,
    never read). After verification, `commit` keeps the prefix plus the accepted nodes, moving them
    down in place when they are not already the first ones; dropping the rest is a length change."""

    def __init__(self, model: LeanLlama, capacity: int, pool: "KVPool | None" = None, slot: int = -1) -> None:
        self.pool, self.slot = pool, slot
        if pool is not None:  # a view of one slot of a pool (batched decoding)
            self.k, self.v = pool.k[:, slot], pool.v[:, slot]
        else:
            shape = (len(model.blocks), model.n_kv, capacity, model.head_dim)
            # empty, not zeros: a step attends only to slots that are committed or written by itself
            self.k = torch.empty(shape, device=model.device, dtype=model.dtype)
            self.v = torch.empty(shape, device=model.device, dtype=model.dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def commit(self, prefix_len: int, accepted: list[int]) -> None:
        """Keep [0, prefix_len) and the accepted tree nodes (indices relative to the tree, in path order)."""
        m = len(accepted)
        if accepted != list(range(m)):
            src = torch.tensor(accepted, device=self.k.device) + prefix_len
            # index_select copies first: source and destination ranges may overlap
            self.k[:, :, prefix_len:prefix_len + m] = self.k.index_select(2, src)
            self.v[:, :, prefix_len:prefix_len + m] = self.v.index_select(2, src)
        self.length = prefix_len + m

    def crop(self, length: int) -> None:
        """Roll back to the first `length` positions."""
        self.length = min(self.length, length)

    def reserve(self, need: int) -> None:
        """Room for `need` positions: a full cache doubles, keeping its valid entries (draft heads,
        whose sequence length is not known up front; the target's cache is sized per request)."""
        if need <= self.capacity:
            return
        if self.pool is not None:
            raise ValueError(f"KV cache full: a pool slot holds {self.capacity} positions, {need} asked")
        cap = max(need, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], cap, old.shape[3])
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)


class KVPool:
    """The KV caches of up to `slots` sequences in one tensor pair [layers, slots, kv_heads, capacity, d].

    Each sequence's `KVCache` is a view of its slot, so everything a lone cache does (step, commit,
    crop) works unchanged, while a batched step writes every sequence's new keys in one indexed
    copy and attends over a range of slots in one SDPA call instead of one call per sequence.
    Zero-initialised: a batched call reads past a sequence's length (masked), and never-written
    memory could hold NaN bit patterns that a mask does not cancel. Memory is slots x capacity
    positions; `fit` grows the capacity (copying, re-pointing the views) for a longer request."""

    def __init__(self, model: LeanLlama, slots: int, capacity: int) -> None:
        self.model, self.slots = model, slots
        self.k = self.v = torch.empty(0)
        self.capacity = 0
        self.views: dict[int, KVCache] = {}
        self.fit(capacity)

    def fit(self, capacity: int) -> None:
        """Hold at least `capacity` positions per slot (rounded up as `LeanForward.new_cache` does)."""
        capacity = -(-(capacity + BUCKETS[-1]) // 256) * 256
        if capacity <= self.capacity:
            return
        m = self.model
        shape = (len(m.blocks), self.slots, m.n_kv, capacity, m.head_dim)
        k = torch.zeros(shape, device=m.device, dtype=m.dtype)
        v = torch.zeros(shape, device=m.device, dtype=m.dtype)
        if self.capacity:
            k[:, :, :, :self.capacity] = self.k
            v[:, :, :, :self.capacity] = self.v
        self.k, self.v, self.capacity = k, v, capacity
        for slot, view in self.views.items():
            view.k, view.v = k[:, slot], v[:, slot]

    def acquire(self, need: int) -> KVCache:
        """The lowest free slot's cache, empty, for a sequence of up to `need` positions."""
        free = next((s for s in range(self.slots) if s not in self.views), None)
        if free is None:
            raise ValueError(f"KV pool: all {self.slots} slots are in use")
        self.fit(need)
        view = KVCache(self.model, self.capacity, pool=self, slot=free)
        self.views[free] = view
        return view

    def release(self, cache: KVCache) -> None:
        """Free the cache's slot (its contents stay until a later sequence overwrites them)."""
        if self.views.get(cache.slot) is cache:
            del self.views[cache.slot]


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


def batch_layer_forward(x: torch.Tensor, b: Block, layer: int, plan: "BatchPlan", cos: torch.Tensor,
                        sin: torch.Tensor, n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
    """One decoder layer over the rows of several sequences concatenated (ragged): every linear runs
    once over all rows (the weights are read once per step, which is what batching buys). Keys and
    values of pooled caches are written in one indexed copy and the short sequences attend in a few
    SDPA calls over runs of their slots (`PooledAttention`); the rest attend on their own cache,
    exactly as `layer_forward` does for one.

    Rows stay rows-major ([n, heads, d]) from q/k/v to the output projection: q and k are rotated in
    one pass, and a pooled call of one-row sequences in slot order reads q and writes o as slices,
    with no gather or scatter (measured on the 2-core Xeon at 8 one-row
    sequences: the head-major form spent 1.8 ms a step in those copies and 2.7 ms in two rotations)."""
    n, d = x.shape[0], plan.seqs[0].cache.k.shape[-1]
    qkv = linear(rms_norm(x, b.ln1, eps), b.wqkv, b.bqkv)
    qk = _rotate(qkv[:, :(n_heads + n_kv) * d].view(n, n_heads + n_kv, d), cos[:, None], sin[:, None])
    q, k = qk[:, :n_heads], qk[:, n_heads:]
    v = qkv[:, (n_heads + n_kv) * d:].view(n, n_kv, d)
    if plan.pool is not None:
        plan.pool.k[layer][plan.slot_of, :, plan.pos_of] = k
        plan.pool.v[layer][plan.slot_of, :, plan.pos_of] = v
    else:
        for s in plan.seqs:
            s.cache.k[layer].index_copy_(1, s.slots, k[s.start:s.stop].transpose(0, 1))
            s.cache.v[layer].index_copy_(1, s.slots, v[s.start:s.stop].transpose(0, 1))
    o = q.new_empty(n, n_heads, d)
    g = n_heads // n_kv
    if plan.decode is not None:
        attention.attend(q, plan.pool.k[layer], plan.pool.v[layer], o, plan.decode)
    for pa in plan.pooled:
        if pa.direct:  # one-row decodes in slot order: queries and outputs are slices of the step's rows
            m = pa.hi - pa.lo
            o[pa.first:pa.first + m] = _pooled_attend(q[pa.first:pa.first + m].reshape(m, n_kv, g, d), plan.pool,
                                                      layer, pa).reshape(m, n_heads, d)
            continue
        qp = q.new_zeros(pa.hi - pa.lo, pa.nmax, n_heads, d)
        qp[pa.at_slot, pa.at_row] = q[pa.rows]
        # the g query heads of a kv head become g blocks of query rows: SDPA then reads each
        # kv head once instead of once per query head (enable_gqa)
        qp = qp.view(-1, pa.nmax, n_kv, g, d).permute(0, 2, 3, 1, 4).reshape(-1, n_kv, g * pa.nmax, d)
        got = _pooled_attend(qp, plan.pool, layer, pa).view(-1, n_kv, g, pa.nmax, d).permute(0, 3, 1, 2, 4)
        o[pa.rows] = got.reshape(-1, pa.nmax, n_heads, d)[pa.at_slot, pa.at_row]
    for s in plan.alone:
        o[s.start:s.stop] = F.scaled_dot_product_attention(
            q[s.start:s.stop].transpose(0, 1)[None], s.cache.k[layer][None, :, :s.length],
            s.cache.v[layer][None, :, :s.length], attn_mask=s.mask, enable_gqa=n_heads != n_kv)[0].transpose(0, 1)
    o = o.view(n, -1)
    x = x + linear(o, b.wo)
    gate, up = linear(rms_norm(x, b.ln2, eps), b.w13).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, b.w2)


def _pooled_attend(qp: torch.Tensor, pool: "KVPool", layer: int, pa: "PooledAttention") -> torch.Tensor:
    """SDPA of grouped queries qp [slots, kv_heads, g * nmax, d] over the pool's slots [lo, hi)."""
    return F.scaled_dot_product_attention(qp, pool.k[layer, pa.lo:pa.hi, :, :pa.length],
                                          pool.v[layer, pa.lo:pa.hi, :, :pa.length], attn_mask=pa.mask)


@dataclass
class BatchRows:
    """One sequence's share of a batched step: its cache, its rows [start, stop) of the step, the
    cache slots they write, the positions its attention covers, and its additive mask."""

    cache: "KVCache"
    start: int
    stop: int
    slots: torch.Tensor
    length: int
    mask: torch.Tensor | None


@dataclass
class PooledAttention:
    """The sequences of a batched step that attend in one call: pool slots [lo, hi), each padded to
    `nmax` query rows over the first `length` positions. Row `rows[i]` of the step is query row
    `at_row[i]` of slot `lo + at_slot[i]`; padding rows and empty slots see position 0 only (their
    output is dropped), so no row of the call is fully masked. The mask covers the g query heads
    of a kv head as g blocks of `nmax` rows each. `direct`: every sequence of the call is one row,
    slot lo + i at step row first + i, so its queries and outputs are slices of the step's rows."""

    lo: int
    hi: int
    nmax: int
    length: int
    rows: torch.Tensor
    at_slot: torch.Tensor
    at_row: torch.Tensor
    mask: torch.Tensor  # [hi - lo, 1, g * nmax, length] additive ([.., 1, length] when nmax is 1)
    direct: bool = False
    first: int = 0  # the step row of slot lo's query when `direct`


@dataclass
class BatchPlan:
    """How a batched step writes and attends: the sequences, the pool when every cache is a view of
    one (then `slot_of`/`pos_of` say where each row's key goes), the pooled calls and the sequences
    that attend alone on their own cache."""

    seqs: list[BatchRows]
    pool: "KVPool | None" = None
    slot_of: torch.Tensor | None = None
    pos_of: torch.Tensor | None = None
    pooled: list[PooledAttention] = field(default_factory=list)
    alone: list[BatchRows] = field(default_factory=list)
    decode: attention.DecodeBatch | None = None  # the short sequences, when they attend through the CPU kernel


# A sequence of at most this many rows joins the pooled attention call; a longer one (a prompt)
# attends alone, since padding every sequence of the call to its rows would cost more than it saves.
POOL_ROWS = 16


# What a pooled attention call costs beyond its reads, in slot-positions (one slot's keys and values
# at one position, over every layer): measured on the 2-core Xeon, a call takes 8 us a layer and a
# slot-position 0.11 us, so a sequence attends in a call of its own once padding it to its
# neighbours' length would read more than ~75 positions it does not have.
CALL_POSITIONS = 75


def _partition(group: list[BatchRows]) -> list[list[BatchRows]]:
    """Split sequences sorted by slot into runs of consecutive slots, each to attend in one call,
    with the least reading: a call reads (its slots) x (its longest length) plus CALL_POSITIONS
    (dynamic programming over the split points; a run never spans a free slot)."""
    best = [0.0] + [float("inf")] * len(group)
    cut = [0] * (len(group) + 1)
    for i in range(1, len(group) + 1):
        longest = 0
        for j in range(i - 1, -1, -1):
            if j < i - 1 and group[j + 1].cache.slot != group[j].cache.slot + 1:
                break
            longest = max(longest, group[j].length)
            cost = best[j] + CALL_POSITIONS + (i - j) * longest
            if cost < best[i]:
                best[i], cut[i] = cost, j
    runs, i = [], len(group)
    while i:
        runs.append(group[cut[i]:i])
        i = cut[i]
    return runs[::-1]


def _pooled_call(run: list[BatchRows], ancestors: dict[int, torch.Tensor | None], device: torch.device,
                 dtype: torch.dtype, heads_per_kv: int) -> PooledAttention:
    lo, hi = run[0].cache.slot, run[-1].cache.slot + 1
    nmax, length = max(s.stop - s.start for s in run), max(s.length for s in run)
    mask = torch.full((hi - lo, 1, nmax, length), _NEG, dtype=dtype)
    mask[..., 0] = 0
    rows, at_slot, at_row = [], [], []
    for s in run:
        n, r = s.stop - s.start, s.cache.slot - lo
        p = s.length - n
        mask[r, 0, :n, :p] = 0
        anc = ancestors[id(s)]
        vis = torch.ones(n, n, dtype=torch.bool).tril() if anc is None else anc.cpu()
        mask[r, 0, :n, p:p + n].masked_fill_(vis, 0.0)
        rows.extend(range(s.start, s.stop))
        at_slot.extend([r] * n)
        at_row.extend(range(n))
    t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    direct = nmax == 1 and rows == list(range(rows[0], rows[0] + len(rows)))
    if nmax > 1:
        mask = mask.repeat(1, 1, heads_per_kv, 1)
    return PooledAttention(lo, hi, nmax, length, t(rows), t(at_slot), t(at_row), mask.to(device), direct, rows[0])


def batch_plan(seqs: list[BatchRows], ancestors: list[torch.Tensor | None], device: torch.device,
               dtype: torch.dtype, heads_per_kv: int = 1) -> BatchPlan:
    """Decide a batched step's writes and attention calls (see BatchPlan), once for all layers;
    `heads_per_kv` is the number of query heads per kv head. On CPU fp32 the short sequences attend
    through the decode attention kernel (engine.models.attention), each over exactly its length;
    elsewhere (CUDA, or no compiler for the kernel) they attend in pooled SDPA calls over runs of
    consecutive slots (`_partition`): padding a short sequence to a long neighbour's length costs
    reads (8 HumanEval prompts of 132-354 tokens: one call over all 8 read 1.7x their positions)."""
    pool = seqs[0].cache.pool
    if pool is None or any(s.cache.pool is not pool for s in seqs):
        return BatchPlan(seqs, alone=list(seqs))
    slot_of = torch.cat([torch.full((s.stop - s.start,), s.cache.slot, dtype=torch.long) for s in seqs]).to(device)
    pos_of = torch.cat([s.slots for s in seqs])
    anc = {id(s): a for s, a in zip(seqs, ancestors)}
    group = sorted((s for s in seqs if s.stop - s.start <= POOL_ROWS), key=lambda s: s.cache.slot)
    ids = {id(s) for s in group}
    alone = [s for s in seqs if id(s) not in ids]
    if group and attention.usable(device, dtype, pool.k.shape[-1]):
        decode = attention.DecodeBatch.of([(s.cache.slot, s.start, s.stop - s.start, s.length, anc[id(s)])
                                           for s in group])
        return BatchPlan(seqs, pool, slot_of, pos_of, alone=alone, decode=decode)
    pooled = [_pooled_call(run, anc, device, dtype, heads_per_kv) for run in _partition(group)]
    return BatchPlan(seqs, pool, slot_of, pos_of, pooled, alone)


def additive_mask(prefix_len: int, n: int, ancestors: torch.Tensor | None, rows: int, length: int,
                  device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[rows, length] additive mask: the prefix is visible to the n real rows, each sees its ancestors
    (causal when `ancestors` is None); padding rows (n..rows) see only themselves; slots past the
    real tree are hidden from everyone but their own padding row."""
    m = torch.full((rows, length), _NEG, device=device, dtype=dtype)
    m[:n, :prefix_len] = 0
    anc = torch.ones(n, n, dtype=torch.bool, device=device).tril() if ancestors is None else ancestors.to(device)
    m[:n, prefix_len:prefix_len + n].masked_fill_(anc, 0.0)
    idx = torch.arange(n, rows, device=device)
    m[idx, prefix_len + idx] = 0
    return m


def visibility_mask(visible: torch.Tensor | None, n: int, prefix_len: int, device: torch.device,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask [n, prefix_len + n] of a bool visibility matrix (None: causal after the
    prefix); None when every row sees every position (SDPA then needs no mask)."""
    if visible is None and n > 1:
        visible = torch.ones(n, prefix_len + n, dtype=torch.bool, device=device).tril(prefix_len)
    if visible is None or bool(visible.all()):
        return None
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, _NEG)


def _bucket(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


_COMPILE_LOCK = threading.Lock()


def compile_cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    """Where inductor keeps compiled artifacts (reused by later processes): <cache>/inductor."""
    from engine.models.machine import cache_root

    return cache_root(cache_dir) / "inductor"


class LeanForward:
    """The lean target forward the decode loop drives: `new_cache`, `step`, then the cache's commit/crop.

    `compile=True` runs the decoder layers through one compiled layer function (see module doc:
    every step on CUDA, the one-row step on CPU); `compile_s` accumulates the wall time of steps
    that compiled something (the first call at each token bucket), which callers report apart
    from tokens/s."""

    def __init__(self, model: LeanLlama, compile: bool = False, cache_dir: str | None = None,
                 native: bool = False) -> None:
        self.model = model
        # steps of up to decode_step.MAX_ROWS rows as one C++ call (engine.models.decode_step), where it runs
        self.native = decode_step.NativeStep.of(model) if native else None
        self.compiled = compile
        self.compile_s = 0.0
        self._seen: set[int] = set()
        self._compiled = layer_forward
        self._buckets = compile and model.device.type == "cuda"
        if compile:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir

            # torch writes its /tmp default into the environment on first use: replace only that
            cur = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            if cur is None or os.path.abspath(cur) == os.path.abspath(default_cache_dir()):
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir(cache_dir))
            mode = "reduce-overhead" if model.device.type == "cuda" else None
            self._compiled = torch.compile(layer_forward, dynamic=None, mode=mode)

    def new_cache(self, need: int) -> KVCache:
        """An empty cache for a generation of up to `need` positions, plus room for bucket padding."""
        return KVCache(self.model, -(-(need + BUCKETS[-1]) // 256) * 256)

    def rows_for(self, n: int) -> int:
        """The rows a step of n tokens runs with: the bucket when compiled on CUDA (beyond the largest: n)."""
        return (_bucket(n) or n) if self._buckets else n

    def step(self, cache: KVCache, tokens: list[int], depths: list[int] | None = None,
             ancestors: torch.Tensor | None = None, last_only: bool = False,
             aux_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Run `tokens` after the cache's committed prefix: positions prefix + depth (prefix + i when
        `depths` is None: a prompt or a chain), attention causal or along `ancestors` [n, n] bool.
        Returns (final normed hidden [n, h], logits [n or 1, V], the inputs of `aux_layers`
        concatenated [n, len*h] or None). The cache then holds the prefix and the n tokens
        (`KVCache.commit`/`crop` decide what stays)."""
        m = self.model
        n, p = len(tokens), cache.length
        dev = m.device
        rows = self.rows_for(n)
        if p + rows > cache.capacity:
            raise ValueError(f"KV cache full: {p}+{rows} > {cache.capacity}")
        pos = torch.arange(p, p + n, device=dev) if depths is None else torch.tensor(depths, device=dev) + p
        if self.native is not None and n <= decode_step.MAX_ROWS:
            return self.native([cache], [tokens], [pos], [ancestors], [last_only], aux_layers)[0]
        ids = torch.tensor(tokens, device=dev)
        if rows > n:  # padding rows: token 0 at the first free position, written past the tree
            pos = torch.cat([pos, torch.full((rows - n,), p, device=dev, dtype=pos.dtype)])
            ids = torch.cat([ids, ids.new_zeros(rows - n)])
        slots = torch.arange(p, p + rows, device=dev)
        cos_t, sin_t = m.rope(int(pos.max()) + 1)
        cos, sin = cos_t[pos], sin_t[pos]
        length = p + rows
        mask = None if rows == 1 else additive_mask(p, n, ancestors, rows, length, dev, m.dtype)
        layer = self._compiled if self._buckets or rows == 1 else layer_forward
        t0 = time.perf_counter() if layer is not layer_forward and rows not in self._seen else None
        x, aux = self._layers(layer, cache, F.embedding(ids, m.embed), slots, cos, sin, mask, length, n, aux_layers)
        if t0 is not None:
            self._seen.add(rows)
            self.compile_s += time.perf_counter() - t0
        x = rms_norm(x[:n], m.norm, m.eps)
        logits = linear(x[-1:] if last_only else x, m.lm_head)
        cache.length = p + n
        aux_t = aux_features(aux, aux_layers)
        return x, logits, aux_t

    def step_batch(self, caches: list[KVCache], tokens: list[list[int]], depths: list[list[int] | None],
                   ancestors: list[torch.Tensor | None], last_only: list[bool],
                   aux_layers: tuple[int, ...] | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """`step` for several sequences in ONE forward: sequence i runs tokens[i] after caches[i]'s
        committed prefix (positions prefix + depths[i], attention along ancestors[i]). The rows of
        all sequences are concatenated (no padding): linears and the lm_head run once over all of
        them. Caches that are views of one `KVPool` attend together (see `batch_plan`), others per
        sequence. One sequence takes `step` (the compiled one-row path at batch 1). Returns `step`'s
        triple per sequence."""
        if len(caches) == 1:
            return [self.step(caches[0], tokens[0], depths[0], ancestors[0], last_only[0], aux_layers)]
        if self.native is not None and sum(map(len, tokens)) <= decode_step.MAX_ROWS:
            dev = self.model.device
            pos = [torch.arange(c.length, c.length + len(t), device=dev) if d is None
                   else torch.tensor(d, device=dev) + c.length for c, t, d in zip(caches, tokens, depths)]
            return self.native(caches, tokens, pos, ancestors, last_only, aux_layers)
        m = self.model
        dev = m.device
        seqs, pos, ids, pick = [], [], [], []
        at = 0
        # rows in slot order, so a step of one-row sequences in consecutive slots attends without gathers
        order = sorted(range(len(caches)), key=lambda i: caches[i].slot) if all(c.pool is not None for c in caches) \
            else list(range(len(caches)))
        for i in order:
            cache, toks, dep, anc, last = caches[i], tokens[i], depths[i], ancestors[i], last_only[i]
            n, p = len(toks), cache.length
            if p + n > cache.capacity:
                raise ValueError(f"KV cache full: {p}+{n} > {cache.capacity}")
            pos.append(torch.arange(p, p + n) if dep is None else torch.tensor(dep) + p)
            ids.extend(toks)
            mask = None if n == 1 else additive_mask(p, n, anc, n, p + n, dev, m.dtype)
            seqs.append(BatchRows(cache, at, at + n, torch.arange(p, p + n, device=dev), p + n, mask))
            pick.extend([at + n - 1] if last else range(at, at + n))
            at += n
        posv = torch.cat(pos).to(dev)
        cos_t, sin_t = m.rope(int(posv.max()) + 1)
        cos, sin = cos_t[posv], sin_t[posv]
        x = F.embedding(torch.tensor(ids, device=dev), m.embed)
        plan = batch_plan(seqs, [ancestors[i] for i in order], dev, m.dtype, m.n_heads // m.n_kv)
        aux = {}
        for i, b in enumerate(m.blocks):
            if aux_layers and i in aux_layers:
                aux[i] = x
            x = batch_layer_forward(x, b, i, plan, cos, sin, m.n_heads, m.n_kv, m.eps)
        x = rms_norm(x, m.norm, m.eps)
        logits = linear(x[torch.tensor(pick, device=dev)], m.lm_head)  # the lm_head read once for every sequence
        aux_t = aux_features(aux, aux_layers)
        out: list = [None] * len(caches)
        li = 0
        for i, s in zip(order, seqs):
            s.cache.length = s.length
            nl = 1 if last_only[i] else s.stop - s.start
            out[i] = (x[s.start:s.stop], logits[li:li + nl], None if aux_t is None else aux_t[s.start:s.stop])
            li += nl
        return out

    def _layers(self, layer: Callable[..., torch.Tensor], cache: KVCache, x: torch.Tensor, slots: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, length: int, n: int,
                aux_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        m = self.model
        aux = {}  # layer id -> its input; aux_layers may be unordered or repeat a layer (small targets)
        for i, b in enumerate(m.blocks):
            if aux_layers and i in aux_layers:
                aux[i] = x[:n]
            x = layer(x, b.ln1, b.wqkv, b.bqkv, b.wo, b.ln2, b.w13, b.w2, cache.k[i], cache.v[i], slots,
                      cos, sin, mask, length, m.n_heads, m.n_kv, m.eps)
        return x, aux

    def run(self, cache: KVCache, tokens: list[int], positions: torch.Tensor,
            visible: torch.Tensor | None) -> torch.Tensor:
        """The general step a draft model needs: `tokens` at rotary `positions` [n] after the cache's
        `length` entries, row i attending to the entries marked in `visible[i]` (bool [n, length + n];
        None: causal), so a tree level sees the uncommitted slots of the levels before it. Eager,
        unpadded. Appends the n entries (growing the cache when full); returns the final normed
        hidden states [n, h]."""
        m = self.model
        n, p = len(tokens), cache.length
        length = p + n
        cache.reserve(length)
        cos_t, sin_t = m.rope(int(positions.max()) + 1)
        mask = visibility_mask(visible, n, p, m.device, m.dtype)
        x = F.embedding(torch.tensor(tokens, device=m.device), m.embed)
        slots = torch.arange(p, length, device=m.device)
        x, _ = self._layers(layer_forward, cache, x, slots, cos_t[positions], sin_t[positions], mask, length, n)
        cache.length = length
        return rms_norm(x, m.norm, m.eps)

    def warm_up(self) -> float:
        """Compile (or load from the on-disk cache) the layer graphs a generation needs: the one-row
        step (and on CUDA a multi-row step and a second multi-row size, after which the row count is
        dynamic).
        Returns the seconds it took (its first step at each size also counts in compile_s)."""
        t = time.perf_counter()
        # two cache capacities and an unbucketed prompt: a generation's own cache and prompt then hit
        # graphs whose cache length and row count are already dynamic (no recompile mid-run). On CPU
        # only the one-row step is compiled, so there a short prefix and two one-row steps per
        # capacity are all the graphs need; the eager multi-row steps would only cost time.
        if self.native is not None and not self._buckets:
            return 0.0  # CPU decoding runs the native step: no step runs a compiled graph
        rows = (8, 1, 1, 4, 16, 100) if self._buckets else (8, 1, 1)
        with torch.inference_mode():
            for need in (64, 600):
                cache = self.new_cache(need)
                for n in rows:
                    if cache.length + self.rows_for(n) <= cache.capacity:
                        self.step(cache, [0] * n)
        return time.perf_counter() - t


_LEAN: dict[tuple, LeanForward] = {}


def lean_forward(target, compile: bool = False, cache_dir: str | None = None,
                 linear_plan: str = "calibrated", native: bool | str = "auto") -> LeanForward:
    """The LeanForward of a loaded Target, built once per process (weights shared with target.model).
    `linear_plan` is engine.builtin.linear_plan: "calibrated" makes a CPU fp32 target of at least
    CALIBRATE_MIN_BYTES of decoder weights follow this machine's measured LinearPlan
    (calibrate_linears, cached), set before anything is compiled; "default" the default plan.
    `native` is engine.builtin.native_step: "auto" runs steps of a few rows through the native step
    where it can run, True requires it (UserError naming why it cannot), False never."""
    if native is True:
        why = native_step_refusal(target.model)
        if why:
            raise UserError(f"engine.builtin.native_step=true: {why}; allowed: auto (use it where it runs) or false")
    fw = lean_forward_of(target.model, compile, cache_dir, native=native is not False)
    m = fw.model
    if linear_plan == "default":
        set_linear_plan(LinearPlan())
    elif m.packed and sum(w.numel() * w.element_size() for b in m.blocks for w in (b.wqkv, b.wo, b.w13, b.w2)) \
            >= CALIBRATE_MIN_BYTES:
        # the compiled one-row form is timed only where a compiled graph will run it (not under the native step)
        calibrate_linears(m, cache_dir, compiled=compile and fw.native is None)
    return fw


def lean_forward_of(hf_model: torch.nn.Module, compile: bool = False, cache_dir: str | None = None,
                    native: bool = False) -> LeanForward:
    """The LeanForward of an HF causal LM (a target or a draft model), built once per process and
    model; every LeanForward of one model shares its LeanLlama (the weights are fused once).
    `native`: its steps of a few rows run as the native step where that can run."""
    key = (id(hf_model), compile, native)
    with _COMPILE_LOCK:
        if key not in _LEAN:
            same = next((f for (i, *_), f in _LEAN.items() if i == id(hf_model)), None)
            model = same.model if same is not None else LeanLlama(hf_model)
            _LEAN[key] = LeanForward(model, compile, cache_dir, native)
        return _LEAN[key]


def native_step_refusal(hf_model: torch.nn.Module) -> str | None:
    """Why the native step cannot run for this model here (None: it can)."""
    p = next(hf_model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return f"it runs on CPU in float32 only (this model: {p.device.type}, {str(p.dtype).removeprefix('torch.')})"
    if decode_step.library() is None:
        return f"the C++ step could not be built here ({decode_step.error()})"
    fw = lean_forward_of(hf_model, native=True)
    if fw.native is None:
        return ("its weights have no packed copy (memory too small for it), or the head size "
                f"{fw.model.head_dim} is not one of {attention.HEAD_DIMS}")
    return None
