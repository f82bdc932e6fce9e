"""One trial: measure a SpecConfig against the baseline measured adjacent in time, until the
speedup's confidence interval is tight, and record everything in the trial's user attrs.

The machines are noisy (about +-15%), so each repeat is a pair (speculation, baseline) in
alternating order, and the trial's figure is the speedup ratio of the pairs. Its objective value
is output tokens/s corrected for drift: speedup x the study's reference baseline (trial 0), so
trials measured at different moments compare fairly.

A crash, a time-out or an invalid point never stops the study: the trial is told FAIL with its
reason in the `fail_reason` user attr.
"""

from __future__ import annotations

from contextlib import nullcontext

import math
import statistics
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import optuna
from optuna.trial import FrozenTrial, TrialState, create_trial

from engine.models import cpuload
from engine.measure.stats import f95, geomean, log_interval, log_spread, robust_log_spread, tight
from tuner.study.limits import REPEAT_MARGIN, TrialClock, TrialTimeout, active_clock, next_repeat_fits
from tuner.schema.config import Level, Rate, SearchConfig, SpecConfig, WorkloadConfig, level_name
from tuner.search.space import SearchSpace
from tuner.study.studies import CONFIRM_ROUND, FAIL_REASON, FLOOR, NOISE, PROBE_PASSES, REUSED, ROLE, ROSE, role

OFF = SpecConfig(method="off")
ENGINE_VERSION = "engine_version"  # trial user attr: the launched engine's release that measured it
# study user attr of a study with rates: its latest K bands [lo, hi, the K parameter] (the first drafts depth)
K_BANDS = "k_bands"
_CONSTRAINT_PREFIX = "constraints:"  # where Optuna keeps a trial's constraint values (its system attrs)
# Re-measurements of an implausible pair before its figure is kept (flagged) as it is.
PLAUSIBILITY_RETRIES = 2
# Re-measurements across a whole held-out check (all its pairs): under a load that comes and goes,
# each of its up to CHECK_PAIRS_LOADED pairs could otherwise be measured three times.
CHECK_RETRIES = 2 * PLAUSIBILITY_RETRIES
OUTLIER_HISTORY = 3  # baseline passes before one can be called an outlier (two say little of the spread)
OUTLIER_WINDOW = 5  # the recent baseline passes an outlier is judged against: a glitch is one or two passes
OUTLIER_BANDS = 3  # how many noise bands (on logs) from the median a pass, or a pair's ratio, is an outlier
OWN_HISTORY = 2  # a configuration's own passes before one of its passes can be an outlier: the band is the
# baseline history's spread, so two passes need only place the centre
# The machine's noise floor: the spread of the study's first baseline passes (trial 0's and the
# first trials' paired baselines: its first minute or so). The recent spread, over the last
# NOISE_WINDOW passes (a drift over the study is not in it: pairs cancel drift), costs repeats only
# when it rises above that floor beyond chance.
FLOOR_PASSES = 6
NOISE_WINDOW = 6
# A trial's first pair shares the baseline pass that ended the trial before only when it starts this
# soon after it (the sampler's ask between them); anything that ran longer between them (a guided
# sampler's profiling, say) leaves the pass too far from the pair: a fresh one is measured.
SHARE_WITHIN_S = 5.0


@dataclass
class Sample:
    """What one run of the load generator measured for one configuration at one concurrency."""

    tok_s: float
    tau: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    draft_mb: float | None = None  # the drafter's parameters + KV cache (built-in engine), MB
    itl_p50_ms: float | None = None  # inter-token latency (gaps between streamed chunks)
    itl_p99_ms: float | None = None
    goodput: float | None = None  # finished requests/s meeting the workload's TTFT and TPOT SLOs
    wall_s: float | None = None  # the run's wall time (goodput's floor: half a request over it)
    ttft_p50_ms: float | None = None
    tpot_p50_ms: float | None = None
    queue_p50_ms: float | None = None  # open loop, in process: arrival to admission
    queue_p99_ms: float | None = None
    waiting_mean: float | None = None  # open loop: requests waiting for a slot, on average
    batch_sizes: dict[int, int] | None = None  # open loop: requests per step -> steps (or gauge samples)
    # per prompt of the split, in its order: (output tokens, end-to-end seconds) summed over the
    # requests that played it; what the held-out check's interval over prompts resamples
    per_prompt: list[tuple[int, float]] | None = None
    # per prompt, in the same order: target forwards summed over its requests (in process only: a
    # server counts forwards over every request), what a part of the pass's tau is drawn from
    per_prompt_forwards: list[int] | None = None


# Which prompts a pass plays: "tune", "heldout", the held-out check's tuning prompts
# (tuner.projection.profiling.CHECK), or one part of a mixed workload (tuner.study.measurer.part_split)
Split = str


@runtime_checkable
class MeasureFn(Protocol):
    """What a trial measures with: one run of the load generator for `spec` on the prompts of
    `split` at one level: `level` requests in flight (an int) or requests arriving at a Rate. The optimize flow builds it from the engine and
    the shared runner (tuner.study.measurer.Measurer); nothing here generates tokens itself."""

    def __call__(self, spec: SpecConfig, split: Split, level: Level) -> Sample: ...


@runtime_checkable
class ServerMeasureFn(MeasureFn, Protocol):
    """A MeasureFn over a launched server, which a trial measures serving-first (one restart less),
    whose start-ups it records apart from every measurement, and whose release it records on
    every trial."""

    @property
    def engine_version(self) -> str | None:
        """The launched engine's release (None until read, or where the server does not say)."""
        ...

    def serving(self, spec: SpecConfig) -> bool:
        """Whether the server up now serves `spec`."""
        ...

    def startups(self) -> tuple[int, float]:
        """Server start-ups so far and their seconds, cumulative."""
        ...


@runtime_checkable
class SkipsRequests(Protocol):
    """A MeasureFn that plays the user's own requests and skips those the engine refuses as such
    (tuner.study.measurer.Measurer): their ids, counted in best.yaml's skipped_requests."""

    skipped: set[str]


def _mean_tok(samples: list[Sample]) -> float:
    """One pass's output tok/s: the mean over its levels."""
    return statistics.fmean(x.tok_s for x in samples)


def _max_opt(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return max(vals) if vals else None


def _mean_opt(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def _level_figures(level: Level, spec: list[Sample], base: list[Sample]) -> dict[str, Any]:
    """One level's figures over the repeats: tok/s of the spec and the baseline, and for a request
    rate also goodput, TTFT / TPOT p50 and p99 (worst repeat), queueing and the batch sizes run."""
    out: dict[str, Any] = {"tok_s": statistics.fmean(x.tok_s for x in spec),
                           "baseline_tok_s": statistics.fmean(x.tok_s for x in base)}
    if not isinstance(level, Rate):
        return {"concurrency": level, **out}
    out = {"rate": level.rps, **out}
    for who, xs in (("", spec), ("baseline_", base)):
        out[f"{who}goodput"] = _mean_opt([x.goodput for x in xs])
        for k in ("ttft_p50_ms", "tpot_p50_ms", "queue_p50_ms"):
            out[f"{who}{k}"] = _mean_opt([getattr(x, k) for x in xs])
        for k in ("ttft_p99_ms", "tpot_p99_ms", "queue_p99_ms"):
            out[f"{who}{k}"] = _max_opt([getattr(x, k) for x in xs])
        out[f"{who}waiting_mean"] = _mean_opt([x.waiting_mean for x in xs])
        sizes: dict[str, int] = {}
        for x in xs:
            for n, k in (x.batch_sizes or {}).items():
                sizes[str(n)] = sizes.get(str(n), 0) + k  # str keys: user attrs are JSON
        out[f"{who}batch_sizes"] = dict(sorted(sizes.items(), key=lambda kv: int(kv[0])))
    return out


def side_sample(x: Sample, at: list[int]) -> Sample:
    """The part of pass `x` that played the prompts at positions `at` (a side of the held-out check's
    pass): their per-prompt figures; tok/s the pass's scaled by their tokens over seconds against the
    whole pass's (the pass's rate at its level, on these prompts); tau their tokens over their target
    forwards, None where the engine counts forwards over the pass only (a launched server). The
    latencies (TTFT, TPOT, ITL percentiles) and the draft's memory are the pass's: a step's time is
    the engine's at that level, not a prompt's, and the pass interleaves both sides' requests."""
    pp = x.per_prompt
    if pp is None or max(at, default=-1) >= len(pp):
        raise RuntimeError(f"the held-out check's pass needs per-prompt figures for positions up to "
                           f"{max(at, default=0)}; it recorded {0 if pp is None else len(pp)}")
    mine = [pp[i] for i in at]
    tokens, seconds = sum(t for t, _ in mine), sum(s for _, s in mine)
    all_tokens, all_seconds = sum(t for t, _ in pp), sum(s for _, s in pp)
    whole = all_tokens / all_seconds if all_seconds > 0 else 0.0
    rate = (tokens / seconds) / whole if seconds > 0 and whole > 0 else 0.0
    fw = x.per_prompt_forwards
    my_fw = [fw[i] for i in at] if fw is not None and len(fw) == len(pp) else None
    forwards = sum(my_fw) if my_fw is not None else 0
    return replace(x, tok_s=x.tok_s * rate, tau=tokens / forwards if forwards else None, per_prompt=mine,
                   per_prompt_forwards=my_fw, goodput=None, wall_s=None, batch_sizes=None)


@dataclass
class TrialOutcome:
    """What the progress display and the tests need from one finished trial."""

    number: int
    state: TrialState
    spec: SpecConfig
    tok_s: float | None = None
    speedup: float | None = None
    reason: str | None = None
    note: str | None = None  # one line for the user: the measured noise changed how trials repeat
    reused_from: int | None = None  # the earlier trial of the same point whose figures it took (not measured)


class Objective:
    """Runs trials of one study with a MeasureFn (ask, measure, set constraints, tell)."""

    def __init__(self, study: optuna.Study, space: SearchSpace, measure: MeasureFn, workload: WorkloadConfig,
                 search: SearchConfig, share_baseline: bool = True) -> None:
        self.study = study
        self.space = space
        self.measure = measure
        self.workload = workload
        self.search = search
        self.levels: list[Level] = workload.levels  # concurrency levels and request rates alike
        self.multi = search.multi_objective
        self.repeats_max = search.repeats_max  # sized by the measured noise (track_noise)
        # the last pass measured, (its split, its samples, when it ended), while it is the baseline's:
        # the next trial's first pair, baseline first, takes it as its baseline (`evaluate`, shared)
        self._tail: tuple[Split, list[Sample], float] | None = None
        # False: every pair measures its own baseline, spec first (what planted tests of other rules script)
        self.share_baseline = share_baseline

    # ---- measuring -------------------------------------------------------------------------
    def _at_levels(self, spec: SpecConfig, split: Split) -> list[Sample]:
        self._tail = None  # a pass that fails leaves nothing to share
        got = [self.measure(spec, split, c) for c in self.levels]
        self._tail = (split, got, time.monotonic()) if spec.method == "off" else None
        return got

    def _shareable(self, split: Split) -> list[Sample] | None:
        """The last pass measured when it was the baseline's on `split` and ended within SHARE_WITHIN_S."""
        t = self._tail
        return t[1] if t is not None and t[0] == split and time.monotonic() - t[2] <= SHARE_WITHIN_S else None

    def measure_pair(self, spec: SpecConfig, split: Split, repeat: int) -> tuple[list[Sample], list[Sample]]:
        """One repeat: the spec and the baseline back to back, order alternating to cancel drift."""
        if repeat % 2 == 0:
            s = self._at_levels(spec, split)
            b = self._at_levels(OFF, split)
        else:
            b = self._at_levels(OFF, split)
            s = self._at_levels(spec, split)
        return s, b

    def evaluate(self, spec: SpecConfig, split: Split = "tune", trial: optuna.Trial | None = None,
                 started: float | None = None, repeats_max: int | None = None, first: int = 0,
                 shared: bool = False) -> dict[str, Any]:
        """Measure `spec` with adjacent baselines until the speedup CI is tight (or repeats_max,
        by default what the measured noise allows: repeats_for); `first`: the order of the first
        pair (even: spec first).

        `shared`: when the first pair runs baseline first (`first` odd: a trial's off-spec spec-off,
        every other pair of the confirmation round) and the last pass measured was the baseline's on
        this split (the end of the trial or pair before, SHARE_WITHIN_S ago at most), that pass is
        this pair's baseline instead of another measured back to back: as adjacent in time as a
        measured one, while each pair of a trial keeps a baseline of its own, so a trial costs three
        passes instead of four. The shared pass counts once in the study's baseline history (attr
        `baseline_passes` holds this measurement's new ones, `baseline_shared` says one was shared).

        A repeat that is implausible (see `implausible`) is measured again, up to
        PLAUSIBILITY_RETRIES times, before it counts: before it can prune, rank or win. Reports
        intermediate values to `trial` and raises TrialPruned when it is hopeless. Returns the
        figures (tok/s, baseline, speedup and its intervals, tau, p99 latencies, repeats, and why
        repeats were measured again).
        """
        started = started or time.monotonic()
        ratios: list[float] = []
        spec_s: list[list[Sample]] = []
        base_s: list[list[Sample]] = []
        remeasured: list[str] = []  # why a pair was measured again
        passes_b: list[float] = []  # every baseline pass measured, retries too: the machine's recent state
        kept: list[str] = []  # pairs still implausible after every retry
        still: str | None = None
        is_off = spec.method == "off"
        repeats_max = repeats_max or self.repeats_max
        server = self.measure if isinstance(self.measure, ServerMeasureFn) else None
        # The order still alternates between repeats; a launched server that already serves the
        # baseline is measured first, so a trial of 2 repeats restarts it twice instead of three times.
        flip = int(not is_off and server is not None and server.serving(OFF) and not server.serving(spec))
        if shared and not is_off:
            flip = 0  # the caller's order: a pair baseline first may share the pass before it
        before = self._shareable(split) if shared else None
        reused = False  # whether the first pair took that pass as its baseline
        starts0, startup0 = server.startups() if server is not None else (0, 0.0)
        history = self.outlier_history(trial) if split == "tune" and not is_off else []
        own = self.spec_history(spec, trial) if split == "tune" and not is_off else []
        passes = first  # pairs measured, re-measurements included: the order alternates over all of them
        figures: dict[str, Any] = {}
        for r in range(repeats_max):
            clock = active_clock()  # the trial's measuring clock (none for the held-out check)
            repeat_t0 = clock.elapsed() if clock is not None else 0.0
            with clock.measuring() if clock is not None else nullcontext():
                if is_off:  # the baseline itself: one measurement per repeat, speedup 1 by definition
                    s = self._at_levels(OFF, split)
                    b = s
                    ratio = 1.0
                else:
                    s, b, ratio, retried, still, used = self.plausible_pair(
                        spec, split, passes + flip, history + passes_b, own + [_mean_tok(x) for x in spec_s],
                        passes_b, shared=shared and r == 0)
                    reused = reused or (before is not None and b is before)
            if not is_off:
                passes += used
                remeasured += [f"repeat {r + 1}: {why}" for why in retried]
                if still is not None:  # kept after every retry: it never prunes another trial nor wins
                    kept.append(f"repeat {r + 1}: {still}")
            spec_s.append(s)
            base_s.append(b)
            ratios.append(ratio)
            figures = self._figures(spec_s, base_s, ratios)
            if remeasured:
                figures["remeasured"] = remeasured
            if remeasured or reused:
                figures["baseline_passes"] = passes_b
            if reused:
                figures["baseline_shared"] = True
            if kept:
                figures["implausible"] = "; ".join(kept)
            if server is not None:  # server start-ups are never inside a measurement; recorded apart
                starts, startup = server.startups()
                figures.update(server_starts=starts - starts0, server_startup_s=round(startup - startup0, 2))
            if trial is not None:
                for k, v in figures.items():
                    trial.set_user_attr(k, v)
                if not self.multi and not is_off:
                    trial.report(self._value(figures), r)
            done = len(ratios) >= self.search.repeats_min and (
                is_off and self._tight([_mean_tok(s_) for s_ in spec_s])
                or not is_off and self._tight(ratios))
            if clock is not None:
                # threads without SIGALRM: a repeat that ran past the limit fails the trial, the last one
                # too, as the alarm would have in the main thread
                clock.check()
            if done or r + 1 == repeats_max:
                break
            # Pruning is single-objective only in Optuna; the study's pruner is BoundPruner.
            if trial is not None and not self.multi and not is_off and trial.should_prune():
                raise optuna.TrialPruned(f"hopeless after {r + 1} repeat(s): speedup {ratios[-1]:.3f}, its optimistic "
                                         "bound below the best trial's pessimistic one")
            if clock is not None:
                # Size the repeats to the limit: stop (complete) when one more would not fit.
                if not next_repeat_fits(clock.elapsed() - repeat_t0):
                    if trial is not None:
                        trial.set_user_attr("repeats_cut", f"search.trial_timeout_s={self.search.trial_timeout_s:g}")
                    break
        return figures

    def plausible_pair(self, spec: SpecConfig, split: Split, order: int, history: list[float],
                       own: list[float] | None = None, seen: list[float] | None = None, shared: bool = False,
                       spread: list[float] | None = None, retries: int = PLAUSIBILITY_RETRIES
                       ) -> tuple[list[Sample], list[Sample], float, list[str], str | None, int]:
        """One pair (`order` even: spec first) measured again while it is implausible (`implausible`
        against the baseline passes `history` and the spec's own earlier passes `own`), up to
        `retries` times: (spec samples, baseline samples, its ratio, why each retry was
        measured, why the kept pair is still implausible or None, pairs measured). None too when
        the baseline moved and stayed (`_moved`): a load that ended or began shifts every later
        baseline, and a pair measured back to back still measures the configuration; and when the
        spec's own passes are the only fault left: a configuration that reads off its earlier
        passes every time is measured again, never barred from winning. Every attempt's baseline
        pass is appended to `seen` (retries too: they measure the machine's state as well as the
        kept one does), and a retry is judged against `history` plus the attempts before it, so a
        machine that moved is recognised from its recent passes. `shared`: a first attempt baseline
        first takes the last pass measured as its baseline when that was the baseline's on `split`
        (Objective.evaluate); it is not appended to `seen` (it was seen when it was measured).
        `spread`: `implausible`'s, when `history` holds passes on other prompts than the study's."""
        retried: list[str] = []
        bases: list[float] = []
        for attempt in range(retries + 1):
            tail = self._shareable(split) if shared and attempt == 0 and order % 2 == 1 else None
            if tail is not None:
                b, s = tail, self._at_levels(spec, split)
            else:
                s, b = self.measure_pair(spec, split, order + attempt)
            ratio = geomean([self._score(x) / max(self._score(y), self._floor(y)) for x, y in zip(s, b)])
            still = self.implausible(s, b, history + bases, own, spread)
            bases.append(_mean_tok(b))
            if seen is not None and tail is None:
                seen.append(bases[-1])
            if (still is not None and attempt == retries
                    and self.implausible(s, b, history + bases[:-1], spread=spread) is None):
                retried.append(f"{still}; so after every retry: the pair counts" if retries else
                               f"{still}; so with no re-measurement left: the pair counts")
                return s, b, ratio, retried, None, attempt + 1
            if (still is not None and attempt == retries
                    and self._moved(bases, s, b, history if spread is None else spread)):
                # every retry's baseline read the same away from the history: the machine's state
                # changed (a load ended or began) and stayed; the pair, measured back to back, holds
                retried.append(f"{still}; every retry's baseline read alike: the machine changed, the pair counts")
                return s, b, ratio, retried, None, attempt + 1
            if still is None or attempt == retries:
                return s, b, ratio, retried, still, attempt + 1
            retried.append(still)
        raise AssertionError("unreachable: the last attempt returns")

    def _moved(self, bases: list[float], s: list[Sample], b: list[Sample], history: list[float]) -> bool:
        """Whether the baseline moved and stayed rather than glitched: the last pair's only fault is
        its baseline against the history (no ratio above tau), and every attempt's baseline lies
        within one noise band (on logs) of the others."""
        noise = self.noise(history)
        no_history = self.implausible(s, b, [])  # the tau rule alone
        return (no_history is None and len(bases) > 1 and min(bases) > 0
                and math.log(max(bases) / min(bases)) <= noise)

    def check(self, spec: SpecConfig, split: Split, sides: dict[str, list[int]], pairs_max: int,
              loaded_max: int = 0, load_cores: float = 0.0) -> dict[str, dict[str, Any]]:
        """The winner's held-out check: `spec` against the baseline on `split`, one pass that plays
        both sides' prompts in turn (the held-out prompts and as many tuning prompts,
        tuner.projection.profiling.check_order; `sides`: each side's positions in the pass), pairs
        in alternating order (spec-off, off-spec, ...). Whatever the machine does during a pass (a
        load that comes or goes, a slower minute) falls on both sides alike and cancels in their
        gap; played side after side, it fell on one. Pairs go on until every side's speedup
        interval is tight (search.ci_rel_width, as a trial's) after at least two, at most
        `pairs_max` (one when it is 1). Under load it goes on while fewer than that many of its
        pairs were quiet (other processes kept at most `load_cores` cores busy during the pair:
        engine.models.cpuload.others_cores, read around each pair, retries included), up to
        `loaded_max` pairs; where the machine cannot be read, as many pairs as without load.
        Implausible pairs are measured again (`plausible_pair`) at most CHECK_RETRIES times over
        the whole check; once those are spent, a pair is measured once and kept as it reads. Pairs
        past the first two are measured only while one more like the last fits in
        search.trial_timeout_s, as a trial's repeats are: the check measures one configuration, and
        under a heavy load its pairs, slower and more of them, otherwise took many times a trial.

        Plausibility holds as in a trial (the pass as a whole: tau, its baseline, its spec pass),
        but a baseline pass is judged against the baseline's earlier passes on these prompts, the
        noise band the study's baseline passes (`implausible`'s `spread`): off runs at another
        speed on other prompts (their lengths, their answers'), so the trials' passes cannot place
        its centre. Each side's figures are drawn from the per-prompt tokens, seconds and forwards
        (`side_sample`). Returns each side's figures (Objective._figures, with `remeasured` /
        `implausible`, the pass's, when they apply, `per_prompt`: per pair and level, the spec's
        and the baseline's Sample.per_prompt on that side, `load_cores`: per pair, how many cores
        other processes kept busy, and `pairs_cut`, the limit that stopped the pairs, when one did)."""
        got: dict[str, tuple[list[list[Sample]], list[list[Sample]], list[float]]] = {
            sd: ([], [], []) for sd in sides}
        spread = self.outlier_history()  # the machine's noise as the study's baseline passes spread
        seen: list[float] = []  # the check's own baseline passes, retries too, in the order measured
        passes: list[float] = []  # the check's spec passes: the spec's own on these prompts
        retried: list[str] = []
        kept: list[str] = []
        loads: list[float | None] = []
        order = r = 0
        budget = CHECK_RETRIES
        cut: str | None = None
        t0 = time.monotonic()
        while True:
            pair_t0 = time.monotonic()
            mark = cpuload.busy_mark()
            allowed = min(PLAUSIBILITY_RETRIES, budget)
            s, b, _, again, still, used = self.plausible_pair(spec, split, r + order, list(seen), passes, seen,
                                                              spread=spread, retries=allowed)
            budget -= used - 1
            cores = cpuload.others_cores(mark)
            loads.append(round(cores, 3) if cores is not None else None)
            order += used - 1  # a retry shifts the order of what follows, as in a trial
            r += 1
            passes.append(_mean_tok(s))
            retried += [f"pair {r}: {why}" for why in again]
            if still is not None:
                spent = "" if allowed == PLAUSIBILITY_RETRIES else "; the check's re-measurements were spent"
                kept.append(f"pair {r}: {still}{spent}")
            for sd, at in sides.items():
                spec_s, base_s, ratios = got[sd]
                spec_s.append([side_sample(x, at) for x in s])
                base_s.append([side_sample(y, at) for y in b])
                ratios.append(geomean([x.tok_s / max(y.tok_s, 1e-12) for x, y in zip(spec_s[-1], base_s[-1])]))
            quiet = sum(1 for x in loads if x is not None and x <= load_cores)
            settled = r >= loaded_max or loads[-1] is None or quiet >= min(r, max(pairs_max, 1))
            if settled and (r >= max(pairs_max, 1) or r >= 2 and all(self._tight(got[sd][2]) for sd in sides)):
                break
            now = time.monotonic()
            if r >= 2 and now - t0 + REPEAT_MARGIN * (now - pair_t0) > self.search.trial_timeout_s:
                cut = f"search.trial_timeout_s={self.search.trial_timeout_s:g}"
                break
        out: dict[str, dict[str, Any]] = {}
        for sd, (spec_s, base_s, ratios) in got.items():
            out[sd] = self._figures(spec_s, base_s, ratios)
            # per pair, per level: the spec's and the baseline's per-prompt (tokens, seconds), for the
            # check's interval over prompts (tuner.study.selection.gap_interval); kept in memory only
            out[sd]["per_prompt"] = [[(x.per_prompt, y.per_prompt) for x, y in zip(s, b)] for s, b in zip(spec_s, base_s)]
            if retried:
                out[sd]["remeasured"] = retried
            if kept:
                out[sd]["implausible"] = "; ".join(kept)
            out[sd]["load_cores"] = loads
            if cut is not None:
                out[sd]["pairs_cut"] = cut
        return out

    def baseline_history(self, trial: optuna.Trial | None = None) -> list[float]:
        """Every baseline tok/s measured on the tuning prompts so far (mean over the levels per
        pass), in the order measured: trial 0's passes and each trial's paired baselines (those of
        pairs measured again too), `trial` itself left out."""
        out: list[float] = []
        mine = trial.number if trial is not None else None
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if t.number == mine or REUSED in t.user_attrs:
                continue
            out += t.user_attrs.get("tok_s_samples", []) if role(t) == "baseline" else t.user_attrs.get(
                "baseline_passes", t.user_attrs.get("baseline_samples", []))
        return out

    def outlier_history(self, trial: optuna.Trial | None = None) -> list[float]:
        """What a paired baseline pass is judged against (`implausible`): the baseline passes the
        study measured before trial 0 (study attr PROBE_PASSES, tuner.study.limits.check_trial_fits),
        then its baseline history. A study's first pairs otherwise have fewer than OUTLIER_HISTORY
        passes behind them, and a baseline that dipped in trial 1 or 2 could prune or win unjudged."""
        return [*self.study.user_attrs.get(PROBE_PASSES, []), *self.baseline_history(trial)]

    def spec_history(self, spec: SpecConfig, trial: optuna.Trial | None = None) -> list[float]:
        """Every pass of `spec` measured on the tuning prompts so far (tok/s, mean over the levels per
        pass) by other trials of the same configuration (a confirmation round's, a repeated
        sample's), `trial` itself and reused trials left out."""
        out: list[float] = []
        mine = trial.number if trial is not None else None
        want = spec.model_dump(mode="json")
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if t.number != mine and REUSED not in t.user_attrs and t.user_attrs.get("spec_json") == want:
                out += t.user_attrs.get("tok_s_samples", [])
        return out

    def noise(self, history: list[float]) -> float:
        """The relative noise the plausibility rules allow: search.noise_rel, or the spread of the
        study's baseline passes when it is larger (a busy machine), robust to the glitches these rules
        look for: one baseline pass at a third of the others (a process that started beside it) made
        the standard deviation so wide that no later glitch was an outlier."""
        return max(self.search.noise_rel, robust_log_spread(history) or 0.0)

    def implausible(self, s: list[Sample], b: list[Sample], history: list[float],
                    own: list[float] | None = None, spread: list[float] | None = None) -> str | None:
        """Why one pair (spec samples `s`, baseline samples `b`, per level) cannot be believed, or None.

        A speedup of output tok/s can never exceed tau (tokens per target forward: a speculative
        step costs at least one forward), so a level's ratio above tau x (1 + noise) is a baseline
        that dipped or a glitch. A paired baseline more than 3 noise bands (on logs) from the
        median of the study's last OUTLIER_WINDOW baseline passes (`history`, OUTLIER_HISTORY or
        more; the recent ones, so that a load that began or ended becomes the norm) is an outlier:
        its ratio measures the machine's load, not the configuration. So is a spec pass as far from
        the median of the same configuration's earlier passes (`own`, OWN_HISTORY or more; the band
        is the baseline's, a property of the machine): a spec pass that dipped deflates the ratio
        as a dipped baseline inflates it, and would cost the configuration its rank.

        `spread`: the baseline passes whose spread is the machine's noise when `history` holds the
        passes on other prompts than the study's (the held-out check's pass): an off pass's tok/s
        depends on the prompts (their lengths, their answers'), so only passes on the same prompts
        place the centre, and with the band known from `spread` OWN_HISTORY of them do, as a
        configuration's own passes do.
        """
        noise = self.noise(history if spread is None else spread)
        if self.search.objective == "speed":  # a goodput ratio may exceed tau (requests meeting SLOs)
            for c, x, y in zip(self.levels, s, b):
                ratio = x.tok_s / max(y.tok_s, 1e-12)
                if x.tau is not None and ratio > x.tau * (1 + noise):
                    return (f"speedup {ratio:.3f}x at {level_name(c)} exceeds tau {x.tau:.2f} x (1 + noise "
                            f"{noise:.2f}): a speedup cannot exceed tau")
        if len(history) >= (OUTLIER_HISTORY if spread is None else OWN_HISTORY):
            recent = history[-OUTLIER_WINDOW:]
            mid, now = statistics.median(recent), _mean_tok(b)
            if mid > 0 and now > 0 and abs(math.log(now / mid)) > OUTLIER_BANDS * noise:
                whose = "the study's baseline history" if spread is None else "the baseline's passes on these prompts"
                return (f"paired baseline {now:.1f} tok/s is an outlier against {whose} "
                        f"(median {mid:.1f} tok/s over the last {len(recent)} passes, noise {noise:.2f})")
        if own is not None and len(own) >= OWN_HISTORY:
            mid, now = statistics.median(own), _mean_tok(s)
            if mid > 0 and now > 0 and abs(math.log(now / mid)) > OUTLIER_BANDS * noise:
                return (f"spec pass {now:.1f} tok/s is an outlier against this configuration's own passes "
                        f"(median {mid:.1f} tok/s over {len(own)} passes, noise {noise:.2f})")
        return None

    def _score(self, x: Sample) -> float:
        """What the search ranks: output tok/s (search.objective=speed) or goodput."""
        if self.search.objective == "speed":
            return x.tok_s
        if x.goodput is None:
            raise RuntimeError("search.objective=goodput: this engine's measurement carries no per-request latencies")
        return x.goodput

    def _floor(self, x: Sample) -> float:
        """The smallest baseline a ratio divides by: a baseline without one good request counts as
        half a request over its run, so a spec that meets the SLOs is not divided by zero."""
        if self.search.objective == "speed" or not x.wall_s:
            return 1e-12
        return 0.5 / x.wall_s

    def _tight(self, xs: list[float]) -> bool:
        return tight(xs, self.search.ci_rel_width)

    def _figures(self, spec_s: list[list[Sample]], base_s: list[list[Sample]], ratios: list[float]) -> dict[str, Any]:
        tok = [_mean_tok(s) for s in spec_s]
        base = [_mean_tok(b) for b in base_s]
        # ratios and rates multiply: their intervals are taken on logs (never negative, asymmetric)
        sp, sp_lo, sp_hi, sp_lower, sp_upper = log_interval(ratios)
        t, t_lo, t_hi, _, _ = log_interval(tok)
        flat = [x for s in spec_s for x in s]
        return {
            "tok_s": t, "tok_s_ci_low": t_lo, "tok_s_ci_high": t_hi,
            "baseline_tok_s": statistics.fmean(base),
            "speedup": sp, "speedup_ci_low": sp_lo, "speedup_ci_high": sp_hi,
            "speedup_lower": sp_lower, "speedup_upper": sp_upper,  # one-sided 95% bounds: prune and rank
            "tau": _mean_opt([x.tau for x in flat]),
            "ttft_p99_ms": _max_opt([x.ttft_p99_ms for x in flat]),
            "tpot_p99_ms": _max_opt([x.tpot_p99_ms for x in flat]),
            "itl_p50_ms": _mean_opt([x.itl_p50_ms for x in flat]),
            "itl_p99_ms": _max_opt([x.itl_p99_ms for x in flat]),
            "draft_mb": _max_opt([x.draft_mb for x in flat]),
            "repeats": len(ratios),
            "ratios": ratios,
            "tok_s_samples": tok,
            "baseline_samples": base,  # the study's baseline history (plausibility)
            # per level, over the repeats: what the throughput-vs-concurrency plot and, for rates,
            # the per-rate table show
            "levels": [_level_figures(c, [s[i] for s in spec_s], [b[i] for b in base_s])
                       for i, c in enumerate(self.levels)],
            "goodput": _mean_opt([x.goodput for x in flat]),
            "baseline_goodput": _mean_opt([y.goodput for b in base_s for y in b]),
        }

    def _value(self, figures: dict[str, Any]) -> float:
        ref = self.study.user_attrs.get("reference_tok_s")
        return figures["speedup"] * ref if ref else figures["tok_s"]

    # ---- one trial ---------------------------------------------------------------------------
    def run_one(self) -> TrialOutcome:
        """Ask one trial, measure it and tell its outcome (with a note when the measured noise
        changed how trials repeat: track_noise). Never raises for a failing trial;
        KeyboardInterrupt marks the trial FAIL ('interrupted') and propagates."""
        outcome = self._run_trial()
        if not self.multi:
            outcome.note = self.track_noise()
        return outcome

    def repeats_for(self, noise: float, ref: float) -> int:
        """Pairs a trial may take at most while the recent spread `noise` is above the reference
        spread `ref` (the floor, at least search.noise_rel): an interval's width goes as
        noise / sqrt(pairs), so search.repeats_max x (noise / ref)^2 pairs separate configurations
        as well as search.repeats_max did at the floor; at most twice search.repeats_max."""
        n = math.ceil(self.search.repeats_max * (noise / max(ref, 1e-9)) ** 2 - 1e-9)
        return max(self.search.repeats_max, min(n, 2 * self.search.repeats_max))

    def noise_floor(self, history: list[float]) -> tuple[float | None, str | None]:
        """The machine's noise floor: the spread of the study's first FLOOR_PASSES baseline passes
        (recorded once, study attr FLOOR, so a resumed or shared study keeps it), None before there
        are as many; and the one line that says so when it is above search.noise_rel (else None)."""
        floor = self.study.user_attrs.get(FLOOR)
        if floor is not None or len(history) < FLOOR_PASSES:
            return floor, None
        floor = log_spread(history[:FLOOR_PASSES]) or 0.0
        self.study.set_user_attr(FLOOR, floor)
        if floor <= self.search.noise_rel:
            return floor, None
        return floor, (f"noise floor: the study's first {FLOOR_PASSES} baseline passes spread {floor:.1%} (above "
                       f"search.noise_rel={self.search.noise_rel:g}): this machine's ordinary spread; trials repeat "
                       f"up to {self.search.repeats_max} pairs unless the noise rises above it")

    def noise_rise(self, history: list[float], floor: float | None) -> float | None:
        """The spread of the last NOISE_WINDOW baseline passes when it is above the floor (at least
        search.noise_rel) beyond chance: the variance ratio past the one-sided 95% F quantile. Else
        None, also while the floor is not known yet."""
        if floor is None or len(history) < NOISE_WINDOW:
            return None
        recent = log_spread(history[-NOISE_WINDOW:])
        ref = max(floor, self.search.noise_rel)
        if recent is None or (recent / ref) ** 2 <= f95(NOISE_WINDOW - 1, FLOOR_PASSES - 1):
            return None
        return recent

    def noise_rose(self) -> float | None:
        """The highest recent spread that rose above the floor during the study (what turns the
        confirmation round on), or the current one; None when the noise stayed at its floor. A
        study too short to know its floor compares its whole spread with search.noise_rel."""
        history = self.baseline_history()
        floor = self.study.user_attrs.get(FLOOR)
        if floor is None and len(history) < FLOOR_PASSES:
            spread = log_spread(history)
            return spread if spread is not None and spread > self.search.noise_rel else None
        floor = floor if floor is not None else log_spread(history[:FLOOR_PASSES])
        now = self.noise_rise(history, floor)
        peak = self.study.user_attrs.get(ROSE)
        return max((x for x in (now, peak) if x is not None), default=None)

    def track_noise(self) -> str | None:
        """Measure the machine's noise from the study's baseline passes (trial 0's, then every
        trial's paired baseline): the whole spread widens the pruner's bands (study attr NOISE)
        when above search.noise_rel; the floor is set from the first passes (noise_floor); a recent
        spread above it beyond chance (noise_rise) sizes the repeats (repeats_for). One line per
        decision: the floor when it is above search.noise_rel, each change of the repeats."""
        history = self.baseline_history()
        spread = log_spread(history)
        if spread is None:
            return None
        if spread > self.search.noise_rel or NOISE in self.study.user_attrs:
            self.study.set_user_attr(NOISE, spread)
        floor, line = self.noise_floor(history)
        lines = [line] if line else []
        rose = self.noise_rise(history, floor)
        ref = max(floor or 0.0, self.search.noise_rel)
        n = self.repeats_for(rose, ref) if rose is not None else self.search.repeats_max
        if rose is not None:
            self.study.set_user_attr(ROSE, max(rose, self.study.user_attrs.get(ROSE, 0.0)))
        if n != self.repeats_max:
            self.repeats_max = n
            lines.append(f"noise: the last {NOISE_WINDOW} baseline passes spread {rose:.1%}, above the floor {ref:.1%} "
                         f"beyond chance: trials now repeat up to {n} pairs" if rose is not None else
                         f"noise: back at its floor {ref:.1%}: trials repeat up to {n} pairs")
        return "\n".join(lines) or None

    def _run_trial(self) -> TrialOutcome:
        trial = self.study.ask()
        started = time.monotonic()
        spec = OFF
        try:
            if role(trial) != "baseline":
                self._observe_rates()  # outside the trial's clock: it may wait for another worker's trial 0
            with TrialClock(self.search.trial_timeout_s):
                if role(trial) != "baseline":
                    spec = self.space.suggest(trial)
                record_spec(trial, spec)
                earlier = self._measured(spec)
                if earlier is not None:
                    return self._reuse(trial, spec, earlier)
                figures = self.evaluate(spec, "tune", trial, started, first=int(self.share_baseline),
                                        shared=self.share_baseline)
        except optuna.TrialPruned as exc:
            self._record_version(trial)
            trial.set_user_attr("prune_reason", str(exc))
            self.study.tell(trial, state=TrialState.PRUNED)
            return TrialOutcome(trial.number, TrialState.PRUNED, spec, reason=str(exc))
        except TrialTimeout as exc:
            self._fail(trial, f"TrialTimeout: {exc}")
            return TrialOutcome(trial.number, TrialState.FAIL, spec, reason=f"TrialTimeout: {exc}")
        except KeyboardInterrupt:
            self._fail(trial, "interrupted by the user (Ctrl-C)")
            raise
        except Exception as exc:  # any crash of the engine or the drafter: record it, keep searching
            reason = f"{type(exc).__name__}: {exc}".strip()
            trial.set_user_attr("traceback", traceback.format_exc(limit=8)[-4000:])
            self._fail(trial, reason)
            return TrialOutcome(trial.number, TrialState.FAIL, spec, reason=reason)
        trial.set_user_attr("duration_s", round(time.monotonic() - started, 3))
        self._record_version(trial)
        if role(trial) == "baseline" and "reference_tok_s" not in self.study.user_attrs:
            self.study.set_user_attr("reference_tok_s", figures["tok_s"])
        self._constrain(trial, figures)
        value = self._value(figures)
        if self.multi:
            tpot = figures["tpot_p99_ms"]
            self.study.tell(trial, [value, tpot if tpot is not None else float("inf")])
        else:
            self.study.tell(trial, value)
        return TrialOutcome(trial.number, TrialState.COMPLETE, spec, figures["tok_s"], figures["speedup"])

    def _observe_rates(self) -> None:
        """Give the space the batch sizes off ran at each request rate so far (baseline_rate_sizes), so
        the K bands follow them (tuner.search.space.batch_bands); record the bands in the study (attr
        K_BANDS, the latest; each trial's spec keeps the bands it was measured with). The
        grid and the model-guided sampler enqueue their points before anything is measured: their
        bands come from the concurrency levels alone."""
        if not self.space.waits_for_rate_sizes or self.search.sampler in ("grid", "model"):
            return
        self.space = self.space.with_rate_sizes(baseline_rate_sizes(self.study))
        bands = [list(b) for b in self.space.bands]
        if self.study.user_attrs.get(K_BANDS) != bands:
            self.study.set_user_attr(K_BANDS, bands)

    def engine_version(self) -> str | None:
        """The release of the launched engine measuring (None in process)."""
        return self.measure.engine_version if isinstance(self.measure, ServerMeasureFn) else None

    def skipped_requests(self) -> int:
        """The user's requests the engine refused as such so far (0 for a MeasureFn that skips none)."""
        return len(self.measure.skipped) if isinstance(self.measure, SkipsRequests) else 0

    def _record_version(self, trial: optuna.Trial) -> None:
        """The launched engine's release on the trial it measured: a shared study's finaliser, or a
        report made from the storage alone, reads it there (tuner.study.selection.measured_version)."""
        version = self.engine_version()
        if version is not None:
            trial.set_user_attr(ENGINE_VERSION, version)

    def _measured(self, spec: SpecConfig) -> optuna.trial.FrozenTrial | None:
        """An earlier COMPLETE or PRUNED trial of the same configuration (a sampler may propose a
        point again; it is not measured again as if it were new)."""
        # the whole spec, not its key: points that differ only in their K per band are different
        want = spec.model_dump(mode="json")
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if t.user_attrs.get("spec_json") == want and REUSED not in t.user_attrs:
                return t
        return None

    def _reuse(self, trial: optuna.Trial, spec: SpecConfig, earlier: optuna.trial.FrozenTrial) -> TrialOutcome:
        """Tell `trial` what `earlier` measured (its figures and state), marked reused_from: it is no
        new evidence, and it does not count against search.n_trials (tuner.study.studies.counted)."""
        trial.set_user_attr(REUSED, earlier.number)
        for k, v in earlier.user_attrs.items():
            if k not in ("spec", "spec_json", "role", "heartbeat") and not k.startswith("spec_"):
                trial.set_user_attr(k, v)
        if earlier.state == TrialState.PRUNED:
            self.study.tell(trial, state=TrialState.PRUNED)
            return TrialOutcome(trial.number, TrialState.PRUNED, spec, reason=f"same configuration as trial {earlier.number}",
                                reused_from=earlier.number)
        for name, c in earlier.constraints.items():
            trial.set_constraint(name, c)
        self.study.tell(trial, earlier.values if self.multi else earlier.value)
        return TrialOutcome(trial.number, TrialState.COMPLETE, spec, earlier.user_attrs.get("tok_s"),
                            earlier.user_attrs.get("speedup"), reused_from=earlier.number)

    def _slo(self, figures: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
        """The workload's SLOs as Optuna constraints (<= 0 is feasible) and the user attrs that say
        so (`feasible`, `slo_violations`)."""
        slo = self.workload.slo
        constraints: dict[str, float] = {}
        violations = []
        for key, limit in (("tpot_p99_ms", slo.tpot_p99_ms), ("ttft_p99_ms", slo.ttft_p99_ms)):
            if limit is None:
                continue
            measured = figures.get(key)
            c = (measured - limit) if measured is not None else 0.0
            constraints[key] = c
            if c > 0:
                violations.append(f"{key}={measured:.1f} > {limit:g}")
        attrs: dict[str, Any] = {"feasible": not violations}
        if violations:
            attrs["slo_violations"] = "; ".join(violations)
        return constraints, attrs

    def _constrain(self, trial: optuna.Trial, figures: dict[str, Any]) -> None:
        constraints, attrs = self._slo(figures)
        for key, c in constraints.items():
            trial.set_constraint(key, c)
        for key, v in attrs.items():
            trial.set_user_attr(key, v)

    def confirm(self, spec: SpecConfig, order: int, round_: int) -> FrozenTrial:
        """One head-to-head pair of the confirmation round (tuner.study.selection.confirm), in the
        order `order` (even: spec first), of its round `round_` (what pairs it with the other
        contenders' pairs), recorded as a COMPLETE trial with role `confirm`: added
        to the study, never asked of the sampler nor counted in search.n_trials. Plausibility holds
        as in any trial; a pair baseline first shares the baseline pass of the pair before it
        (`evaluate`, shared): within a round, two contenders then divide by one baseline pass, and
        their head-to-head quotient is their passes' own."""
        t0 = time.monotonic()
        figures = self.evaluate(spec, "tune", repeats_max=1, first=order, shared=self.share_baseline)
        constraints, attrs = self._slo(figures)
        tpot = figures["tpot_p99_ms"]
        value = self._value(figures)
        frozen = create_trial(
            state=TrialState.COMPLETE, values=[value, tpot if tpot is not None else float("inf")] if self.multi
            else [value], params={}, distributions={},
            user_attrs={**figures, **attrs, **spec_attrs(spec), ROLE: "confirm", CONFIRM_ROUND: round_,
                        **({ENGINE_VERSION: v} if (v := self.engine_version()) else {}),
                        "duration_s": round(time.monotonic() - t0, 3)},
            system_attrs={f"{_CONSTRAINT_PREFIX}{k}": c for k, c in constraints.items()})
        self.study.add_trial(frozen)
        return frozen

    def _fail(self, trial: optuna.Trial, reason: str) -> None:
        trial.set_user_attr(FAIL_REASON, reason)
        self.study.tell(trial, state=TrialState.FAIL)


def baseline_rate_sizes(study: optuna.Study, poll_s: float = 1.0) -> dict[float, dict[int, int]]:
    """The batch sizes (size -> steps) off ran at each request rate: trial 0's, pooled with every
    finished trial's paired baselines, so one disturbed pass (the engine's first, warming up) weighs
    less as the study goes on. In a shared study another worker may still be measuring trial 0: wait
    until it is told (a lost worker's trial is swept FAIL by the heartbeat sweep)."""
    while True:
        trials = study.get_trials(deepcopy=False)
        base = next((t for t in trials if role(t) == "baseline"), None)
        if base is None or base.state in (TrialState.FAIL, TrialState.PRUNED):
            raise RuntimeError("the baseline trial (trial 0) did not complete: no batch sizes per request rate to "
                               "draw the K bands from")
        if base.state == TrialState.COMPLETE:
            break
        time.sleep(poll_s)
    out: dict[float, dict[int, int]] = {}
    for t in trials:
        if t.state not in (TrialState.COMPLETE, TrialState.PRUNED) or REUSED in t.user_attrs:
            continue
        key = "batch_sizes" if t is base else "baseline_batch_sizes"
        for lv in t.user_attrs.get("levels", []):
            if "rate" in lv:
                sizes = out.setdefault(float(lv["rate"]), {})
                for k, v in (lv.get(key) or {}).items():
                    sizes[int(k)] = sizes.get(int(k), 0) + int(v)
    return out


def spec_attrs(spec: SpecConfig) -> dict[str, Any]:
    """A trial's SpecConfig as user attrs: whole (for best.yaml) and by field (for trials.csv)."""
    attrs: dict[str, Any] = {"spec": spec.key(), "spec_json": spec.model_dump(mode="json")}
    for k in ("depth", "topk", "budget"):
        attrs[f"spec_{k}"] = getattr(spec, k) if spec.method != "off" else None
    attrs["spec_method"] = spec.method
    return attrs


def record_spec(trial: optuna.Trial, spec: SpecConfig) -> None:
    """Store the trial's SpecConfig in its user attrs (spec_attrs)."""
    for k, v in spec_attrs(spec).items():
        trial.set_user_attr(k, v)


def spec_of(trial: optuna.trial.FrozenTrial) -> SpecConfig | None:
    """The SpecConfig a trial measured (from its user attrs), None if it never got that far."""
    raw = trial.user_attrs.get("spec_json")
    return SpecConfig.model_validate(raw) if raw is not None else None
