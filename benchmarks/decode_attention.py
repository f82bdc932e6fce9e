"""The attention of a batched step on CPU: the decode attention kernel (engine.models.attention) against
the pooled SDPA calls it replaced (engine.models.batchplan's PooledAttention, still the path on CUDA),
over every layer of SmolLM2's shapes (30 layers, 9 query heads, 3 KV heads, head size 64) for B
sequences of HumanEval-like mixed lengths in one KV pool, each with `rows` new rows (1: a decode
step; more: a chain being verified).

    .venv/bin/python benchmarks/decode_attention.py --batch 8 --rows 1,5,9

A table of ms per step (all layers), the GB/s of the keys and values each sequence needs, and the
SDPA/kernel ratio; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch_layout import best_ms  # noqa: E402 (this directory is on the path when run as a script)
from engine.models import attention, batchplan  # noqa: E402

LAYERS, H, K, D = 30, 9, 3, 64
LENGTHS = (132, 180, 354, 250, 300, 200, 160, 340, 145, 230, 310, 190, 270, 150, 330, 210)  # + the new rows


def case(batch: int, rows: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    lens = [n + 32 + rows for n in LENGTHS[:batch]]  # prompt, 32 tokens decoded, this step's rows
    cap = -(-max(lens) // 256) * 256
    pool = SimpleNamespace(k=torch.randn(LAYERS, batch, K, cap, D, generator=g),
                           v=torch.randn(LAYERS, batch, K, cap, D, generator=g))
    q = torch.randn(batch * rows, H + 2 * K, D, generator=g)[:, :H]  # a view of fused q/k/v rows, as in a step
    o = torch.empty(batch * rows, H, D)
    seqs = [batchplan.BatchRows(SimpleNamespace(slot=s, pool=pool), s * rows, (s + 1) * rows, torch.arange(n - rows, n),
                            n, None) for s, n in enumerate(lens)]
    decode = attention.DecodeBatch.of([(s, s * rows, rows, n, None) for s, n in enumerate(lens)])
    calls = [batchplan._pooled_call(run, {id(s): None for s in seqs}, torch.device("cpu"), torch.float32, H // K)
             for run in batchplan._partition(seqs)]
    plan = SimpleNamespace(pool=pool, pooled=calls)

    def kernel() -> None:
        for layer in range(LAYERS):
            attention.attend(q, pool.k[layer], pool.v[layer], o, decode)

    def sdpa() -> None:  # the pooled branch of batch_layer_forward, for every layer
        for layer in range(LAYERS):
            for pa in plan.pooled:
                if pa.direct:
                    m = pa.hi - pa.lo
                    o[pa.first:pa.first + m] = batchplan._pooled_attend(
                        q[pa.first:pa.first + m].reshape(m, K, H // K, D), pool, layer, pa).reshape(m, H, D)
                    continue
                qp = q.new_zeros(pa.hi - pa.lo, pa.nmax, H, D)
                qp[pa.at_slot, pa.at_row] = q[pa.rows]
                qp = qp.view(-1, pa.nmax, K, H // K, D).permute(0, 2, 3, 1, 4).reshape(-1, K, H // K * pa.nmax, D)
                got = batchplan._pooled_attend(qp, pool, layer, pa).view(-1, K, H // K, pa.nmax, D).permute(0, 3, 1, 2, 4)
                o[pa.rows] = got.reshape(-1, pa.nmax, H, D)[pa.at_slot, pa.at_row]

    need = sum(lens) * K * D * 4 * 2 * LAYERS  # bytes of keys and values the sequences attend over
    out = {"kernel_ms": best_ms(kernel, repeats), "sdpa_ms": best_ms(sdpa, repeats)}
    ref = o.clone()
    kernel()
    out["max_abs_diff"] = float((o - ref).abs().max())
    out["kernel_gbs"] = need / out["kernel_ms"] / 1e6
    out["sdpa_gbs"] = need / out["sdpa_ms"] / 1e6
    out["sdpa_over_kernel"] = out["sdpa_ms"] / out["kernel_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8, help=f"sequences in the pool (at most {len(LENGTHS)})")
    ap.add_argument("--rows", default="1,5,9", help="new rows per sequence, comma-separated")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    if not 1 <= args.batch <= len(LENGTHS):
        sys.exit(f"--batch={args.batch}: allowed 1..{len(LENGTHS)}")
    if attention.library() is None:
        sys.exit(f"the decode attention kernel does not build here: {attention.error()}")
    torch.set_grad_enabled(False)
    print(f"{'rows':>4} {'kernel ms':>10} {'sdpa ms':>8} {'kernel GB/s':>12} {'sdpa GB/s':>10} {'sdpa/kernel':>12} "
          f"{'max diff':>9}")
    res = {}
    for rows in (int(r) for r in args.rows.split(",")):
        r = res[rows] = case(args.batch, rows, args.repeats)
        print(f"{rows:>4} {r['kernel_ms']:>10.2f} {r['sdpa_ms']:>8.2f} {r['kernel_gbs']:>12.1f} {r['sdpa_gbs']:>10.1f} "
              f"{r['sdpa_over_kernel']:>12.2f} {r['max_abs_diff']:>9.1e}")
    print(json.dumps({"batch": args.batch, "threads": torch.get_num_threads(),
                      **{f"rows_{k}": {n: v if n == "max_abs_diff" else round(v, 3) for n, v in r.items()}
                         for k, r in res.items()}}))


if __name__ == "__main__":
    main()
