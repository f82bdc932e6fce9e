"""Ragged or padded attention for a batched decode step? The choice behind LeanForward.step_batch,
measured: the attention of one layer for B sequences (SmolLM2's shapes: 9 query heads, 3 KV heads,
head size 64), each with its own KV cache of `--context` positions and `--rows` new rows.

- ragged: one SDPA call per sequence on a view of its own cache (what the engine runs);
- padded: the sequences' keys and values gathered into one [B, K, L, d] tensor and one SDPA call
  with a padding mask (what a slot-padded cache would run, plus the gather it avoids only when
  the caches are one tensor already: `padded_view` times that best case, no gather).

    .venv/bin/python benchmarks/batch_layout.py --context 300 --rows 1,5

A table of ms per layer and the padded/ragged ratios; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

H, K, D = 9, 3, 64


def best_ms(fn, repeats: int = 20) -> float:
    """Best-of-`repeats` milliseconds of fn() after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def case(b: int, rows: int, ctx: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    lens = [ctx - 7 * i % max(ctx // 3, 1) for i in range(b)]  # mixed lengths, as in a real batch
    caches = [(torch.randn(K, ctx + rows, D, generator=g), torch.randn(K, ctx + rows, D, generator=g)) for _ in range(b)]
    q = torch.randn(H, b * rows, D, generator=g)
    masks = [None if rows == 1 else torch.zeros(rows, n + rows).masked_fill_(
        ~torch.ones(rows, n + rows, dtype=torch.bool).tril(n), float("-inf")) for n in lens]

    def ragged() -> None:
        torch.cat([F.scaled_dot_product_attention(q[None, :, i * rows:(i + 1) * rows], ck[None, :, :n + rows],
                                                  cv[None, :, :n + rows], attn_mask=m, enable_gqa=True)[0]
                   for i, ((ck, cv), n, m) in enumerate(zip(caches, lens, masks))], dim=1)

    L = max(lens) + rows
    pad_mask = torch.full((b, 1, rows, L), float("-inf"))
    for i, n in enumerate(lens):
        pad_mask[i, 0, :, :n] = 0
        pad_mask[i, 0, :, n:n + rows] = 0 if masks[i] is None else masks[i][:, n:]
    qb = q.view(H, b, rows, D).transpose(0, 1)
    stacked_k = torch.stack([ck[:, :L] if ck.shape[1] >= L else F.pad(ck, (0, 0, 0, L - ck.shape[1])) for ck, _ in caches])
    stacked_v = torch.stack([cv[:, :L] if cv.shape[1] >= L else F.pad(cv, (0, 0, 0, L - cv.shape[1])) for _, cv in caches])

    def padded() -> None:
        kb = torch.stack([F.pad(ck[:, :n + rows], (0, 0, 0, L - n - rows)) for (ck, _), n in zip(caches, lens)])
        vb = torch.stack([F.pad(cv[:, :n + rows], (0, 0, 0, L - n - rows)) for (_, cv), n in zip(caches, lens)])
        F.scaled_dot_product_attention(qb, kb, vb, attn_mask=pad_mask, enable_gqa=True)

    def padded_view() -> None:
        F.scaled_dot_product_attention(qb, stacked_k, stacked_v, attn_mask=pad_mask, enable_gqa=True)

    return {"ragged": best_ms(ragged), "padded": best_ms(padded), "padded_view": best_ms(padded_view)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--rows", default="1,5", help="new rows per sequence (1: AR; 5: a depth-4 chain)")
    ap.add_argument("--context", type=int, default=300)
    args = ap.parse_args(argv)
    try:
        batches = [int(x) for x in args.batches.split(",") if x]
        rows = [int(x) for x in args.rows.split(",") if x]
    except ValueError:
        print(f"--batches={args.batches} / --rows={args.rows}: comma-separated integers", file=sys.stderr)
        return 2
    out = []
    print(f"attention of one layer, ms (context {args.context}, {torch.get_num_threads()} threads)")
    print(f"{'B':>3} {'rows':>4} {'ragged':>8} {'padded':>8} {'padded(view)':>13} {'padded/ragged':>14}")
    with torch.inference_mode():
        for r in rows:
            for b in batches:
                t = case(b, r, args.context)
                out.append({"batch": b, "rows": r, **{k: round(v, 4) for k, v in t.items()}})
                print(f"{b:>3} {r:>4} {t['ragged']:8.3f} {t['padded']:8.3f} {t['padded_view']:13.3f} "
                      f"{t['padded'] / t['ragged']:14.2f}")
    print(json.dumps({"context": args.context, "rows": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
