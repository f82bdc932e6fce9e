"""What other processes take of this machine's CPUs over an interval, read from Linux's /proc: every
CPU's busy time (/proc/stat) less this process tree's own (/proc/<pid>/stat of this process and its
descendants). A timing taken while others were busy is not cached (engine.models.machine.timed_once),
and the held-out check measures more pairs (tuner.study.selection.heldout_check): a pass's timing tells
load from quiet poorly on a shared machine, what other processes ran is the load itself.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def tree_ticks(root: int) -> int:
    """Clock ticks (user and system) of process `root` and every live descendant (/proc/<pid>/stat)."""
    ticks: dict[int, int] = {}
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                rest = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):  # gone meanwhile
                continue
            parent[int(d)], ticks[int(d)] = int(rest[1]), int(rest[11]) + int(rest[12])
    total = 0
    for pid, t in ticks.items():
        p, up = pid, 0
        while p > 1 and p != root and up < 64:  # up the parents to `root` or to init
            p, up = parent.get(p, 0), up + 1
        total += t if p == root else 0
    return total


def busy_mark() -> tuple[float, float, float] | None:
    """Now on three clocks: wall seconds, the seconds the machine's CPUs have been busy (all of them,
    /proc/stat) and the CPU seconds of this process and its descendants (a launched server is this
    process's work); None where /proc/stat cannot be read. A descendant that ends between two marks
    takes its seconds out of the sum: the interval then reads more of other processes than there was."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle and iowait
    hz = os.sysconf("SC_CLK_TCK")
    return time.monotonic(), (sum(ticks) - idle) / hz, tree_ticks(os.getpid()) / hz


def others_cores(mark: tuple[float, float, float] | None) -> float | None:
    """How many cores, on average, other processes kept busy since `mark` (`busy_mark`); None where it
    cannot be told."""
    return _cores_since(mark)


def others_share(mark: tuple[float, float, float] | None) -> float | None:
    """The share of the machine's CPUs (0: none, 1: all of them) that other processes kept busy since
    `mark` (`busy_mark`); None where it cannot be told."""
    cores = _cores_since(mark)  # not through others_cores: the suite plants that one for the check alone
    return None if cores is None else min(cores / (os.cpu_count() or 1), 1.0)


def _cores_since(mark: tuple[float, float, float] | None) -> float | None:
    now = busy_mark()
    if mark is None or now is None or now[0] <= mark[0]:
        return None
    return max((now[1] - mark[1]) - (now[2] - mark[2]), 0.0) / (now[0] - mark[0])
