"""How many live trials does TPE need to find (nearly) the best configuration of a small space?

1. Measure the exhaustive grid of a small space ONCE on the real model and engine, with the real
   `tuner optimize` flow (search.sampler=grid: every point enqueued, each with its adjacent baseline).
   Each point is measured `--repeats` times (pooled): with one short measurement per point the
   grid's best is a noise spike rather than a configuration.
2. For a few seeds, run the study's own TPE sampler (trial 0 `off`, then the engines' clipped
   defaults, then TPE, with the default search's n_trials=8 setting its start-up) and REPLAY the
   grid's measured values as a lookup table instead of measuring again (pruned points replay as
   pruned, with their intermediate value): count the trials (baseline and defaults included)
   until a speculative one reaches 97% of the grid's best speculative value (objective:
   drift-corrected tok/s). Random search is replayed the same way, for comparison.
3. Goal: the TPE median over seeds is at most 10% of the grid's size.
4. `search.sampler=model` (`--model-live N`, 0 skips it): the grid's prompts are profiled and this
   machine's cost model measured, a batched step per concurrency level included
   (tuner.search.guided.predict_space: each point ranked over the levels, with its K per band); `off` and the N best predicted points
   are looked up as live trials, widening by N whenever a looked-up speedup is off its prediction
   by more than twice the noise band. Deterministic, so one row. The profile's greedy tau is also
   compared with each grid point's live tau (they must agree: the same prompts, T=0).

Prints a table (samplers side by side), writes <grid run>/search_efficiency.png (best so far
against trials, per seed), and the last line printed is one JSON object. Usage:

    python benchmarks/search_efficiency.py                    # SmolLM2, ngram + EAGLE head, measures the grid
    python benchmarks/search_efficiency.py --grid-run runs/X  # replay an already measured grid run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna

from tuner.schema.compose import load_saved_config
from tuner.study.objective import OFF, spec_of
from tuner.run.session import optimize
from tuner.run.rundir import open_run_study
from tuner.schema.config import UserError
from tuner.search.space import SearchSpace
from tuner.study.studies import create_study, role


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


def _grid_table(run_dir: Path) -> tuple[dict[str, float], dict[str, float], float]:
    """(complete point -> value, pruned point -> its last intermediate value, the baseline's
    value) of a grid run."""
    grid = open_run_study(run_dir)
    base = next(t.value for t in grid.trials if role(t) == "baseline" and t.value is not None)
    table: dict[str, float] = {}
    pruned: dict[str, float] = {}
    for t in grid.trials:
        spec = spec_of(t)
        if spec is None:
            continue
        if t.state == optuna.trial.TrialState.COMPLETE:
            table.setdefault(_key(spec), t.value)
        elif t.state == optuna.trial.TrialState.PRUNED and t.intermediate_values:
            pruned.setdefault(_key(spec), t.intermediate_values[max(t.intermediate_values)])
    return table, pruned, base


class _NoDefaults(SearchSpace):
    """The same space without the engines' defaults enqueued: what the sampler finds on its own."""

    def defaults(self) -> list:
        return []


def _replay_one(cfg, table: dict[str, float], pruned: dict[str, float], sampler: str, defaults: bool, seed: int,
                n_trials: int, target: float, best: float, limit: int) -> tuple[int | None, list[float]]:
    """One replay: (trials until a speculative point reaches `target`, best-so-far / best per trial).
    The sampler sees what it would see live: values, pruned trials with their intermediate value."""
    c = cfg.model_copy(deep=True)
    c.search.sampler, c.search.seed, c.search.n_trials = sampler, seed, n_trials
    c.search.storage = None  # a throwaway SQLite file: nothing is measured in a replay
    space = SearchSpace.from_config(c)
    if not defaults:
        space = _NoDefaults(**dataclasses.asdict(space))
    curve: list[float] = []
    so_far = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        study = create_study(c, space, Path(tmp), f"replay-{sampler}-{seed}")
        for n in range(1, limit + 1):
            trial = study.ask()
            spec = OFF if role(trial) == "baseline" else space.suggest(trial)
            key = _key(spec)
            if key in table:
                study.tell(trial, table[key])
                if key != _key(OFF):
                    so_far = max(so_far, table[key])
            elif key in pruned:
                trial.report(pruned[key], 0)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:  # a point that failed in the grid fails here too
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            curve.append(so_far / best)
            if so_far >= target:
                return n, curve
    return None, curve


def plot(curves: dict[str, list[list[float]]], within: float, grid_points: int, out: Path) -> None:
    """Best-so-far (share of the grid's best) against trials, one line per seed and sampler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, runs), color in zip(curves.items(), ("tab:blue", "tab:orange", "tab:green")):
        for i, c in enumerate(runs):
            ax.step(range(1, len(c) + 1), c, where="post", color=color, alpha=0.6,
                    label=name if i == 0 else None)
    ax.axhline(1 - within, color="k", ls="--", lw=1, label=f"{1 - within:.0%} of the grid's best")
    ax.axvline(0.10 * grid_points, color="r", ls=":", lw=1, label="10% of the grid")
    ax.set_xscale("log")  # the interesting part is the first few trials; misses run to the limit
    ax.set_ylim(0.5, 1.02)
    ax.set_xlabel("trials (baseline and defaults included)")
    ax.set_ylabel("best speculative value / grid best")
    ax.set_title(f"Replays against a measured {grid_points}-point grid")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _grid_taus(run_dir: Path) -> dict[str, float]:
    """Measured tau of each complete grid point that runs one spec at every level (its K per band,
    if any, is its depth everywhere), keyed as that spec (live engine, the grid's prompts)."""
    out: dict[str, float] = {}
    for t in open_run_study(run_dir).trials:
        spec = spec_of(t)
        if spec is None or t.state != optuna.trial.TrialState.COMPLETE or t.user_attrs.get("tau") is None:
            continue
        if spec.k_per_batch_size and any(k != spec.depth for _, _, k in spec.k_per_batch_size):
            continue  # another spec in some band: its tau mixes two configurations
        out.setdefault(_key(spec.model_copy(update={"k_per_batch_size": None})), t.user_attrs["tau"])
    return out


def replay_model(run_dir: Path, cfg, table: dict[str, float], pruned: dict[str, float], base: float, best: float,
                 within: float, live: int) -> dict:
    """search.sampler=model against the measured grid: a profile of the grid's prompts and this
    machine's measured cost rank every point; `off` and the `live` best predicted points are
    looked up as live trials, and a looked-up speedup off its prediction by more than twice the
    noise band widens the sample by `live` more, as tuner.search.guided does. Deterministic (no seed).
    Also: the profile's greedy tau against the grid's live tau, point by point."""
    from tuner.search.guided import PREDICTED, predict_space

    heads = {}
    for t in open_run_study(run_dir).trials:
        spec = spec_of(t)
        if spec is not None and spec.head_path:
            heads.setdefault(spec.method, spec.head_path)
    c = cfg.model_copy(deep=True)
    space = SearchSpace.from_config(c, head_paths=heads)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        ranked = predict_space(c, space, Path(tmp))
        predict_s = time.monotonic() - t0
        prof = json.loads((Path(tmp) / "profile.json").read_text())
    from tuner.schema.config import SpecConfig

    band = 2 * cfg.search.noise_rel
    target = (1 - within) * best
    enq = min(live, len(ranked))
    queue, n, so_far, hit, widened = list(range(enq)), 1, 0.0, None, 0
    seen: list[dict] = []
    while queue:
        r = queue.pop(0)
        n += 1
        key = _key(SpecConfig(**ranked[r]["spec"]))
        value = table.get(key, pruned.get(key))
        if value is None:
            continue
        so_far = max(so_far, value)
        err = (value / base) / ranked[r][PREDICTED] - 1
        seen.append({"rank": r, "spec": ranked[r]["label"], "predicted": round(ranked[r][PREDICTED], 3),
                     "measured": round(value / base, 3), "error": round(err, 3)})
        if hit is None and so_far >= target:
            hit = n
        if abs(err) > band:  # as tuner.search.guided.Widener: the next `live` predicted points
            more = list(range(enq, min(enq + live, len(ranked))))
            queue.extend(more)
            enq += len(more)
            widened += bool(more)
    taus = _grid_taus(run_dir)
    tau_err = [abs(p["tau"] / taus[_key(SpecConfig(**p["spec"]))] - 1) for p in prof["points"]
               if _key(SpecConfig(**p["spec"])) in taus]
    return {"trials_needed": hit, "live_trials": n, "widenings": widened, "live": seen,
            "share_of_grid": round((hit or n) / max(len(ranked), 1), 3), "predict_s": round(predict_s, 1),
            "tau_points": len(tau_err), "tau_max_abs_error": round(max(tau_err), 4) if tau_err else None,
            "tau_median_abs_error": round(statistics.median(tau_err), 4) if tau_err else None}


# (row label, sampler, engines' defaults enqueued): the first row is what `tuner optimize` does.
SAMPLERS = (("tpe", "tpe", True), ("tpe, no defaults", "tpe", False), ("random, no defaults", "random", False))


def replay(run_dir: Path, seeds: list[int], within: float, n_trials: int,
           samplers: tuple[tuple[str, str, bool], ...] = SAMPLERS, model_live: int = 0) -> dict:
    """Replays of a measured grid run (lookup table of its measured values) for each sampler."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg = load_saved_config(run_dir / "config.yaml")
    table, pruned, base = _grid_table(run_dir)
    points = [k for k in (*table, *pruned) if k != _key(OFF)]
    # The target is the best SPECULATIVE point: when `off` wins, trial 0 would find it trivially.
    best = max(table[k] for k in table if k != _key(OFF))
    limit = 10 * len(points)
    per: dict[str, dict] = {}
    curves: dict[str, list[list[float]]] = {}
    for label, sampler, defaults in samplers:
        needed, needed_noise, runs = [], [], []
        for seed in seeds:
            hit, curve = _replay_one(cfg, table, pruned, sampler, defaults, seed, n_trials, (1 - within) * best,
                                     best, limit)
            needed.append(hit)
            runs.append(curve)
            # within the noise band (search.noise_rel, e.g. 5%): the first trial at that level
            band = next((i + 1 for i, v in enumerate(curve) if v >= 1 - cfg.search.noise_rel), None)
            needed_noise.append(band)
        # a seed that never got there counts as the limit (so the median is a lower bound then)
        med = statistics.median(n if n is not None else limit for n in needed)
        per[label] = {"trials_needed": needed, "median_trials": med,
                        "median_share_of_grid": round(med / len(points), 3),
                        "trials_needed_within_noise": needed_noise}
        curves[label] = runs
    if model_live:
        m = replay_model(run_dir, cfg, table, pruned, base, best, within, model_live)
        per["model"] = {"trials_needed": [m["trials_needed"]], "median_trials": m["trials_needed"] or m["live_trials"],
                        "median_share_of_grid": round((m["trials_needed"] or limit) / len(points), 3),
                        "trials_needed_within_noise": [None], "replay": m}
    png = run_dir / "search_efficiency.png"
    plot(curves, within, len(points), png)
    tpe = per["tpe"]
    close = sorted((table[k] / best, json.loads(k)) for k in table if k != _key(OFF))[::-1]
    return {
        "benchmark": "search_efficiency", "run_dir": str(run_dir), "model": cfg.model.name,
        "space": {"methods": list(cfg.search.methods), "depth_max": cfg.search.depth.max,
                  "topk": list(cfg.search.topk), "budget_max": cfg.search.budget_max},
        "grid_points": len(points), "grid_repeats": cfg.search.repeats_max, "grid_best_value": round(best, 3),
        "baseline_value": round(base, 3), "grid_best_spec": close[0][1],
        "points_within": sum(1 for r, _ in close if r >= 1 - within),
        "within": within, "seeds": seeds, "replay_n_trials": n_trials, "replay_limit": limit,
        "trials_needed": tpe["trials_needed"], "median_trials": tpe["median_trials"],
        "median_share_of_grid": tpe["median_share_of_grid"], "samplers": per,
        "goal_share": 0.10, "goal_met": tpe["median_share_of_grid"] <= 0.10, "replayed": True, "plot": str(png),
    }


def table_print(out: dict) -> None:
    """The replay figures side by side (sampler, trials per seed, median, share of the grid)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{out['grid_points']}-point grid, best {out['grid_best_value']:.2f} "
                    f"({out['points_within']} point(s) within {out['within']:.0%}); goal: median <= 10% of the grid")
    for col in ("sampler", "trials per seed", "median", "share of grid", "within noise band"):
        t.add_column(col)
    for name, r in out["samplers"].items():
        t.add_row(name, ", ".join("-" if n is None else str(n) for n in r["trials_needed"]), f"{r['median_trials']:g}",
                  f"{r['median_share_of_grid']:.0%}", ", ".join("-" if n is None else str(n) for n in r["trials_needed_within_noise"]))
    Console(stderr=True).print(t)


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
    p.add_argument("--replay-trials", type=int, default=8,
                   help="search.n_trials of the replayed study (sets TPE's start-up; conf/search/default has 8)")
    p.add_argument("--model-live", type=int, default=3,
                   help="also replay search.sampler=model with this search.model_live (0: skip; it profiles "
                        "the grid's prompts and measures this machine's cost model)")
    p.add_argument("--run-dir", default="runs")
    p.add_argument("--grid-run", type=Path, help="replay this measured grid run instead of measuring one")
    p.add_argument("--train", nargs="*", default=["prompts=24", "steps=150", "max_new_tokens=96"],
                   help="train.* overrides for the EAGLE head of the benchmark (its own workload, so its own cache)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()
    t0 = time.monotonic()
    run_dir = args.grid_run or measure_grid(args)
    out = replay(run_dir, [int(s) for s in args.seeds.split(",")], args.within, args.replay_trials,
                 model_live=args.model_live)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    table_print(out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:  # a wrong --grid-run, a bad override: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
