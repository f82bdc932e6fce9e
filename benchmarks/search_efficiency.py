"""How many live trials does TPE need to find (nearly) the best configuration of a small space?

1. Measure the exhaustive grid of a small space ONCE on the real model and engine, with the real
   `tuner optimize` flow (search.sampler=grid: every point enqueued, each with its adjacent baseline).
2. For a few seeds, run the study's own TPE sampler (trial 0 `off`, then the engines' clipped
   defaults, then TPE) and REPLAY the grid's measured values as a lookup table instead of
   measuring again: count the trials (baseline and defaults included) until a speculative one
   reaches 97% of the grid's best speculative value (objective: drift-corrected tok/s).
3. Goal: the median over seeds is at most 10% of the grid's size.

The last line printed is one JSON object. Usage:

    python benchmarks/search_efficiency.py                    # SmolLM2, ngram + EAGLE head, measures the grid
    python benchmarks/search_efficiency.py --grid-run runs/X  # replay an already measured grid run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna

from tuner.cli_optimize import open_run_study
from tuner.config import load_saved_config
from tuner.objective import OFF, spec_of
from tuner.optimize import optimize
from tuner.space import SearchSpace
from tuner.study import create_study, role


def measure_grid(args: argparse.Namespace) -> Path:
    """The real optimize flow over every point of the small space; returns its run directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    over = [
        f"model={args.model}", "+workload=code", "search=grid", f"search.methods=[{args.methods}]",
        f"search.depth.min=1", f"search.depth.max={args.depth_max}", f"search.topk=[{args.topk}]",
        f"search.budget_max={args.budget_max}", "search.n_trials=100000", f"search.repeats_min={args.repeats}",
        f"search.repeats_max={args.repeats}", f"workload.num_prompts={args.prompts}", "workload.num_heldout=2",
        f"workload.max_new_tokens={args.tokens}", f"engine.builtin.threads={args.threads}",
        f"run_dir={args.run_dir}", f"search.study_name=search-efficiency-grid-{stamp}",
        *[f"train.{kv}" for kv in args.train],
    ]
    return optimize(over, quiet=args.quiet)


def _key(spec) -> str:
    """A point's identity without drafter paths (the grid's specs carry the head's path)."""
    return spec.model_copy(update={"head_path": None, "draft_model": None}).model_dump_json()


def replay(run_dir: Path, seeds: list[int], within: float) -> dict:
    """TPE replays of a measured grid run (lookup table of its measured values)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg = load_saved_config(run_dir / "config.yaml")
    grid = open_run_study(run_dir)
    table: dict[str, float] = {}
    for t in grid.trials:
        if t.state == optuna.trial.TrialState.COMPLETE and spec_of(t) is not None:
            table.setdefault(_key(spec_of(t)), t.value)
    base = next(t.value for t in grid.trials if role(t) == "baseline" and t.value is not None)
    points = [k for k in table if k != _key(OFF)]
    # The target is the best SPECULATIVE point: when `off` wins, trial 0 would find it trivially.
    best = max(table[k] for k in points)
    target = (1 - within) * best
    needed: list[int | None] = []  # None: not reached within the replay's limit
    needed_noise: list[int | None] = []  # the same for the noise band (search.noise_rel, e.g. 5%)
    limit = 10 * len(table)
    for seed in seeds:
        tpe = cfg.model_copy(deep=True)
        tpe.search.sampler = "tpe"
        tpe.search.seed = seed
        tpe.search.n_trials = len(points) + 1
        tpe.search.storage = None  # a throwaway SQLite file: nothing is measured in a replay
        space = SearchSpace.from_config(tpe, head_path=None)
        hit: int | None = None
        hit_noise: int | None = None
        with tempfile.TemporaryDirectory() as tmp:
            study = create_study(tpe, space, Path(tmp), f"replay-{seed}")
            for n in range(1, limit + 1):
                trial = study.ask()
                spec = OFF if role(trial) == "baseline" else space.suggest(trial)
                key = _key(spec)
                if key not in table:  # a point that crashed in the grid: a failed trial here too
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    continue
                study.tell(trial, table[key])
                if key != _key(OFF) and hit_noise is None and table[key] >= (1 - cfg.search.noise_rel) * best:
                    hit_noise = n
                if key != _key(OFF) and table[key] >= target:
                    hit = n
                    break
        needed.append(hit)
        needed_noise.append(hit_noise)
    # a seed that never got there counts as the limit (so the median is a lower bound then)
    med = statistics.median(n if n is not None else limit for n in needed)
    med_noise = statistics.median(n if n is not None else limit for n in needed_noise)
    return {
        "benchmark": "search_efficiency", "run_dir": str(run_dir), "model": cfg.model.name,
        "space": {"methods": list(cfg.search.methods), "depth_max": cfg.search.depth.max,
                  "topk": list(cfg.search.topk), "budget_max": cfg.search.budget_max},
        "grid_points": len(points), "grid_best_value": round(best, 3), "baseline_value": round(base, 3),
        "grid_best_spec": next(json.loads(k) for k in points if table[k] == best),
        "within": within, "seeds": seeds, "trials_needed": needed, "median_trials": med, "replay_limit": limit,
        "noise_rel": cfg.search.noise_rel, "trials_needed_within_noise": needed_noise,
        "median_trials_within_noise": med_noise,
        "median_share_of_grid": round(med / len(points), 3), "goal_share": 0.10,
        "goal_met": med / len(points) <= 0.10, "replayed": True,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="ngram,eagle")
    p.add_argument("--depth-max", type=int, default=4)
    p.add_argument("--topk", default="1,2,4")
    p.add_argument("--budget-max", type=int, default=8)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="measurements per grid point (pooled): one is too noisy here")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--within", type=float, default=0.03)
    p.add_argument("--run-dir", default="runs")
    p.add_argument("--grid-run", type=Path, help="replay this measured grid run instead of measuring one")
    p.add_argument("--train", nargs="*", default=["prompts=24", "steps=150", "max_new_tokens=96"],
                   help="train.* overrides for the EAGLE head of the benchmark (its own workload, so its own cache)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()
    t0 = time.monotonic()
    run_dir = args.grid_run or measure_grid(args)
    out = replay(run_dir, [int(s) for s in args.seeds.split(",")], args.within)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
