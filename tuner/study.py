"""The Optuna study: storage, sampler, creation (baseline and known defaults first) and resume.

Storage (`search.storage`): None is an SQLite file `study.db` in the run directory; any
SQLAlchemy URL (`postgresql://...`) is used as is; `journal:PATH` is a journal file (PATH
relative to the run directory unless absolute), the storage to share between processes on NFS.
"""

from __future__ import annotations

import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from tuner.schema import Config, SearchConfig, UserError
from tuner.space import SearchSpace

DB_FILE = "study.db"
ROLE = "role"  # user attr naming why a trial exists: baseline | default | grid | search
FAIL_REASON = "fail_reason"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
METRICS = ["output_tok_s"]
METRICS_MULTI = ["output_tok_s", "tpot_p99_ms"]


class HopelessPruner(optuna.pruners.BasePruner):
    """Prune a trial whose drift-corrected tok/s after a repeat is so far below both the baseline and
    the best trial so far that further repeats cannot make it the winner (2x the noise band)."""

    def __init__(self, noise_rel: float) -> None:
        self.noise_rel = noise_rel

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        now = trial.intermediate_values[step]
        ref = study.user_attrs.get("reference_tok_s")
        best = max((t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.value is not None), default=0.0)
        bar = max(ref or 0.0, best)
        return bar > 0 and now < bar * (1 - 2 * self.noise_rel)


def storage_url(search: SearchConfig, run_dir: Path) -> str:
    """The storage as one string (recorded in best.yaml's provenance)."""
    if search.storage is None:
        return f"sqlite:///{(run_dir / DB_FILE).resolve()}"
    if search.storage.startswith("journal:"):
        path = Path(search.storage[len("journal:"):])
        return f"journal:{path if path.is_absolute() else (run_dir / path).resolve()}"
    if search.storage == "env":  # the whole URL from SPECTUNE_STORAGE_URL (mask it before showing it)
        from tuner.distributed import resolve_storage

        return resolve_storage("env")
    return search.storage


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """An Optuna storage for a `storage_url` string; one line naming the cause when it cannot open."""
    try:
        if url.startswith("journal:"):
            from optuna.storages.journal import JournalFileBackend

            path = Path(url[len("journal:"):])
            path.parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
        if url.startswith("sqlite:///"):
            Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.RDBStorage(url)
    except Exception as exc:  # SQLAlchemy raises many types (bad URL, missing driver, refused connection)
        from tuner.distributed import mask_url

        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"search.storage={mask_url(url)!r} cannot be opened ({first}); allowed: null (SQLite in the run dir), "
            "an SQLAlchemy URL, journal:PATH, env (SPECTUNE_STORAGE_URL)"
        ) from None


def make_pruner(search: SearchConfig) -> optuna.pruners.BasePruner:
    """HopelessPruner for single-objective studies (Optuna prunes single-objective trials only)."""
    return optuna.pruners.NopPruner() if search.multi_objective else HopelessPruner(search.noise_rel)


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
    study.enqueue_trial({}, user_attrs={ROLE: "baseline"})
    if cfg.search.sampler == "grid":
        for spec in space.points():
            study.enqueue_trial(space.params_of(spec), user_attrs={ROLE: "grid"})
    else:
        for spec in space.defaults():
            study.enqueue_trial(space.params_of(spec), user_attrs={ROLE: "default"})
    return study


def load_study(cfg: Config, run_dir: Path, name: str) -> optuna.Study:
    """Reopen a study to resume it; trials left RUNNING by an interruption become FAIL."""
    storage = open_storage(storage_url(cfg.search, run_dir))
    try:
        study = optuna.load_study(study_name=name, storage=storage, sampler=make_sampler(cfg.search),
                                  pruner=make_pruner(cfg.search))
    except KeyError:
        raise UserError(f"{run_dir}: no study named {name!r} in {storage_url(cfg.search, run_dir)}") from None
    fail_stale_trials(study, storage)
    return study


def fail_stale_trials(study: optuna.Study, storage: optuna.storages.BaseStorage) -> list[int]:
    """Mark RUNNING trials FAIL (their process is gone: ask/tell has no heartbeat). Returns their numbers."""
    stale = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # FrozenTrial.set_user_attr would only change a local copy: write through the storage.
        storage.set_trial_user_attr(t._trial_id, FAIL_REASON, "interrupted: the process stopped during this trial")
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        stale.append(t.number)
    return stale


def finished_count(study: optuna.Study) -> int:
    """Trials that count against `search.n_trials` (complete, pruned or failed)."""
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def waiting_count(study: optuna.Study) -> int:
    """Enqueued trials not yet run."""
    return len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


def role(trial: Any) -> str:
    """Why a trial exists (user attr set at enqueue time; sampled trials are 'search')."""
    return trial.user_attrs.get(ROLE, "search")
