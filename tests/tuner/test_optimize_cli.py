"""`tuner dashboard` and `tuner report` on a run directory (no engine needed: a study created in real SQLite)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import free_port
from tuner.cli import main
from tuner.schema.compose import load_config, save_config
from tuner.search.space import SearchSpace
from tuner.study.studies import create_study


def _run_dir(tmp_path: Path) -> Path:
    cfg = load_config(["model=tiny-random", "+workload=code", "search=quick", "search.study_name=d"])
    run_dir = tmp_path / "d"
    save_config(cfg, run_dir / "config.yaml")
    create_study(cfg, SearchSpace.from_config(cfg), run_dir, "d")
    return run_dir


def test_dashboard_serves_the_run_dirs_study_on_localhost(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", "dashboard", str(run_dir), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/studies", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-1000:]
                time.sleep(0.5)
        assert r.status_code == 200
        assert [s["study_name"] for s in r.json()["study_summaries"]] == ["d"]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    # SIGTERM to `tuner dashboard` stops the server itself: nothing is left listening
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/api/studies", timeout=2)


def test_report_of_an_unfinished_study_and_of_a_wrong_dir(tmp_path: Path, capsys) -> None:
    run_dir = _run_dir(tmp_path)
    assert main(["report", str(run_dir)]) == 0  # enqueued trials only: still a report, no best.yaml yet
    assert "has not finished" in (run_dir / "report.html").read_text()
    assert (run_dir / "trials.csv").read_text().count("\n") == 3  # header, baseline and one default (waiting)
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_bench_and_serve_never_draft_with_an_untrained_head(tmp_path, capsys) -> None:
    """Without spec.head_path, bench and serve take the head train-draft cached for the target and
    workload, or refuse in one line naming both ways: never a random head."""
    from engine.heads.pipeline import META, head_dir
    from tuner.cli import main
    from tuner.schema.compose import load_config
    from tuner.study.measurer import spec_with_trained_draft, train_job

    over = ["model=tiny-random", "+workload=code", f"cache_dir={tmp_path}", "spec.method=eagle", "spec.depth=3"]
    for cmd in (["bench", *over], ["serve", *over]):
        assert main(cmd) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "tuner train-draft spec.method=eagle" in err[0] and "spec.head_path" in err[0]
    cfg = load_config(over)
    out = head_dir(train_job(cfg), "eagle")
    out.mkdir(parents=True)
    (out / META).write_text("{}")
    assert spec_with_trained_draft(cfg).head_path == str(out)
    given = load_config([*over, f"spec.head_path={tmp_path / 'mine'}"])
    assert spec_with_trained_draft(given).head_path == str(tmp_path / "mine")
    assert spec_with_trained_draft(load_config(["spec.method=ngram"])).head_path is None


def test_report_out_writes_the_report_there_and_leaves_the_run(tmp_path: Path, capsys) -> None:
    """Issue 25: `tuner report RUN --out DIR` writes trials.csv, the figures and report.html into DIR
    (the run directory is only read); --wait, which only a shared study has, is refused for RUN."""
    run_dir = _run_dir(tmp_path)
    before = sorted(p.name for p in run_dir.iterdir())
    out = tmp_path / "elsewhere" / "report"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    assert (out / "report.html").is_file() and (out / "trials.csv").read_text().count("\n") == 3
    assert sorted(p.name for p in run_dir.iterdir()) == before
    (tmp_path / "afile").write_text("x")
    assert main(["report", str(run_dir), "--out", str(tmp_path / "afile")]) == 2
    assert main(["report", str(run_dir), "--wait", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "is an existing file" in err[0] and err[1].startswith("error: --wait 5 is for a shared study")
