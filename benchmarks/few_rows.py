"""The few-row kernel's block (engine.models.smallm, the linears of the native step) on its own: G
weights a second for one row and for a few rows, at each weight format, over a weight that stays in
the core's cache and over one streamed from memory, at one thread (one core: the kernel's compute and
the widening per weight, apart from the other core's share of the read).

    .venv/bin/python benchmarks/few_rows.py --formats fp32,bf16,fp8 --rows 1,2,5,8

Each figure is the best of `--repeats` timings of a loop of calls run inside C (no Python between the
calls), in this thread's CPU time (the kernel runs on the calling thread: time another process takes
the core from it is not counted; what it does to the caches and the memory bus is). A copy of this file in another checkout's benchmarks/ times that checkout's kernel with the
same loop. A table, then one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models import native, smallm  # noqa: E402

# calls of smallm_linear in a loop (the same x, w, y: a weight in cache stays there)
LOOP = r"""
extern "C" int linear_loop(const float* x, const void* wp, float* y, long M, long N, long K, int fmt, float scale,
                           int threads, long calls) {
  for (long i = 0; i < calls; ++i)
    if (int rc = smallm_linear(x, wp, y, M, N, K, fmt, scale, threads)) return rc;
  return 0;
}
"""

PLACES = {"cache": 128, "stream": 32768}  # output columns at K: SmolLM2's hidden size
K = 576


def _bind(lib: ctypes.CDLL) -> None:
    smallm._bind(lib)
    lib.linear_loop.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int, ctypes.c_float,
                                                                             ctypes.c_int, ctypes.c_long]
    lib.linear_loop.restype = ctypes.c_int


def measure(formats: list[str], rows: list[int], repeats: int, seconds: float, defines: list[str]) -> list[dict]:
    """G weights a second per (format, place, rows), one thread, the kernel built with `defines` added."""
    lib = native.Native("smallm_loop", smallm._SOURCE + LOOP, [f"-DVW={smallm.VW}", f"-DNB={smallm.NB}", *defines],
                        _bind).library()
    if lib is None:
        raise SystemExit("few_rows: the kernel could not be built")
    out = []
    g = torch.Generator().manual_seed(0)
    for weights in formats:
        for place, n in PLACES.items():
            w = torch.randn(n, K, generator=g)
            packed, scale = smallm.pack(w, weights, lib)
            width = packed.shape[0] * smallm.BW
            fmt = smallm.FORMATS[packed.dtype]
            for m in rows:
                x = torch.randn(m, K, generator=g)
                y = torch.empty(m, width)

                def run(calls: int) -> float:
                    t = time.thread_time()
                    rc = lib.linear_loop(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, width, K, fmt, scale, 1,
                                         calls)
                    if rc:
                        raise SystemExit(f"few_rows: smallm_linear returned {rc}")
                    return time.thread_time() - t

                calls = max(1, int(seconds / max(run(1), 1e-7)))
                best = min(run(calls) / calls for _ in range(repeats))
                out.append({"weights": weights, "place": place, "rows": m, "us": round(best * 1e6, 2),
                            "g_weights_s": round(width * K / best / 1e9, 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="fp32,bf16,fp8")
    ap.add_argument("--rows", default="1,2,5,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.2, help="length of one timed loop")
    ap.add_argument("--define", action="append", default=[], help="a -D flag for the kernel's build (repeatable)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [int(r) for r in args.rows.split(",")]
    res = measure(args.formats.split(","), rows, args.repeats, args.seconds, args.define)
    print(f"kernel {smallm.TAG} {' '.join(args.define)}, {smallm.VW} lanes x {smallm.NB}; G weights/s (one thread)")
    print("weights place  " + " ".join(f"{m:>6} rows" for m in rows))
    for weights in args.formats.split(","):
        for place in PLACES:
            cells = [r["g_weights_s"] for r in res if r["weights"] == weights and r["place"] == place]
            print(f"{weights:7} {place:6} " + " ".join(f"{c:>11.2f}" for c in cells))
    print(json.dumps({"kernel": smallm.TAG, "defines": args.define, "lanes": smallm.VW, "results": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
