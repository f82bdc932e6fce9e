"""Progress of draft-head training (answering prompts, then training steps) for people and logs.

On a terminal: rich progress bars with tokens/s, loss and ETA. Otherwise (CI logs, files, `kubectl
logs`): one line per 10% of a phase, and at least one every 30 s even while no report comes (one
slow batch of answers: engine.heartbeat prints the phase's last state), so long work is never silent.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from collections.abc import Iterator

from rich.console import Console

from engine.heartbeat import INTERVAL_S, Heartbeat

_LABEL = {"generate": "answering prompts", "fixed text": "reading fixed text", "train": "training head"}


def _info_text(phase: str, info: dict) -> str:
    parts = []
    if "tok_s" in info:
        parts.append(f"{info['tok_s']:.0f} tok/s")
    if "tokens" in info:
        parts.append(f"{info['tokens']} tokens")
    if "loss" in info:
        parts.append(f"loss {info['loss']:.3f} acc@1 {info.get('acc', 0):.2f}")
    if "val" in info:
        parts.append(f"val {info['val']:.3f}")
    return "  ".join(parts)


@contextmanager
def head_progress(quiet: bool = False, stream=None, *, interval: float = INTERVAL_S,
                  clock=time.monotonic, poll: float | None = None) -> Iterator:
    """Yield a report(phase, done, total, info) callable for engine.heads.drafts.ensure_draft.
    Redirected, a line comes at least every `interval` s (`clock`, `poll`: engine.heartbeat's;
    report.heartbeat is the Heartbeat)."""
    stream = stream or sys.stderr
    if quiet:
        yield lambda *a: None
        return
    if stream.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=Console(file=stream)) as bar:
            tasks: dict[str, int] = {}

            def report(phase: str, done: int, total: int, info: dict) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(_LABEL.get(phase, phase), total=total, info="", completed=0)
                bar.update(tasks[phase], completed=done, total=total, info=_info_text(phase, info))

            yield report
        return
    console = Console(file=stream, highlight=False, soft_wrap=True)
    last: dict[str, tuple[int, float]] = {}
    start: dict[str, float] = {}
    state: dict[str, object] = {}  # the latest report, for the heartbeat's line

    def line(phase: str, done: int, total: int, info: dict, now: float) -> str:
        return (f"{_LABEL.get(phase, phase)} {done}/{total}  {_info_text(phase, info)}  "
                f"{now - start[phase]:.0f} s")

    def describe() -> str:
        if not state:
            return f"preparing: still working, {hb.elapsed():.0f} s"
        now = clock()
        return line(state["phase"], state["done"], state["total"], state["info"], now) + "  (still working)"  # type: ignore[arg-type]

    def report(phase: str, done: int, total: int, info: dict) -> None:
        now = clock()
        start.setdefault(phase, now)
        state.update(phase=phase, done=done, total=total, info=dict(info))
        tenth, t_last = last.get(phase, (-1, 0.0))
        if 10 * done // max(total, 1) > tenth or now - t_last >= interval or done == total:
            last[phase] = (10 * done // max(total, 1), now)
            console.print(line(phase, done, total, info, now))
            hb.beat()

    with Heartbeat(describe, interval=interval, stream=stream, clock=clock, active=True, poll=poll) as hb:
        report.heartbeat = hb  # type: ignore[attr-defined]
        yield report
