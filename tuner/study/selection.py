"""The winner of a study: trials pooled per configuration, the proven winner (or `off` and why),
and best.yaml with the winner re-measured on the held-out prompts.

Ties go to the smaller draft budget (a tie: the trials' intervals cannot tell two configurations
apart and they read within 3%, the regret goal, of each other; head to head, the interval of the
ratio between them lies within +-3%); `off` wins when nothing beats the baseline beyond noise (the
slowdown trap), and best.yaml says whether acceptance or verification cost is to blame.
"""

from __future__ import annotations

import math
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from engine.measure.stats import geomean, log_interval, ratio_bounds, t95, t_one_sided
from tuner.study.objective import ENGINE_VERSION, OFF, OUTLIER_BANDS, Objective, spec_of
from tuner.schema.engine_command import measured_server
from tuner.schema.config import (ArmLevel, Arms, BestResult, Config, Figures, Level, PartResult, Provenance, Rate,
                                 SearchConfig, SpecConfig, level_name, measured_weights, weights_reason)
from tuner.schema.results import HeldoutCheck, SplitSpeedup
from tuner.projection.profiling import CHECK, CHECK_PASS, check_order, check_prompt_count
from tuner.study.storage import mask_url, storage_url
from tuner.study.studies import CHECK_SIDE, CONFIRM_ROUND, NOISE, REUSED, counted, role

HELDOUT_PAIRS = 2  # spec/baseline pairs of a part's (mixed workload) or the baseline's held-out figures
# The held-out check's gap interval is mostly which prompts each side holds (gap_interval resamples
# them); the pairs add their own noise, which the study's trials have measured over many pairs
# (pair_noise) far better than a bootstrap over two pairs does (two resampled pairs show half their
# variance): that noise, pooled with the check's own pairs, widens the check's intervals.
PAIR_NOISE_MIN_DF = 4  # pooled degrees of freedom of pair_noise before the check's intervals stand on it
# That noise sizes the check's pairs as the spread sizes a trial's repeats (Objective.repeats_for): two
# a side while a pair's log ratio strays no more than two passes at search.noise_rel each would make it
# (sqrt(2) x noise_rel), 2 x (noise / that)^2 above it, at most twice search.repeats_max. Never one: one
# pair a side is one draw of the machine's state per side, and the trials' pair noise (their passes
# are shorter) did not show what that draw costs the gap, quiet or loaded (docs/results.md, session 30).
CHECK_PAIRS_MIN = 2
# Under load the check measures more pairs: two pairs a side hold the gap on a quiet machine, not under
# fidelity's background load, where the gap strays more from pair to pair (docs/results.md, issue 39).
# Whether a pair was contended is read from what other processes ran during it (engine.models.cpuload.
# others_cores), not from timing noise, which read alike quiet and loaded: a pair during which they kept more than
# LOAD_CORES cores busy does not count towards the pairs the check asked for, and pairs go on up to
# CHECK_PAIRS_LOADED. LOAD_CORES: about half of what fidelity's background load takes beside a pass,
# well above a quiet machine's own housekeeping.
CHECK_PAIRS_LOADED = 6
LOAD_CORES = 0.08
CONFIRM_TOP = 3  # the best configurations by pessimistic bound that the confirmation round measures
CONFIRM_PAIRS_MAX = 6  # head-to-head pairs per contender at most (rounds; 2 at the noise floor: CONFIRM_FLOOR)
CONFIRM_FLOOR = 2  # rounds when only pruned trials brought the round on at the floor: a head-to-head interval
# The confirmation round adds rounds past the second only while it has taken less than the trials'
# own time (CONFIRM_SHARE of it) or CONFIRM_MIN_S, whichever is longer: a bound on what noise may
# cost; the floor keeps a short study's round from stopping after two rounds.
CONFIRM_SHARE = 1.0
CONFIRM_MIN_S = 90.0
# At the noise floor under search.confirm=auto, the round's share of the trials' time: it measures as
# many contenders (the trials' winner among them) as CONFIRM_FLOOR rounds of pairs fit in that share
# at the trials' own cost per pair, so the main command keeps to its time (docs/results.md); the
# winner and CONFIRM_TOP - 1 contenders at least, those the trials' bounds do not tell apart from it
# (6 pairs: more than the share in a study of a few single-pair trials, search=quick's; with one
# contender at least, session 26's loaded fidelity run measured d4 against d2, never the close d3).
FLOOR_SHARE = 0.25
# How a configuration measured in the confirmation round is ranked: the geometric mean of its pairs,
# each pair's log first held within CLIP_BANDS noise bands of the configuration's median (the noise:
# search.noise_rel, or the study's pairs' spread when larger, each configuration's furthest pair left
# out of it). One bad pair then cannot decide the winner (fidelity's loaded seed 7, session 31: d4's
# pairs 1.63 / 1.48 / 1.21 pooled below d2's 1.45 / 1.51 / 1.42), while pairs that spread as the
# noise does count in full: in simulation of the round at a pair noise of 3-9% with and without
# bursts, a plain median picked wrong more often than the mean wherever the noise was not bursts.
CLIP_BANDS = 2.0
# A tie goes to the smaller budget, so a tie may cost the difference between the two: at most the
# regret goal of issue 39 (the winner within 3% of the best configuration).
TIE_MAX = 0.03
# The head-to-head test is repeated after every round from the second on: one look per round, up to
# CONFIRM_PAIRS_MAX - 1 looks, each asking whether either configuration is faster (two sides). At
# one-sided 5% per look two equal configurations would be told apart far more often than 5% over the
# looks; a Bonferroni split of HEAD_ALPHA over the looks and the two sides keeps it at HEAD_ALPHA at most.
HEAD_ALPHA = 0.05
HEAD_LOOKS = CONFIRM_PAIRS_MAX - 1


def head_alpha() -> float:
    """The one-sided level of each bound a head-to-head look uses (see HEAD_ALPHA)."""
    return HEAD_ALPHA / (2 * HEAD_LOOKS)

# Below this many tokens per target forward, drafts are too rarely accepted to pay for drafting
# and verification at all; above it, a slowdown means verifying costs more than it saves.
TAU_LOW = 1.3


@dataclass
class Candidate:
    """All complete trials of one SpecConfig, pooled: a point sampled twice is twice the evidence."""

    spec: SpecConfig
    trials: list[FrozenTrial]
    speedup: float
    ci_low: float | None
    ci_high: float | None
    tau: float | None
    feasible: bool
    lower: float | None = None  # one-sided 95% lower bound of the speedup, from the repeats' ratios
    ratios: list[float] = field(default_factory=list)  # every repeat's ratio, pooled (`dropped` left out)
    confirmed: list[float] = field(default_factory=list)  # the confirmation round's ratios (head to head)
    rounds: list[int] = field(default_factory=list)  # the confirmation round each of `confirmed` was measured in
    implausible: str | None = None  # why a figure stayed implausible after its re-measurements
    dropped: list[float] = field(default_factory=list)  # trial pairs left out: outliers against the round's pairs
    reading: float | None = None  # what the confirmation round ranks by (`clipped_mean`; `candidates` sets it)

    @classmethod
    def of(cls, spec: SpecConfig, trials: list[FrozenTrial], band: float | None = None) -> "Candidate":
        """The trials of `spec` pooled. `band` (on logs; `round_band`): a trial pair further than it from
        the median of the configuration's confirmation-round pairs is left out of the pool (`dropped`):
        the round measured it head to head, minutes apart from its rivals, and one lucky trial pair
        measured under other conditions must not outweigh it (fidelity's loaded run at aa7b89a: d4's one
        trial pair read 1.447x, its four round pairs 1.10-1.19x; pooled, it beat d3, ahead in 3 of 4 rounds)."""
        confirmed = [r for t in trials if role(t) == "confirm" for r in t.user_attrs.get("ratios", [])]
        trial_ratios = [r for t in trials if role(t) != "confirm"
                        for r in t.user_attrs.get("ratios", [t.user_attrs["speedup"]])]
        kept, dropped = against_round(trial_ratios, confirmed, band)
        ratios = kept + confirmed
        sp, lo, hi, lower, _ = log_interval(ratios)  # ratios: intervals on logs
        if len(trials) == 1 and "ratios" not in trials[0].user_attrs:  # a bare figure: keep its own interval
            a = trials[0].user_attrs
            sp, lo, hi = a["speedup"], a.get("speedup_ci_low"), a.get("speedup_ci_high")
        taus = [t.user_attrs["tau"] for t in trials if t.user_attrs.get("tau") is not None]
        # a pair's round pairs it with the other contenders' pairs of that round (measured minutes apart
        # at most); a study from before rounds were recorded numbers them in order
        rounds = [t.user_attrs.get(CONFIRM_ROUND, -1) for t in trials if role(t) == "confirm"
                  for _ in t.user_attrs.get("ratios", [])]
        if any(r < 0 for r in rounds):
            rounds = list(range(len(confirmed)))
        why = "; ".join(t.user_attrs["implausible"] for t in trials if t.user_attrs.get("implausible")) or None
        return cls(spec, trials, sp, lo, hi, statistics.fmean(taus) if taus else None,
                   all(all(c <= 0 for c in t.constraints.values()) for t in trials), lower, ratios, confirmed,
                   rounds, why, dropped)

    def ranked_by(self) -> float:
        """What the confirmation round ranks this configuration by: its `reading` when set, else its speedup."""
        return self.reading if self.reading is not None else self.speedup

    def head(self) -> dict[int, float]:
        """The confirmation round's ratios by round."""
        return dict(zip(self.rounds, self.confirmed))

    def mean(self, key: str) -> float | None:
        vals = [t.user_attrs[key] for t in self.trials if t.user_attrs.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    def bounds(self, noise_rel: float) -> tuple[float, float]:
        """(pessimistic, optimistic) bounds of the speedup (engine.measure.stats.ratio_bounds)."""
        return ratio_bounds(self.ratios or [self.speedup], noise_rel)

    def beats_baseline(self, noise_rel: float) -> bool:
        """Faster than the baseline beyond noise. Without accepted drafts (tau ~ 1) nothing can be
        faster than plain decoding, so such a measurement is noise, however large; a figure that
        stayed implausible after its re-measurements proves nothing either."""
        # "Faster" is a one-sided claim: the one-sided 95% bound of the repeats' ratios must clear 1.0
        # (the two-sided interval, reported, is far wider with the usual two repeats).
        bound = self.lower if self.lower is not None else self.ci_low
        return (self.implausible is None and self.speedup >= 1 + noise_rel and (bound is None or bound > 1.0)
                and (self.tau is None or self.tau >= 1 + noise_rel))


def leader(trials: list[FrozenTrial], noise_rel: float) -> Candidate | None:
    """The best configuration by what is known: the highest pessimistic bound among feasible,
    plausible candidates (what the progress line, history.png and the report show)."""
    known = [c for c in candidates(trials, noise_rel) if c.feasible and c.implausible is None]
    return max(known, key=lambda c: c.bounds(noise_rel)[0], default=None)


def describe(c: Candidate, noise_rel: float) -> str:
    """'SPEC 1.290x [1.10, 1.52], lower bound 1.21x': a candidate's speedup, its 95% interval and
    its pessimistic bound."""
    ci = f" [{c.ci_low:.2f}, {c.ci_high:.2f}]" if c.ci_low is not None and c.ci_high is not None else ""
    return f"{c.spec.key()} {c.speedup:.3f}x{ci}, lower bound {c.bounds(noise_rel)[0]:.2f}x"


@dataclass
class Winner:
    spec: SpecConfig
    candidate: Candidate | None  # None: speculation off wins
    reason: str
    chain: Candidate | None = None  # best chain (topk=1) beating the baseline, for vLLM targets


def candidates(trials: list[FrozenTrial], noise_rel: float | None = None) -> list[Candidate]:
    """Complete speculative trials grouped by SpecConfig, in order of first appearance. With
    `noise_rel`, a configuration measured in the confirmation round is ranked by its round pairs and
    the trial pairs that agree with them (`Candidate.of`, the band `round_band`), each held within
    CLIP_BANDS noise bands of their median (`Candidate.reading`, `clipped_mean`)."""
    groups: dict[str, list[FrozenTrial]] = {}
    specs: dict[str, SpecConfig] = {}
    for t in trials:
        spec = spec_of(t)
        if (t.state != TrialState.COMPLETE or role(t) == "baseline" or spec is None or spec.method == "off"
                or "speedup" not in t.user_attrs or REUSED in t.user_attrs):  # a reuse is no new evidence
            continue
        key = spec.model_dump_json()
        groups.setdefault(key, []).append(t)
        specs[key] = spec
    band = None
    if noise_rel is not None:
        band = round_band([[r for t in ts if role(t) == "confirm" for r in t.user_attrs.get("ratios", [])]
                           for ts in groups.values()], noise_rel)
    out = [Candidate.of(specs[k], ts, band) for k, ts in groups.items()]
    if noise_rel is not None:
        scale = max(noise_rel, spread_without_furthest([c.ratios for c in out]))
        for c in out:
            c.reading = clipped_mean(c.ratios, scale) if c.ratios and min(c.ratios) > 0 else None
    return out


def spread_without_furthest(groups: list[list[float]]) -> float:
    """The pooled spread (on logs) of groups of pair ratios about each group's own mean, each group's
    pair furthest from its median left out (a burst must not widen the band that holds it in); groups
    of fewer than three pairs add nothing (two pairs cannot say which one strayed). 0 without any."""
    kept = []
    for rs in groups:
        if len(rs) < 3 or any(r <= 0 for r in rs):
            continue
        mid = statistics.median(math.log(r) for r in rs)
        far = max(range(len(rs)), key=lambda i: abs(math.log(rs[i]) - mid))
        kept.append([r for i, r in enumerate(rs) if i != far])
    ss, df = _log_deviations(kept)
    return math.sqrt(ss / df) if df else 0.0


def clipped_mean(ratios: list[float], scale: float) -> float:
    """The geometric mean of `ratios` (all > 0), each log first held within CLIP_BANDS x `scale` of
    their median: a pair that strays further counts as if it read at that bound (`held_in`)."""
    return math.exp(statistics.fmean(math.log(r) for r in held_in(ratios, scale)))


def held_in(ratios: list[float], scale: float) -> list[float]:
    """`ratios` (all > 0), each log held within CLIP_BANDS x `scale` of their median (what
    `clipped_mean` averages; an interval on them is the clipped pooling's)."""
    logs = [math.log(r) for r in ratios]
    mid, band = statistics.median(logs), CLIP_BANDS * scale
    return [math.exp(mid + max(-band, min(band, v - mid))) for v in logs]


def _log_deviations(groups: list[list[float]]) -> tuple[float, int]:
    """The squared deviations of each group's log ratios about their own mean, summed, and their degrees
    of freedom (each group's count less one); groups of fewer than two ratios, or with one <= 0, add none."""
    ss, df = 0.0, 0
    for rs in groups:
        if len(rs) < 2 or any(r <= 0 for r in rs):
            continue
        logs = [math.log(r) for r in rs]
        m = statistics.fmean(logs)
        ss += sum((v - m) ** 2 for v in logs)
        df += len(logs) - 1
    return ss, df


def round_band(rounds: list[list[float]], noise_rel: float) -> float:
    """How far (on logs) a trial pair may read from the median of its configuration's round pairs and
    still be pooled with them: OUTLIER_BANDS noise bands, as a pass is judged in a trial (the noise:
    search.noise_rel, or the spread of the round's own pairs about each configuration's mean when
    larger: a loaded round's pairs wander more, and so may a trial pair)."""
    ss, df = _log_deviations(rounds)
    return OUTLIER_BANDS * max(noise_rel, math.sqrt(ss / df) if df else 0.0)


def against_round(trial_ratios: list[float], round_ratios: list[float], band: float | None
                  ) -> tuple[list[float], list[float]]:
    """(kept, dropped) of a configuration's trial pairs: with round pairs and a `band`, those further
    than `band` (on logs) from the round pairs' median are dropped; else all are kept."""
    if band is None or not round_ratios or any(r <= 0 for r in round_ratios):
        return list(trial_ratios), []
    mid = statistics.median(math.log(r) for r in round_ratios)
    kept = [r for r in trial_ratios if r > 0 and abs(math.log(r) - mid) <= band]
    return kept, [r for r in trial_ratios if r not in kept]


def tie_rel(noise_rel: float) -> float:
    """How far below the best a configuration may read and still tie with it (when the intervals
    cannot tell them apart): search.noise_rel, at most TIE_MAX, so a tie never costs more than the
    regret goal."""
    return min(noise_rel, TIE_MAX)


def told_apart(a: list[float], b: list[float], noise_rel: float) -> bool:
    """Whether two configurations' trial ratios say which is faster: their one-sided 95% bounds
    (ratio_bounds, never narrower than the noise band) do not overlap."""
    a_lo, a_hi = ratio_bounds(a, noise_rel)
    b_lo, b_hi = ratio_bounds(b, noise_rel)
    return a_hi < b_lo or b_hi < a_lo


def ties(a: list[float], b: list[float], noise_rel: float) -> bool:
    """Whether two configurations' trials tie: their intervals cannot tell them apart (told_apart)
    and their geometric means lie within tie_rel(noise_rel) of each other. A pair that reads further
    apart without being told apart is no tie: the better reading is taken, which costs less than
    giving the tie to the smaller budget could."""
    ma, mb = geomean(a), geomean(b)
    if ma <= 0 or mb <= 0:
        return False
    return abs(math.log(ma / mb)) <= math.log(1 + tie_rel(noise_rel)) and not told_apart(a, b, noise_rel)


def head_to_head(a: dict[int, float], b: dict[int, float], alpha: float = HEAD_ALPHA
                 ) -> tuple[float, float, float, int] | None:
    """How much faster `a` is than `b` head to head: from the confirmation rounds both were measured
    in (ratios by round), the geometric mean of a's ratio over b's and its one-sided (1 - alpha)
    bounds (lower, upper; 95% by default: one look), on the logs of the per-round quotients:
    (ratio, lower, upper, rounds). None with fewer than two common rounds. Per round, because the
    two pairs of a round were measured minutes apart at most: a load that comes and goes between
    rounds cancels."""
    common = sorted(a.keys() & b.keys())
    if len(common) < 2 or any(a[r] <= 0 or b[r] <= 0 for r in common):
        return None
    d = [math.log(a[r] / b[r]) for r in common]
    m = statistics.fmean(d)
    half = t_one_sided(len(d), alpha) * statistics.stdev(d) / math.sqrt(len(d))
    return math.exp(m), math.exp(m - half), math.exp(m + half), len(d)


def head_verdict(a: dict[int, float], b: dict[int, float], noise_rel: float) -> str:
    """Head to head (`head_to_head`): "apart" when the one-sided bounds of the ratio between them
    exclude 1 (one is faster), "tie" when both lie within +-tie_rel(noise_rel) (at most TIE_MAX: an
    equivalence test, so a tie costs at most the regret goal), else "open": more pairs are needed.
    The bounds are one-sided at `head_alpha()`, since the confirmation round asks again after every
    round: over all its looks two equal configurations are told apart at most HEAD_ALPHA of the
    time, and two that differ by more than the band are tied less often still. Not told apart is no tie:
    three pairs that read within 0.4% of each other under load prove nothing about a 6% difference."""
    h = head_to_head(a, b, head_alpha())
    if h is None:
        return "open"
    _, lo, hi, _ = h
    if lo > 1.0 or hi < 1.0:
        return "apart"
    band = math.log(1 + tie_rel(noise_rel))
    return "tie" if abs(math.log(lo)) <= band and abs(math.log(hi)) <= band else "open"


def _cheapest_of_best(cands: list[Candidate], noise_rel: float) -> tuple[Candidate, int]:
    """The best speedup, and among those tied with it the smallest budget (then depth). When the
    confirmation round measured candidates head to head, only those compete, each by the geometric
    mean of its round pairs and the trial pairs that agree with them, each held within CLIP_BANDS noise
    bands of their median (`Candidate.reading`; under noise every pair counts,
    and in simulation at the loaded machine's spread pooling halves the wrong picks of the round's
    pairs alone; a trial pair that is an outlier against the round is left out: `Candidate.of`), and
    a tie is what `head_verdict` calls one; otherwise the trials' figures, and a tie is what `ties`
    calls one."""
    confirmed = [c for c in cands if c.confirmed]
    if confirmed:  # ranked by the round's pairs and the trial pairs that agree with them, held in (`ranked_by`)
        best = max(confirmed, key=lambda c: c.ranked_by())
        tied = [c for c in confirmed if c is best or head_verdict(c.head(), best.head(), noise_rel) == "tie"]
        return min(tied, key=lambda c: (c.spec.budget, c.spec.depth, -c.ranked_by())), len(tied)
    best = max(cands, key=lambda c: c.speedup)
    tied = [c for c in cands if c is best or ties(c.ratios or [c.speedup], best.ratios or [best.speedup], noise_rel)]
    return min(tied, key=lambda c: (c.spec.budget, c.spec.depth, -c.speedup)), len(tied)


def reading_bounds(ratios: list[float], noise: float) -> tuple[float, float]:
    """(pessimistic, optimistic) bounds of what the noisy machine's round compares: ratio_bounds, and
    for a single pair the band of a pair's ratio, sqrt(2) times ratio_bounds' two noise bands (on
    logs): `noise` is one pass's spread (the baseline passes'), and a pair's ratio divides two passes.
    One pair of each is all a quick study has: fidelity's loaded run at aa7b89a left d1 (one pair,
    1.158x) out of the round against d4's one lucky pair (1.447x, then 1.10-1.19x head to head) by
    a band of one pass's noise."""
    if len(ratios) != 1 or ratios[0] <= 0:
        return ratio_bounds(ratios, noise)
    half = 2 * math.sqrt(2) * noise
    return ratios[0] * math.exp(-half), ratios[0] * math.exp(half)


def _near(trials: list[FrozenTrial], lead: Candidate, noise_rel: float, taken: set[str], overlap: bool = False
          ) -> list[tuple[SpecConfig, list[float]]]:
    """Pruned configurations whose first repeat read within the noise of `lead`'s speedup or above
    it (one repeat can have been the unlucky one), the CONFIRM_TOP best of them by that repeat.
    `overlap` (the noisy machine's round): whose first repeat's optimistic bound, a pair's
    (`reading_bounds`), reaches lead's pessimistic one, the overlap rule of every contender."""
    near: list[tuple[SpecConfig, list[float]]] = []
    for t in trials:
        spec, ratios = spec_of(t), t.user_attrs.get("ratios")
        if (t.state != TrialState.PRUNED or spec is None or not ratios or REUSED in t.user_attrs
                or t.user_attrs.get("implausible") or spec.model_dump_json() in taken):
            continue
        close = (reading_bounds(ratios[:1], noise_rel)[1] >= reading_bounds(lead.ratios or [lead.speedup], noise_rel)[0]
                 if overlap else ratios[0] >= lead.speedup * (1 - noise_rel))
        if close:
            near.append((spec, ratios[:1]))
            taken.add(spec.model_dump_json())
    return sorted(near, key=lambda x: -x[1][0])[:CONFIRM_TOP]


def _by_bound(trials: list[FrozenTrial], noise_rel: float) -> list[Candidate]:
    """Feasible, plausible candidates whose optimistic bound reaches 1.0 (one that cannot even
    optimistically is no contender: off beats it), best pessimistic bound first."""
    return sorted((c for c in candidates(trials, noise_rel) if c.feasible and c.implausible is None
                   and c.bounds(noise_rel)[1] >= 1.0), key=lambda c: -c.bounds(noise_rel)[0])


def floor_field(trials: list[FrozenTrial]) -> int:
    """How many contenders a round at the noise floor may measure: CONFIRM_FLOOR rounds of one pair
    each must fit in FLOOR_SHARE of the trials' time at the trials' own seconds per pair, i.e. in
    FLOOR_SHARE of the pairs the counted trials measured."""
    pairs = sum(len(t.user_attrs.get("ratios") or []) for t in trials
                if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and counted(t) and REUSED not in t.user_attrs)
    return int(FLOOR_SHARE * pairs / CONFIRM_FLOOR)


def contenders(trials: list[FrozenTrial], noise_rel: float, lead: Candidate | None = None
               ) -> list[tuple[SpecConfig, list[float]]]:
    """What the confirmation round measures, with the ratios known so far, the leader first: the
    CONFIRM_TOP best configurations by pessimistic bound (among those whose optimistic bound reaches
    1.0), and the pruned configurations whose first repeat was within the noise of the leader's
    speedup (`_near`: a glitch may have pruned them). With `lead` (the trials' winner, the noise at
    its floor), that candidate first, then, of those the trials' bounds do not separate from it
    (`unresolved`), in this order as many as `floor_field` allows and at least CONFIRM_TOP - 1: the best by
    pessimistic bound when it is not the winner (what the progress line showed), the pruned one
    whose first repeat read best, then the others by their reading, best first (among those the
    bounds cannot separate, the higher reading is the likelier better: the main command at faa2076
    left out ngram d8 adaptive, the best reading at 1.32x over two pairs that disagreed, because its
    pessimistic bound was the lowest). That many however short
    the study: a study of single pairs under a load there from its start named the reading 4% below
    the best without a round, and with one contender measured another 5.5% below it (docs/results.md)."""
    if lead is not None:
        taken = {lead.spec.model_dump_json()}
        near = _near(trials, lead, noise_rel, set(taken))[:1]
        lead_lo = lead.bounds(noise_rel)[0]
        top = [c for c in _by_bound(trials, noise_rel) if c.spec.model_dump_json() not in taken]
        first = [(c.spec, c.ratios) for c in top[:1] if c.bounds(noise_rel)[0] > lead_lo]
        rest = [(c.spec, c.ratios) for c in sorted(top, key=lambda c: -c.speedup)]
        # one entry per configuration: a pruned one near the leader is in `top` too when it has
        # repeats of its own (search=quick's round measured ngram d3 twice a round)
        seen: set[str] = set()
        ordered = [(s, r) for s, r in first + near + rest
                   if s.model_dump_json() not in seen and not seen.add(s.model_dump_json())]
        # those the trials' bounds tell apart from the winner left out before the cut to the field
        # (cutting first let one told apart take the place of one that is not)
        open_ = [ordered[i] for i in unresolved(ordered, lead.ratios, noise_rel)]
        return [(lead.spec, lead.ratios)] + open_[:max(len(near), CONFIRM_TOP - 1, floor_field(trials) - 1)]
    known = _by_bound(trials, noise_rel)
    if not known:
        return []
    out = [(c.spec, c.ratios) for c in known[:CONFIRM_TOP]]
    return out + _near(trials, known[0], noise_rel, {c.spec.model_dump_json() for c in known}, overlap=True)


def unresolved(others: list[tuple[SpecConfig, list[float]]], lead: list[float], noise_rel: float,
               pairs: bool = False) -> list[int]:
    """Which of `others` the trials' bounds do not separate from the leader (ratios `lead`): an
    optimistic bound at or above the leader's pessimistic one. `pairs` (the noisy machine's round):
    a one-pair reading's band is a pair's (`reading_bounds`)."""
    bounds = reading_bounds if pairs else ratio_bounds
    lead_lo = bounds(lead, noise_rel)[0]
    return [i for i, (_, ratios) in enumerate(others) if bounds(ratios, noise_rel)[1] >= lead_lo]


def trials_seconds(trials: list[FrozenTrial]) -> float:
    """The wall seconds the study's counted trials took (start to finish, summed)."""
    return sum((t.datetime_complete - t.datetime_start).total_seconds() for t in trials
               if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and counted(t)
               and t.datetime_start is not None and t.datetime_complete is not None)


def confirm(study: optuna.Study, objective: Objective, noise_rel: float,
            log: Callable[[str], None] = lambda s: None) -> int:
    """The confirmation round before the winner is named: the contenders (see `contenders`) are
    measured head to head, one pair each per round in alternating order with the baseline; each
    pair is a COMPLETE trial with role `confirm` that records its round. After two rounds, every
    round measures the best so far (by the geometric mean of its round pairs and the trial pairs
    that agree with them, each held within CLIP_BANDS of their median, as pick_winner ranks)
    and those whose `head_verdict` against it is still open: neither told apart from it nor tied with
    it. It stops when none is open, at CONFIRM_PAIRS_MAX rounds, or once it has taken as long as
    the trials did (at least CONFIRM_MIN_S).

    It runs when the machine's noise rose above its floor during the study (Objective.noise_rose),
    with search.confirm=always (two pairs that agree by chance can lead by lower bound at the floor
    too), or at the floor under search.confirm=auto whenever the trials' bounds do not tell the
    winner the trials name from the best by pessimistic bound or the next best, or a pruned trial's
    first repeat read within the noise of that winner (one unlucky repeat must not lose the answer):
    then that winner (the best by pessimistic bound when the trials name off) and as many of those
    as FLOOR_SHARE of the trials' time holds, at least CONFIRM_TOP - 1 (`contenders`), for CONFIRM_FLOOR
    rounds. The bounds are the pruner's: their band is the study's measured spread when above
    search.noise_rel, so a machine as loaded at the study's start as at its end (its noise never
    rose) still gets its round.
    Nothing runs unless some contender reads at least 1 + noise_rel. Returns the pairs measured."""
    t0 = time.monotonic()
    trials = study.get_trials(deepcopy=False)
    rose = objective.noise_rose()
    auto = objective.search.confirm == "auto"
    # the bounds' band: the pruner's (the study's measured spread when above search.noise_rel, also
    # when it was that high from the study's start and so never rose), or the spread that rose
    spread = study.user_attrs.get(NOISE)
    noise = max(noise_rel, rose or 0.0, spread or 0.0)
    rounds_max = CONFIRM_PAIRS_MAX
    at_floor = rose is None and auto
    if at_floor:  # at the floor: the trials' winner and what its time share allows
        # the trials' winner; when they name off, the best by pessimistic bound whose drafts are
        # accepted (a noisy machine's two pairs rarely clear the one-sided bound; without accepted
        # drafts no pair can make it win; the nothing-reads-a-winner check below still holds)
        named = pick_winner(trials, noise_rel, objective.levels).candidate
        lead = named or next((c for c in _by_bound(trials, noise) if c.tau is None or c.tau >= 1 + noise_rel), None)
        if lead is None:
            return 0
        field_ = contenders(trials, noise, lead)
        rounds_max = CONFIRM_FLOOR
        near = {s.model_dump_json() for s, _ in _near(trials, lead, noise, {lead.spec.model_dump_json()})}
        why = ("a pruned trial's one repeat read within the noise of the trials' winner"
               if any(s.model_dump_json() in near for s, _ in field_[1:])
               else "the trials' bounds do not tell the top configurations apart")
        if named is None:
            why += " and none of them clears the baseline by the winner's rule yet"
        if spread is not None and spread > noise_rel:
            why += f" (their band: the study's baseline passes spread {spread:.1%}; it never rose above its floor)"
    else:
        field_ = contenders(trials, noise)
        why = (f"the baseline passes spread {rose:.1%}, above the machine's floor" if rose is not None
               else "search.confirm=always")
    # nothing to confirm when no contender even reads what the winner rule asks (1 + noise_rel):
    # the slowdown trap needs no head-to-head
    if len(field_) < 2 or max(geomean(r) for _, r in field_) < 1 + noise_rel:
        return 0
    lead_spec, lead_known = field_[0]
    # the noisy machine's round gives one-pair readings a pair's band; the floor's keeps its cost
    specs = [lead_spec] + [field_[1:][i][0] for i in unresolved(field_[1:], lead_known, noise, pairs=not at_floor)]
    if len(specs) < 2:
        return 0
    log(f"confirmation round: {why}; {lead_spec.key()} head to head with "
        f"{', '.join(s.key() for s in specs[1:])}")
    budget_s = max(CONFIRM_SHARE * trials_seconds(trials), CONFIRM_MIN_S)
    first = 1 + max((t.user_attrs.get(CONFIRM_ROUND, -1) for t in trials if role(t) == "confirm"), default=-1)
    head: dict[str, dict[int, float]] = {s.model_dump_json(): {} for s in specs}

    def ranked() -> dict[str, Candidate]:
        # what pick_winner ranks by: the round's pairs and the trial pairs that agree with them (a
        # pruned first repeat is not among them)
        return {c.spec.model_dump_json(): c for c in candidates(study.get_trials(deepcopy=False), noise_rel)}

    # the noisy machine's round takes in, once its pairs have placed the best, a configuration left
    # out against the leader's trial reading whose own reading the best's bounds cannot tell apart
    reserve = [] if at_floor else _reserve(trials, noise, {s.model_dump_json() for s in specs})
    live, pairs, left, joined = list(specs), 0, "", []
    best, hb = lead_spec, head[lead_spec.model_dump_json()]  # set from the second round on
    for r in range(rounds_max):
        for spec in live:
            t = objective.confirm(spec, pairs, first + r)
            head[spec.model_dump_json()][first + r] = t.user_attrs["ratios"][0]
            pairs += 1
        if r == 0:
            continue  # a head-to-head interval needs two rounds
        now = ranked()
        measured = [s for s in specs if head[s.model_dump_json()] and s.model_dump_json() in now]
        best = max(measured, key=lambda s: now[s.model_dump_json()].ranked_by())
        hb = head[best.model_dump_json()]
        open_ = [s for s in measured if s is not best and head_verdict(head[s.model_dump_json()], hb, noise_rel) == "open"]
        over = r + 1 >= rounds_max or time.monotonic() - t0 >= budget_s
        lo = reading_bounds(now[best.model_dump_json()].ratios, noise)[0]
        # at most CONFIRM_TOP a look, the best readings first: a round's cost stays that of its field
        new = [] if over else [spec for spec, ratios in sorted(reserve, key=lambda x: -geomean(x[1]))
                               if reading_bounds(ratios, noise)[1] >= lo][:CONFIRM_TOP]
        reserve = [(spec, ratios) for spec, ratios in reserve if spec not in new]
        for spec in new:
            head[spec.model_dump_json()] = {}
        specs += new
        joined += new
        live = [best] + open_ + new
        if not open_ and not new:
            break
        if r + 1 < rounds_max and time.monotonic() - t0 >= budget_s:
            left = f"; stopped after {budget_s:.0f} s (the trials' time, at least {CONFIRM_MIN_S:.0f} s)"
            break
    else:
        left = f"; {rounds_max} rounds"
    undecided = [s for s in specs if s is not best and head[s.model_dump_json()]
                 and head_verdict(head[s.model_dump_json()], hb, noise_rel) == "open"]
    if undecided:
        left += (f", {best.key()} read best, not told apart from {', '.join(s.key() for s in undecided)} "
                 f"nor within {tie_rel(noise_rel):.0%} of it: the best reading wins")
    if joined:
        left += (f"; taken in once the round placed the best: {', '.join(s.key() for s in joined)}")
    log(f"confirmation round: {pairs} pairs in {time.monotonic() - t0:.0f} s{left}")
    return pairs


def _reserve(trials: list[FrozenTrial], noise_rel: float, taken: set[str]) -> list[tuple[SpecConfig, list[float]]]:
    """What the noisy machine's round may still take in, with its trial ratios: the complete
    configurations whose optimistic bound reaches 1.0, and the pruned ones by their first repeat
    (figures that stayed implausible and reused points left out), none of `taken`."""
    out = [(c.spec, c.ratios) for c in _by_bound(trials, noise_rel) if c.spec.model_dump_json() not in taken]
    seen = set(taken) | {spec.model_dump_json() for spec, _ in out}
    for t in trials:
        spec, ratios = spec_of(t), t.user_attrs.get("ratios")
        if (t.state == TrialState.PRUNED and spec is not None and ratios and REUSED not in t.user_attrs
                and not t.user_attrs.get("implausible") and spec.model_dump_json() not in seen):
            out.append((spec, ratios[:1]))
            seen.add(spec.model_dump_json())
    return out


def pick_winner(trials: list[FrozenTrial], noise_rel: float, concurrency: list[Level]) -> Winner:
    """The proven winner of a study, or `off` with the reason why speculation does not pay."""
    done = candidates(trials, noise_rel)
    if not done:
        return Winner(OFF, None, "no speculative configuration completed a measurement: speculation stays off")
    feasible = [c for c in done if c.feasible]
    if not feasible:
        viol = sorted({t.user_attrs.get("slo_violations", "") for c in done for t in c.trials} - {""})
        return Winner(OFF, None, "no speculative configuration met the workload's SLOs "
                                 f"({'; '.join(viol[:3])}): speculation stays off")
    winners = [c for c in feasible if c.beats_baseline(noise_rel)]
    # what vLLM serves of a tree: a static chain (an adaptive one is served as the study's static schedule)
    chains = [c for c in winners if c.spec.topk == 1 and not c.spec.adaptive]
    chain = _cheapest_of_best(chains, noise_rel)[0] if chains else None
    if not winners:
        best = max(feasible, key=lambda c: c.speedup)
        ci = f", 95% CI [{best.ci_low:.3f}, {best.ci_high:.3f}]" if best.ci_low is not None else ""
        head = (f"slowdown trap: no speculative configuration beats the baseline beyond noise "
                f"(+{noise_rel:.0%}); the best, {best.spec.key()}, reached {best.speedup:.3f}x{ci}. ")
        tau = best.tau
        if tau is None:
            why = "Acceptance unknown (the engine reported no tau)."
        elif tau < TAU_LOW:
            why = (f"Acceptance too low: tau={tau:.2f} tokens per target forward, so drafts are rarely "
                   "accepted and drafting plus verifying is pure overhead.")
        else:
            at = (f"concurrency {concurrency}" if all(isinstance(c, int) for c in concurrency)
                  else ", ".join(level_name(c) for c in concurrency))
            why = (f"Verification too costly at {at}: tau={tau:.2f} tokens per target "
                   f"forward, but verifying {best.spec.budget} tokens per step costs more than the accepted "
                   "tokens save.")
        return Winner(OFF, None, head + why + " Serve without speculation.")
    pick, n_tied = _cheapest_of_best(winners, noise_rel)
    n = len(pick.trials)
    reason = f"{pick.spec.key()}: {pick.speedup:.3f}x over the baseline measured adjacent in time"
    if pick.ci_low is not None:
        reason += f" (95% CI [{pick.ci_low:.3f}, {pick.ci_high:.3f}]"
        reason += f"; one-sided 95% lower bound {pick.lower:.3f})" if pick.lower is not None else ")"
    if pick.tau is not None:
        reason += f", tau {pick.tau:.2f}"
    if pick.confirmed:
        reason += f"; head to head in the confirmation round {geomean(pick.confirmed):.3f}x over {len(pick.confirmed)} pairs"
    if n > 1:
        reason += f", pooled over {n} trials"
    if pick.confirmed and pick.reading is not None and abs(pick.reading / pick.speedup - 1) > 5e-4:
        reason += (f"; ranked at {pick.reading:.3f}x (each pair within {CLIP_BANDS:g} noise bands of its "
                   "configuration's median)")
    left_out = [(c, r) for c in winners if c.confirmed for r in c.dropped]
    if left_out:
        reason += ("; left out as outliers against the round's pairs: "
                   + ", ".join(f"{c.spec.key()}'s trial pair {r:.3f}x" for c, r in left_out))
    if n_tied > 1:
        reason += (f"; {n_tied} configurations could not be told apart and read within {tie_rel(noise_rel):.0%} of "
                   "the best: the smallest budget wins")
    return Winner(pick.spec, pick, reason + _unlike_leader(trials, pick, noise_rel, n_tied), chain)


def _unlike_leader(trials: list[FrozenTrial], pick: Candidate, noise_rel: float, n_tied: int) -> str:
    """Why the winner is not the best by pessimistic bound (`leader`: what the progress line,
    history.png and the report's trials show), or '' when it is."""
    lead = leader(trials, noise_rel)
    if lead is None or lead.spec == pick.spec:
        return ""
    head = f"; the best by lower bound, {describe(lead, noise_rel)}, "
    if pick.confirmed and lead.confirmed:
        return head + (f"read {lead.ranked_by():.3f}x over its round pairs and the trial pairs that agree with them "
                       f"(each within {CLIP_BANDS:g} noise bands of their median), against {pick.ranked_by():.3f}x: "
                       "the best reading wins")
    if n_tied > 1 and lead.spec.budget > pick.spec.budget and ties(lead.ratios or [lead.speedup],
                                                                   pick.ratios or [pick.speedup], noise_rel):
        return head + "ties with it"
    if not lead.beats_baseline(noise_rel):
        return head + "does not beat the baseline beyond noise by the winner's rule (its own one-sided bound)"
    return head + (f"reads {lead.speedup:.3f}x: among the configurations that beat the baseline beyond noise the "
                   "best reading wins (no confirmation round measured both head to head)")


def _level_key(level: Level) -> str:
    return f"{level.rps:g} req/s" if isinstance(level, Rate) else f"c={level}"


def _level_speedups(c: Candidate, n: int) -> list[float | None]:
    """A candidate's speedup at each of n levels: per trial the level's tok/s over its paired
    baseline's (means over the repeats), the geometric mean over its trials."""
    out: list[float | None] = []
    for i in range(n):
        ratios = [lv[i]["tok_s"] / lv[i]["baseline_tok_s"] for t in c.trials
                  if len(lv := t.user_attrs.get("levels") or []) == n and lv[i].get("baseline_tok_s")]
        out.append(geomean(ratios) if ratios else None)
    return out


def compare_arms(trials: list[FrozenTrial], noise_rel: float, levels: list[Level], win: Winner) -> Arms | None:
    """The adaptive arm against the best static schedule and off, at every measured level (None when
    no adaptive configuration completed a measurement). Each arm is its best configuration by the
    winner's rule (the fastest when none beats off), with its speedup over the baseline measured
    beside it per level, and that speedup x the baseline trial's tok/s at the level (as Optuna's
    values are)."""
    done = [c for c in candidates(trials, noise_rel) if c.feasible]
    # an implausible figure never wins, but the arm is still shown from it when it is all there is
    adaptive = [c for c in done if c.spec.adaptive and c.implausible is None] or [c for c in done if c.spec.adaptive]
    if not adaptive:
        return None
    static = [c for c in done if not c.spec.adaptive and c.implausible is None]

    def best_of(cs: list[Candidate]) -> Candidate | None:  # the winner's rule; the fastest when none beat off
        proven = [c for c in cs if c.beats_baseline(noise_rel)]
        return _cheapest_of_best(proven, noise_rel)[0] if proven else max(cs, key=lambda c: c.speedup, default=None)

    best_adaptive, best_static = best_of(adaptive), best_of(static)
    assert best_adaptive is not None
    base = next((t for t in trials if role(t) == "baseline" and t.state == TrialState.COMPLETE), None)
    off = [lv.get("tok_s") for lv in (base.user_attrs.get("levels") or [])] if base is not None else []
    off = off if len(off) == len(levels) else [None] * len(levels)
    a_sp = _level_speedups(best_adaptive, len(levels))
    s_sp = _level_speedups(best_static, len(levels)) if best_static is not None else [None] * len(levels)

    def tok(sp: float | None, o: float | None) -> float | None:
        return round(sp * o, 2) if sp is not None and o is not None else None

    rows = [ArmLevel(level=_level_key(lv), off_tok_s=round(o, 2) if o is not None else None,
                     static_speedup=round(s, 4) if s is not None else None, static_tok_s=tok(s, o),
                     adaptive_speedup=round(a, 4) if a is not None else None, adaptive_tok_s=tok(a, o))
            for lv, o, s, a in zip(levels, off, s_sp, a_sp)]
    choice = "off" if win.spec.method == "off" else "adaptive" if win.spec.adaptive else "static"
    return Arms(choice=choice, adaptive=best_adaptive.spec, static=best_static.spec if best_static else None,
                static_beats_off=best_static is not None and best_static.beats_baseline(noise_rel),
                adaptive_speedup=round(best_adaptive.speedup, 4),
                static_speedup=round(best_static.speedup, 4) if best_static is not None else None, levels=rows)


def describe_arms(arms: Arms) -> str:
    """One line: the adaptive arm against the best static schedule and off, and which was chosen."""
    a = f"adaptive {arms.adaptive.key()} {arms.adaptive_speedup:.3f}x" if arms.adaptive is not None else "adaptive -"
    s = (f"best static {arms.static.key()} {arms.static_speedup:.3f}x" if arms.static is not None
         else "no static schedule measured")
    return f"arms over every level: {a}, {s}, off 1.000x: chosen {arms.choice}"


def _mean_attr(trials: list[Any], key: str) -> float | None:
    """Mean of a figure over the pooled trials that recorded it (None if none did)."""
    vals = [t.user_attrs[key] for t in trials if t.user_attrs.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def best_result(cfg: Config, study: optuna.Study, run_dir: Path, win: Winner, objective: Objective | None) -> BestResult:
    """Re-measure the winner on the held-out prompts and assemble best.yaml."""
    trials = study.get_trials(deepcopy=False)
    base_trial = next((t for t in trials if role(t) == "baseline" and t.state == TrialState.COMPLETE), None)

    def figs(a: dict[str, Any], prefix: str = "tok_s") -> Figures:
        return Figures(output_tokens_per_s=a[prefix], ci_low=a.get(f"{prefix}_ci_low"),
                       ci_high=a.get(f"{prefix}_ci_high"), tau=a.get("tau"),
                       ttft_p99_ms=a.get("ttft_p99_ms"), tpot_p99_ms=a.get("tpot_p99_ms"),
                       itl_p50_ms=a.get("itl_p50_ms"), itl_p99_ms=a.get("itl_p99_ms"), draft_mb=a.get("draft_mb"))

    c = win.candidate
    if c is not None:
        metrics = Figures(output_tokens_per_s=c.mean("tok_s"), ci_low=c.mean("tok_s_ci_low"),
                          ci_high=c.mean("tok_s_ci_high"), tau=c.tau,
                          ttft_p99_ms=max(t.user_attrs.get("ttft_p99_ms") or 0.0 for t in c.trials) or None,
                          tpot_p99_ms=max(t.user_attrs.get("tpot_p99_ms") or 0.0 for t in c.trials) or None,
                          itl_p50_ms=_mean_attr(c.trials, "itl_p50_ms"),
                          itl_p99_ms=max(t.user_attrs.get("itl_p99_ms") or 0.0 for t in c.trials) or None,
                          draft_mb=max(t.user_attrs.get("draft_mb") or 0.0 for t in c.trials) or None)
        baseline = Figures(output_tokens_per_s=c.mean("baseline_tok_s"))
        speedup = c.speedup
    else:
        metrics = figs(base_trial.user_attrs) if base_trial is not None else None
        baseline = metrics
        speedup = 1.0 if metrics is not None else None
    heldout = heldout_baseline = heldout_speedup = check = None
    if cfg.workload.num_heldout > 0 and objective is not None:
        if win.spec.method == "off":  # nothing to compare: the baseline's own figures on the held-out prompts
            h = objective.evaluate(win.spec, "heldout", repeats_max=min(HELDOUT_PAIRS, cfg.search.repeats_max))
        else:
            check, h = heldout_check(cfg, objective, win.spec)
        heldout = Figures(output_tokens_per_s=h["tok_s"], ci_low=h["tok_s_ci_low"], ci_high=h["tok_s_ci_high"],
                          tau=h["tau"], ttft_p99_ms=h["ttft_p99_ms"], tpot_p99_ms=h["tpot_p99_ms"],
                          itl_p50_ms=h.get("itl_p50_ms"), itl_p99_ms=h.get("itl_p99_ms"),
                          draft_mb=h.get("draft_mb"))
        heldout_baseline = Figures(output_tokens_per_s=h["baseline_tok_s"])  # what the held-out speedup divides by
        heldout_speedup = h["speedup"]
    chain = win.chain.spec if win.chain is not None else None
    arms = compare_arms(trials, cfg.search.noise_rel, cfg.workload.levels, win)
    parts = part_results(cfg, win.spec, objective) if objective is not None else []
    skipped = objective.skipped_requests() if objective is not None else 0
    from tuner.study.measurer import auto_weights_timed

    timed = auto_weights_timed(cfg)  # read from the cache the engine's timing wrote when it loaded
    return BestResult(
        parts=parts, skipped_requests=skipped, arms=arms,
        spec=win.spec, chain_spec=chain, metrics=metrics, baseline=baseline, speedup=speedup,
        heldout=heldout, heldout_baseline=heldout_baseline, heldout_speedup=heldout_speedup, heldout_check=check,
        reason=win.reason,
        k_schedule_note=(("K per batch-size band tuned (spec.k_per_batch_size; the bands follow the concurrency "
                          "levels and the batch sizes the baseline ran at each request rate)") if cfg.workload.request_rate
                         else "K per concurrency band tuned (spec.k_per_batch_size)") if win.spec.k_per_batch_size else None,
        provenance=Provenance(
            study=study.study_name, trial=c.trials[0].number if c is not None else
            (base_trial.number if base_trial is not None else None),
            storage=mask_url(storage_url(cfg.search, run_dir)),  # no password in best.yaml
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            model=cfg.model.name, hardware=cfg.hardware.name, engine=cfg.engine.kind, workload=cfg.workload.name,
            measured_weights=measured_weights(cfg, timed), served_weights=cfg.model.hf_id,
            weights_reason=weights_reason(cfg, timed),
            server=measured_server(cfg, measured_version(trials, c.trials if c is not None else [], objective))),
    )


# One side of the held-out check as its passes measured it: per pair, per level, the spec's and the
# baseline's per-prompt (output tokens, seconds) (tuner.study.objective.Sample.per_prompt)
PerPrompt = list[tuple[int, float]]
SidePasses = list[list[tuple[PerPrompt | None, PerPrompt | None]]]
GAP_DRAWS = 2000  # bootstrap draws of the gap's interval


def _side_log_speedup(side: SidePasses, prompts: list[int], pairs: list[int]) -> float:
    """log of one side's speedup over the given prompts and pairs (indices, repeats allowed): per pair
    and level the spec's tok/s over the baseline's, each a ratio of sums over the prompts (as the
    load generator's tok/s is), geometric mean over the pairs and levels (as the check's speedup is)."""
    logs = []
    for j in pairs:
        for spec, off in side[j]:
            assert spec is not None and off is not None
            st, ss = sum(spec[i][0] for i in prompts), sum(spec[i][1] for i in prompts)
            bt, bs = sum(off[i][0] for i in prompts), sum(off[i][1] for i in prompts)
            logs.append(math.log((st / ss) / (bt / bs)))
    return statistics.fmean(logs)


def gap_interval(tuning: SidePasses, heldout: SidePasses, gap: float, seed: int = 0,
                 draws: int = GAP_DRAWS, resample_pairs: bool = True) -> tuple[float, float] | None:
    """The 95% interval of the check's gap (held-out / tuning - 1) over which prompts each side holds
    and which pairs it measured: each draw resamples, independently per side, its prompts and (with
    `resample_pairs`) its pairs with replacement, and recomputes both speedups from the per-prompt
    figures; the interval is the measured `gap` moved by the draws' 2.5th and 97.5th percentiles
    around the full sample's (on logs). None when a pass recorded no per-prompt figures or a side
    holds fewer than two prompts that every pass played to the end. Without `resample_pairs` every
    draw keeps all the pairs as measured: the interval is the prompts' alone, for a caller that adds
    the pairs' noise as measured over many more pairs (`widen`).

    The gap's sampling error is mostly the prompts': one prompt's tau under an n-gram chain differs
    widely from another's, so two small sets differ however long they are timed
    (benchmarks/split_gap.py). A t-interval over two pairs knows nothing of it."""
    sides = (tuning, heldout)
    kept: list[list[int]] = []
    for side in sides:
        passes = [pp for pair in side for level in pair for pp in level]
        if not passes or any(pp is None for pp in passes):
            return None
        # the prompts every pass of the side played to the end with tokens (a request the engine
        # refused as such, from the user's own file, has none)
        n = min(len(pp) for pp in passes if pp is not None)
        kept.append([i for i in range(n) if all(pp[i][0] > 0 and pp[i][1] > 0 for pp in passes if pp is not None)])
    if min(len(k) for k in kept) < 2:
        return None
    rng = random.Random(seed)
    full = [_side_log_speedup(side, k, list(range(len(side)))) for side, k in zip(sides, kept)]
    shifts = []
    for _ in range(draws):
        d = []
        for side, k in zip(sides, kept):
            prompts = [k[rng.randrange(len(k))] for _ in k]
            pairs = [rng.randrange(len(side)) for _ in side] if resample_pairs else list(range(len(side)))
            d.append(_side_log_speedup(side, prompts, pairs))
        shifts.append((d[1] - d[0]) - (full[1] - full[0]))
    shifts.sort()
    lo, hi = shifts[int(0.025 * draws)], shifts[min(draws - 1, int(0.975 * draws))]
    return (1 + gap) * math.exp(lo) - 1, (1 + gap) * math.exp(hi) - 1


def verdict(low: float | None, high: float | None, tuning: float) -> str | None:
    """The check's verdict from its gap interval [low, high] and the tuning side's speedup: `holds`
    when the interval holds 0 and excludes the gap at which the held-out prompts would run no faster
    than off (1 / tuning - 1: the interval is narrow enough to say speculation still pays on prompts
    it never tuned on); `below` / `above` when the whole interval lies on one side of 0 (the held-out
    prompts differ beyond what which prompts and which pairs explain); `inconclusive` otherwise.
    None without an interval."""
    if low is None or high is None:
        return None
    if high < 0:
        return "below"
    if low > 0:
        return "above"
    return "holds" if tuning > 1 and low > 1 / tuning - 1 else "inconclusive"


def pair_noise(trials: list[FrozenTrial]) -> tuple[float, int] | None:
    """How far one (configuration, baseline) pair's ratio strays at a fixed configuration: the
    standard deviation of the logs of the ratios about each configuration's own mean, pooled over
    the study's configurations measured in two pairs or more (trials and confirmation round alike;
    a figure that stayed implausible left out), and its degrees of freedom. None without any."""
    ss, df = 0.0, 0
    for c in candidates(trials):
        if c.implausible is not None or len(c.ratios) < 2 or any(r <= 0 for r in c.ratios):
            continue
        logs = [math.log(r) for r in c.ratios]
        m = statistics.fmean(logs)
        ss += sum((v - m) ** 2 for v in logs)
        df += len(logs) - 1
    return (math.sqrt(ss / df), df) if df else None


def check_pairs(noise: tuple[float, int] | None, search: SearchConfig, repeats_max: int) -> int | None:
    """Pairs the held-out check measures when the study's trials measured how far a pair's
    ratio strays (`noise`, its spread and degrees of freedom: pair_noise): CHECK_PAIRS_MIN while it
    is at most what two passes at search.noise_rel each make it (sqrt(2) x noise_rel), else
    CHECK_PAIRS_MIN x (noise / that)^2 rounded up, at most twice search.repeats_max (and never fewer
    than CHECK_PAIRS_MIN), as the spread sizes a trial's repeats. None when
    that noise is not known well enough (fewer than PAIR_NOISE_MIN_DF degrees of freedom) or the
    baseline spread rose during the study (repeats_max above search.repeats_max): then the check
    repeats until its own intervals are tight, as a trial does."""
    if noise is None or noise[1] < PAIR_NOISE_MIN_DF or repeats_max > search.repeats_max:
        return None
    n = math.ceil(CHECK_PAIRS_MIN * (noise[0] / (math.sqrt(2) * search.noise_rel)) ** 2 - 1e-9)
    return max(CHECK_PAIRS_MIN, min(n, 2 * search.repeats_max))


def pooled_noise(noise: tuple[float, int], ratios: list[list[float]]) -> tuple[float, int]:
    """The trials' pair noise (spread of a pair's log ratio, degrees of freedom) pooled with the
    check's own pairs: each list of `ratios` (one side's, two pairs or more) adds its logs' squared
    deviations about their own mean, and their count less one."""
    ss, df = _log_deviations(ratios)
    ss, df = ss + noise[0] ** 2 * noise[1], df + noise[1]
    return math.sqrt(ss / df), df


def pair_half_width(noise: float, df: int) -> float:
    """The half-width, on logs, of one pair's 95% interval when a pair's log ratio strays by `noise`
    (estimated on `df` degrees of freedom)."""
    return t95(df + 1) * noise


def widen(low: float, high: float, gap: float, noise: float, df: int, pairs: int = 1) -> tuple[float, float]:
    """The gap's 95% interval [low, high] over prompts, widened by the pairs' noise: each side's log
    speedup carries noise^2 / pairs of it (a pair's log ratio strays by `noise`, estimated on `df`
    degrees of freedom), the gap twice that; added to each half-width in quadrature, on logs."""
    g = math.log1p(gap)
    extra = pair_half_width(noise, df) * math.sqrt(2 / pairs)
    return (math.expm1(g - math.hypot(g - math.log1p(low), extra)),
            math.expm1(g + math.hypot(math.log1p(high) - g, extra)))


def heldout_check(cfg: Config, objective: Objective, spec: SpecConfig) -> tuple[HeldoutCheck, dict[str, Any]]:
    """The winner on the held-out prompts against as many tuning prompts (check_prompt_count),
    both in one pass, prompt by prompt (Objective.check, tuner.projection.profiling.check_order):
    the check (the gap, its interval over prompts and pairs, `gap_interval`, and its `verdict`) and
    the held-out split's figures.

    When the study's trials measured the pairs' noise (`pair_noise`, PAIR_NOISE_MIN_DF or more) and
    the baseline spread did not rise, that noise sizes the pairs (`check_pairs`: two at the floor,
    more above it, as a trial's repeats are), and the intervals are the prompts' (pairs kept as
    measured) widened by that noise pooled with the check's own pairs' (`pooled_noise`, `widen`):
    two pairs resampled show half their variance. `widen` takes the sides' pair noise as
    independent; in one pass they share each pass's state, so the gap's interval errs wide. Else, as
    a trial may take now (more pairs when the noise rose, at least two), until both speedup
    intervals are tight, with intervals of their own."""
    noise = pair_noise(objective.study.get_trials(deepcopy=False))
    sized = check_pairs(noise, cfg.search, objective.repeats_max)
    at_tune, at_held = check_order(check_prompt_count(cfg), cfg.workload.num_heldout)
    got = objective.check(spec, CHECK_PASS, {CHECK: at_tune, "heldout": at_held}, sized or max(2, objective.repeats_max),
                          loaded_max=CHECK_PAIRS_LOADED, load_cores=LOAD_CORES)
    if sized is not None and noise is not None:
        noise = pooled_noise(noise, [got[CHECK]["ratios"], got["heldout"]["ratios"]])

    def side(split: str, n: int) -> SplitSpeedup:
        f = got[split]
        lo, hi = f["speedup_ci_low"], f["speedup_ci_high"]
        if sized is not None and noise is not None:  # the pairs' noise as the study and the check measured it
            half = pair_half_width(*noise) / math.sqrt(f["repeats"])
            lo, hi = f["speedup"] * math.exp(-half), f["speedup"] * math.exp(half)
        return SplitSpeedup(prompts=n, speedup=f["speedup"], ci_low=lo, ci_high=hi, tau=f["tau"],
                            tok_s=f["tok_s"], baseline_tok_s=f["baseline_tok_s"])

    tune, held = side(CHECK, check_prompt_count(cfg)), side("heldout", cfg.workload.num_heldout)
    gap = held.speedup / tune.speedup - 1 if tune.speedup > 0 else 0.0
    pairs = got["heldout"]["repeats"]
    ci = gap_interval(got[CHECK].pop("per_prompt"), got["heldout"].pop("per_prompt"), gap, seed=cfg.seed,
                      resample_pairs=sized is None)
    if ci is not None and sized is not None and noise is not None:
        ci = widen(ci[0], ci[1], gap, noise[0], noise[1], pairs=min(got[CHECK]["repeats"], pairs))
    lo, hi = ci if ci is not None else (None, None)
    again = got["heldout"].get("remeasured", [])  # the pass's: both sides share it
    return HeldoutCheck(pairs=pairs, tuning=tune, heldout=held, gap=gap, gap_ci_low=lo,
                        gap_ci_high=hi, verdict=verdict(lo, hi, tune.speedup),
                        pair_noise=round(noise[0], 4) if sized is not None and noise is not None else None,
                        remeasured=again or None, implausible=got["heldout"].get("implausible"),
                        check_side=objective.study.user_attrs.get(CHECK_SIDE),
                        load_cores=got["heldout"].pop("load_cores", None),
                        pairs_cut=got["heldout"].pop("pairs_cut", None)), got["heldout"]


def heldout_excess(c: HeldoutCheck) -> float | None:
    """How far the check's gap lies beyond its interval over prompts and pairs: 0 when the interval
    holds 0, else the distance from 0 to its nearer end (what benchmarks/fidelity.py's
    max_heldout_gap takes the maximum of); None without an interval."""
    if c.gap_ci_low is None or c.gap_ci_high is None:
        return None
    return max(0.0, c.gap_ci_low, -c.gap_ci_high)


def tau_gap(c: HeldoutCheck) -> float | None:
    """How far the held-out prompts' tau lies from the tuning prompts' (held-out / tuning - 1) in the
    check: a property of the prompts (how much of each greedy answer repeats what came before), not
    of the measurement: one prompt's tau differs widely from another's, so small sets differ however
    they are split (benchmarks/split_gap.py)."""
    t, h = c.tuning.tau, c.heldout.tau
    return h / t - 1 if t and h else None


def gap_at_equal_tau(c: HeldoutCheck) -> float | None:
    """The check's gap over its tau gap: (held-out speedup / its tau) over (tuning speedup / its tau),
    minus 1. Descriptive only: a speedup is not proportional to tau, so this is neither the timing's
    error nor a property of the configuration. A speculative step costs more on a longer context and
    when it carries a draft (an n-gram drafter proposes nothing where it finds no match, and that
    step costs what off's does), so speedup / tau is higher where tau is lower, as on this workload's
    held-out prompts, and it moves from pass to pass, either side of zero (benchmarks/heldout_sides.py,
    docs/results.md). benchmarks/fidelity.py once kept only its size, which read as "above zero in
    every run"; signed, it falls either side of zero, and the matched sides' drafted-step share and
    context agree (docs/results.md, issue 39, session 32)."""
    g = tau_gap(c)
    return (1 + c.gap) / (1 + g) - 1 if g is not None else None


def describe_check(c: HeldoutCheck) -> str:
    """'held-out 1.30x [1.22, 1.39] on 6 prompts against tuning 1.35x [1.28, 1.42] on 6 (3 pairs each,
    interleaved): 3.7% below [-31.2%, +30.5%] over prompts and pairs: holds; tau 1.71 against 1.86
    (8.1% below)'."""
    def one(x: SplitSpeedup) -> str:
        ci = f" [{x.ci_low:.2f}, {x.ci_high:.2f}]" if x.ci_low is not None and x.ci_high is not None else ""
        return f"{x.speedup:.3f}x{ci}"

    def rel(g: float) -> str:
        return f"{abs(g):.1%} {'below' if g < 0 else 'above'}"

    pairs = f"{c.pairs} pairs, both sides in each pass, prompt by prompt"
    if c.pair_noise is not None:
        pairs += f", sized by the pair noise {c.pair_noise:.1%} (the trials' and the check's own)"
    line = (f"held-out check: held-out {one(c.heldout)} on {c.heldout.prompts} prompts against tuning {one(c.tuning)} "
            f"on {c.tuning.prompts} ({pairs}): {rel(c.gap)}")
    if c.gap_ci_low is not None and c.gap_ci_high is not None:
        line += f" [{c.gap_ci_low:+.1%}, {c.gap_ci_high:+.1%}] over prompts and pairs: {c.verdict}"
    g = tau_gap(c)
    if g is not None:
        line += f"; tau {c.heldout.tau:.2f} against {c.tuning.tau:.2f} ({rel(g)})"
    if c.pairs_cut:
        line += f"; pairs stopped at {c.pairs_cut}, as a trial's repeats"
    if c.remeasured:
        line += "; a pair measured again as implausible (best.yaml heldout_check.remeasured says why)"
    if c.implausible:
        n = len(re.findall(r"(?:^|; )pair \d+: ", c.implausible))  # Objective.check's "pair N: why" parts
        line += (f"; {n} pair{'s' if n > 1 else ''} counted as read, still implausible "
                 "(best.yaml heldout_check.implausible says why)")
    return line


def measured_version(trials: list[FrozenTrial], winners: list[FrozenTrial], objective: Objective | None) -> str | None:
    """The launched engine's release the study measured: this process's server's with what the
    winner's trials recorded (all trials' when they recorded none), so a shared study's finaliser
    whose server never started, or a report from the storage alone, still has it. Several releases
    are listed, comma-separated, so render refuses them."""
    mine = objective.engine_version() if objective is not None else None
    seen = [t.user_attrs.get(ENGINE_VERSION) for t in winners]
    if not any(seen):
        seen = [t.user_attrs.get(ENGINE_VERSION) for t in trials]
    found = sorted({v for v in [mine, *seen] if v})
    return ", ".join(found) if found else None


def part_results(cfg: Config, spec: SpecConfig, objective: Objective) -> list[PartResult]:
    """A mixed workload: the winner on each part's requests alone (held-out when there are some),
    paired with the baseline as every measurement is, so a user sees which part it serves well."""
    from engine.measure.workloads import split_counts
    from tuner.study.measurer import part_split

    w = cfg.workload
    if not w.mix:
        return []
    split = "heldout" if w.num_heldout > 0 else "tune"
    counts = split_counts([p.weight for p in w.mix], w.num_heldout if split == "heldout" else w.num_prompts)
    out = []
    for part, n in zip(w.mix, counts):
        h = objective.evaluate(spec, part_split(part.label), repeats_max=min(HELDOUT_PAIRS, cfg.search.repeats_max))
        out.append(PartResult(name=part.label, weight=part.weight, requests=n, split=split, tau=h["tau"],
                              speedup=h["speedup"], output_tokens_per_s=h["tok_s"],
                              baseline_tokens_per_s=h["baseline_tok_s"]))
    return out


def compute_best(cfg: Config, study: optuna.Study, run_dir: Path, objective: Objective | None,
                 log: Callable[[str], None] = lambda s: None) -> BestResult:
    """Pick the winner from the study's trials and assemble best.yaml. With an objective (an
    engine) at hand, the confirmation round runs first and the winner is re-measured on the
    held-out prompts after; without one, both are left out."""
    t0 = time.monotonic()
    if objective is not None and not cfg.search.multi_objective:
        confirm(study, objective, cfg.search.noise_rel, log)
    t1 = time.monotonic()
    win = pick_winner(study.get_trials(deepcopy=False), cfg.search.noise_rel, cfg.workload.levels)
    if objective is None and cfg.workload.num_heldout > 0:
        cfg = cfg.model_copy(deep=True)
        cfg.workload.num_heldout = 0
    if cfg.workload.num_heldout > 0:
        log("re-measuring the winner on the held-out prompts against as many tuning prompts, interleaved")
    if cfg.workload.mix and objective is not None:
        log(f"measuring the winner on each of the {len(cfg.workload.mix)} parts of the mix")
    best = best_result(cfg, study, run_dir, win, objective)
    if best.heldout_check is not None:
        log(describe_check(best.heldout_check))
    best.phases_s = {"confirmation": round(t1 - t0, 3), "held-out": round(time.monotonic() - t1, 3)}
    if best.arms is not None:
        log(describe_arms(best.arms))
    if cfg.search.capacity:
        if objective is None:  # a finaliser without an engine: the rates cannot be measured here
            log("search.capacity=true: not measured (no engine in this process); best.yaml has no capacity")
        else:
            from tuner.study.capacity import describe, measure_capacity

            base_tok_s = best.baseline.output_tokens_per_s if best.baseline is not None else None
            t2 = time.monotonic()
            best.capacity = measure_capacity(cfg, objective.measure, best.spec, base_tok_s, log)
            best.phases_s["capacity"] = round(time.monotonic() - t2, 3)
            log(describe(best.capacity, best.spec.key()))
    return best
