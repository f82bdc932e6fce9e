"""The one study driver, for a single-machine study and for every worker of a shared one.

engine (or a launched server) -> the draft -> the study -> ask, measure, tell until the budget is
spent (study.Budget: finished trials for one process, started ones across workers; a grid ends
when no enqueued point is left) -> the caller's finalisation (the winner, best.yaml), with live
progress on stderr throughout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from engine.heartbeat import INTERVAL_S, Heartbeat
from tuner.study.limits import check_trial_fits
from tuner.study.measurer import (LAUNCHED, get_drafts, match_check_side, needs_head, open_engine, study_measure,
                                  study_prompts, without_methods)
from tuner.study.objective import MeasureFn, Objective, TrialOutcome
from tuner.study.selection import describe, leader
from tuner.schema.config import BestResult, Config, HeadBound, SearchConfig
from tuner.schema.fit import check_study_fits
from tuner.search.space import SearchSpace
from tuner.study.studies import CHECK_SIDE, PROBE_PASSES, Budget, finished_count
from tuner.study.workers import BudgetSpent, WorkerStudy, heartbeat_stopped

Log = Callable[[str], None]
# finish(study, objective, trials this process ran, log) -> best.yaml, or None for a worker that
# leaves the finalisation to another one.
Finish = Callable[[optuna.Study, Objective, int, Log], "BestResult | None"]


def budget_of(study: optuna.Study, search: SearchConfig) -> Budget:
    """A worker study carries its shared budget; any other study counts its finished trials."""
    return study.budget if isinstance(study, WorkerStudy) else Budget.of(search)


def run_trials(study: optuna.Study, objective: Objective, search: SearchConfig,
               on_trial: Callable[[TrialOutcome], None] | None = None) -> int:
    """Run trials until the study's budget is spent or search.timeout_s; the trials run here."""
    budget = budget_of(study, search)
    gated = isinstance(study, WorkerStudy)  # its ask checks the budget under the study lock
    started, n = time.monotonic(), 0
    while search.timeout_s is None or time.monotonic() - started < search.timeout_s:
        if not gated and budget.spent(study.get_trials(deepcopy=False)):
            break
        with heartbeat_stopped(study):
            try:
                outcome = objective.run_one()
            except BudgetSpent:
                # Running trials hold their share of the budget, but one that turns out to re-propose a
                # measured point gives it back (not counted): wait for them, then ask again if it did.
                study.wait_done()
                if budget.spent(study.get_trials(deepcopy=False)):
                    break
                continue
        n += 1
        if on_trial is not None:
            on_trial(outcome)
    return n


class Progress:
    """Live progress on stderr: trial k/N, parameters, tok/s, speedup, the best so far by what is
    known (its one-sided lower bound: a lucky figure is not shown as the best), ETA. A line per
    trial; redirected (CI, `kubectl logs`, where rich's bar shows nothing), also one at least every
    `interval` s while a trial (or the held-out re-measurement) runs (engine.heartbeat)."""

    def __init__(self, study: optuna.Study, n_trials: int, quiet: bool = False, *, noise_rel: float,
                 interval: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 poll: float | None = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self.study = study
        self.console = Console(stderr=True, quiet=quiet)
        self.bar = RichProgress(TextColumn("[bold]trials"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.description}"), TimeElapsedColumn(),
                                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=False)
        self.task = self.bar.add_task("", total=n_trials, completed=finished_count(study))
        self.noise_rel = noise_rel
        self.best: str | None = None  # selection.describe of the leader by lower bound
        # what runs once the trials are done (the confirmation round, the held-out check): without it the
        # heartbeat read "trials N/N ... still working" for minutes, as though a trial hung
        self.after: str | None = None
        self.heartbeat = Heartbeat(self._describe, interval=interval, clock=clock, poll=poll,
                                   active=not quiet and not self.console.is_terminal)

    def _describe(self) -> str:
        best = f"best {self.best}" if self.best is not None else "best -"
        since = self.heartbeat.clock() - self.heartbeat.last
        done = f" done, {self.after}" if self.after is not None else ""
        return (f"trials {finished_count(self.study)}/{self.task_total}{done} | {best} | still working: "
                f"{since:.0f} s since the last line, {self.heartbeat.elapsed():.0f} s in all")

    def __enter__(self) -> "Progress":
        self.bar.__enter__()
        self.heartbeat.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.heartbeat.__exit__(*exc)
        self.bar.__exit__(*exc)

    def log(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)  # one line per trial, also in logs
        self.heartbeat.beat()

    def __call__(self, o: TrialOutcome) -> None:
        n = finished_count(self.study)
        lead = leader(self.study.get_trials(deepcopy=False), self.noise_rel)
        self.best = describe(lead, self.noise_rel) if lead is not None else None
        if o.reused_from is not None:  # a sampler proposed a measured point again: nothing measured, not counted
            what = f"same configuration as trial {o.reused_from}: not measured again, not counted"
        elif o.state == TrialState.COMPLETE:
            what = f"{o.tok_s:7.2f} tok/s {o.speedup:.3f}x"
        else:
            what = f"{o.state.name}: {o.reason}"
        best = f"best {self.best}" if self.best is not None else "best -"
        self.log(f"trial {n}/{self.task_total} #{o.number} {o.spec.key()}: {what} | {best}")
        if o.note:
            self.log(o.note)
        self.bar.update(self.task, completed=n, description=best)

    @property
    def task_total(self) -> int:
        return int(self.bar.tasks[0].total or 0)


@contextmanager
def timed(phases: dict[str, float], name: str, keep: bool = True) -> Iterator[None]:
    """Record the wall seconds of the block as phases[name] (best.yaml's phases_s), where `keep`."""
    t0 = time.monotonic()
    yield
    if keep:
        phases[name] = round(time.monotonic() - t0, 3)


def drive(cfg: Config, run_dir: Path, open_study: Callable[[SearchSpace], optuna.Study], finish: Finish, *,
          quiet: bool = False, engine: Any = None, measure: MeasureFn | None = None,
          before_work: Callable[[], None] | None = None,
          intro: Callable[[optuna.Study], list[str]] = lambda study: []) -> tuple[optuna.Study, BestResult | None]:
    """Run one process's part of a study from start to finish; (study, its best.yaml or None).

    `open_study(space)` creates or opens the study (a WorkerStudy for a shared one). The engine is
    cfg.engine: a server launched here for engine=vllm/sglang, else the built-in engine (`engine`,
    or loaded here once). `measure` replaces both (benchmarks that replay measurements).
    `before_work` runs before the heavy imports and the model load (spawning other workers), or
    after the draft head is trained when one is needed (they then find it cached).
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own progress says what happens
    check_study_fits(cfg)
    head_first = needs_head(cfg)
    if before_work is not None and not head_first:
        before_work()
    phases: dict[str, float] = {}  # wall seconds per phase, in order: best.yaml's phases_s
    if engine is None and measure is None and cfg.engine.kind not in LAUNCHED:
        with timed(phases, "engine load"):
            engine = open_engine(cfg)
    bounds: list[HeadBound] = []  # heads bounded before training; one that cannot win here is left out
    drafts = get_drafts(cfg, engine, quiet, phases, bounds)
    cfg = without_methods(cfg, bounds)
    space = SearchSpace.from_config(cfg, head_paths=drafts)
    if before_work is not None and head_first:
        before_work()
    study = open_study(space)
    prompts = study_prompts(cfg, engine)
    with timed(phases, "check side", keep=engine is not None and cfg.workload.num_heldout > 0):
        check_side = match_check_side(cfg, engine, prompts)
    study.set_user_attr(CHECK_SIDE, check_side)
    with ExitStack() as stack:
        if measure is None:
            measure = stack.enter_context(study_measure(cfg, engine, prompts, run_dir))
            # refuse before the first trial what cannot fit; its passes judge the first trials' baselines
            with timed(phases, "fit probe"):
                _, passes = check_trial_fits(cfg, measure, prompts)
            if passes:
                study.set_user_attr(PROBE_PASSES, passes)
        objective = Objective(study, space, measure, cfg.workload, cfg.search)
        total = budget_of(study, cfg.search).total(study.get_trials(deepcopy=False))
        with Progress(study, total, quiet=quiet, noise_rel=cfg.search.noise_rel) as progress:
            for line in intro(study):
                progress.log(line)
            progress.log(f"held-out check's tuning side: {check_side}")
            lean = getattr(engine, "lean", None)
            if getattr(lean, "native", None) is not None:
                progress.log("target forward: the native step, one C++ call a step (engine.builtin.native_step)")
            elif lean is not None and lean.compiled:
                progress.log(f"target forward compiled (or loaded from the on-disk cache) in {lean.compile_s:.0f} s, "
                             "outside every trial")
            on_trial: Callable[[TrialOutcome], None] = progress
            if cfg.search.sampler == "model":  # widen the live sample where a prediction is off
                from tuner.search.guided import Widener
                from tuner.study.studies import ROLE

                on_trial = Widener(study, space, cfg, run_dir, progress, progress.log, ROLE)
            with timed(phases, "trials"):
                ran = run_trials(study, objective, cfg.search, on_trial)
            progress.after = "choosing the winner (confirmation round, held-out check)"
            best = finish(study, objective, ran, progress.log)
            if best is not None:
                best.phases_s = {**phases, **best.phases_s}
                best.head_bounds = bounds
                progress.log(f"winner: {best.spec.key()} — {best.reason}")
                progress.log("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in best.phases_s.items()))
    return study, best
