"""The step-cost curve adaptive speculation weighs drafts against (`spec.adaptive`): the seconds of
one target forward as a function of the sequences in it and the rows beyond one per sequence,
timed on this machine over the engine's own forward at start-up and cached like the linear plan
(engine.models.machine.measured_once, <cache>/step_cost.json; never a curve timed while other
processes kept the CPUs busy, `engine.models.machine.timed_once`); plus what the live engine learns
from the steps it actually runs: the drafter's seconds per drafted node and, per batch size, what a
step without drafts and each further row really cost against the curve, and what a step spends
outside the forward and the drafting: every step (`overhead_s`), and apart, what one that ran draft
rows spent beyond one the controller priced and left without (`setup_s`: the cut, the trees'
verification, the estimates' updates, timed in the engine's thread), a fixed cost of drafting at all
that rows do not scale.

The curve was timed once, at other contexts, perhaps under another load: the live figures, not the
curve, price a step. Per batch size the live steps fit t = c0 (a + b m) by least squares (c0: the
curve's step without extra rows, m: the curve's cost of the extra rows over c0), the slope b held
towards 1 until the steps run spread their rows enough to say otherwise: a served step runs slower
than the curve by a share of the step, not of its rows (the server's threads share the cores with
the forward: served over HTTP, steps without rows ran well over the curve while the draft rows
run most often cost about the curve's rows over them, not that level times them; docs/results.md,
adaptive speculation). A batch size that has not run takes the live level of
all steps (each step's seconds less the curve's rows, over c0) for its step and the curve for its
rows; a batch size whose drafts cost more than the curve said learns it from the steps that
drafted.

The fit prices every row alike, at no less than the curve's average row over a window of at least
as many rows as the batch has sequences (the lower envelope has flat stretches that are not the
machine's: at the largest batch it timed a stretch of rows as nearly free, while the static chains'
steps there cost about the curve's average row over as many rows as sequences): the average from
no rows to the first count timed at or beyond the priced one and the batch. Not a fixed window:
at a batch of one or two the few-row kernel's staircase is real, its first rows nearly free, and
a window of DENSE rows priced a request's few-node draft well above what the curve (and the
static chains' steps) said. Not the average over every count timed: at a large batch the forward
turns compute-bound within the timed range, its rows dearer there, and a few rows priced at the
whole range's average cost more than the curve measured them at. The first few rows of a step
often cost well under that average at small batches (docs/results.md, adaptive speculation), and
a price above their real cost keeps the drafts that would pay there from ever running. So each
batch size also keeps a live table of the forward's seconds per count of draft rows (up to ROWS_LIVE), filled by the steps that ran with that many rows (the
controller's choices and its probes, engine.decode.control): where a count was seen, the price of
its rows over the step without rows moves from the fit's towards the table's, by the weight of
its observations (ROWS_SEEN observations weigh as much as the fit; they fade as the batch size's
steps go by without that count, at the online figures' rate), and so does the price of the
step without rows. A count never run keeps the
fit's price; `table(..., optimistic=True)` prices rows at no more than the curve's average row,
what the probes weigh to decide whether a row could pay and so be
measured."""

from __future__ import annotations

import bisect
import os
import time
from collections import deque
from typing import Any

import torch

from engine.models.machine import cache_root, cpu_signature, timed_once

CONTEXT = 256  # committed positions of each timed sequence
DENSE = 16  # every extra row count up to this one is timed
MAX_ROWS = 256  # the largest step timed; beyond it the last segment's slope extends the curve
ROUNDS = 3  # the fastest of this many timings of each point, taken in passes over all points
FOLLOW = 0.05  # the share of each live observation in the online figures (about the last 20 steps)
CLIP_LOW, CLIP_HIGH = 0.25, 4.0  # a live step counts as taking between these multiples of the curve
# the ridge towards the prior slope: live steps whose m / c0 vary this much (variance) weigh as much
# as the prior (a batch size whose steps all have the same rows leaves the slope at the prior; a
# weaker prior let one stalled step among steps without rows set the slope several times the curve's)
PRIOR_VAR = 0.01
LOW_SLOPE = 0.5  # the slope never falls below this share of the prior (a few lucky steps are noise)
STEP_CLIP = (0.5, 2.0)  # a live step counts as taking between these multiples of what was expected of it
ROWS_LIVE = 32  # draft-row counts up to this have a live table entry per batch size
ROWS_SEEN = 8  # a live entry of this many observations weighs as much as the fit's price of its rows
VERSION = 4  # in the cache key: a change of what is timed measures again


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


class _Live:
    """One batch size's live steps, exponentially weighted: sums of 1, m, t, m^2 and m t, where m
    and t are the curve's extra-row cost and the step's seconds, both over the curve's c0; and the
    m of its last 1 / FOLLOW steps (`top`: the most rows its recent steps ran)."""

    def __init__(self) -> None:
        self.w = self.m = self.t = self.mm = self.mt = 0.0
        self.recent: deque[float] = deque(maxlen=round(1 / FOLLOW))

    def add(self, m: float, t: float) -> None:
        k = 1 - FOLLOW
        self.w, self.m, self.t = k * self.w + FOLLOW, k * self.m + FOLLOW * m, k * self.t + FOLLOW * t
        self.mm, self.mt = k * self.mm + FOLLOW * m * m, k * self.mt + FOLLOW * m * t
        self.recent.append(m)

    @property
    def top(self) -> float:
        """The largest m of the last 1 / FOLLOW steps: beyond it the fit's slope is older steps' word."""
        return max(self.recent, default=0.0)

    def fit(self, slope0: float) -> tuple[float, float]:
        """(a, b) of t = a + b m: least squares, b ridged towards slope0 and at least LOW_SLOPE x it."""
        mean_m, mean_t = self.m / self.w, self.t / self.w
        var = max(self.mm / self.w - mean_m ** 2, 0.0)
        cov = self.mt / self.w - mean_m * mean_t
        b = max((cov + PRIOR_VAR * slope0) / (var + PRIOR_VAR), LOW_SLOPE * slope0)
        return mean_t - b * mean_m, b


class _Rows:
    """One batch size's live forward seconds per count of draft rows (0..ROWS_LIVE): each count's
    mean over its own steps (the last 1 / FOLLOW of them once it has that many), its count, and
    when it last ran (in this batch size's steps). A count's observations weigh less the longer it
    has not run, at the rate the online figures forget (1 - FOLLOW a step): a count priced dear by
    a few stalled steps is rarely chosen again, so its mean is rarely re-timed, and without the
    fading it kept that price for good."""

    def __init__(self) -> None:
        self.t = [0.0] * (ROWS_LIVE + 1)
        self.n = [0] * (ROWS_LIVE + 1)
        self.last = [0] * (ROWS_LIVE + 1)
        self.clock = 0  # the steps observed at this batch size

    def add(self, rows: int, seconds: float) -> None:
        self.clock += 1
        if 0 <= rows <= ROWS_LIVE:
            self.n[rows] += 1
            self.last[rows] = self.clock
            self.t[rows] += max(1 / self.n[rows], FOLLOW) * (seconds - self.t[rows])

    def seen(self, rows: int) -> float:
        """The observations of `rows` draft rows, faded by the steps since that count last ran."""
        return self.n[rows] * (1 - FOLLOW) ** (self.clock - self.last[rows])

    def base(self, fit: float) -> float:
        """The seconds of a step without draft rows: `fit` moved towards the table's by the weight of
        its observations."""
        seen = self.seen(0)
        w = seen / (seen + ROWS_SEEN)
        return (1 - w) * fit + w * self.t[0]

    def price(self, rows: int, fit: float) -> float:
        """The seconds of `rows` draft rows over a step without any: `fit` (the fit's) moved towards
        the table's difference by the weight of the fewer observations of the two counts."""
        if rows > ROWS_LIVE or not self.n[rows] or not self.n[0]:
            return fit
        seen = min(self.seen(rows), self.seen(0))
        w = seen / (seen + ROWS_SEEN)
        return (1 - w) * fit + w * max(self.t[rows] - self.t[0], 0.0)


class StepCost:
    """`step_s(batch, extra)`: seconds of a target step over `batch` sequences with `extra` rows
    beyond one each, as the live steps say (the curve where none ran yet); `draft_s`: seconds per
    drafted node."""

    def __init__(self, curves: dict[int, list[tuple[int, float]]], max_rows: int) -> None:
        self.curves = {b: _envelope(sorted(pts)) for b, pts in curves.items()}
        self._xs = {b: [x for x, _ in pts] for b, pts in self.curves.items()}  # each level's row counts
        self.levels = sorted(self.curves)
        self.max_rows = max_rows  # rows per sequence the curve was timed up to
        self.draft_s = 0.0
        self.level = 1.0  # live steps less the curve's rows over the curve's step, all batch sizes, followed online
        self.live: dict[int, _Live] = {}
        self.rows: dict[int, _Rows] = {}  # per batch size: the forward's seconds per count of draft rows
        # the curve is fixed once timed: its interpolations are read several times a step (every
        # priced total, every observed step, every overhead), so each (batch, rows) is computed once:
        # the step, and the rows' seconds (rows_s) with the curve's average rows (`_slope`) beside them
        self._curve_memo: dict[tuple[int, float], float] = {}
        self._rows_memo: dict[tuple[int, float], tuple[float, float]] = {}
        # per batch size, the seconds of a step outside the forward and the drafting (verifying,
        # committing, streaming, the server's loop): what every step costs whatever its rows
        self.overhead: dict[int, float] = {}
        # the same per batch size over the steps the controller priced in full, apart: those that ran
        # no draft row (`plain`) and those that ran some (`drafting`: their drafts cut, verified as
        # trees and learnt from)
        self.plain: dict[int, float] = {}
        self.drafting: dict[int, float] = {}
        # per batch size and kind of priced step (ran draft rows or not), the engine's own seconds
        # verifying, committing, learning and cutting, timed in its thread (`observe_work`): their
        # difference is what drafting at all adds to a step (`setup_s`). Taken from the wall
        # overheads above instead, it moved between runs of a served batch by several times
        # itself (the server's own threads share the cores, so a step's wall overhead varies by
        # more than drafting adds, and the few drafting steps where drafts barely pay set it),
        # while in process the work timed here is the wall difference (docs/results.md, issue 36)
        self.work: dict[bool, dict[int, float]] = {False: {}, True: {}}
        # per batch size, the controller's own seconds pricing a step in full (the estimates' gains,
        # every total of rows, the choice, the probe): part of both kinds above, and of drafting's
        # cost, since a step screened out below the pay floor (the way the engine runs as off does)
        # pays none of it (`pricing_s`)
        self.pricing: dict[int, float] = {}

    def _at(self, batch: int, extra: float) -> float:
        pts = self.curves[batch]
        xs = self._xs[batch]
        i = bisect.bisect_right(xs, extra) - 1
        if len(pts) == 1:
            return pts[0][1]
        i = min(max(i, 0), len(pts) - 2)
        (x0, y0), (x1, y1) = pts[i], pts[i + 1]
        return y0 + (y1 - y0) * (extra - x0) / (x1 - x0)

    def curve_s(self, batch: int, extra: float) -> float:
        """The timed curve alone, interpolated linearly in rows and, between batch levels, at the
        same total of rows (`_curve_s`)."""
        got = self._curve_memo.get((batch, extra))
        if got is None:
            got = self._curve_memo[(batch, extra)] = self._curve_s(batch, extra)
        return got

    def _curve_s(self, batch: int, extra: float) -> float:
        lv = self.levels
        if batch <= lv[0]:
            return self._at(lv[0], extra) * batch / lv[0]
        if batch >= lv[-1]:
            return self._at(lv[-1], extra) * batch / lv[-1] if batch > lv[-1] else self._at(lv[-1], extra)
        j = bisect.bisect_left(lv, batch)
        if lv[j] == batch:
            return self._at(batch, extra)
        # between two levels, at the same total of rows: a forward's seconds follow its total rows
        # (the few-row kernel reads the weights once per pass of rows, so the step jumps where the
        # total crosses a pass, whatever the sequences), plus a little per sequence. Blended at the
        # same extra rows instead, batch 7 with 2 draft rows (9 rows: a pass more than 8) was priced
        # at half what it ran at and 1 row (8 rows: no pass more) at more (docs/results.md, issue 36)
        b0, b1 = lv[j - 1], lv[j]
        w = (batch - b0) / (b1 - b0)
        total = batch + extra
        low = self._at(b0, total - b0)
        # what the upper level's sequences add at the same total; where the total is below the
        # upper level's sequences, what they add at its step without rows
        more = (self._at(b1, total - b1) - low if total >= b1
                else self._at(b1, 0) - self._at(b0, b1 - b0))
        return low + w * more

    def rows_s(self, batch: int, extra: float) -> float:
        """The curve's seconds for `extra` rows beyond the step without them, at least the curve's
        average per row over the window that holds them (`_slope`). The staircase of a few-row
        kernel is real at small batches, but a flat stretch that the lower envelope made of
        noisy timings is not: at batch 32 it priced a few draft rows as free, where every row
        costs about what a token yields, and the drafts cost more than they gained."""
        return self._rows(batch, extra)[0]

    def _rows(self, batch: int, extra: float) -> tuple[float, float]:
        """(`rows_s`, the curve's average row times `extra`), computed once per (batch, extra)."""
        got = self._rows_memo.get((batch, extra))
        if got is None:
            c0 = self.curve_s(batch, 0)
            avg = self._slope(batch, c0, extra) * extra
            got = self._rows_memo[(batch, extra)] = (max(self.curve_s(batch, extra) - c0, avg), avg)
        return got

    def _slope(self, batch: int, c0: float, extra: float) -> float:
        """The curve's average seconds per extra row from none to the first count it timed at this
        batch size (its level's, the level below where it was not timed) at or beyond both `extra`
        and `batch` (the last count timed where none is)."""
        lv = self.levels
        xs = self._xs[max([b for b in lv if b <= batch] or lv[:1])]
        top = xs[min(bisect.bisect_left(xs, max(extra, batch)), len(xs) - 1)]
        return (self.curve_s(batch, top) - c0) / top if top > 0 else 0.0

    def step_s(self, batch: int, extra: float) -> float:
        """Expected seconds of a live step: the batch size's fit of its live steps on the curve
        (engine.decode.stepcost); where that batch size has not run, the curve's step without rows
        times the live level, plus the curve's rows."""
        return self._forward_s(batch, extra, 0)[0]

    def _forward_s(self, batch: int, extra: float, count: int, optimistic: bool = False) -> list[float]:
        """`step_s(batch, extra + n)` for n = 0..count, the fit computed once (`optimistic`: each
        total's rows priced at no more than the average row)."""
        c0 = self.curve_s(batch, 0)
        live = self.live.get(batch)
        a, b = live.fit(1.0) if live is not None else (self.level, 1.0)
        # beyond the most rows the recent live steps ran, each further row costs the curve's
        # increment. The fit's weights fade per step observed at its batch size: a batch size first
        # met with confident estimates drafted many rows there, and where those ran slow their slope
        # priced eight rows at three times the curve long after (docs/results.md, session 34: code
        # at 8). Its screened steps, timed as steps without rows (engine.decode.batch), now fade
        # that slope within a pass; observed alone, its few probe steps took a dozen passes
        top = c0 * (live.top if live is not None else 0.0)
        fit_base = c0 * max(a, 0.1)
        table = self.rows.get(batch)
        base = table.base(fit_base) if table is not None else fit_base
        out = []
        for n in range(count + 1):
            x = extra + n
            m, avg = self._rows(batch, x)
            seen = min(m, top)
            rows = c0 * max(a + b * seen / c0, 0.1) - fit_base + (m - seen)
            if table is not None and x == int(x):  # only whole counts of rows ran
                rows = table.price(int(x), rows)
            if optimistic:  # the curve's average row: the fit's slope may be one stall's
                rows = min(rows, avg)
            out.append(base + max(rows, 0.0))
        return out

    def table(self, batch: int, extra: float, count: int, optimistic: bool = False) -> list[float]:
        """Seconds of a whole step with n = 0..count draft rows: `step_s(batch, extra + n)` (the fit
        computed once) plus the step's overhead beyond the forward: a priced step's without draft
        rows (`overhead_s` until one was seen) less its pricing (a step that is not priced, screened
        out below the pay floor, pays none), and for n >= 1 what drafting at all adds to that
        (`setup_s`, the pricing included). What the controller reads for every total of rows it weighs (a few hundred per
        step at batch 32). `optimistic`: no total's rows priced above the average row (what the
        probes weigh)."""
        plain = _nearest(self.plain, batch)
        over = max((plain if plain is not None else self.overhead_s(batch)) - self.pricing_s(batch), 0.0)
        setup = self.setup_s(batch)
        forward = self._forward_s(batch, extra, count, optimistic)
        return [over + t + (setup if n else 0.0) for n, t in enumerate(forward)]

    def overhead_s(self, batch: int) -> float:
        """A step's seconds outside the forward and the drafting at this batch size (the nearest
        batch size observed where this one was not; 0 before any step was)."""
        got = _nearest(self.overhead, batch)
        return 0.0 if got is None else got

    def pricing_s(self, batch: int) -> float:
        """The controller's own seconds pricing a step in full at this batch size (the nearest batch
        size observed where this one was not; 0 before any step was priced)."""
        got = _nearest(self.pricing, batch)
        return 0.0 if got is None else got

    def setup_s(self, batch: int) -> float:
        """What a priced step that ran draft rows spent outside the forward and the drafting beyond
        a step that is not priced: the pricing (`pricing_s`), and beyond one priced and left
        without rows, at the nearest batch size where both kinds were seen (nothing more before
        they were), cutting the drafts, verifying them as trees, learning from them (each kind's
        seconds timed in the engine's thread: `observe_work`). A fixed
        cost of drafting at all, whatever the rows: at a batch size where a few rows yield about
        what they cost, it is what decides that the step is off's (priced as sunk, the pricing
        kept a batch drafting near break-even, every step paying it where off's pays nothing)."""
        cut = 0.0
        plain, drafting = self.work[False], self.work[True]
        both = [b for b in plain if b in drafting]
        if both:
            b = min(both, key=lambda b: (abs(b - batch), b))
            cut = max(drafting[b] - plain[b], 0.0)
        return cut + self.pricing_s(batch)

    def observe_work(self, batch: int, seconds: float, drafted: bool) -> None:
        """A priced step's own seconds verifying and committing its rows, learning from them and
        cutting its drafts (timed in the engine's thread; `drafted`: it ran draft rows), at most
        STEP_CLIP's high multiple of what that kind took so far at this batch size (a stall says
        little)."""
        _follow_clipped(self.work[drafted], batch, seconds)

    def observe_pricing(self, batch: int, seconds: float) -> None:
        """The controller's seconds pricing a step in full (at most STEP_CLIP's high multiple of
        what it took so far at this batch size: a stall says little)."""
        _follow_clipped(self.pricing, batch, seconds)

    def observe_overhead(self, batch: int, seconds: float, drafted: bool | None = None) -> None:
        """A step's wall seconds, start to the next step's start, less its forward and drafting:
        taken as at most CLIP_HIGH x the curve's step and the overhead known so far at this batch
        size (a stall says little; a small model's overhead may be several forwards, learnt in a
        few steps). `drafted`: for a step the controller priced in full, whether it ran draft rows
        (None: a step it did not price, or not adaptive's)."""
        old = self.overhead.get(batch)
        s = min(max(seconds, 0.0), CLIP_HIGH * (self.curve_s(batch, 0) + (old or 0.0)))
        _follow(self.overhead, batch, s)
        if drafted is not None:
            # at most STEP_CLIP's high multiple of every step's: drafting steps stop where drafting
            # does not pay, so one stall among them would otherwise keep drafting priced out there
            s = min(s, STEP_CLIP[1] * self.overhead[batch])
            _follow(self.drafting if drafted else self.plain, batch, s)

    def observe_step(self, batch: int, extra: int, seconds: float) -> None:
        """A live step's time (taken as within [CLIP_LOW, CLIP_HIGH] x the curve and within
        STEP_CLIP of what the live figures expected: a step stalled by another process says little,
        and one stalled step of many rows would otherwise set the fit's slope for dozens of steps)."""
        c0 = self.curve_s(batch, 0)
        c = c0 + self.rows_s(batch, extra)
        expected = self._forward_s(batch, extra, 0)[0]
        t = min(max(seconds, CLIP_LOW * c, STEP_CLIP[0] * expected), CLIP_HIGH * c, STEP_CLIP[1] * expected)
        self.level += FOLLOW * (max(t - (c - c0), CLIP_LOW * c0) / c0 - self.level)  # the step's, not its rows
        self.live.setdefault(batch, _Live()).add(c / c0 - 1, t / c0)
        self.rows.setdefault(batch, _Rows()).add(extra, t)

    def observe_draft(self, seconds: float, nodes: int) -> None:
        """A step's drafting seconds (the engine thread's CPU time: engine.decode.batch) over the
        nodes it drafted."""
        if nodes > 0:
            self.draft_s += FOLLOW * (seconds / nodes - self.draft_s)

    def to_json(self) -> dict[str, Any]:
        return {"max_rows": self.max_rows, "ms": {str(b): [[x, round(s * 1e3, 4)] for x, s in pts]
                                                  for b, pts in self.curves.items()}}

    @classmethod
    def from_json(cls, got: dict[str, Any]) -> "StepCost":
        return cls({int(b): [(int(x), ms / 1e3) for x, ms in pts] for b, pts in got["ms"].items()}, got["max_rows"])


def _follow(figures: dict[int, float], batch: int, seconds: float) -> None:
    """Move a batch size's online figure toward `seconds` at FOLLOW (set it at its first)."""
    old = figures.get(batch)
    figures[batch] = seconds if old is None else old + FOLLOW * (seconds - old)


def _follow_clipped(figures: dict[int, float], batch: int, seconds: float) -> None:
    """`_follow`, the observation taken as at most STEP_CLIP's high multiple of the figure so far (a
    stall says little); the first sets it."""
    old = figures.get(batch)
    s = max(seconds, 0.0)
    _follow(figures, batch, s if old is None else min(s, STEP_CLIP[1] * old))


def _nearest(by_batch: dict[int, float], batch: int) -> float | None:
    """The figure at `batch`, else at the nearest batch size that has one (the smaller on a tie);
    None when there is none."""
    if batch in by_batch:
        return by_batch[batch]
    if not by_batch:
        return None
    return by_batch[min(by_batch, key=lambda b: (abs(b - batch), b))]


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
    positions, the extra rows (`extras_timed`) spread over them, on a pool of its own. Each batch
    size is timed in passes over all its points, a warm-up pass first: a burst of another process's
    work then slows one timing of several points rather than every timing of one point."""
    curves: dict[int, list[tuple[int, float]]] = {}
    with torch.inference_mode():
        pool = forward.pool(max_batch, CONTEXT + max_rows)
        caches = [pool.acquire(CONTEXT + max_rows) for _ in range(max_batch)]
        for b in batch_levels(max_batch):
            xs = extras_timed(b, max_rows)
            best = dict.fromkeys(xs, float("inf"))
            for i in range(ROUNDS + 1):
                for x in xs:
                    rows = [[1] * (1 + x // b + (j < x % b)) for j in range(b)]
                    for c in caches[:b]:
                        c.length = CONTEXT  # the pool is zeroed: attention over zeros costs what it would
                    t = time.perf_counter()
                    forward.step_batch(caches[:b], rows, [None] * b, [None] * b, [False] * b)
                    if i:
                        best[x] = min(best[x], time.perf_counter() - t)
            curves[b] = list(best.items())
        for c in caches:
            pool.release(c)
    return StepCost(curves, max_rows)


def step_cost(forward: Any, max_batch: int, max_rows: int, signature: str,
              cache_dir: str | os.PathLike | None = None) -> StepCost:
    """This machine's step-cost curve for a forward (`signature`: the model, its weights and the
    forward's form), timed once and cached in <cache>/step_cost.json (a few seconds on a small model)."""
    key = f"{cpu_signature()}|torch {torch.__version__}|{signature}|b{max_batch}|r{max_rows}|ctx {CONTEXT}|v{VERSION}"
    got = timed_once(cache_root(cache_dir) / "step_cost.json", key,
                     lambda _old: time_steps(forward, max_batch, max_rows).to_json(),
                     "the step-cost curve")
    return StepCost.from_json(got)
