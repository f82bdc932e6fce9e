"""Distributed tuning: many workers, each with its own engine, on one study in a shared storage.

There is no scheduler: Optuna's storage (PostgreSQL, or a journal file for users without a
database) is the coordination point, and each worker runs the ordinary ask -> measure -> tell
loop through a `WorkerStudy`, which adds three things to `optuna.Study`:

- a budget gate: under a study-wide lock (a PostgreSQL advisory lock, or an flock beside the
  journal file) a worker counts the trials already started (running or finished) and asks only
  while that count is below `search.n_trials`, so the budget holds across workers. The baseline
  and the engines' defaults are enqueued once, when the study is created, and Optuna hands each
  enqueued trial to exactly one worker;
- a heartbeat: while a trial runs, a thread of its worker stamps the trial's `heartbeat` user
  attr every `heartbeat_grace_s / 5` seconds (Optuna's own RDB heartbeat does not work with
  ask/tell, and journal storage has none);
- a stale-trial sweep: before asking, and while waiting for the others at the end, a worker marks
  FAIL every RUNNING trial whose heartbeat is older than `search.heartbeat_grace_s`, so a worker
  killed mid-trial leaves no trial RUNNING forever and the study completes with the others.

The study stores the composed config (`config` study user attr): `tuner optimize --worker` and
`tuner report --storage URL --study NAME` read it from there, so every worker tunes the same
thing. The first worker to find the budget spent re-measures the winner on the held-out prompts
and stores best.yaml in the study (`best`); the report reads it without needing an engine.

Credentials never pass through the command line or config.yaml (the schema rejects passwords
in `search.storage`): PostgreSQL reads PGPASSWORD (or ~/.pgpass), or `search.storage=env` takes
the whole URL from SPECTUNE_STORAGE_URL. URLs are masked wherever they are printed or stored.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState
from pydantic import ValidationError

from tuner.schema import BestResult, Config, SearchConfig, UserError
from tuner.study import FAIL_REASON, open_storage

STORAGE_ENV = "SPECTUNE_STORAGE_URL"
HEARTBEAT = "heartbeat"  # trial user attr: unix time of the worker's last sign of life
WORKER = "worker"  # trial user attr: host:pid of the worker that runs the trial
CONFIG_ATTR = "config"  # study user attr: the composed config every worker uses
BEST_ATTR = "best"  # study user attr: best.yaml (JSON) stored by the worker that finalized
FINALIZING = "finalizing"  # study user attr: [worker, unix time] of the worker measuring the held-out prompts
WORKERS_DIR = "workers"  # logs of local worker processes inside the run directory


# ---- storage URLs and credentials ---------------------------------------------------------------

def resolve_storage(value: str) -> str:
    """The storage URL a `search.storage` value stands for: `env` reads SPECTUNE_STORAGE_URL."""
    if value != "env":
        return value
    url = os.environ.get(STORAGE_ENV, "").strip()
    if not url:
        raise UserError(f"search.storage=env: the environment variable {STORAGE_ENV} is not set "
                        "(it holds the storage URL, e.g. from a Kubernetes Secret)")
    return url


def reject_password(value: str) -> None:
    """UserError when a storage given on the command line holds a password (schema's one rule)."""
    try:
        SearchConfig(name="check", n_trials=1, storage=value)
    except ValidationError as err:  # the message never echoes the value
        raise UserError(err.errors()[0]["msg"].removeprefix("Value error, ")) from None


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for logs, best.yaml and reports."""
    if "://" not in url:
        return url
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not an SQLAlchemy URL: mask everything between '//' and '@'
        head, _, rest = url.partition("://")
        return f"{head}://***@{rest.rpartition('@')[2]}" if "@" in rest else url


def is_shared(url: str) -> bool:
    """Whether several processes may work on one study in this storage."""
    return url.startswith(("journal:", "postgresql"))


def check_shared(url: str, what: str) -> None:
    """UserError unless `url` is a storage for parallel workers (PostgreSQL or a journal file)."""
    if not is_shared(url):
        raise UserError(f"{what} needs a storage shared by processes: search.storage=postgresql://USER@HOST/DB "
                        f"(password from PGPASSWORD), search.storage=env ({STORAGE_ENV}) or "
                        f"search.storage=journal:PATH; got {mask_url(url)!r} (SQLite is for one process only)")


# ---- the study-wide lock ----------------------------------------------------------------------

@contextmanager
def study_lock(storage: optuna.storages.BaseStorage, url: str, study_name: str) -> Iterator[None]:
    """Mutual exclusion across workers (processes and machines) for one study."""
    if url.startswith("journal:"):
        lock_path = url[len("journal:"):] + ".spectune-lock"
        with open(lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
        return
    from sqlalchemy import text

    # A transaction-scoped advisory lock: released by the commit, also when the worker dies.
    key = int.from_bytes(hashlib.sha256(f"spectune:{study_name}".encode()).digest()[:8], "big", signed=True)
    with storage.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
        yield


# ---- heartbeats and the stale-trial sweep ----------------------------------------------------

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


def last_sign_of_life(t: optuna.trial.FrozenTrial) -> float:
    """Unix time of a running trial's last heartbeat (its start before the first one)."""
    beat = t.user_attrs.get(HEARTBEAT)
    if beat is not None:
        return float(beat)
    return t.datetime_start.timestamp() if t.datetime_start is not None else time.time()


def sweep_stale(study: optuna.Study, grace_s: float,
                trials: list[optuna.trial.FrozenTrial] | None = None) -> list[int]:
    """Mark FAIL every RUNNING trial (of `trials`, default: the study's) without a heartbeat for
    `grace_s` seconds; their numbers."""
    now = time.time()
    storage = study._storage
    swept = []
    if trials is None:
        trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        age = now - last_sign_of_life(t)
        if age <= grace_s:
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, FAIL_REASON,
                                        f"worker {t.user_attrs.get(WORKER, '?')} lost: no heartbeat for {age:.0f} s "
                                        f"(search.heartbeat_grace_s={grace_s:g})")
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        except UpdateFinishedTrialError:
            continue  # its worker told it, or another worker swept it, just now
        swept.append(t.number)
    return swept


# ---- the worker's study -----------------------------------------------------------------------

class BudgetSpent(Exception):
    """search.n_trials trials have been started in the study (by all workers together)."""


class WorkerStudy(optuna.Study):
    """An Optuna study whose `ask` respects the shared budget and whose trials carry a heartbeat."""

    def __init__(self, study_name: str, storage: optuna.storages.BaseStorage, url: str, n_trials: int,
                 grace_s: float, grid: bool = False, sampler: optuna.samplers.BaseSampler | None = None,
                 pruner: optuna.pruners.BasePruner | None = None) -> None:
        super().__init__(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
        self.raw_storage = storage
        self.url = url
        self.n_trials = n_trials
        self.grace_s = grace_s
        self.grid = grid
        self.heartbeat = Heartbeat(self._storage, heartbeat_interval(grace_s))
        self.swept: list[int] = []

    def lock(self) -> Any:
        return study_lock(self.raw_storage, self.url, self.study_name)

    def started(self) -> int:
        """Trials that count against the budget: running or finished, not merely enqueued."""
        return sum(1 for t in self.get_trials(deepcopy=False) if t.state != TrialState.WAITING)

    def running(self) -> int:
        return len(self.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))

    def budget_spent(self, trials: list[optuna.trial.FrozenTrial] | None = None) -> bool:
        """search.n_trials started, or (grid) every enqueued point handed out."""
        trials = self.get_trials(deepcopy=False) if trials is None else trials
        waiting = sum(1 for t in trials if t.state == TrialState.WAITING)
        return len(trials) - waiting >= self.n_trials or (self.grid and waiting == 0)

    def ask(self, fixed_distributions: Any = None) -> optuna.Trial:
        """Ask one trial if the budget allows (BudgetSpent otherwise) and start its heartbeat."""
        with self.lock():
            trials = self.get_trials(deepcopy=False)  # one listing for the sweep and the budget
            self.swept += sweep_stale(self, self.grace_s, trials)
            if self.budget_spent(trials):  # a swept trial still counts: FAIL, not WAITING
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


def open_worker_study(cfg: Config, url: str, name: str) -> WorkerStudy:
    """The shared study `name` in storage `url`, as a WorkerStudy with the config's sampler and pruner."""
    from tuner.study import make_pruner, make_sampler

    storage = open_storage(url)
    if name not in optuna.study.get_all_study_names(storage):
        raise UserError(f"search.study_name={name!r}: no such study in {mask_url(url)} "
                        "(create it with `tuner optimize --create-only ...`)")
    return WorkerStudy(name, storage, url, cfg.search.n_trials, cfg.search.heartbeat_grace_s,
                       grid=cfg.search.sampler == "grid", sampler=make_sampler(cfg.search),
                       pruner=make_pruner(cfg.search))


def work(study: WorkerStudy, objective: Any, cfg: Config, on_trial: Callable[[Any], None] | None = None,
         log: Callable[[str], None] = lambda s: None) -> int:
    """Run trials until the shared budget is spent (or search.timeout_s), then wait for the other
    workers' running trials (sweeping those of dead workers). Returns the trials this worker ran."""
    started, n = time.monotonic(), 0
    while cfg.search.timeout_s is None or time.monotonic() - started < cfg.search.timeout_s:
        try:
            outcome = objective.run_one()
        except BudgetSpent:
            break
        finally:
            study.heartbeat.stop()  # also when run_one raised (Ctrl-C): never beat for a dead trial
        n += 1
        if on_trial is not None:
            on_trial(outcome)
    study.wait_done(on_sweep=lambda nums: log(f"marked FAIL (worker lost, no heartbeat): trial(s) {nums}"))
    return n


# ---- creating the study and finishing it ------------------------------------------------------

def create_shared_study(cfg: Config, url: str, space: Any) -> tuple[optuna.Study, bool]:
    """Create the study (baseline and defaults enqueued once) unless it exists; (study, created)."""
    from tuner.study import create_study

    storage = open_storage(url)
    name = cfg.search.study_name
    if name in optuna.study.get_all_study_names(storage):
        return optuna.load_study(study_name=name, storage=storage), False
    # create_study opens the storage named by cfg: hand it the resolved URL (model_copy does not
    # validate, so a password from SPECTUNE_STORAGE_URL passes; this copy is never saved).
    c = cfg.model_copy(update={"search": cfg.search.model_copy(update={"storage": url})})
    study = create_study(c, space, Path("."), name)
    stored = cfg.model_dump(mode="json")
    study.set_user_attr(CONFIG_ATTR, stored)
    return study, True


def study_config(study: optuna.Study) -> Config:
    """The config the study was created with (every worker tunes exactly this)."""
    from tuner.config import validate

    raw = study.user_attrs.get(CONFIG_ATTR)
    if raw is None:
        raise UserError(f"study {study.study_name!r} holds no spectune config: it was not created by "
                        "`tuner optimize --create-only` or `tuner optimize search.workers=N`")
    return validate(raw)


def claim_finalize(study: WorkerStudy, stale_s: float) -> bool:
    """Whether this worker is the one to measure and store the winner (first come, under the lock)."""
    with study.lock():
        attrs = study.user_attrs
        if BEST_ATTR in attrs:
            return False
        claim = attrs.get(FINALIZING)
        if claim is not None and time.time() - float(claim[1]) < stale_s:
            return False
        study.set_user_attr(FINALIZING, [worker_id(), time.time()])
        return True


def stored_best(study: optuna.Study) -> BestResult | None:
    raw = study.user_attrs.get(BEST_ATTR)
    return BestResult.model_validate(raw) if raw is not None else None


def compute_best(cfg: Config, study: optuna.Study, run_dir: Path, objective: Any | None) -> BestResult:
    """Pick the winner from the shared trials; re-measure it on the held-out prompts when an
    objective (an engine) is at hand."""
    from tuner.optimize import best_result, pick_winner

    trials = study.get_trials(deepcopy=False)
    win = pick_winner(trials, cfg.search.noise_rel, cfg.workload.concurrency)
    c = cfg
    if objective is None and cfg.workload.num_heldout > 0:
        c = cfg.model_copy(deep=True)
        c.workload.num_heldout = 0  # no engine here: the held-out figures stay empty
    return best_result(c, study, run_dir, win, objective)


def finalize(study: WorkerStudy, cfg: Config, run_dir: Path, objective: Any | None, force: bool = False,
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
    stale = cfg.search.trial_timeout_s + cfg.search.heartbeat_grace_s
    if not (force or claim_finalize(study, stale)):
        return None
    if cfg.workload.num_heldout > 0 and objective is not None:
        log("re-measuring the winner on the held-out prompts")
    best = compute_best(cfg, study, run_dir, objective)
    study.set_user_attr(BEST_ATTR, best.model_dump(mode="json"))
    return best


def write_run(study: optuna.Study, cfg: Config, run_dir: Path, best: BestResult) -> None:
    """config.yaml, best.yaml, trials.csv, the report and the manifests: the same files as a
    single-machine run."""
    from tuner.config import save_config
    from tuner.optimize import render_manifests
    from tuner.report import write_report

    if not (run_dir / "config.yaml").is_file():
        save_config(cfg, run_dir / "config.yaml")
    write_report(study, run_dir, best)
    render_manifests(run_dir)


# ---- the commands -----------------------------------------------------------------------------

def create_only(overrides: list[str]) -> str:
    """`tuner optimize --create-only`: create the shared study (idempotent); returns its name."""
    from tuner.config import load_config, require_workload
    from tuner.space import SearchSpace

    cfg = load_config(overrides)
    require_workload(cfg)
    if cfg.search.storage is None:
        raise UserError("--create-only needs search.storage (postgresql://USER@HOST/DB, env or journal:PATH)")
    url = resolve_storage(cfg.search.storage)
    check_shared(url, "--create-only")
    if not cfg.search.study_name:
        raise UserError("--create-only needs search.study_name (the name the workers join)")
    # head_path is not part of the Optuna params: the space is complete without training a head.
    _, created = create_shared_study(cfg, url, SearchSpace.from_config(cfg))
    print(f"study {cfg.search.study_name} {'created' if created else 'exists'} in {mask_url(url)}", file=sys.stderr)
    return cfg.search.study_name


# Overrides a joining worker may give: the study's identity and what differs per machine.
WORKER_KEYS = ("search.storage", "search.study_name", "engine.", "run_dir", "cache_dir")


def worker_config(overrides: list[str]) -> tuple[Config, str, str]:
    """(the study's config with the worker's own overrides, resolved URL, study name)."""
    from tuner.cli_deploy import config_for_run
    from tuner.config import load_config

    bad = [o for o in overrides if not o.lstrip("+~").startswith(WORKER_KEYS)]
    if bad:
        raise UserError(f"--worker takes its config from the study; only {', '.join(WORKER_KEYS)} may be given "
                        f"(got {' '.join(bad)})")
    search = load_config(overrides).search  # validated: the no-password rule, with its one-line message
    if not search.storage or not search.study_name:
        raise UserError("--worker needs search.storage=... and search.study_name=NAME (the study to join)")
    url = resolve_storage(search.storage)
    check_shared(url, "--worker")
    name = search.study_name
    study = optuna.load_study(study_name=name, storage=open_storage(url)) if name in \
        optuna.study.get_all_study_names(open_storage(url)) else None
    if study is None:
        raise UserError(f"search.study_name={name!r}: no such study in {mask_url(url)} "
                        "(create it with `tuner optimize --create-only ...`)")
    base = study_config(study)
    import tempfile

    import yaml

    with tempfile.TemporaryDirectory() as tmp:  # config_for_run merges overrides onto a saved config
        Path(tmp, "config.yaml").write_text(yaml.safe_dump(base.model_dump(mode="json"), sort_keys=False))
        cfg = config_for_run(Path(tmp), overrides)
    return cfg, url, name


def run_worker(overrides: list[str], quiet: bool = False, engine: Any = None, measure: Any = None) -> Path:
    """`tuner optimize --worker`: join the study, run trials until the budget is spent, and (if first
    to finish) store the winner. Writes config.yaml (and, for the finalizer, the whole run) into
    <run_dir>/<study>; returns that directory."""
    cfg, url, name = worker_config(overrides)
    run_dir = Path(cfg.run_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.yaml").is_file():
        from tuner.config import save_config

        save_config(cfg, run_dir / "config.yaml")
    best = _work_and_finish(cfg, url, name, run_dir, quiet, engine, measure, force=False)
    if best is not None:
        write_run(open_worker_study(cfg, url, name), cfg, run_dir, best)
    print(run_dir)
    return run_dir


def _work_and_finish(cfg: Config, url: str, name: str, run_dir: Path, quiet: bool, engine: Any, measure: Any,
                     force: bool, children: list[subprocess.Popen] | None = None,
                     before_work: Callable[[], None] | None = None) -> BestResult | None:
    """One worker's whole life: engine, trials until the budget is spent, the winner (see finalize)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Spawned workers import torch and load their engines while this one does (so before the heavy
    # imports here), unless a draft head must be trained first (once, here; they find it cached).
    needs_head = any(m in ("eagle", "eagle3", "medusa") for m in cfg.search.methods)
    if before_work is not None and not needs_head:
        before_work()
    from tuner.objective import Objective
    from tuner.optimize import Progress, get_draft, make_measure, open_engine, study_prompts
    from tuner.space import SearchSpace

    if engine is None and measure is None:
        engine = open_engine(cfg)
    space = SearchSpace.from_config(cfg, head_path=get_draft(cfg, engine))
    if before_work is not None and needs_head:
        before_work()
    study = open_worker_study(cfg, url, name)
    if measure is None:
        measure = make_measure(engine, cfg, study_prompts(cfg))
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    total = cfg.search.n_trials
    if cfg.search.sampler == "grid":  # the grid ends when every enqueued point is handed out
        total = min(total, len(study.get_trials(deepcopy=False)))
    with Progress(study, total, quiet=quiet) as progress:
        progress.log(f"worker {worker_id()} on study {name} in {mask_url(url)}")
        n = work(study, objective, cfg, progress, progress.log)
        progress.log(f"budget spent: this worker ran {n} trial(s)")
        for i, p in enumerate(children or []):
            rc = p.wait()
            if rc != 0:
                progress.log(f"worker {i + 1} (pid {p.pid}) exited with code {rc}; the trial it was running, "
                             "if any, was marked FAIL by the heartbeat sweep")
        if children:
            study.wait_done()  # a child that died last may have left a trial behind
        best = finalize(study, cfg, run_dir, objective, force=force, log=progress.log)
        if best is not None:
            progress.log(f"winner: {best.spec.key()} — {best.reason}")
    return best


def optimize_parallel(cfg: Config, run_dir: Path, resuming: bool, quiet: bool = False, engine: Any = None,
                      measure: Any = None) -> Path:
    """`tuner optimize ... search.workers=N`: this process and N-1 worker processes on one study.

    This process creates the study (or reopens it with --resume), starts the others with
    `tuner optimize --worker` (each loads its own engine; logs in RUN_DIR/workers/), works itself,
    waits for them and writes the run directory like a single-machine run.
    """
    from tuner.study import storage_url

    url = storage_url(cfg.search, run_dir)  # resolved: `env` becomes SPECTUNE_STORAGE_URL's value
    check_shared(url, f"search.workers={cfg.search.workers}")
    name = cfg.search.study_name
    children: list[subprocess.Popen] = []

    def spawn() -> None:
        from tuner.space import SearchSpace

        if not resuming:
            study, created = create_shared_study(cfg, url, SearchSpace.from_config(cfg))
            if not created:
                raise UserError(f"search.study_name={name!r} already exists in {mask_url(url)}: join it with "
                                "`tuner optimize --worker` or choose another name")
        logs = run_dir / WORKERS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        # The children see the URL as given (`env` stays `env`, resolved from their inherited
        # environment); a relative journal path becomes absolute.
        given = f"journal:{url[len('journal:'):]}" if url.startswith("journal:") else cfg.search.storage
        cmd = [sys.executable, "-m", "tuner.cli", "optimize", "--worker",
               f"search.storage={given}", f"search.study_name={name}", f"run_dir={cfg.run_dir}"]
        if cfg.cache_dir:
            cmd.append(f"cache_dir={cfg.cache_dir}")
        for i in range(1, cfg.search.workers):
            with (logs / f"worker-{i}.log").open("ab") as log:
                children.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    try:
        best = _work_and_finish(cfg, url, name, run_dir, quiet, engine, measure, force=True, children=children,
                                before_work=spawn)
    finally:
        for p in children:  # only on an error or Ctrl-C are any still alive
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
    assert best is not None  # force=True always yields a result
    write_run(open_worker_study(cfg, url, name), cfg, run_dir, best)
    print(run_dir)
    return run_dir


def report_from_storage(storage: str, study_name: str, out: Path | None = None, wait_s: float | None = None) -> Path:
    """`tuner report --storage URL --study NAME`: best.yaml, trials.csv, report and manifests of a
    shared study into `out` (default <run_dir>/<study>), from the storage alone (no engine)."""
    reject_password(storage)
    url = resolve_storage(storage)
    if wait_s is not None:
        wait_for_study(url, study_name, wait_s, done=True)
    storage_obj = open_storage(url)
    if study_name not in optuna.study.get_all_study_names(storage_obj):
        raise UserError(f"--study {study_name}: no such study in {mask_url(url)}")
    base = optuna.load_study(study_name=study_name, storage=storage_obj)
    cfg = study_config(base)
    cfg.search.storage, cfg.search.study_name = storage, study_name
    run_dir = out or Path(cfg.run_dir) / study_name
    run_dir.mkdir(parents=True, exist_ok=True)
    study = WorkerStudy(study_name, storage_obj, url, cfg.search.n_trials, cfg.search.heartbeat_grace_s)
    best = stored_best(study) or compute_best(cfg, study, run_dir, None)
    from tuner.config import save_config

    save_config(cfg, run_dir / "config.yaml")
    write_run(study, cfg, run_dir, best)
    return run_dir


def is_distributed_run(run_dir: Path) -> bool:
    """Whether RUN_DIR belongs to a shared study (its config names a shared storage and the study
    was created by the distributed flow), so its report comes from the storage."""
    from tuner.config import load_saved_config
    from tuner.study import storage_url

    search = load_saved_config(run_dir / "config.yaml").search
    if search.storage is None or not search.study_name:
        return False
    url = resolve_storage(storage_url(search, run_dir))
    if not is_shared(url):
        return False
    storage = open_storage(url)
    if search.study_name not in optuna.study.get_all_study_names(storage):
        return False
    return CONFIG_ATTR in optuna.load_study(study_name=search.study_name, storage=storage).user_attrs


def wait_for_study(url: str, study_name: str | None, timeout_s: float, done: bool = False) -> None:
    """Wait until the storage answers (and the study exists; with `done`, until its budget is spent,
    nothing runs and the winner is stored, or its finalizer is gone). UserError on time-out."""
    deadline, why = time.monotonic() + timeout_s, "not reached yet"
    while True:
        try:
            storage = open_storage(url)
            if study_name is None:
                return
            if study_name not in optuna.study.get_all_study_names(storage):
                why = f"no study {study_name!r} yet"
            elif not done:
                return
            else:
                study = optuna.load_study(study_name=study_name, storage=storage)
                cfg = study_config(study)
                ws = WorkerStudy(study_name, storage, url, cfg.search.n_trials, cfg.search.heartbeat_grace_s,
                                 grid=cfg.search.sampler == "grid")
                sweep_stale(ws, cfg.search.heartbeat_grace_s)
                attrs = study.user_attrs
                claim = attrs.get(FINALIZING)
                claim_alive = claim is not None and \
                    time.time() - float(claim[1]) < cfg.search.trial_timeout_s + cfg.search.heartbeat_grace_s
                if ws.budget_spent() and ws.running() == 0 and (BEST_ATTR in attrs or not claim_alive):
                    return
                why = f"{ws.started()}/{cfg.search.n_trials} trials started, {ws.running()} running"
        except UserError as exc:
            why = str(exc)
        if time.monotonic() > deadline:
            raise UserError(f"gave up after {timeout_s:g} s waiting for {mask_url(url)}: {why}")
        time.sleep(2)
