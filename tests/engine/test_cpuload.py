"""The load signal (engine.models.cpuload): the machine's busy time less this process tree's own, in
cores over an interval. A child that burns CPU is ours (a launched server is part of the study); the
arithmetic on planted counters: tests/engine/test_machine.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.models import cpuload

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc")
HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _own_ticks(pid: int) -> int:
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])


def test_a_child_that_burns_cpu_counts_as_ours() -> None:
    """A child process (a launched server, say) is in this process tree: its ticks are in
    tree_ticks(ours), so its CPU is never read as another process's load. A planted fault, the
    process alone without its descendants, misses them."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.4: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while _own_ticks(child.pid) < 0.3 * HZ and time.monotonic() < deadline:
            time.sleep(0.05)
        burnt = _own_ticks(child.pid)
        assert burnt >= 0.3 * HZ
        assert cpuload.tree_ticks(os.getpid()) - _own_ticks(os.getpid()) >= burnt
        assert burnt <= cpuload.tree_ticks(child.pid) <= _own_ticks(child.pid)  # a tree of one, read in turn
    finally:
        child.kill()
        child.wait()


def test_the_real_counters_show_this_process_as_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite plants a quiet machine (undone here): this process's CPU time between two marks is in
    its own clock, and the reading of others is a number of cores, never negative."""
    monkeypatch.undo()
    m0 = cpuload.busy_mark()
    assert m0 is not None and m0[1] > 0
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    m1 = cpuload.busy_mark()
    assert m1 is not None and m1[2] - m0[2] >= 0.1 and m1[0] > m0[0]
    got = cpuload.others_cores(m0)
    assert got is not None and 0.0 <= got <= (os.cpu_count() or 1) + 0.5


STAT = """cpu  900 0 90 900 10 0 0 9 0 0
cpu0 100 0 10 300 5 0 0 1 0 0
cpu1 200 0 20 300 5 0 0 2 0 0
cpu2 300 0 30 150 0 0 0 3 0 0
cpu3 300 0 30 150 0 0 0 3 0 0
intr 12345 0 0
ctxt 999
"""


def test_only_the_cpus_this_process_may_run_on_are_read() -> None:
    """Pinned to CPUs 0 and 1 (a container's cpuset, a taskset), the busy time is theirs alone: user,
    system and steal, not idle or iowait, and never the summary line or another core's. Planted faults:
    reading the summary `cpu` line (every core) or every `cpuN` line both give 999, not 333."""
    assert cpuload.busy_ticks(STAT, {0, 1}) == (100 + 10 + 1) + (200 + 20 + 2)
    assert cpuload.busy_ticks(STAT, {2}) == 333
    assert cpuload.busy_ticks(STAT, {0, 1, 2, 3}) == 999  # every core: the summary line's busy time
    assert cpuload.busy_ticks(STAT, set()) == 0


def test_the_reading_follows_this_process_affinity() -> None:
    """busy_mark reads the CPUs os.sched_getaffinity names (all the machine's where it is not pinned)."""
    assert cpuload.cpus() == set(os.sched_getaffinity(0))
    mark = cpuload.busy_mark()
    assert mark is not None
    stat = Path("/proc/stat").read_text()
    hz = os.sysconf("SC_CLK_TCK")
    assert mark[1] <= cpuload.busy_ticks(stat, cpuload.cpus()) / hz + 1e-9  # counters only grow
