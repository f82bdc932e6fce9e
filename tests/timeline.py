"""`pytest --timeline PATH`: where the suite's time goes, per test and per xdist worker.

Each test appends one CSV row to PATH from the process that ran it: the worker (`gw0`, `gw1`, or
`main` without xdist), its file and name, when it started (unix seconds), its wall seconds (setup,
call and teardown) and its CPU seconds (user + system of that process and of the children it reaped:
tuner workers, vLLM servers, compilers). At the end the controller prints each worker's share: tests,
busy seconds, CPU seconds and when its last test ended, so an unbalanced run (one worker idle while
the other finishes a long file) shows, and the slowest tests with their CPU beside their wall (a test
whose wall far exceeds its CPU is waiting: a grace period, a sleep, a server's start-up).
Loaded for the suite by tests/conftest.py; elsewhere `-p timeline` (tests/ is on pytest's path).
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Generator
from pathlib import Path

import pytest

FIELDS = ("worker", "file", "test", "start", "wall_s", "cpu_s")
TOP = 15  # slowest tests listed in the summary


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--timeline", metavar="PATH", default=None,
                     help="append one CSV row per test (worker, file, test, start, wall_s, cpu_s) to PATH "
                          "and print each xdist worker's share at the end")


def _path(config: pytest.Config) -> Path | None:
    value = config.getoption("timeline", None)
    return Path(value).resolve() if value else None


def _worker(config: pytest.Config) -> str | None:
    """The xdist worker's name (its config's `workerinput`, not the environment a nested pytest inherits)."""
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else str(workerinput["workerid"])


def pytest_configure(config: pytest.Config) -> None:
    """The controller (or the lone process) starts PATH with its header; xdist workers only append."""
    path = _path(config)
    if path is not None and _worker(config) is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            csv.writer(f).writerow(FIELDS)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    path = _path(item.config)
    if path is None:
        return (yield)
    start, t0, cpu0 = time.time(), time.perf_counter(), _cpu()
    result = yield
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    file = os.path.relpath(item.path, item.config.rootpath)
    row = [_worker(item.config) or "main", file, item.name, f"{start:.3f}", f"{wall:.3f}", f"{cpu:.3f}"]
    # one short line a write: appends from both workers do not interleave
    with path.open("a", newline="") as f:
        csv.writer(f).writerow(row)
    return result


def read(path: Path) -> list[dict[str, str]]:
    """The rows of a timeline file."""
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def summary(rows: list[dict[str, str]]) -> list[str]:
    """Each worker's tests, busy and CPU seconds and when its last test ended (seconds after the
    first test started), then the slowest tests, wall and CPU."""
    if not rows:
        return ["timeline: no tests ran"]
    t0 = min(float(r["start"]) for r in rows)
    lines = []
    for worker in sorted({r["worker"] for r in rows}):
        mine = [r for r in rows if r["worker"] == worker]
        busy = sum(float(r["wall_s"]) for r in mine)
        cpu = sum(float(r["cpu_s"]) for r in mine)
        end = max(float(r["start"]) + float(r["wall_s"]) for r in mine) - t0
        lines.append(f"timeline {worker}: {len(mine)} tests, {len({r['file'] for r in mine})} files, busy {busy:.1f} s, "
                     f"CPU {cpu:.1f} s, last test ended at {end:.1f} s")
    lines.append(f"slowest {TOP} tests (wall / CPU seconds, worker):")
    for r in sorted(rows, key=lambda r: -float(r["wall_s"]))[:TOP]:
        lines.append(f"  {float(r['wall_s']):8.2f} {float(r['cpu_s']):8.2f}  {r['worker']}  {r['file']}::{r['test']}")
    return lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    path = _path(config)
    if path is None or _worker(config) is not None or not path.is_file():
        return
    terminalreporter.section("timeline")
    for line in summary(read(path)):
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"rows: {path}")
