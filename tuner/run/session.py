"""`tuner optimize`: compose the config, load the model once, run the study, pick and prove the winner.

The flow: config -> run directory (config.yaml, study.db) -> the study driver (tuner.study.driver:
engine, draft, trial 0 `off`, the engines' defaults, then the sampler, with live progress) -> the
winner (tuner.study.selection: ties within noise go to the smaller budget; `off` when nothing beats the
baseline beyond noise) re-measured on the held-out prompts -> best.yaml, trials.csv, report.html,
PNGs -> manifests in k8s/ (tuner.run.rundir). With search.workers=N the same study is shared by N
worker processes (tuner.run.distributed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna

from tuner.run.distributed import optimize_parallel
from tuner.study.driver import drive
from tuner.study.objective import MeasureFn
from tuner.run.rundir import prepare_run, write_run
from tuner.search.space import SearchSpace
from tuner.study.studies import create_study, finished_count, load_study
from tuner.study.selection import compute_best


def optimize(overrides: list[str] | None = None, resume: Path | None = None, quiet: bool = False,
             engine: Any = None, measure: MeasureFn | None = None) -> Path:
    """The whole `tuner optimize` flow; returns the run directory (see the module docstring).

    `engine` / `measure` let a caller that already holds a loaded engine (or a benchmark that
    replays measurements) reuse it; by default the engine is loaded here, once.
    """
    cfg, run_dir, resuming = prepare_run(overrides, resume)
    if cfg.search.workers > 1:  # N worker processes on one shared study
        return optimize_parallel(cfg, run_dir, resuming, quiet=quiet, engine=engine, measure=measure)
    name = cfg.search.study_name

    def open_study(space: SearchSpace) -> optuna.Study:
        return load_study(cfg, run_dir, name) if resuming else create_study(cfg, space, run_dir, name)

    def intro(study: optuna.Study) -> list[str]:
        return [f"resuming {name}: {finished_count(study)} trials already finished"] if resuming else []

    study, best = drive(cfg, run_dir, open_study,
                        lambda study, objective, ran, log: compute_best(cfg, study, run_dir, objective, log),
                        quiet=quiet, engine=engine, measure=measure, intro=intro)
    assert best is not None
    write_run(study, cfg, run_dir, best)
    print(run_dir)
    return run_dir
