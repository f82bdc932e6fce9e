"""What other processes take of this machine's CPUs over an interval, read from Linux's /proc: the busy
time (/proc/stat) of the CPUs this process may run on (its affinity: a container's cpuset, a `taskset`;
load on a big host's other cores does not slow it) less this process tree's own (/proc/<pid>/stat of this process and its
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
    """Now on three clocks: wall seconds, the seconds this process's CPUs have been busy (`cpus`,
    /proc/stat) and the CPU seconds of this process and its descendants (a launched server is this
    process's work); None where /proc/stat cannot be read. A descendant that ends between two marks
    takes its seconds out of the sum: the interval then reads more of other processes than there was."""
    try:
        busy = busy_ticks(Path("/proc/stat").read_text(), cpus())
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy / hz, tree_ticks(os.getpid()) / hz


def cpus() -> set[int]:
    """The CPUs this process may run on (its affinity), where the OS tells; else all of them."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def busy_ticks(stat: str, among: set[int]) -> int:
    """Clock ticks the CPUs `among` have been busy (user, nice, system, irq, softirq and steal: all but
    idle and iowait), from the per-CPU lines (`cpuN ...`) of /proc/stat's text `stat`."""
    total = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in among:
            ticks = [int(x) for x in rest.split()[:8]]
            total += sum(ticks) - ticks[3] - ticks[4]
    return total


def others_cores(mark: tuple[float, float, float] | None) -> float | None:
    """How many cores, on average, other processes kept busy since `mark` (`busy_mark`); None where it
    cannot be told."""
    return _cores_since(mark)


def others_share(mark: tuple[float, float, float] | None) -> float | None:
    """The share of the machine's CPUs (0: none, 1: all of them) that other processes kept busy since
    `mark` (`busy_mark`); None where it cannot be told."""
    cores = _cores_since(mark)  # not through others_cores: the suite plants that one for the check alone
    return None if cores is None else min(cores / len(cpus()), 1.0)


def _cores_since(mark: tuple[float, float, float] | None) -> float | None:
    now = busy_mark()
    if mark is None or now is None or now[0] <= mark[0]:
        return None
    return max((now[1] - mark[1]) - (now[2] - mark[2]), 0.0) / (now[0] - mark[0])
