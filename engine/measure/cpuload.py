"""What the rest of the machine takes of its CPUs while we measure: the load signal that sizes the
held-out check (tuner.study.selection.heldout_check). Read from Linux's /proc over an interval:
every CPU's busy time (/proc/stat) less this process tree's own (/proc/<pid>/stat of this process
and its descendants: a launched server is ours), in cores. The kernel's CPU pressure
(/proc/pressure/cpu, `some`: the share of the time some runnable task waited for a CPU) is read
beside it and recorded only: it counts this process's own threads waiting for each other too.

A pass's timing tells load from quiet poorly on a shared machine (a pair's noise and a prompt's
timing noise read alike quiet and loaded: docs/results.md, issue 39); what other processes ran is
the load itself. A descendant that ends within an interval takes its time out of the tree's sum,
so the interval reads more load than there was (the check starts no process while it measures).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuMark:
    """The machine's CPU counters at one moment."""

    at: float  # time.monotonic()
    busy: int  # clock ticks every CPU spent busy (not idle, not waiting for I/O)
    ours: int  # clock ticks this process and its descendants ran (user and system)
    stall_us: int | None  # /proc/pressure/cpu `some` total (microseconds); None where the kernel has none


def _busy_ticks() -> int:
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    # cpu user nice system idle iowait irq softirq steal (guest time is inside user already)
    v = [int(x) for x in fields[1:9]]
    return sum(v) - v[3] - v[4]


def tree_ticks(root: int) -> int:
    """Clock ticks (utime + stime) of `root` and every live descendant."""
    ticks: dict[int, int] = {}
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            rest = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        pid = int(d)
        parent[pid], ticks[pid] = int(rest[1]), int(rest[11]) + int(rest[12])
    total = 0
    for pid, t in ticks.items():
        p, seen = pid, 0
        while p > 1 and p != root and seen < 64:  # up the parents to the root or to init
            p, seen = parent.get(p, 0), seen + 1
        if p == root:
            total += t
    return total


def _stall_us() -> int | None:
    try:
        line = Path("/proc/pressure/cpu").read_text().split("\n", 1)[0]
    except OSError:
        return None
    return int(line.rsplit("total=", 1)[1]) if line.startswith("some") and "total=" in line else None


def mark() -> CpuMark | None:
    """The counters now; None where /proc/stat cannot be read (not Linux)."""
    try:
        busy = _busy_ticks()
    except (OSError, ValueError, IndexError):
        return None
    return CpuMark(time.monotonic(), busy, tree_ticks(os.getpid()), _stall_us())


def others_cores(a: CpuMark, b: CpuMark) -> float:
    """How many cores, on average, processes outside this process tree kept busy from `a` to `b`."""
    dt = b.at - a.at
    if dt <= 0:
        return 0.0
    return max(0.0, ((b.busy - a.busy) - (b.ours - a.ours)) / CLK_TCK / dt)


def stall_share(a: CpuMark, b: CpuMark) -> float | None:
    """The share of the time from `a` to `b` some runnable task waited for a CPU (None without PSI)."""
    if a.stall_us is None or b.stall_us is None or b.at <= a.at:
        return None
    return (b.stall_us - a.stall_us) / 1e6 / (b.at - a.at)
