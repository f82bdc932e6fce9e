"""Trial time limits: what `search.trial_timeout_s` bounds, and whether a search can fit in it.

`search.trial_timeout_s` bounds the *measurement* of one trial. A server start-up (vLLM, SGLang) is
bounded by its own `engine.<kind>.startup_timeout_s` and runs with the trial's clock paused
(`startup_excluded`), so a 30-150 s vLLM start never eats a trial's measuring time.

Before the first trial, `check_trial_fits` plays one tuning prompt on the baseline (twice: the
first run pays warm-up costs) and refuses, in one line, a search whose trials cannot fit: tuning
prompts x new tokens x runs per repeat (the configuration and its adjacent baseline) x
concurrency levels x `search.repeats_min`, at the measured speed. Repeats beyond `repeats_min` are sized on the fly: a trial stops repeating when
the next repeat would not fit (`next_repeat_fits`), and completes with the repeats it has. Then it
plays the trials' prompts twice, the study's first baseline history (Objective.outlier_history).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tuner.schema.config import Config, SpecConfig, UserError

LIMIT_KEY = "search.trial_timeout_s"


class TrialTimeout(BaseException):
    """The trial's measurement ran past search.trial_timeout_s. A BaseException (like
    KeyboardInterrupt) so that the load generator, which records an Exception as one failed
    request and goes on, lets it through."""


_ACTIVE: list["TrialClock"] = []  # the clock of the trial running in this process (a stack)


class TrialClock:
    """A trial's measuring clock: elapsed time minus paused start-ups, enforced by SIGALRM.

    Outside the main thread no signal can be armed; there the limit is checked between repeats.
    The alarm interrupts only a measurement (`measuring`): fired elsewhere (the trial's storage
    calls, whose transaction an exception would cut, leaving a SQLite file locked) it is held until
    the next measurement starts or the next `check`.
    """

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.t0 = time.monotonic()
        self.paused_s = 0.0
        self._armed = False
        self._measuring = 0
        self._pending = False

    def __enter__(self) -> "TrialClock":
        self.t0 = time.monotonic()
        self.paused_s = 0.0
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.limit_s)
            self._armed = True
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        if self._armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)
            self._armed = False

    def _fire(self, signum: int, frame: Any) -> None:
        if signum and not self._measuring:  # the alarm outside a measurement: held (see the class)
            self._pending = True
            return
        raise TrialTimeout(f"exceeded {LIMIT_KEY}={self.limit_s:g} (measuring time; server start-ups excluded)")

    def elapsed(self) -> float:
        """Seconds measured so far (paused start-ups not counted)."""
        return time.monotonic() - self.t0 - self.paused_s

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop the clock (and its alarm) for the duration of the block."""
        left = signal.setitimer(signal.ITIMER_REAL, 0)[0] if self._armed else 0.0
        t = time.monotonic()
        try:
            yield
        finally:
            self.paused_s += time.monotonic() - t
            if self._armed:  # an alarm of 0 would disarm it: re-arm with at least a moment left
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """A measurement: the block the alarm may interrupt (at once, if it fired already)."""
        if self._pending:
            self._fire(0, None)
        self._measuring += 1
        try:
            yield
        finally:
            self._measuring -= 1

    def check(self) -> None:
        """Raise TrialTimeout when the measuring time is spent (threads without SIGALRM), or when
        the alarm fired outside a measurement."""
        if self._pending or self.elapsed() > self.limit_s:
            self._fire(0, None)


@contextmanager
def startup_excluded() -> Iterator[None]:
    """Run a server start-up outside the running trial's clock (a no-op outside a trial)."""
    if not _ACTIVE:
        yield
        return
    with _ACTIVE[-1].paused():
        yield


def active_clock() -> TrialClock | None:
    """The running trial's clock in this process, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


# A repeat's duration varies by about +-15% on a shared machine: leave room for a slower one.
REPEAT_MARGIN = 1.25


def next_repeat_fits(repeat_s: float) -> bool:
    """Whether one more repeat like the last one (with a margin) still fits the running trial's limit."""
    clock = active_clock()
    return clock is None or clock.elapsed() + REPEAT_MARGIN * repeat_s <= clock.limit_s


# ---- sizing a trial before the first one ---------------------------------------------------------

@dataclass
class TrialWork:
    """What one speculative trial measures at least, and how long that takes at a measured speed."""

    prompts: int
    max_new_tokens: int
    runs: int  # per repeat: the configuration and its adjacent baseline
    levels: int  # concurrency levels
    repeats: int  # search.repeats_min
    tok_s: float  # the baseline's measured output tokens/s
    rates: tuple[float, ...] = ()  # request rates (open loop): each plays rate_requests requests
    rate_requests: int = 0

    @property
    def tokens(self) -> int:
        per_repeat = self.prompts * self.levels + self.rate_requests * len(self.rates)
        return per_repeat * self.max_new_tokens * self.runs * self.repeats

    @property
    def seconds(self) -> float:
        """An upper bound: every answer runs to max_new_tokens, every level at the measured speed; a
        rate level lasts at least as long as its arrivals take."""
        arriving = sum(self.rate_requests / r for r in self.rates) * self.runs * self.repeats
        return max(self.tokens / self.tok_s, arriving)

    def describe(self) -> str:
        levels = f" x {self.levels} concurrency levels" if self.levels > 1 else ""
        head = f"{self.prompts} prompts x {self.max_new_tokens} tokens"
        if self.rates:  # open-loop levels play rate_requests requests each
            parts = [f"{self.prompts} prompts{levels}"] if self.levels else []
            parts.append(f"{self.rate_requests} requests x {len(self.rates)} request rates")
            head, levels = f"({' + '.join(parts)}) x {self.max_new_tokens} tokens", ""
        return (f"{head} x {self.runs} runs (configuration + baseline){levels} x {self.repeats} repeat(s) = "
                f"{self.tokens} tokens at the baseline's measured {self.tok_s:.1f} tok/s = ~{self.seconds:.3g} s")


def trial_work(cfg: Config, n_prompts: int, tok_s: float) -> TrialWork:
    """The least work of one speculative trial of this search (see TrialWork)."""
    w = cfg.workload
    rates = sorted(set(w.request_rate))
    n_rate = max(n_prompts, w.rate_requests)
    return TrialWork(prompts=n_prompts, max_new_tokens=w.max_new_tokens, runs=2, levels=len(set(w.concurrency)),
                     repeats=cfg.search.repeats_min, tok_s=max(tok_s, 1e-9), rates=tuple(rates), rate_requests=n_rate)


def fits_or_refuse(cfg: Config, work: TrialWork) -> None:
    """Raise UserError (one line: the limit, the work, what to change) when a trial cannot fit."""
    limit = cfg.search.trial_timeout_s
    if work.seconds <= limit:
        return
    per_prompt = work.seconds / work.prompts
    most = max(0, math.floor(limit / per_prompt))
    fewer = f" or search.trial_prompts<={most}" if most >= 1 else ""
    raise UserError(
        f"{LIMIT_KEY}={limit:g} cannot fit one trial: {work.describe()}; set {LIMIT_KEY}>="
        f"{math.ceil(work.seconds * 1.25)}{fewer} (or fewer workload.max_new_tokens)")


# Baseline passes on the trials' prompts measured before trial 0, after the warm-up run: the
# history a study's first pairs are judged against (Objective.outlier_history). Two, so that with
# trial 0's single pass of a quick study the first trial's pair already has OUTLIER_HISTORY behind it.
PROBE_HISTORY = 2


def check_trial_fits(cfg: Config, measure: Any, prompts: dict[str, list[Any]]) -> tuple[TrialWork | None, list[float]]:
    """Measure the baseline before the first trial, refuse a search whose trials cannot fit, and
    return (the trial's least work, the baseline passes measured on the trials' prompts).

    `measure` is the study's MeasureFn; it reads `prompts[split]` when called, so the probe is
    one more split of the same dict. One tuning prompt twice (the first run of a process pays
    one-off warm-up costs: the faster sizes the work), the refusal before anything longer runs;
    then PROBE_HISTORY passes of the trials' prompts at every level, as a trial's baseline pass
    plays them (their tok/s, the mean over the levels, are the study's first baseline history). On
    a launched engine this starts the baseline server (outside any trial clock), which trial 0 then
    reuses. A probe that fails (a server that does not start, failed requests) checks nothing:
    trial 0 then records that failure like any other.
    """
    prompts["probe"] = prompts["tune"][:1]
    off = SpecConfig(method="off")
    levels = cfg.workload.levels
    try:
        tok_s = max(measure(off, "probe", levels[0]).tok_s for _ in range(2))
    except Exception:
        return None, []
    work = trial_work(cfg, len(prompts["tune"]), tok_s)
    fits_or_refuse(cfg, work)
    try:
        passes = [[measure(off, "tune", c).tok_s for c in levels] for _ in range(PROBE_HISTORY)]
    except Exception:
        return work, []
    return work, [sum(p) / len(p) for p in passes]
