"""Distributed tuning, the commands: create a shared study, join it as a worker, run N local worker
processes on it, wait for it and report it from the storage alone.

Each worker runs the one study driver (tuner.study.driver) on a WorkerStudy (tuner.study.workers) with its own
engine, exactly as a single-machine study does (engine=vllm/sglang launches a server per worker).
The study's storage (tuner.study.storage: PostgreSQL or a journal file) is the only coordination.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna

from tuner.schema.compose import apply_overrides, load_config, load_saved_config, require_workload, save_config
from tuner.study.driver import drive
from tuner.run.rundir import write_run
from tuner.schema.config import BestResult, Config, UserError
from tuner.search.space import SearchSpace
from tuner.study.storage import (check_shared, is_shared, mask_url, open_storage, reject_password, resolve_storage,
                           storage_url)
from tuner.study.studies import Budget, sweep_stale
from tuner.study.selection import compute_best
from tuner.study.workers import (BEST_ATTR, CONFIG_ATTR, WorkerStudy, create_shared_study, finalize, finalize_stale_s,
                           open_worker_study, require_study, stored_best, study_config, worker_id)

WORKERS_DIR = "workers"  # logs of local worker processes inside the run directory
# Overrides a joining worker may give: the study's identity and what differs per machine.
WORKER_KEYS = ("search.storage", "search.study_name", "engine.", "run_dir", "cache_dir")


def create_only(overrides: list[str]) -> str:
    """`tuner optimize --create-only`: create the shared study (idempotent); returns its name."""
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


def worker_config(overrides: list[str]) -> tuple[Config, str, str]:
    """(the study's config with the worker's own overrides, resolved URL, study name)."""
    bad = [o for o in overrides if not o.lstrip("+~").startswith(WORKER_KEYS)]
    if bad:
        raise UserError(f"--worker takes its config from the study; only {', '.join(WORKER_KEYS)} may be given "
                        f"(got {' '.join(bad)})")
    # Validated alone (the no-password rule, with its one-line message); the rest applies to the study's config.
    search = load_config([o for o in overrides if o.lstrip("+~").startswith("search.")]).search
    if not search.storage or not search.study_name:
        raise UserError("--worker needs search.storage=... and search.study_name=NAME (the study to join)")
    url = resolve_storage(search.storage)
    check_shared(url, "--worker")
    name = search.study_name
    base = study_config(optuna.load_study(study_name=name, storage=require_study(url, name)))
    return apply_overrides(base.model_dump(mode="json"), overrides), url, name


def work_and_finish(cfg: Config, url: str, name: str, run_dir: Path, quiet: bool = False, engine: Any = None,
                    measure: Any = None, force: bool = False, children: list[subprocess.Popen] | None = None,
                    before_work: Any = None) -> BestResult | None:
    """One worker's whole life through the study driver: its engine (or launched server), trials
    until the shared budget is spent, waiting for the other workers, and the winner (see
    workers.finalize: None unless this worker writes the run)."""

    def finish(study: optuna.Study, objective: Any, ran: int, log: Any) -> BestResult | None:
        assert isinstance(study, WorkerStudy)
        study.wait_done(on_sweep=lambda nums: log(f"marked FAIL (worker lost, no heartbeat): trial(s) {nums}"))
        log(f"budget spent: this worker ran {ran} trial(s)")
        for i, p in enumerate(children or []):
            rc = p.wait()
            if rc != 0:
                log(f"worker {i + 1} (pid {p.pid}) exited with code {rc}; the trial it was running, "
                    "if any, was marked FAIL by the heartbeat sweep")
        if children:
            study.wait_done()  # a child that died last may have left a trial behind
        return finalize(study, cfg, run_dir, objective, force=force, log=log)

    _, best = drive(cfg, run_dir, lambda space: open_worker_study(cfg, url, name), finish, quiet=quiet,
                    engine=engine, measure=measure, before_work=before_work,
                    intro=lambda study: [f"worker {worker_id()} on study {name} in {mask_url(url)}"])
    return best


def missing_drafts(cfg: Config) -> list[str]:
    """The searched methods whose trained draft is not (yet) in cfg's cache_dir (tuner.schema.config.trained_drafts)."""
    from engine.heads.pipeline import cached_head
    from tuner.schema.config import trained_drafts
    from tuner.study.measurer import train_job

    return [m for m in trained_drafts(cfg) if cached_head(train_job(cfg), m) is None]


def wait_for_drafts(cfg: Config, timeout_s: float, log: Any = None, poll_s: float = 5.0, every_s: float = 30.0) -> None:
    """Wait until every draft the study trains is in cache_dir (put there by `tuner train-draft
    --searched`, the render's train Job), printing a line every `every_s`; UserError on time-out."""
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.monotonic()
    last = -every_s
    while True:
        missing = missing_drafts(cfg)
        if not missing:
            return
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise UserError(f"--wait-drafts {timeout_s:g}: no trained {', '.join(missing)} draft for {cfg.model.name} "
                            f"on workload {cfg.workload.name if cfg.workload else 'none'} in "
                            f"cache_dir={cfg.cache_dir} after {waited:.0f} s (the train Job writes it: "
                            f"`tuner train-draft --searched` with the study's overrides and this cache_dir)")
        if waited - last >= every_s:
            say(f"waiting for the trained {', '.join(missing)} draft(s) in cache_dir={cfg.cache_dir} "
                f"({waited:.0f} s of {timeout_s:g} s)")
            last = waited
        time.sleep(poll_s)


def run_worker(overrides: list[str], quiet: bool = False, engine: Any = None, measure: Any = None,
               wait_drafts_s: float | None = None) -> Path:
    """`tuner optimize --worker`: join the study, run trials until the budget is spent, and (if first
    to finish) store the winner. Writes config.yaml (and, for the finalizer, the whole run) into
    <run_dir>/<study>; returns that directory. `wait_drafts_s`: first wait that long for the drafts
    another process trains (wait_for_drafts) instead of training them here."""
    cfg, url, name = worker_config(overrides)
    if wait_drafts_s is not None:
        wait_for_drafts(cfg, wait_drafts_s)
    run_dir = Path(cfg.run_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.yaml").is_file():
        save_config(cfg, run_dir / "config.yaml")
    best = work_and_finish(cfg, url, name, run_dir, quiet, engine, measure)
    if best is not None:
        write_run(open_worker_study(cfg, url, name), cfg, run_dir, best)
    print(run_dir)
    return run_dir


def optimize_parallel(cfg: Config, run_dir: Path, resuming: bool, quiet: bool = False, engine: Any = None,
                      measure: Any = None) -> Path:
    """`tuner optimize ... search.workers=N`: this process and N-1 worker processes on one study.

    This process creates the study (or reopens it with --resume), starts the others with
    `tuner optimize --worker` (each loads its own engine; logs in RUN_DIR/workers/), works itself,
    waits for them and writes the run directory like a single-machine run.
    """
    url = storage_url(cfg.search, run_dir)  # resolved: `env` becomes SPECTUNE_STORAGE_URL's value
    check_shared(url, f"search.workers={cfg.search.workers}")
    name = cfg.search.study_name
    children: list[subprocess.Popen] = []

    def spawn() -> None:
        if not resuming:
            _, created = create_shared_study(cfg, url, SearchSpace.from_config(cfg))
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
        best = work_and_finish(cfg, url, name, run_dir, quiet, engine, measure, force=True, children=children,
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
    study = optuna.load_study(study_name=study_name, storage=storage_obj)
    cfg = study_config(study)
    cfg.search.storage, cfg.search.study_name = storage, study_name
    run_dir = out or Path(cfg.run_dir) / study_name
    run_dir.mkdir(parents=True, exist_ok=True)
    best = stored_best(study) or compute_best(cfg, study, run_dir, None)
    save_config(cfg, run_dir / "config.yaml")
    write_run(study, cfg, run_dir, best)
    return run_dir


def is_distributed_run(run_dir: Path) -> bool:
    """Whether RUN_DIR belongs to a shared study (its config names a shared storage and the study
    was created by the distributed flow), so its report comes from the storage."""
    search = load_saved_config(run_dir / "config.yaml").search
    if search.storage is None or not search.study_name:
        return False
    url = storage_url(search, run_dir)
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
                cfg = study_config(optuna.load_study(study_name=study_name, storage=storage))
                ws = WorkerStudy(study_name, storage, url, Budget.of(cfg.search, "started"),
                                 cfg.search.heartbeat_grace_s)
                sweep_stale(ws, cfg.search.heartbeat_grace_s)
                if ws.budget_spent() and ws.running() == 0 and (
                        BEST_ATTR in ws.user_attrs or not ws.finalizing_alive(finalize_stale_s(cfg))):
                    return
                why = f"{ws.started()}/{cfg.search.n_trials} trials started, {ws.running()} running"
        except UserError as exc:
            why = str(exc)
        if time.monotonic() > deadline:
            raise UserError(f"gave up after {timeout_s:g} s waiting for {mask_url(url)}: {why}")
        time.sleep(2)
