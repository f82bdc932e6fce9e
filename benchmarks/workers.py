"""Distributed tuning: 1 vs N local workers on one PostgreSQL study, same trial budget, tiny model.

For each worker count: a fresh study (`tuner optimize --create-only`), N `tuner optimize --worker`
processes started together, each with its own built-in engine on the tiny random model. Reported:

- wall_s: first worker started -> last worker exited (includes each process's start-up);
- study_s: first trial started -> last trial finished (the storage's timestamps);
- coordination overhead per trial (ms): the mean gap between a trial's tell and the same worker's
  next trial's start (budget lock, stale sweep, trial listing, sampling, progress output);
- storage round-trips per trial: statements PostgreSQL executed (log_statement=all: every simple
  query and every extended-protocol execute is one round-trip), from study creation to the last
  worker's exit, divided by the trials.

With --fake-delay S the workers are threads of this process measuring with a fake engine that
sleeps S seconds per measurement (no CPU used): the coordination cost without the CPU contention
of N engines on a small machine.

Usage: .venv/bin/python benchmarks/workers.py [--trials 12] [--workers 1 3] [--fake-delay 0.5]
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import pg  # noqa: E402  (the tests' throwaway PostgreSQL server)

SMALL = ["model=tiny-random", "+workload=code", "search=quick", "workload.num_prompts=2", "workload.num_heldout=1",
         "workload.max_new_tokens=16", "engine.builtin.threads=1"]
STATEMENT = re.compile(r"LOG:  (statement|execute [^:]*):")


def statements(log: Path) -> int:
    return sum(1 for line in log.read_text(errors="replace").splitlines() if STATEMENT.search(line))


def _processes(server: pg.Server, name: str, n_workers: int, tmp: Path) -> None:
    """N `tuner optimize --worker` processes, each with its own engine."""
    env = {**os.environ, **server.env}
    cmd = [sys.executable, "-m", "tuner.cli", "optimize", "--worker", "--quiet", f"search.storage={server.url}",
           f"search.study_name={name}", "engine.builtin.threads=1"]
    procs = [subprocess.Popen([*cmd, f"run_dir={tmp / name / str(i)}"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for i in range(n_workers)]
    rcs = [p.wait() for p in procs]
    assert rcs == [0] * n_workers, rcs


def _threads(server: pg.Server, name: str, n_workers: int, delay_s: float) -> None:
    """N worker threads, each with its own WorkerStudy (own connections), measuring with a fake engine."""
    import threading

    from tuner.run.distributed import worker_config
    from tuner.study.driver import run_trials
    from tuner.study.objective import Objective, Sample
    from tuner.search.space import SearchSpace
    from tuner.study.workers import open_worker_study

    cfg = worker_config([f"search.storage={server.url}", f"search.study_name={name}"])[0]  # the study's own
    space = SearchSpace.from_config(cfg)

    def measure(spec, split, concurrency):  # speculation 'helps' with depth; no CPU used
        time.sleep(delay_s)
        return Sample(100.0 if spec.method == "off" else 100.0 + 10 * spec.depth, 1.0 + 0.2 * spec.depth)

    def one() -> None:
        study = open_worker_study(cfg, server.url, name)
        run_trials(study, Objective(study, space, measure, cfg.workload, cfg.search), cfg.search)
        study.wait_done()

    threads = [threading.Thread(target=one) for _ in range(n_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(server: pg.Server, n_workers: int, trials: int, tmp: Path, fake_delay_s: float | None = None) -> dict:
    name = f"bench-w{n_workers}" + ("-fake" if fake_delay_s is not None else "")
    os.environ.update(server.env)
    before = statements(server.log)
    subprocess.run([sys.executable, "-m", "tuner.cli", "optimize", "--create-only", *SMALL,
                    f"search.storage={server.url}", f"search.study_name={name}", f"search.n_trials={trials}"],
                   check=True, capture_output=True)
    t0 = time.monotonic()
    if fake_delay_s is None:
        _processes(server, name, n_workers, tmp)
    else:
        _threads(server, name, n_workers, fake_delay_s)
    wall = time.monotonic() - t0
    time.sleep(1)  # let the server flush its log
    n_statements = statements(server.log) - before

    done = [t for t in optuna.load_study(study_name=name, storage=server.url).get_trials()
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)]
    assert len(done) == trials, len(done)
    by_worker: dict[str, list] = {}
    for t in done:
        by_worker.setdefault(t.user_attrs["worker"], []).append(t)
    gaps = 0.0
    for ts in by_worker.values():
        ts.sort(key=lambda t: t.datetime_start)
        gaps += sum((b.datetime_start - a.datetime_complete).total_seconds() for a, b in zip(ts, ts[1:]))
    in_trials = sum((t.datetime_complete - t.datetime_start).total_seconds() for t in done)
    gap_count = sum(len(ts) - 1 for ts in by_worker.values())
    study_s = (max(t.datetime_complete for t in done) - min(t.datetime_start for t in done)).total_seconds()
    return {
        "workers": n_workers, "engine": "fake" if fake_delay_s is not None else "tiny-random", "trials": trials,
        "wall_s": round(wall, 1), "study_s": round(study_s, 1),
        "trial_s_mean": round(in_trials / trials, 2),
        "trials_per_worker": sorted(len(ts) for ts in by_worker.values()),
        "overhead_ms_per_trial": round(1000 * gaps / max(1, gap_count), 1),
        "statements": n_statements, "statements_per_trial": round(n_statements / trials, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--fake-delay", type=float, help="worker threads with a fake engine sleeping this long per "
                                                     "measurement (two per trial) instead of engine processes")
    args = ap.parse_args()
    import tempfile

    results = []
    with tempfile.TemporaryDirectory() as tmp, pg.postgres_server({"log_statement": "all"}) as server:
        for n in args.workers:
            r = run(server, n, args.trials, Path(tmp), args.fake_delay)
            print(r, file=sys.stderr, flush=True)
            results.append(r)
    base = results[0]
    summary = {"runs": results}
    if len(results) > 1:
        summary["study_speedup"] = {str(r["workers"]): round(base["study_s"] / r["study_s"], 2) for r in results}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
