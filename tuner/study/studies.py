"""The Optuna study: sampler, pruner, creation (baseline and known defaults first), resume, the
budget rule and the one stale-trial sweep. Where the study lives is tuner.study.storage's business.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from engine.measure.stats import ratio_bounds
from tuner.schema.config import Config, SearchConfig, UserError
from tuner.search.space import SearchSpace
from tuner.study.storage import open_storage, storage_url

ROLE = "role"  # user attr naming why a trial exists: baseline | default | adaptive | grid | search | confirm
FAIL_REASON = "fail_reason"
HEARTBEAT = "heartbeat"  # trial user attr: unix time of its worker's last sign of life
WORKER = "worker"  # trial user attr: host:pid of the worker that runs the trial
NOISE_REL = "noise_rel"  # study user attr: search.noise_rel of the study
NOISE = "noise_rel_measured"  # study user attr: the spread of its baseline passes, when above noise_rel
FLOOR = "noise_floor"  # study user attr: the spread of its first baseline passes (the machine as the study found it)
ROSE = "noise_rose"  # study user attr: the highest recent spread that rose above the floor beyond chance
CONFIRM_ROUND = "confirm_round"  # trial user attr: the confirmation round a head-to-head pair belongs to
CHECK_SIDE = "check_side"  # study user attr: which tuning prompts the held-out check compares with, and why
PROBE_PASSES = "probe_passes"  # study user attr: the baseline passes measured before trial 0 (the first history)
REUSED = "reused_from"  # trial user attr: the earlier trial of the same point whose figures it took (not measured)
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
METRICS = ["output_tok_s"]
METRICS_MULTI = ["output_tok_s", "tpot_p99_ms"]


class BoundPruner(optuna.pruners.BasePruner):
    """Prune a trial whose optimistic bound cannot reach what is already known: its speedup's
    one-sided 95% upper bound (after one repeat: the ratio widened by twice the noise band) is
    below 1.0 or below the pessimistic bound (one-sided 95% lower bound) of the best trial so far.

    Bounds, never point values: one glitched measurement has a wide interval, so it cannot prune
    the trials after it. A trial whose figure stayed implausible (tuner.study.objective) is no bar.
    The noise band is search.noise_rel, or the noise measured at the study's start when larger.
    """

    def __init__(self, noise_rel: float) -> None:
        self.noise_rel = noise_rel

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        ratios = trial.user_attrs.get("ratios")
        if not ratios or trial.user_attrs.get("implausible"):
            return False
        noise = max(self.noise_rel, study.user_attrs.get(NOISE, 0.0))
        return ratio_bounds(ratios, noise)[1] < max(1.0, best_lower(study, noise))


def best_lower(study: optuna.Study, noise: float) -> float:
    """The best pessimistic bound of a speedup among the study's complete, feasible, plausible
    speculative trials (0 when there is none)."""
    best = 0.0
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        a = t.user_attrs
        if role(t) == "baseline" or not a.get("ratios") or a.get("implausible") or not a.get("feasible", True):
            continue
        best = max(best, ratio_bounds(a["ratios"], noise)[0])
    return best


def make_pruner(search: SearchConfig) -> optuna.pruners.BasePruner:
    """BoundPruner for single-objective studies (Optuna prunes single-objective trials only)."""
    return optuna.pruners.NopPruner() if search.multi_objective else BoundPruner(search.noise_rel)


def make_sampler(search: SearchConfig) -> optuna.samplers.BaseSampler:
    """The sampler of `search.sampler` (grid: every point is enqueued, so any sampler would do)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if search.sampler == "tpe":
            # Few live trials: start modelling early; group=True handles the conditional topk/budget.
            n_startup = max(3, min(10, search.n_trials // 3))
            return optuna.samplers.TPESampler(
                seed=search.seed, multivariate=True, group=True, n_startup_trials=n_startup,
            )
        if search.sampler == "gp":
            return optuna.samplers.GPSampler(seed=search.seed, deterministic_objective=False)
        return optuna.samplers.RandomSampler(seed=search.seed)


def default_study_name(cfg: Config) -> str:
    """`search.study_name`, or `<workload>-<model>-<engine>-<UTC timestamp>`."""
    if cfg.search.study_name:
        return cfg.search.study_name
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    workload = cfg.workload.name if cfg.workload else "none"
    return f"{workload}-{cfg.model.name}-{cfg.engine.kind}-{stamp}"


def create_study(cfg: Config, space: SearchSpace, run_dir: Path, name: str) -> optuna.Study:
    """A new study: trial 0 is speculation off, then the known defaults (or every grid point)."""
    storage = open_storage(storage_url(cfg.search, run_dir))
    multi = cfg.search.multi_objective
    try:
        study = optuna.create_study(
            study_name=name, storage=storage, sampler=make_sampler(cfg.search), pruner=make_pruner(cfg.search),
            directions=["maximize", "minimize"] if multi else ["maximize"],
        )
    except optuna.exceptions.DuplicatedStudyError:
        raise UserError(
            f"search.study_name={name!r} already exists in {storage_url(cfg.search, run_dir)}: "
            "resume it with --resume RUN_DIR or choose another name"
        ) from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(METRICS_MULTI if multi else METRICS)
    study.set_user_attr("workload", cfg.workload.name if cfg.workload else None)
    study.set_user_attr("model", cfg.model.name)
    study.set_user_attr("engine", cfg.engine.kind)
    study.set_user_attr("created", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    study.set_user_attr(NOISE_REL, cfg.search.noise_rel)  # the report's bounds use the study's own band
    study.enqueue_trial({}, user_attrs={ROLE: "baseline"})
    if cfg.search.sampler == "grid":
        for spec in space.points():
            study.enqueue_trial(space.params_of(spec), user_attrs={ROLE: "grid"})
    elif cfg.search.sampler == "model":  # the best predicted points (tuner.search.guided)
        from tuner.search.guided import enqueue_predicted, predict_space

        enqueue_predicted(study, space, predict_space(cfg, space, run_dir), 0, cfg.search.model_live, ROLE)
    else:
        for spec in space.defaults():
            study.enqueue_trial(space.params_of(spec), user_attrs={ROLE: "default"})
    if cfg.search.sampler != "grid":  # a grid holds the adaptive points already
        for spec in space.arms():  # measured early, as the defaults are: the arm the study compares
            study.enqueue_trial(space.params_of(spec), user_attrs={ROLE: "adaptive"})
    return study


def load_study(cfg: Config, run_dir: Path, name: str) -> optuna.Study:
    """Reopen a study to resume it; trials left RUNNING by an interruption become FAIL."""
    storage = open_storage(storage_url(cfg.search, run_dir))
    try:
        study = optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(cfg.search),
                                  pruner=make_pruner(cfg.search))
    except KeyError:
        raise UserError(f"{run_dir}: no study named {name!r} in {storage_url(cfg.search, run_dir)}") from None
    sweep_stale(study, 0.0, why=_interrupted)
    return study


def last_sign_of_life(t: FrozenTrial) -> float:
    """Unix time of a running trial's last heartbeat (its start before the first one)."""
    beat = t.user_attrs.get(HEARTBEAT)
    if beat is not None:
        return float(beat)
    return t.datetime_start.timestamp() if t.datetime_start is not None else time.time()


def _lost_worker(t: FrozenTrial, age_s: float, grace_s: float) -> str:
    return (f"worker {t.user_attrs.get(WORKER, '?')} lost: no heartbeat for {age_s:.0f} s "
            f"(search.heartbeat_grace_s={grace_s:g})")


def sweep_stale(study: optuna.Study, grace_s: float, trials: list[FrozenTrial] | None = None,
                why: Callable[[FrozenTrial, float, float], str] = _lost_worker) -> list[int]:
    """Mark FAIL every RUNNING trial (of `trials`, default: the study's) without a sign of life for
    more than `grace_s` seconds, with `why(trial, age_s, grace_s)` as its fail reason; their numbers.

    The one sweep: shared studies run it with the heartbeat grace period (a worker killed
    mid-trial leaves no trial RUNNING forever); a resumed single-process study with 0 (its
    process is gone, so is every trial it was running).
    """
    now = time.time()
    storage = study._storage  # FrozenTrial.set_user_attr would only change a local copy
    swept = []
    if trials is None:
        trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        age = now - last_sign_of_life(t)
        if age < grace_s:
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, FAIL_REASON, why(t, age, grace_s))
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        except UpdateFinishedTrialError:
            continue  # its worker told it, or another worker swept it, just now
        swept.append(t.number)
    return swept


def _interrupted(t: FrozenTrial, age_s: float, grace_s: float) -> str:
    return "interrupted: the process stopped during this trial"


@dataclass(frozen=True)
class Budget:
    """When a study has run its trials: `search.n_trials` of them counted, or (grid) no enqueued
    point left. One process counts `finished` trials (it asks only after the last one was told);
    workers sharing a study count `started` ones, so a trial another worker is running already
    holds its share of the budget."""

    n_trials: int
    grid: bool = False
    count: Literal["finished", "started"] = "finished"

    @classmethod
    def of(cls, search: SearchConfig, count: Literal["finished", "started"] = "finished") -> "Budget":
        # a model-guided study, like a grid, ends when its enqueued points are measured
        return cls(search.n_trials, search.sampler in ("grid", "model"), count)

    def used(self, trials: list[FrozenTrial]) -> int:
        # the confirmation round's pairs (role confirm) come after the budget, and a trial that reused
        # an earlier measurement of its point measured nothing: neither counts in it
        if self.count == "finished":
            return sum(1 for t in trials if t.state in FINISHED and counted(t))
        return sum(1 for t in trials if t.state != TrialState.WAITING and counted(t))

    def spent(self, trials: list[FrozenTrial]) -> bool:
        """The budget is spent, no enqueued point is left (grid), or the sampler proposed measured
        points as often as the budget has trials: it finds nothing new to measure."""
        waiting = sum(1 for t in trials if t.state == TrialState.WAITING)
        reused = sum(1 for t in trials if REUSED in t.user_attrs)
        return self.used(trials) >= self.n_trials or reused >= self.n_trials or (self.grid and waiting == 0)

    def total(self, trials: list[FrozenTrial]) -> int:
        """The trials this study will have run when the budget is spent (the progress bar's end)."""
        if not self.grid:
            return self.n_trials
        waiting = sum(1 for t in trials if t.state == TrialState.WAITING)
        return min(self.n_trials, self.used(trials) + waiting)


def counted(trial: Any) -> bool:
    """Whether a finished trial counts against `search.n_trials`: not a confirmation round's pair,
    nor a trial that reused an earlier measurement of its point (REUSED)."""
    return role(trial) != "confirm" and REUSED not in trial.user_attrs


def finished_count(study: optuna.Study) -> int:
    """Trials that count against `search.n_trials` (complete, pruned or failed; not the
    confirmation round's pairs nor reused points: `counted`)."""
    return sum(1 for t in study.get_trials(deepcopy=False, states=FINISHED) if counted(t))


def role(trial: Any) -> str:
    """Why a trial exists (user attr set at enqueue time; sampled trials are 'search'; the
    confirmation round's pairs are 'confirm')."""
    return trial.user_attrs.get(ROLE, "search")
