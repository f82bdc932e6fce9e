"""Workers sharing one study: the worker's study (budget gate and heartbeat), creating the shared
study, and the one worker that finalizes it.

There is no scheduler: Optuna's storage (PostgreSQL, or a journal file for users without a
database) is the coordination point, and each worker runs the ordinary ask -> measure -> tell
loop (tuner.study.driver) through a `WorkerStudy`, which adds to `optuna.Study`:

- a budget gate: under the study-wide lock (tuner.study.storage.study_lock) a worker counts the trials
  already started (running or finished) and asks only while the budget allows (study.Budget with
  count="started"), so it holds across workers. The baseline and the engines' defaults are
  enqueued once, when the study is created, and Optuna hands each enqueued trial to one worker;
- a heartbeat: while a trial runs, a thread of its worker stamps the trial's `heartbeat` user
  attr every `heartbeat_grace_s / 5` seconds (Optuna's own RDB heartbeat does not work with
  ask/tell, and journal storage has none);
- the stale-trial sweep (study.sweep_stale) before asking and while waiting for the others at
  the end, so a worker killed mid-trial leaves no trial RUNNING forever.

The study stores the composed config (`config` study user attr): every worker tunes exactly that.
The first worker to find the budget spent claims the study, re-measures the winner on the
held-out prompts and stores best.yaml in the study (`best`); the report reads it from there.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from tuner.schema.compose import validate
from tuner.study.objective import Objective
from tuner.schema.config import BestResult, Config, UserError
from tuner.search.space import SearchSpace
from tuner.study.storage import mask_url, open_storage, study_lock
from tuner.study.studies import HEARTBEAT, WORKER, Budget, create_study, make_pruner, make_sampler, sweep_stale
from tuner.study.selection import compute_best

CONFIG_ATTR = "config"  # study user attr: the composed config every worker uses
BEST_ATTR = "best"  # study user attr: best.yaml (JSON) stored by the worker that finalized
FINALIZING = "finalizing"  # study user attr: [worker, unix time] of the worker measuring the held-out prompts


def worker_id() -> str:
    """host:pid (plus :thread for a worker that is not the main thread), recorded on every trial."""
    me = threading.current_thread()
    suffix = "" if me is threading.main_thread() else f":{me.name}"
    return f"{socket.gethostname()}:{os.getpid()}{suffix}"


def heartbeat_interval(grace_s: float) -> float:
    """How often a running trial is stamped: five beats fit in the grace period."""
    return min(30.0, max(0.2, grace_s / 5))


class Heartbeat:
    """A thread stamping one running trial's `heartbeat` user attr until stopped."""

    def __init__(self, storage: optuna.storages.BaseStorage, interval_s: float) -> None:
        self.storage = storage
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, trial_id: int) -> None:
        self.stop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(trial_id, self._stop), daemon=True,
                                        name=f"heartbeat-{trial_id}")
        self._thread.start()

    def _beat(self, trial_id: int, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            try:
                self.storage.set_trial_user_attr(trial_id, HEARTBEAT, time.time())
            except UpdateFinishedTrialError:
                return  # told (or swept) meanwhile
            except Exception:  # a storage hiccup: the next beat retries; the grace period absorbs a few misses
                continue

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


class BudgetSpent(Exception):
    """The shared study's budget is spent (by all workers together): ask no more."""


class WorkerStudy(optuna.Study):
    """An Optuna study whose `ask` respects the shared budget and whose trials carry a heartbeat."""

    def __init__(self, study_name: str, storage: optuna.storages.BaseStorage, url: str, budget: Budget,
                 grace_s: float, sampler: optuna.samplers.BaseSampler | None = None,
                 pruner: optuna.pruners.BasePruner | None = None) -> None:
        super().__init__(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
        self.raw_storage = storage
        self.url = url
        self.budget = budget
        self.grace_s = grace_s
        self.heartbeat = Heartbeat(self._storage, heartbeat_interval(grace_s))
        self.swept: list[int] = []

    def lock(self) -> Any:
        return study_lock(self.raw_storage, self.url, self.study_name)

    def started(self) -> int:
        """Trials that count against the budget: running or finished, not merely enqueued."""
        return sum(1 for t in self.get_trials(deepcopy=False) if t.state != TrialState.WAITING)

    def running(self) -> int:
        return len(self.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))

    def budget_spent(self) -> bool:
        return self.budget.spent(self.get_trials(deepcopy=False))

    def ask(self, fixed_distributions: Any = None) -> optuna.Trial:
        """Ask one trial if the budget allows (BudgetSpent otherwise) and start its heartbeat."""
        with self.lock():
            trials = self.get_trials(deepcopy=False)  # one listing for the sweep and the budget
            self.swept += sweep_stale(self, self.grace_s, trials)
            if self.budget.spent(trials):  # a swept trial still counts: FAIL, not WAITING
                raise BudgetSpent
            trial = super().ask(fixed_distributions)
            # Stamped before the lock is released: no other worker can see it RUNNING without a heartbeat.
            trial.set_user_attr(WORKER, worker_id())
            trial.set_user_attr(HEARTBEAT, time.time())
        self.heartbeat.start(trial._trial_id)
        return trial

    def tell(self, trial: Any, values: Any = None, state: TrialState | None = None,
             skip_if_finished: bool = False) -> optuna.trial.FrozenTrial:
        """Stop the heartbeat, then tell. A trial swept meanwhile (this worker was presumed dead)
        keeps its FAIL: the other workers have already counted it."""
        self.heartbeat.stop()
        return super().tell(trial, values, state, skip_if_finished=True)

    def wait_done(self, poll_s: float | None = None, on_sweep: Callable[[list[int]], None] | None = None) -> None:
        """Wait until no trial is RUNNING, sweeping those whose worker is gone."""
        poll = poll_s if poll_s is not None else min(2.0, heartbeat_interval(self.grace_s))
        while True:
            swept = sweep_stale(self, self.grace_s)
            if swept:
                self.swept += swept
                if on_sweep is not None:
                    on_sweep(swept)
            if self.running() == 0:
                return
            time.sleep(poll)

    def finalizing_alive(self, stale_s: float) -> bool:
        """Whether a worker claimed the finalisation less than stale_s seconds ago."""
        claim = self.user_attrs.get(FINALIZING)
        return claim is not None and time.time() - float(claim[1]) < stale_s


def require_study(url: str, name: str) -> optuna.storages.BaseStorage:
    """The storage at `url`, which must hold the study `name` (UserError naming how to create it)."""
    storage = open_storage(url)
    if name not in optuna.study.get_all_study_names(storage):
        raise UserError(f"search.study_name={name!r}: no such study in {mask_url(url)} "
                        "(create it with `tuner optimize --create-only ...`)")
    return storage


def open_worker_study(cfg: Config, url: str, name: str) -> WorkerStudy:
    """The shared study `name` in storage `url` as a WorkerStudy with the config's budget, sampler
    and pruner; UserError when there is no such study."""
    storage = require_study(url, name)
    return WorkerStudy(name, storage, url, Budget.of(cfg.search, "started"), cfg.search.heartbeat_grace_s,
                       sampler=make_sampler(cfg.search), pruner=make_pruner(cfg.search))


def create_shared_study(cfg: Config, url: str, space: SearchSpace) -> tuple[optuna.Study, bool]:
    """Create the study (baseline and defaults enqueued once) unless it exists; (study, created)."""
    storage = open_storage(url)
    name = cfg.search.study_name
    if name in optuna.study.get_all_study_names(storage):
        return optuna.load_study(study_name=name, storage=storage), False
    # create_study opens the storage named by cfg: hand it the resolved URL (model_copy does not
    # validate, so a password from SPECTUNE_STORAGE_URL passes; this copy is never saved).
    c = cfg.model_copy(update={"search": cfg.search.model_copy(update={"storage": url})})
    study = create_study(c, space, Path("."), name)
    study.set_user_attr(CONFIG_ATTR, cfg.model_dump(mode="json"))
    return study, True


def study_config(study: optuna.Study) -> Config:
    """The config the study was created with (every worker tunes exactly this)."""
    raw = study.user_attrs.get(CONFIG_ATTR)
    if raw is None:
        raise UserError(f"study {study.study_name!r} holds no spectune config: it was not created by "
                        "`tuner optimize --create-only` or `tuner optimize search.workers=N`")
    return validate(raw)


def claim_finalize(study: WorkerStudy, stale_s: float) -> bool:
    """Whether this worker is the one to measure and store the winner (first come, under the lock)."""
    with study.lock():
        if BEST_ATTR in study.user_attrs or study.finalizing_alive(stale_s):
            return False
        study.set_user_attr(FINALIZING, [worker_id(), time.time()])
        return True


def stored_best(study: optuna.Study) -> BestResult | None:
    """best.yaml as the finalizing worker stored it in the study, if it has."""
    raw = study.user_attrs.get(BEST_ATTR)
    return BestResult.model_validate(raw) if raw is not None else None


def finalize_stale_s(cfg: Config) -> float:
    """How long a finalizer's claim holds: a held-out measurement may take a trial's time."""
    return cfg.search.trial_timeout_s + cfg.search.heartbeat_grace_s


def finalize(study: WorkerStudy, cfg: Config, run_dir: Path, objective: Objective | None, force: bool = False,
             log: Callable[[str], None] = lambda s: None) -> BestResult | None:
    """The study's best.yaml for the one worker that writes the run: computed now (held-out prompts
    included) and stored in the study by the claiming worker; with force (the coordinator of
    search.workers=N), the stored one if another worker got there first. None for every other
    worker: `tuner report --storage` gives anyone the stored result."""
    best = stored_best(study)
    if best is not None:
        if not force:
            log("the winner was stored by another worker")
        return best if force else None
    if not (force or claim_finalize(study, finalize_stale_s(cfg))):
        return None
    best = compute_best(cfg, study, run_dir, objective, log)
    study.set_user_attr(BEST_ATTR, best.model_dump(mode="json"))
    return best


@contextmanager
def heartbeat_stopped(study: optuna.Study) -> Iterator[None]:
    """Stop a worker study's heartbeat on leaving, also when a trial raised (Ctrl-C): never beat
    for a dead trial. A no-op for other studies."""
    try:
        yield
    finally:
        if isinstance(study, WorkerStudy):
            study.heartbeat.stop()
