"""The step-cost curve adaptive speculation weighs drafts against (`spec.adaptive`): the seconds of
one target forward as a function of the sequences in it and the rows beyond one per sequence,
timed on this machine over the engine's own forward at start-up and cached like the linear plan
(engine.models.machine.measured_once, <cache>/step_cost.json); plus what the live engine adds:
the drafter's seconds per drafted node and the level of real steps (contexts longer than the
timed one read more keys), both followed online."""

from __future__ import annotations

import bisect
import os
import time
from typing import Any

import torch

from engine.models.machine import cache_root, cpu_signature, measured_once

CONTEXT = 256  # committed positions of each timed sequence
DENSE = 16  # every extra row count up to this one is timed
MAX_ROWS = 256  # the largest step timed; beyond it the last segment's slope extends the curve
ROUNDS = 2  # the fastest of this many timings after one warm-up call
FOLLOW = 0.1  # the share of each live observation in the online figures
CLIP_LOW, CLIP_HIGH = 0.5, 4.0  # a live step counts as taking between these multiples of the curve
VERSION = 3  # in the cache key: a change of what is timed measures again


def _envelope(pts: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """More rows never cost less: each point at most what any point of more rows took (another
    process stalling a timing only adds time, so the lower envelope is the machine's)."""
    out, low = [], float("inf")
    for x, s in reversed(pts):
        low = min(low, s)
        out.append((x, low))
    return out[::-1]


def batch_levels(max_batch: int) -> list[int]:
    """The batch sizes timed: powers of two below max_batch, and max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class StepCost:
    """`step_s(batch, extra)`: seconds of a target step over `batch` sequences with `extra` rows
    beyond one each; `draft_s`: seconds per drafted node."""

    def __init__(self, curves: dict[int, list[tuple[int, float]]], max_rows: int) -> None:
        self.curves = {b: _envelope(sorted(pts)) for b, pts in curves.items()}
        self.levels = sorted(self.curves)
        self.max_rows = max_rows  # rows per sequence the curve was timed up to
        self.draft_s = 0.0
        self.offset = 0.0  # live steps minus the curve (seconds), followed online

    def _at(self, batch: int, extra: float) -> float:
        pts = self.curves[batch]
        xs = [x for x, _ in pts]
        i = bisect.bisect_right(xs, extra) - 1
        if len(pts) == 1:
            return pts[0][1]
        i = min(max(i, 0), len(pts) - 2)
        (x0, y0), (x1, y1) = pts[i], pts[i + 1]
        return y0 + (y1 - y0) * (extra - x0) / (x1 - x0)

    def curve_s(self, batch: int, extra: float) -> float:
        """The timed curve alone, interpolated linearly in rows and between batch levels."""
        lv = self.levels
        if batch <= lv[0]:
            return self._at(lv[0], extra) * batch / lv[0]
        if batch >= lv[-1]:
            return self._at(lv[-1], extra) * batch / lv[-1] if batch > lv[-1] else self._at(lv[-1], extra)
        j = bisect.bisect_left(lv, batch)
        if lv[j] == batch:
            return self._at(batch, extra)
        b0, b1 = lv[j - 1], lv[j]
        w = (batch - b0) / (b1 - b0)
        return (1 - w) * self._at(b0, extra) + w * self._at(b1, extra)

    def step_s(self, batch: int, extra: float) -> float:
        """Expected seconds of a live step (the curve plus the followed offset, never below a tenth
        of the curve)."""
        c = self.curve_s(batch, extra)
        return max(c + self.offset, 0.1 * c)

    def observe_step(self, batch: int, extra: int, seconds: float) -> None:
        """A live step's time: the offset follows what it took beyond the curve (a step taken
        within [CLIP_LOW, CLIP_HIGH] x the curve: one stalled by another process says little)."""
        c = self.curve_s(batch, extra)
        self.offset += FOLLOW * (min(max(seconds, CLIP_LOW * c), CLIP_HIGH * c) - c - self.offset)

    def observe_draft(self, seconds: float, nodes: int) -> None:
        """A step's drafting time over the nodes it drafted."""
        if nodes > 0:
            self.draft_s += FOLLOW * (seconds / nodes - self.draft_s)

    def to_json(self) -> dict[str, Any]:
        return {"max_rows": self.max_rows, "ms": {str(b): [[x, round(s * 1e3, 4)] for x, s in pts]
                                                  for b, pts in self.curves.items()}}

    @classmethod
    def from_json(cls, got: dict[str, Any]) -> "StepCost":
        return cls({int(b): [(int(x), ms / 1e3) for x, ms in pts] for b, pts in got["ms"].items()}, got["max_rows"])


def extras_timed(batch: int, max_rows: int) -> list[int]:
    """The extra rows timed at a batch size: every count up to DENSE (a few-row kernel runs rows in
    passes, so its cost is a staircase whose first steps a coarse grid would smooth away), then
    2^i and 2^i + 1 (each side of a pass boundary) up to batch x (max_rows - 1) or MAX_ROWS."""
    top = min(batch * (max_rows - 1), MAX_ROWS - batch)
    xs = set(range(min(DENSE, top) + 1)) | {top}
    p = DENSE
    while p < top:
        xs |= {p, p + 1}
        p *= 2
    return sorted(x for x in xs if x <= top)


def time_steps(forward: Any, max_batch: int, max_rows: int) -> StepCost:
    """Time `forward.step_batch` over batch_levels(max_batch) sequences of CONTEXT committed
    positions, the extra rows (`extras_timed`) spread over them, on a pool of its own."""
    curves: dict[int, list[tuple[int, float]]] = {}
    with torch.inference_mode():
        pool = forward.pool(max_batch, CONTEXT + max_rows)
        caches = [pool.acquire(CONTEXT + max_rows) for _ in range(max_batch)]
        for b in batch_levels(max_batch):
            pts = []
            for x in extras_timed(b, max_rows):
                rows = [[1] * (1 + x // b + (i < x % b)) for i in range(b)]
                best = float("inf")
                for i in range(ROUNDS + 1):
                    for c in caches[:b]:
                        c.length = CONTEXT  # the pool is zeroed: attention over zeros costs what it would
                    t = time.perf_counter()
                    forward.step_batch(caches[:b], rows, [None] * b, [None] * b, [False] * b)
                    if i:
                        best = min(best, time.perf_counter() - t)
                pts.append((x, best))
            curves[b] = pts
        for c in caches:
            pool.release(c)
    return StepCost(curves, max_rows)


def step_cost(forward: Any, max_batch: int, max_rows: int, signature: str,
              cache_dir: str | os.PathLike | None = None) -> StepCost:
    """This machine's step-cost curve for a forward (`signature`: the model, its weights and the
    forward's form), timed once and cached in <cache>/step_cost.json (a few seconds on a small model)."""
    key = f"{cpu_signature()}|torch {torch.__version__}|{signature}|b{max_batch}|r{max_rows}|ctx {CONTEXT}|v{VERSION}"
    got = measured_once(cache_root(cache_dir) / "step_cost.json", key,
                        lambda old: time_steps(forward, max_batch, max_rows).to_json())
    return StepCost.from_json(got)
