"""Batched steps of the lean forward: how a step of several sequences writes its keys and values and
attends (`batch_plan`, decided once for all layers), and the decoder layer that runs it
(`batch_layer_forward`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.models import attention
from engine.models.kernels import linear
from engine.models.kvpool import KVCache, KVPool
from engine.models.llama import Block, _rotate, rms_norm

_NEG = float("-inf")


def batch_layer_forward(x: torch.Tensor, b: Block, layer: int, plan: "BatchPlan", cos: torch.Tensor,
                        sin: torch.Tensor, n_heads: int, n_kv: int, eps: float) -> torch.Tensor:
    """One decoder layer over the rows of several sequences concatenated (ragged): every linear runs
    once over all rows (the weights are read once per step, which is what batching buys). Keys and
    values of pooled caches are written in one indexed copy and the short sequences attend in a few
    SDPA calls over runs of their slots (`PooledAttention`); the rest attend on their own cache,
    exactly as `layer_forward` does for one.

    Rows stay rows-major ([n, heads, d]) from q/k/v to the output projection: q and k are rotated in
    one pass, and a pooled call of one-row sequences in slot order reads q and writes o as slices,
    with no gather or scatter (the head-major form spent a measurable share of a step in those copies
    and rotations: docs/results.md, "Figures behind the code")."""
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
# at one position, over every layer): a call's fixed cost over a slot-position's, as measured on the
# 2-core Xeon (docs/results.md, "Figures behind the code"), so a sequence attends in a call of its
# own once padding it to its neighbours' length would read more positions than that.
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
    reads (docs/results.md, "Figures behind the code")."""
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
