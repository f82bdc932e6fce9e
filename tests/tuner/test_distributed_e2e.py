"""Distributed tuning end to end: real worker processes, each with its own built-in engine on the tiny
random model, share one study in a real PostgreSQL server (tests/pg.py) or a journal file; one
worker is killed with SIGKILL mid-trial and the study still completes, that trial FAIL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

import pg
from tuner.study import storage as st
from tuner.study import workers as w
from tuner.cli import main
from tuner.schema.compose import load_config
from tuner.schema.config import BestResult
from tuner.search.space import SearchSpace
from tuner.study.studies import WORKER

# Small: a trial is a few seconds; one intra-op thread per worker so three share two cores fairly. No
# PNGs (report.figures=false): these tests check the study, best.yaml, report.html and the manifests.
SMALL = ["model=tiny-random", "+workload=code", "search=quick", "workload.num_prompts=2", "workload.num_heldout=1",
         "workload.max_new_tokens=16", "search.heartbeat_grace_s=10", "engine.builtin.threads=1", "report.figures=false"]
TIMEOUT_S = 420
pytestmark = pytest.mark.slow  # worker processes and a real PostgreSQL server: tens of seconds a test


def _trials(storage: optuna.storages.BaseStorage, name: str) -> list[optuna.trial.FrozenTrial]:
    if name not in optuna.study.get_all_study_names(storage):
        return []
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def _kill_mid_trial(url: str, name: str, victim: Callable[[int], bool], procs: list[subprocess.Popen]) -> int:
    """SIGKILL the first worker pid for which `victim` holds seen running a trial; the trial's number. The worker is frozen
    (SIGSTOP) and the trial read again before the kill: a trial that finished between the first
    read and the kill would otherwise count as killed. One storage for every read: each read still
    asks the server (or reads the journal's new lines), where opening an RDBStorage at every poll (an
    engine, a connection, the schema's check) took CPU from the workers starting beside it."""
    storage = st.open_storage(url)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for t in _trials(storage, name):
            pid = int(str(t.user_attrs.get(WORKER, ":0")).rsplit(":", 1)[1])
            if t.state == TrialState.RUNNING and pid and victim(pid):
                os.kill(pid, signal.SIGSTOP)
                if next(u for u in _trials(storage, name) if u.number == t.number).state == TrialState.RUNNING:
                    os.kill(pid, signal.SIGKILL)
                    return t.number
                os.kill(pid, signal.SIGCONT)
        assert all(p.poll() is None for p in procs), ("a worker ended before one could be killed mid-trial",
                                                      [p.communicate()[0] for p in procs if p.poll() is not None])
        time.sleep(0.2)
    raise AssertionError("no worker was seen running a trial")


def _check_study(trials: list[optuna.trial.FrozenTrial], budget: int, killed: int) -> None:
    # the finaliser's confirmation round may add head-to-head pairs (role confirm) after the budget;
    # a point the sampler proposed again (reused_from) is not counted in it either
    started = [t for t in trials if t.state != TrialState.WAITING and t.user_attrs.get("role") != "confirm"
               and "reused_from" not in t.user_attrs]
    # or fewer, when the sampler had proposed measured points as often as the budget has trials (a tiny
    # space: the study ends rather than loop; Budget.spent)
    reused = [t for t in trials if "reused_from" in t.user_attrs]
    assert len(started) == budget or (len(started) < budget and len(reused) >= budget), (len(started), len(reused))
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    by_number = {t.number: t for t in trials}
    assert by_number[killed].state == TrialState.FAIL
    assert "no heartbeat" in by_number[killed].user_attrs["fail_reason"]
    failed = {t.number: t.user_attrs.get("fail_reason") for t in started if t.state == TrialState.FAIL}
    assert list(failed) == [killed], failed
    roles = Counter(t.user_attrs.get("role", "search") for t in started)
    assert roles["baseline"] == 1 and roles["default"] == 1  # enqueued once, run once
    # the baseline ran once: the killed trial may be it (whether it recorded its spec before the kill
    # depends on when the kill came), so count the others
    killed_baseline = by_number[killed].user_attrs.get("role") == "baseline"
    offs = sum(1 for t in started if t.user_attrs.get("spec") == "off" and t.number != killed)
    assert offs == (0 if killed_baseline else 1)
    assert len({t.user_attrs[WORKER] for t in started}) >= 2  # the study was shared


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_three_workers_share_a_postgres_study_and_survive_a_kill(tmp_path: Path) -> None:
    budget = 6
    with pg.postgres_server() as server:
        env = {**os.environ, **server.env}
        os.environ["PGPASSWORD"] = pg.PASSWORD
        try:
            study = [f"search.storage={server.url}", "search.study_name=e2e"]
            # A shorter grace than SMALL's: PostgreSQL ends a killed worker's lock with its connection, so
            # only the heartbeat's period (a fifth of the grace) bounds it; the survivors, done with the
            # budget, wait for the sweep of the killed trial.
            assert main(["optimize", "--create-only", *SMALL, *study, f"search.n_trials={budget}",
                         "search.heartbeat_grace_s=4"]) == 0
            cmd = [sys.executable, "-m", "tuner.cli", "optimize", "--worker", *study, "engine.builtin.threads=1"]
            procs = [subprocess.Popen([*cmd, f"run_dir={tmp_path / f'w{i}'}"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for i in range(3)]
            try:
                killed = _kill_mid_trial(server.url, "e2e", {p.pid for p in procs}.__contains__, procs)
                outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
            finally:
                for p in procs:
                    p.kill()
            rcs = sorted(p.returncode for p in procs)
            assert rcs == [-signal.SIGKILL, 0, 0], outs
            _check_study(_trials(st.open_storage(server.url), "e2e"), budget, killed)

            # One surviving worker re-measured the winner on the held-out prompts and stored it.
            stored = optuna.load_study(study_name="e2e", storage=server.url).user_attrs[w.BEST_ATTR]
            assert BestResult.model_validate(stored).heldout is not None
            finalizers = [i for i in range(3) if (tmp_path / f"w{i}" / "e2e" / "best.yaml").is_file()]
            assert len(finalizers) == 1

            # The winner from the storage alone: best.yaml, the report and the manifests.
            out = tmp_path / "report"
            assert main(["report", "--storage", server.url, "--study", "e2e", "--out", str(out)]) == 0
            best = BestResult.model_validate(yaml.safe_load((out / "best.yaml").read_text()))
            assert best == BestResult.model_validate(stored)
            assert (out / "report.html").is_file() and (out / "k8s" / "kustomization.yaml").is_file()
            assert pg.PASSWORD not in "".join(outs) + (out / "config.yaml").read_text()
        finally:
            os.environ.pop("PGPASSWORD", None)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_local_workers_over_a_journal_file_survive_a_kill(tmp_path: Path) -> None:
    """`tuner optimize search.workers=3` with a journal file: this process plus two spawned workers;
    a grid study, so every point runs exactly once (the killed one stays FAIL)."""
    url = f"journal:{tmp_path / 'study.journal'}"
    # Six grid points (n-gram chains of depth 1..6): enough work that the spawned workers, which
    # start after this process, surely get some of it.
    # Longer generations than SMALL's: its trials took 0.1-0.3 s, so the parent ran 6 of 7 before the
    # spawned workers had started, and no worker's trial was seen running to be killed.
    # SMALL's grace stays: a worker killed while appending leaves the journal's lock to others for
    # JOURNAL_LOCK_GRACE_S, which stalls their heartbeats too.
    small = [o for o in SMALL if not o.startswith("workload.max_new_tokens=")]
    grid = [*small, "workload.max_new_tokens=192", "workload.concurrency=[1]", f"search.storage={url}", "search.workers=3", "search.sampler=grid",
            "search.depth.max=6",
            "search.budget_max=7", "search.n_trials=20"]
    n_points = len(SearchSpace.from_config(load_config(grid)).points())
    assert n_points == 6
    cmd = [sys.executable, "-m", "tuner.cli", "optimize", *grid, "search.study_name=j", f"run_dir={tmp_path}",
           "--quiet"]
    parent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Children are the workers whose pid is not the parent's: kill one of them mid-trial.
        killed = _kill_mid_trial(url, "j", lambda pid: pid != parent.pid, [parent])
        out = parent.communicate(timeout=TIMEOUT_S)[0]
    finally:
        parent.kill()
    assert parent.returncode == 0, out
    run_dir = tmp_path / "j"
    assert out.strip().splitlines()[-1] == str(run_dir)
    trials = [t for t in _trials(st.open_storage(url), "j") if t.user_attrs.get("role") != "confirm"]  # not the confirmation pairs
    assert len(trials) == n_points + 1, [(t.number, t.state.name) for t in trials]
    # finished: a bound may prune a grid point once noise gives it a second repeat
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL) for t in trials), [t.state.name for t in trials]
    specs = Counter(t.user_attrs.get("spec") for t in trials)
    assert all(v == 1 for v in specs.values()), specs  # each grid point exactly once
    failed = {t.number: t.user_attrs.get("fail_reason") for t in trials if t.state == TrialState.FAIL}
    assert set(failed) == {killed}, failed
    assert "no heartbeat" in {t.number: t for t in trials}[killed].user_attrs["fail_reason"]
    assert len({t.user_attrs[WORKER] for t in trials}) >= 2
    for f in ("config.yaml", "best.yaml", "trials.csv", "report.html", "k8s/kustomization.yaml"):
        assert (run_dir / f).is_file(), f
