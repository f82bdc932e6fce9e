"""Adaptive speculation against the best static spec and off, per workload and concurrency, over HTTP.

    .venv/bin/python benchmarks/adaptive.py                                   # code and chat, c = 1..32
    .venv/bin/python benchmarks/adaptive.py --levels 1,4 --prompts 2 --max-new-tokens 16 --depths 2  # a smoke run
    .venv/bin/python benchmarks/adaptive.py --prompts 12 --max-new-tokens 128 --depths 1,2,3,4,6,8 --rounds 4

Each configuration runs as `tuner serve` in a process of its own (max_batch = the highest level;
benchmarks/concurrency.py starts it, with the same SpecConfig-to-`tuner serve` mapping the manifests
use), and the one load generator plays HumanEval (code) and MT-bench (chat) prompts at every level:
speculation off, a small grid of static n-gram chains (`--depths`; the best of them at each level is
that level's "best static") and the adaptive engine bounded by the grid's deepest chain
(`spec.adaptive=true`). A level of N plays max(prompts, N) requests with N clients in flight, T=0.
Every round after the first measures the configurations again in the reverse order; a cell is the
mean over the rounds (two, by default, cancel linear drift). The last line is one JSON object with `min_adaptive_vs_best_static` and
`min_adaptive_vs_off`, the minima over every level of both workloads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from concurrency import _levels_run, _tuner_serve  # noqa: E402

from engine.measure.runner import HttpTarget  # noqa: E402
from engine.measure.workloads import load_prompts, sampling_params  # noqa: E402
from tuner.schema.compose import load_config  # noqa: E402
from tuner.schema.config import SpecConfig  # noqa: E402

WORKLOADS = ("code", "chat")


def specs(method: str, depths: list[int]) -> list[SpecConfig]:
    """Off, the static grid (chains of each depth) and the adaptive engine within the deepest chain."""
    bound = max(depths)
    return ([SpecConfig(method="off")] + [SpecConfig(method=method, depth=d, topk=1, budget=d + 1) for d in depths]
            + [SpecConfig(method=method, depth=bound, topk=1, budget=bound + 1, adaptive=True)])


def run(specs_: list[SpecConfig], workloads: list[str], levels: list[int], prompts: int, max_new_tokens: int,
        rounds: int) -> list[dict[str, Any]]:
    """Rows (workload, config, level, tok/s, tau) of every round: each configuration's server started
    once per round, both workloads played against it."""
    over = [f"engine.builtin.max_batch={max(levels)}", f"serve.queue_size={4 * max(levels)}"]
    loads = {}
    for w in workloads:
        cfg = load_config([f"+workload={w}", f"workload.num_prompts={prompts}", f"workload.max_new_tokens={max_new_tokens}"])
        loads[w] = (load_prompts(cfg.workload), sampling_params(cfg.workload), cfg.workload.chat_template)
    model = load_config([]).model.name
    log_dir = tempfile.mkdtemp(prefix="spectune-adaptive-")
    rows = []
    for r in range(rounds):
        for spec in (specs_ if r % 2 == 0 else specs_[::-1]):
            with _tuner_serve(over, model, spec, log_dir) as url:
                for w, (ps, params, chat) in loads.items():
                    got = _levels_run(HttpTarget(url, model, chat), ps, params, levels, repeats=1)
                    for c, s in got.items():
                        rows.append({"workload": w, "config": spec.key(), "concurrency": c, "round": r,
                                     "tok_s": s.output_tokens_per_s, "tau": s.tau})
                        print(f"  {w:<5} {spec.key():<24} c={c:<3} {s.output_tokens_per_s:7.1f} tok/s  tau "
                              f"{s.tau or 0:.2f}", file=sys.stderr)
    return rows


def cells(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], float]:
    """(workload, config, level) -> tok/s, the mean over the rounds."""
    out: dict[tuple[str, str, int], list[float]] = {}
    for r in rows:
        out.setdefault((r["workload"], r["config"], r["concurrency"]), []).append(r["tok_s"])
    return {k: statistics.fmean(v) for k, v in out.items()}


def compare(rows: list[dict[str, Any]], specs_: list[SpecConfig], workloads: list[str],
            levels: list[int]) -> list[dict[str, Any]]:
    """Per workload and level: off, the best static configuration and adaptive (tok/s), and the two
    ratios of adaptive."""
    tok = cells(rows)
    static = [s.key() for s in specs_ if s.method != "off" and not s.adaptive]
    adaptive = next(s.key() for s in specs_ if s.adaptive)
    out = []
    for w in workloads:
        for c in levels:
            best = max(static, key=lambda k: tok[(w, k, c)])
            off, top, ad = tok[(w, "off", c)], tok[(w, best, c)], tok[(w, adaptive, c)]
            out.append({"workload": w, "concurrency": c, "off": round(off, 2), "best_static": best,
                        "best_static_tok_s": round(top, 2), "adaptive_tok_s": round(ad, 2),
                        "adaptive_vs_best_static": round(ad / top, 3), "adaptive_vs_off": round(ad / off, 3)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,2,4,8,16,32")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per workload (a level plays max(prompts, N))")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--depths", default="2,4,8", help="the static grid's chain depths; the deepest bounds adaptive")
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix"], help="a drafter that needs no head")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=2, help="passes over the configurations, alternating their order")
    args = ap.parse_args(argv)
    try:
        levels = sorted({int(x) for x in args.levels.split(",") if x})
        depths = sorted({int(x) for x in args.depths.split(",") if x})
    except ValueError:
        print(f"--levels={args.levels} / --depths={args.depths}: comma-separated integers", file=sys.stderr)
        return 2
    workloads = [w for w in args.workloads.split(",") if w]
    if not levels or levels[0] < 1 or not depths or depths[0] < 1 or depths[-1] > 16:
        print("--levels: each >= 1; --depths: each in 1..16", file=sys.stderr)
        return 2
    if bad := [w for w in workloads if w not in WORKLOADS]:
        print(f"--workloads: {bad[0]} is not allowed (allowed: {', '.join(WORKLOADS)})", file=sys.stderr)
        return 2
    if args.prompts < 1 or args.max_new_tokens < 1 or args.rounds < 1:
        print("--prompts, --max-new-tokens and --rounds must be >= 1", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    grid = specs(args.method, depths)
    rows = run(grid, workloads, levels, args.prompts, args.max_new_tokens, args.rounds)
    table = compare(rows, grid, workloads, levels)

    print(f"\nload average {load:.1f} at the start; {args.prompts} prompts per workload, {args.max_new_tokens} new "
          f"tokens, T=0, {args.rounds} round(s); adaptive = {grid[-1].key()}")
    print(f"{'workload':<8} {'c':>3} {'off':>8} {'best static':>24} {'tok/s':>8} {'adaptive':>9} "
          f"{'vs static':>10} {'vs off':>7}")
    for t in table:
        print(f"{t['workload']:<8} {t['concurrency']:>3} {t['off']:8.1f} {t['best_static']:>24} "
              f"{t['best_static_tok_s']:8.1f} {t['adaptive_tok_s']:9.1f} {t['adaptive_vs_best_static']:9.3f}x "
              f"{t['adaptive_vs_off']:6.3f}x")
    print("(output tok/s over all requests; best static: the fastest chain of the grid at that level)")
    out = {"levels": levels, "workloads": workloads, "depths": depths, "method": args.method, "rounds": args.rounds,
           "load_average": round(load, 2), "table": table,
           "rows": rows,
           "min_adaptive_vs_best_static": min(t["adaptive_vs_best_static"] for t in table),
           "min_adaptive_vs_off": min(t["adaptive_vs_off"] for t in table)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
