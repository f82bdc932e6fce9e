"""Capacity at the SLOs (`search.capacity=true`): the highest request rate at which the workload's
SLOs hold, for the baseline and for the winner, as GuideLLM's sweep and vLLM's `bench sweep` find it.

A bracketing search over open-loop rates (engine.measure.runner, through the study's MeasureFn):
from a starting rate, double while the SLOs hold (halve while they break) until one rate holds and
the next breaks, then bisect that bracket geometrically until it is within `REL_TOL` or the probes
(`search.capacity_probes`) are spent. The capacity is the highest rate measured to hold; when the
SLOs held at every rate tried it is a lower bound (`bounded` false), and when they broke at every
rate it is None. Every probe plays the same seeded arrivals, so the two configurations meet the
same traffic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tuner.schema.config import SLO, Capacity, CapacityProbe, Config, Rate, SpecConfig
from tuner.study.objective import OFF, MeasureFn, Sample

REL_TOL = 0.1  # the bracket is narrow enough once hi / lo <= 1 + REL_TOL


def slo_holds(sample: Sample, slo: SLO) -> bool:
    """Whether one measurement meets the workload's p99 SLOs (a missing figure meets nothing)."""
    for measured, limit in ((sample.ttft_p99_ms, slo.ttft_p99_ms), (sample.tpot_p99_ms, slo.tpot_p99_ms)):
        if limit is not None and (measured is None or measured > limit):
            return False
    return True


def search_capacity(measure: MeasureFn, spec: SpecConfig, slo: SLO, start_rps: float, probes_max: int,
                    log: Callable[[str], None] = lambda s: None) -> tuple[float | None, bool, list[CapacityProbe]]:
    """(capacity in requests/s or None, bounded, the probes) of `spec` (see the module docstring).
    A probe whose requests fail breaks the SLOs (the configuration cannot serve that rate)."""
    probes: list[CapacityProbe] = []

    def probe(rate: float) -> bool:
        try:
            s = measure(spec, "tune", Rate(rate))
            ok = slo_holds(s, slo)
            p = CapacityProbe(spec=spec.key(), rate=rate, ttft_p99_ms=s.ttft_p99_ms, tpot_p99_ms=s.tpot_p99_ms,
                              goodput=s.goodput, ok=ok)
        except RuntimeError as exc:  # failed requests (Measurer raises): this rate is not served
            ok = False
            p = CapacityProbe(spec=spec.key(), rate=rate, ok=False)
            log(f"capacity {spec.key()}: {rate:.3g} req/s failed: {exc}")
        probes.append(p)
        log(f"capacity {spec.key()}: {rate:.3g} req/s -> SLOs {'hold' if ok else 'broken'}"
            + (f" (TTFT p99 {p.ttft_p99_ms:.0f} ms, TPOT p99 {p.tpot_p99_ms:.0f} ms)"
               if p.ttft_p99_ms is not None and p.tpot_p99_ms is not None else ""))
        return ok

    lo: float | None = None  # highest rate that held
    hi: float | None = None  # lowest rate that broke
    rate = start_rps
    while len(probes) < probes_max and (lo is None or hi is None):
        if probe(rate):
            lo = rate
            rate = rate * 2 if hi is None else rate
        else:
            hi = rate
            rate = rate / 2 if lo is None else rate
    while len(probes) < probes_max and lo is not None and hi is not None and hi / lo > 1 + REL_TOL:
        mid = math.sqrt(lo * hi)
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi is not None, probes


def start_rate(cfg: Config, baseline_tok_s: float | None) -> float:
    """Where the search starts: the highest rate the workload measures, else the requests per second
    one closed-loop client of the baseline completes (its tok/s over the output budget), else 1."""
    w = cfg.workload
    if w.request_rate:
        return float(max(w.request_rate))
    if baseline_tok_s:
        return max(baseline_tok_s / w.max_new_tokens, 0.01)
    return 1.0


def measure_capacity(cfg: Config, measure: MeasureFn, winner: SpecConfig, baseline_tok_s: float | None,
                     log: Callable[[str], None] = lambda s: None) -> Capacity:
    """The capacity of the baseline and of the winner (the same search for both; when off wins it
    is searched once)."""
    slo, n = cfg.workload.slo, cfg.search.capacity_probes
    start = start_rate(cfg, baseline_tok_s)
    log(f"capacity at the SLOs: bracketing request rates from {start:.3g} req/s, at most {n} rates each")
    w, batch = cfg.workload, cfg.engine.builtin.max_batch
    if cfg.engine.kind == "builtin" and w.rate_requests <= batch:
        # every request of a probe finds a place in the batch at once, however fast they arrive
        log(f"capacity: a probe plays workload.rate_requests={w.rate_requests} requests, no more than "
            f"engine.builtin.max_batch={batch}: they never queue, so this is the capacity for a burst of "
            f"{w.rate_requests}, not a sustained rate (raise workload.rate_requests)")
    base, base_bounded, probes = search_capacity(measure, OFF, slo, start, n, log)
    if winner.method == "off":
        win, win_bounded, more = base, base_bounded, []
    else:
        win, win_bounded, more = search_capacity(measure, winner, slo, start, n, log)
    return Capacity(baseline_rps=base, winner_rps=win, baseline_bounded=base_bounded, winner_bounded=win_bounded,
                    slo_ttft_p99_ms=slo.ttft_p99_ms, slo_tpot_p99_ms=slo.tpot_p99_ms, probes=[*probes, *more])


def describe(c: Capacity, winner: str) -> str:
    """One line: both capacities, each marked when it is only a lower bound."""
    def one(rps: float | None, bounded: bool) -> str:
        if rps is None:
            return "below every rate tried"
        return f"{rps:.3g} req/s" if bounded else f">= {rps:.3g} req/s (held at every rate tried)"

    return f"capacity at the SLOs: off {one(c.baseline_rps, c.baseline_bounded)}, {winner} {one(c.winner_rps, c.winner_bounded)}"


def probes_of(c: Capacity, spec: str) -> list[Any]:
    """The probes of one configuration, by rate."""
    return sorted((p for p in c.probes if p.spec == spec), key=lambda p: p.rate)
