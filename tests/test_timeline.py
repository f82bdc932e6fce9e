"""tests/timeline.py: `pytest --timeline PATH` rows and summary, on a throwaway test file run by a
pytest of its own (the suite's conftest not loaded: no torch); the xdist side by its hooks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import timeline

TESTS = Path(__file__).resolve().parent
# One test's CPU is a child's (the child burns process time: counted only if reaped children count),
# one test only waits (its wall, not its CPU), and two are quick.
BODY = '''
import subprocess, sys, time

def test_child_burns_cpu():
    subprocess.run([sys.executable, "-c",
                    "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.3: pass"], check=True)

def test_sleeps():
    time.sleep(0.3)

def test_quick():
    pass

def test_quick_too():
    pass
'''


def _run(tmp_path: Path, *args: str) -> tuple[list[dict[str, str]], str]:
    (tmp_path / "test_sample.py").write_text(BODY)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # its own rootdir: not this repository's settings
    out = tmp_path / "rows.csv"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "timeline",
                           "--timeline", str(out), *args, "test_sample.py"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(TESTS)}, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return timeline.read(out), proc.stdout


def _by_test(rows: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    return {r["test"]: r for r in rows}


def test_rows_count_reaped_children_and_tell_waiting_from_working(tmp_path: Path) -> None:
    rows, out = _run(tmp_path)
    assert list(rows[0]) == list(timeline.FIELDS)
    by = _by_test(rows)
    assert sorted(by) == ["test_child_burns_cpu", "test_quick", "test_quick_too", "test_sleeps"]
    assert {r["worker"] for r in rows} == {"main"} and {r["file"] for r in rows} == {"test_sample.py"}
    burn, sleep = by["test_child_burns_cpu"], by["test_sleeps"]
    assert float(burn["cpu_s"]) >= 0.28  # the child's CPU (a parent only waiting has next to none)
    assert float(sleep["wall_s"]) >= 0.3 and float(sleep["cpu_s"]) < 0.2  # waiting is wall, not CPU
    starts = [float(r["start"]) for r in rows]
    assert starts == sorted(starts)  # one process: rows in the order the tests ran
    assert float(by["test_sleeps"]["start"]) >= float(burn["start"]) + float(burn["wall_s"]) - 0.01
    assert "timeline main: 4 tests, 1 files" in out
    slowest = out[out.index("slowest"):].splitlines()[1:3]
    assert {line.split("::")[-1] for line in slowest} == {"test_child_burns_cpu", "test_sleeps"}


def test_an_xdist_worker_appends_under_its_name_and_leaves_the_header(tmp_path: Path) -> None:
    """The hooks as an xdist worker runs them: its configure keeps what the controller wrote (a
    worker restarted mid-run would otherwise wipe the rows before it), its rows carry its name."""
    out = tmp_path / "rows.csv"
    controller = SimpleNamespace(getoption=lambda name, default=None: str(out), rootpath=tmp_path)
    timeline.pytest_configure(controller)  # the header
    config = SimpleNamespace(**vars(controller), workerinput={"workerid": "gw1"})
    item = SimpleNamespace(config=config, path=tmp_path / "sub" / "test_x.py", name="test_y[a,b]")
    for _ in range(2):
        timeline.pytest_configure(config)  # a worker (started, then restarted)
        run = timeline.pytest_runtest_protocol(item, None)
        next(run)
        with pytest.raises(StopIteration):
            next(run)
    rows = timeline.read(out)
    assert [(r["worker"], r["file"], r["test"]) for r in rows] == [("gw1", "sub/test_x.py", "test_y[a,b]")] * 2
    assert out.read_text().count("worker,") == 1


def test_summary_reads_each_workers_end() -> None:
    rows = [{"worker": "gw0", "file": "a.py", "test": "t1", "start": "100.0", "wall_s": "5.0", "cpu_s": "4.0"},
            {"worker": "gw1", "file": "b.py", "test": "t2", "start": "101.0", "wall_s": "20.0", "cpu_s": "1.0"},
            {"worker": "gw0", "file": "c.py", "test": "t3", "start": "105.0", "wall_s": "2.0", "cpu_s": "2.0"}]
    lines = timeline.summary(rows)
    assert lines[0] == "timeline gw0: 2 tests, 2 files, busy 7.0 s, CPU 6.0 s, last test ended at 7.0 s"
    assert lines[1] == "timeline gw1: 1 tests, 1 files, busy 20.0 s, CPU 1.0 s, last test ended at 21.0 s"
    assert lines[3].split() == ["20.00", "1.00", "gw1", "b.py::t2"]
    assert timeline.summary([]) == ["timeline: no tests ran"]
