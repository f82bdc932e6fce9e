"""Load and split a file of 100,000 OpenAI request bodies (HumanEval, MT-bench and GSM texts, each
made distinct by its index; half greedy, half T=0.7): the wall time of the one streaming pass and
its peak Python heap (tracemalloc, a second pass). Run: python benchmarks/load_requests.py [N] [DIR]."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

from engine.measure.traffic import sample_file
from engine.measure.workloads import gsm_prompts, humaneval_prompts, mtbench_prompts


def write(path: Path, n: int) -> None:
    texts = [p.text for p in humaneval_prompts()] + [p.text for p in mtbench_prompts()] + [p.text for p in gsm_prompts(100, 0)]
    with path.open("w") as f:
        for i in range(n):
            body: dict = {"model": "m", "messages": [{"role": "user", "content": f"{texts[i % len(texts)]}\n#{i}"}],
                          "max_tokens": 16 + i % 240}
            if i % 2:
                body.update(temperature=0.7, seed=i)
            f.write(json.dumps(body) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description="Load and split a file of N OpenAI request bodies: wall time and peak heap.")
    ap.add_argument("n", type=int, nargs="?", default=100_000, help="request bodies in the file (default 100000)")
    ap.add_argument("dir", type=Path, nargs="?", help="where the file is written or read (default: a new temporary folder)")
    args = ap.parse_args()
    n, d = args.n, args.dir or Path(tempfile.mkdtemp())
    path = d / f"requests_{n}.jsonl"
    if not path.is_file():
        write(path, n)
    t0 = time.perf_counter()
    s = sample_file(path, "auto", 12, 6, 0, 0.0)
    wall = time.perf_counter() - t0
    tracemalloc.start()
    sample_file(path, "auto", 12, 6, 0, 0.0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"{path.name}: {path.stat().st_size / 1e6:.1f} MB, {s.shape.requests} requests ({s.shape.tune} tuning, "
          f"{s.shape.heldout} held out), load and split {wall:.2f} s, peak Python heap {peak / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
