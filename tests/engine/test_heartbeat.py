"""engine.heartbeat: a plain line at least every interval while long work runs redirected (issue 24.5b)."""

from __future__ import annotations

import io
import time

from engine.heartbeat import Heartbeat, redirected, still_working


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_is_due_every_interval_unless_the_caller_printed_one() -> None:
    clock, out = Clock(), io.StringIO()
    hb = Heartbeat(lambda: f"working {hb.elapsed():.0f} s", interval=30, stream=out, clock=clock, poll=3600)
    with hb:
        clock.t += 29
        assert not hb.tick()
        clock.t += 1
        assert hb.tick() and not hb.tick()  # printed at 30 s; the next is due at 60 s
        clock.t += 20
        hb.beat()  # the caller printed a line of its own at 50 s
        clock.t += 29
        assert not hb.tick()
        clock.t += 1
        assert hb.tick()
    assert out.getvalue().splitlines() == ["working 30 s", "working 80 s"]


def test_a_terminal_gets_no_heartbeat_and_redirected_output_does() -> None:
    assert redirected(io.StringIO()) and not redirected(Tty())
    clock, tty = Clock(), Tty()
    with Heartbeat(lambda: "x", interval=1, stream=tty, clock=clock, poll=3600) as hb:
        clock.t += 100
        assert not hb.tick()
    assert tty.getvalue() == ""


def test_the_thread_prints_while_the_work_is_silent() -> None:
    out = io.StringIO()
    with still_working("converting model.gguf", interval=0.05, stream=out, poll=0.01):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and all(ln.startswith("converting model.gguf: still working, ") for ln in lines)
    n = len(lines)
    time.sleep(0.1)
    assert len(out.getvalue().splitlines()) == n  # stopped with the step
