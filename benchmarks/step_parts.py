"""Where a one-row native decode step's time goes, in ms per token: each kind of linear (and the GB/s it
reached over the bytes it reads), the lm_head, the attention and the merge of its chunks, the norms and
residual adds, the activation, the barriers, and what the Python around the C++ call adds, per weight
format. The native step (engine.models.decode_step) is built a second time with STEP_PARTS, which
adds a read of the thread's CPU time at each part's end (time another process takes the
core is not counted); the step as served has none.

    .venv/bin/python benchmarks/step_parts.py --weights fp32,bf16,fp8 [--steps 200] [--threads 2] [--define=-DX]

Each figure is the median over `--steps` one-row steps after a `--prefix`-token context (the cache
rolled back each time), per thread; the step's wall time is timed around the C++ call (`c_ms`) and
around `LeanForward.step_batch` (`step_ms`: the Python that builds the call's arguments included).
The wall times count everything. A table, then one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models import decode_step, native, smallm  # noqa: E402
from tuner.schema.compose import load_config  # noqa: E402
from tuner.study.measurer import open_engine  # noqa: E402

PARTS = ["norms+residual", "qkv", "attention", "attn merge", "o", "w13", "silu", "w2", "lm_head", "barriers"]
LINEARS = {"qkv": "wqkv", "o": "wo", "w13": "w13", "w2": "w2"}


def _bind(lib: ctypes.CDLL) -> None:
    decode_step._bind(lib)
    lib.step_parts.argtypes = [ctypes.c_void_p, ctypes.c_int]


def measure(weights: str, steps: int, prefix: int, threads: int) -> dict:
    """One format's parts (ms per one-row step, per thread) and wall times."""
    eng = open_engine(load_config(["model=smollm2-135m", "spec.method=off", "engine.builtin.forward=lean",
                                   "engine.builtin.compile=false", f"engine.builtin.weights={weights}",
                                   "engine.builtin.native_step=true"]))
    fw, step = eng.forward, eng.lean.native
    lib = decode_step.library()
    n = len(PARTS)
    buf = (ctypes.c_ulonglong * (64 * n))()
    per: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(threads)]
    c_ms, step_ms = [], []
    real = step._fn  # the C++ entry the step bound when it was built

    def timed(*a):
        t = time.perf_counter()
        rc = real(*a)
        c_ms.append((time.perf_counter() - t) * 1e3)
        return rc

    with torch.inference_mode():
        cache = fw.new_cache(prefix + 2)
        fw.step_batch([cache], [list(range(1000, 1000 + prefix))], [None], [None], [True])
        step._fn = timed
        try:
            for i in range(steps + 5):
                cache.crop(prefix)
                lib.step_parts(buf, threads)
                before = list(buf)
                t = time.perf_counter()
                fw.step_batch([cache], [[1234]], [None], [None], [True])
                step_ms.append((time.perf_counter() - t) * 1e3)
                lib.step_parts(buf, threads)
                if i >= 5:  # warm
                    for th in range(threads):
                        for p in range(n):
                            per[th][p].append((buf[th * n + p] - before[th * n + p]) / 1e6)
        finally:
            step._fn = real
    c_ms, step_ms = c_ms[5:], step_ms[5:]
    model = step.model
    nbytes = {}
    for name, attr in LINEARS.items():
        nbytes[name] = sum(getattr(b, attr)._smallm_packed.numel() * getattr(b, attr)._smallm_packed.element_size()
                           for b in model.blocks)
    nbytes["lm_head"] = step.lm.numel() * step.lm.element_size()
    parts = {p: [round(statistics.median(per[th][i]), 3) for th in range(threads)] for i, p in enumerate(PARTS)}
    gb_s = {p: round(nbytes[p] / (max(parts[p]) / 1e3) / 1e9, 1) for p in nbytes}
    return {"weights": weights, "threads": threads, "parts_ms": parts, "linear_gb_s": gb_s,
            "linear_mb": {p: round(b / 1e6, 1) for p, b in nbytes.items()},
            "c_ms": round(statistics.median(c_ms), 3), "step_ms": round(statistics.median(step_ms), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="fp32,bf16,fp8")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--define", action="append", default=[], help="a -D flag for the step's build (repeatable)")
    args = ap.parse_args(argv)
    if bad := [w for w in args.weights.split(",") if w not in ("fp32", "bf16", "fp8")]:
        print(f"--weights {bad[0]}: allowed fp32, bf16, fp8 (comma-separated)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    decode_step._NATIVE = native.Native("decode_step_parts", decode_step._SOURCE,
                                        [f"-DVW={smallm.VW}", f"-DNB={smallm.NB}", "-DSTEP_PARTS", *args.define], _bind)
    out = [measure(w, args.steps, args.prefix, threads) for w in args.weights.split(",")]
    for r in out:
        print(f"{r['weights']} {' '.join(args.define)}: step {r['step_ms']} ms (C++ call {r['c_ms']} ms), {threads} threads")
        for p, ms in r["parts_ms"].items():
            extra = f"  {r['linear_mb'][p]} MB, {r['linear_gb_s'][p]} GB/s" if p in r["linear_gb_s"] else ""
            print(f"  {p:15s} {' / '.join(f'{v:.3f}' for v in ms)} ms{extra}")
    print(json.dumps({"rows": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
