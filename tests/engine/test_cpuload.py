"""The load signal the held-out check reads (engine.measure.cpuload): the machine's busy time less
this process tree's own, in cores over an interval. A child that burns CPU is ours (a launched server
is part of the study), and what the counters say is turned into cores as planted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.measure import cpuload
from engine.measure.cpuload import CLK_TCK, CpuMark, others_cores, stall_share, tree_ticks

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc")


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
        while _own_ticks(child.pid) < 0.3 * CLK_TCK and time.monotonic() < deadline:
            time.sleep(0.05)
        burnt = _own_ticks(child.pid)
        assert burnt >= 0.3 * CLK_TCK
        assert tree_ticks(os.getpid()) - _own_ticks(os.getpid()) >= burnt
        assert burnt <= tree_ticks(child.pid) <= _own_ticks(child.pid)  # a tree of one (read in turn: it may still burn)
    finally:
        child.kill()
        child.wait()


def test_a_mark_reads_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real counters (the suite plants a quiet machine: undone here): this process's own CPU
    time shows in `ours` between two marks."""
    monkeypatch.undo()
    m0 = cpuload.mark()
    assert m0 is not None and m0.busy > 0 and m0.ours >= _own_ticks(os.getpid())
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    m1 = cpuload.mark()
    assert m1 is not None and m1.ours - m0.ours >= 0.1 * CLK_TCK and m1.at > m0.at
    assert others_cores(m0, m1) >= 0.0


def test_cores_and_stall_from_the_counters() -> None:
    """Busy ticks less ours over the interval's seconds: two seconds, both CPUs busy (4 s x CLK_TCK
    ticks), half a second of it ours -> 1.75 cores of others; never negative; the stall share from
    PSI's microseconds, None without PSI."""
    a = CpuMark(10.0, 0, 0, 1_000_000)
    b = CpuMark(12.0, 4 * CLK_TCK, CLK_TCK // 2, 2_000_000)
    assert others_cores(a, b) == pytest.approx(1.75, abs=1 / CLK_TCK)
    assert others_cores(a, CpuMark(12.0, 0, CLK_TCK, None)) == 0.0
    assert stall_share(a, b) == pytest.approx(0.5)
    assert stall_share(a, CpuMark(12.0, 0, 0, None)) is None
