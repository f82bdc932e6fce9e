"""Progress of draft-head training (answering prompts, then training steps) for people and logs.

On a terminal: rich progress bars with tokens/s, loss and ETA. Otherwise (CI logs, files): one line
per 10% of a phase or every 30 s, whichever comes first, so long work is never silent.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from collections.abc import Iterator

from rich.console import Console

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
def head_progress(quiet: bool = False, stream=None) -> Iterator:
    """Yield a report(phase, done, total, info) callable for engine.heads.pipeline.ensure_head."""
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

    def report(phase: str, done: int, total: int, info: dict) -> None:
        now = time.monotonic()
        start.setdefault(phase, now)
        tenth, t_last = last.get(phase, (-1, 0.0))
        if 10 * done // max(total, 1) > tenth or now - t_last >= 30 or done == total:
            last[phase] = (10 * done // max(total, 1), now)
            console.print(f"{_LABEL.get(phase, phase)} {done}/{total}  {_info_text(phase, info)}  "
                          f"{now - start[phase]:.0f} s")

    yield report
