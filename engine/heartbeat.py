"""A plain line at least every 30 s while long work runs with its output redirected.

Rich's live displays redraw in place on a terminal and print nothing useful when stderr is a file,
a CI log or `kubectl logs`; a step that reports rarely (one slow batch, one long trial, a model
conversion) would then be silent for minutes. `Heartbeat` prints `describe()` on its own thread
whenever `interval` seconds passed since the last line (its own, or one the caller reported with
`beat()`), and nothing at all on a terminal. The clock is a parameter so tests need not wait.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

INTERVAL_S = 30.0


def redirected(stream: TextIO | None = None) -> bool:
    """True when `stream` (default stderr) is no terminal: a file, a pipe, a CI or pod log."""
    stream = stream or sys.stderr
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):  # closed or a stream without isatty
        return True


class Heartbeat:
    """Context manager: while inside, print `describe()` to `stream` when `interval` s passed
    without a line. `active` defaults to redirected(stream): on a terminal it does nothing."""

    def __init__(self, describe: Callable[[], str], *, interval: float = INTERVAL_S, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, active: bool | None = None,
                 poll: float | None = None) -> None:
        self.describe = describe
        self.interval = interval
        self.stream = stream
        self.clock = clock
        self.active = redirected(stream) if active is None else active
        self.poll = min(1.0, interval / 4) if poll is None else poll
        self.start = self.last = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def beat(self) -> None:
        """The caller just printed a line: the next heartbeat is due `interval` s from now."""
        with self._lock:
            self.last = self.clock()

    def tick(self) -> bool:
        """Print a line if one is due (True when it did); the thread calls this every `poll` s."""
        with self._lock:
            now = self.clock()
            if not self.active or now - self.last < self.interval:
                return False
        try:
            text = self.describe()  # may read `last`: the time of the previous line
        except Exception as exc:  # a progress line must never break the work it reports on
            text = f"still working ({type(exc).__name__} describing progress)"
        with self._lock:
            self.last = now
        stream = self.stream or sys.stderr
        try:
            print(text, file=stream, flush=True)
        except (OSError, ValueError):
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self.tick()

    def __enter__(self) -> "Heartbeat":
        self.start = self.last = self.clock()
        if self.active:
            self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def still_working(label: str, **kw: Any) -> Heartbeat:
    """A heartbeat for one long step with no progress of its own: '<label>: still working, 90 s'."""
    hb: Heartbeat

    def describe() -> str:
        return f"{label}: still working, {hb.elapsed():.0f} s"

    hb = Heartbeat(describe, **kw)
    return hb
