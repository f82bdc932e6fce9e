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

import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from engine.measure.stats import geomean, mean_ci, tight
from tuner.study.limits import TrialClock, TrialTimeout, active_clock, next_repeat_fits
from tuner.schema.config import Level, Rate, SpecConfig, WorkloadConfig
from tuner.search.space import SearchSpace
from tuner.study.studies import FAIL_REASON, role

OFF = SpecConfig(method="off")


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


# (spec, split "tune"|"heldout", level: concurrency (int) or Rate) -> Sample. The optimize flow builds it from the
# engine and the shared runner; nothing here generates tokens itself.
# A MeasureFn over a launched server may also carry `serving(spec) -> bool` (is that server up now?)
# and `startups() -> (starts, seconds)` (cumulative server start-ups), both optional.
MeasureFn = Callable[[SpecConfig, str, Level], Sample]


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


@dataclass
class TrialOutcome:
    """What the progress display and the tests need from one finished trial."""

    number: int
    state: TrialState
    spec: SpecConfig
    tok_s: float | None = None
    speedup: float | None = None
    reason: str | None = None


class Objective:
    """Runs trials of one study with a MeasureFn (ask, measure, set constraints, tell)."""

    def __init__(self, study: optuna.Study, space: SearchSpace, measure: MeasureFn, workload: WorkloadConfig,
                 search: Any) -> None:
        self.study = study
        self.space = space
        self.measure = measure
        self.workload = workload
        self.search = search
        self.levels: list[Level] = workload.levels  # concurrency levels and request rates alike
        self.multi = search.multi_objective

    # ---- measuring -------------------------------------------------------------------------
    def _at_levels(self, spec: SpecConfig, split: str) -> list[Sample]:
        return [self.measure(spec, split, c) for c in self.levels]

    def measure_pair(self, spec: SpecConfig, split: str, repeat: int) -> tuple[list[Sample], list[Sample]]:
        """One repeat: the spec and the baseline back to back, order alternating to cancel drift."""
        if repeat % 2 == 0:
            s = self._at_levels(spec, split)
            b = self._at_levels(OFF, split)
        else:
            b = self._at_levels(OFF, split)
            s = self._at_levels(spec, split)
        return s, b

    def evaluate(self, spec: SpecConfig, split: str = "tune", trial: optuna.Trial | None = None,
                 started: float | None = None, repeats_max: int | None = None) -> dict[str, Any]:
        """Measure `spec` with adjacent baselines until the speedup CI is tight (or repeats_max,
        by default search.repeats_max).

        Reports intermediate values to `trial` and raises TrialPruned when it is hopeless.
        Returns the figures (tok/s, baseline, speedup and its CI, tau, p99 latencies, repeats).
        """
        started = started or time.monotonic()
        ratios: list[float] = []
        spec_s: list[list[Sample]] = []
        base_s: list[list[Sample]] = []
        is_off = spec.method == "off"
        repeats_max = repeats_max or self.search.repeats_max
        # The order still alternates between repeats; a launched server that already serves the
        # baseline is measured first, so a trial of 2 repeats restarts it twice instead of three times.
        serving = getattr(self.measure, "serving", None)
        flip = int(not is_off and serving is not None and serving(OFF) and not serving(spec))
        startups = getattr(self.measure, "startups", None)
        starts0, startup0 = startups() if startups is not None else (0, 0.0)
        for r in range(repeats_max):
            clock = active_clock()  # the trial's measuring clock (none for the held-out check)
            repeat_t0 = clock.elapsed() if clock is not None else 0.0
            if is_off:  # the baseline itself: one measurement per repeat, speedup 1 by definition
                s = self._at_levels(OFF, split)
                b = s
            else:
                s, b = self.measure_pair(spec, split, r + flip)
            spec_s.append(s)
            base_s.append(b)
            ratios.append(geomean([self._score(x) / max(self._score(y), self._floor(y)) for x, y in zip(s, b)])
                          if not is_off else 1.0)
            figures = self._figures(spec_s, base_s, ratios)
            if startups is not None:  # server start-ups are never inside a measurement; recorded apart
                starts, startup = startups()
                figures.update(server_starts=starts - starts0, server_startup_s=round(startup - startup0, 2))
            if trial is not None:
                for k, v in figures.items():
                    trial.set_user_attr(k, v)
                if not self.multi and not is_off:
                    trial.report(self._value(figures), r)
            done = len(ratios) >= self.search.repeats_min and (
                is_off and self._tight([statistics.fmean(x.tok_s for x in s_) for s_ in spec_s])
                or not is_off and self._tight(ratios))
            if done or r + 1 == repeats_max:
                break
            # Pruning is single-objective only in Optuna; the study's pruner is HopelessPruner.
            if trial is not None and not self.multi and not is_off and trial.should_prune():
                raise optuna.TrialPruned(f"hopeless after {r + 1} repeat(s): speedup {ratios[-1]:.3f}")
            if clock is not None:
                clock.check()  # threads without SIGALRM
                # Size the repeats to the limit: stop (complete) when one more would not fit.
                if not next_repeat_fits(clock.elapsed() - repeat_t0):
                    if trial is not None:
                        trial.set_user_attr("repeats_cut", f"search.trial_timeout_s={self.search.trial_timeout_s:g}")
                    break
        return figures

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
        tok = [statistics.fmean(x.tok_s for x in s) for s in spec_s]
        base = [statistics.fmean(x.tok_s for x in b) for b in base_s]
        sp, sp_lo, sp_hi = mean_ci(ratios)
        t, t_lo, t_hi = mean_ci(tok)
        flat = [x for s in spec_s for x in s]
        return {
            "tok_s": t, "tok_s_ci_low": t_lo, "tok_s_ci_high": t_hi,
            "baseline_tok_s": statistics.fmean(base),
            "speedup": sp, "speedup_ci_low": sp_lo, "speedup_ci_high": sp_hi,
            "tau": _mean_opt([x.tau for x in flat]),
            "ttft_p99_ms": _max_opt([x.ttft_p99_ms for x in flat]),
            "tpot_p99_ms": _max_opt([x.tpot_p99_ms for x in flat]),
            "itl_p50_ms": _mean_opt([x.itl_p50_ms for x in flat]),
            "itl_p99_ms": _max_opt([x.itl_p99_ms for x in flat]),
            "draft_mb": _max_opt([x.draft_mb for x in flat]),
            "repeats": len(ratios),
            "ratios": ratios,
            "tok_s_samples": tok,
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
        """Ask one trial, measure it and tell its outcome. Never raises for a failing trial;
        KeyboardInterrupt marks the trial FAIL ('interrupted') and propagates."""
        trial = self.study.ask()
        started = time.monotonic()
        spec = OFF
        try:
            with TrialClock(self.search.trial_timeout_s):
                if role(trial) != "baseline":
                    spec = self.space.suggest(trial)
                record_spec(trial, spec)
                earlier = self._measured(spec)
                if earlier is not None:
                    return self._reuse(trial, spec, earlier)
                figures = self.evaluate(spec, "tune", trial, started)
        except optuna.TrialPruned as exc:
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

    def _measured(self, spec: SpecConfig) -> optuna.trial.FrozenTrial | None:
        """An earlier COMPLETE or PRUNED trial of the same configuration (a sampler may propose a
        point again; it is not measured again as if it were new)."""
        # the whole spec, not its key: points that differ only in their K per band are different
        want = spec.model_dump(mode="json")
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if t.user_attrs.get("spec_json") == want and "reused_from" not in t.user_attrs:
                return t
        return None

    def _reuse(self, trial: optuna.Trial, spec: SpecConfig, earlier: optuna.trial.FrozenTrial) -> TrialOutcome:
        """Tell `trial` what `earlier` measured (its figures and state), marked reused_from."""
        trial.set_user_attr("reused_from", earlier.number)
        for k, v in earlier.user_attrs.items():
            if k not in ("spec", "spec_json", "role", "heartbeat") and not k.startswith("spec_"):
                trial.set_user_attr(k, v)
        if earlier.state == TrialState.PRUNED:
            self.study.tell(trial, state=TrialState.PRUNED)
            return TrialOutcome(trial.number, TrialState.PRUNED, spec, reason=f"same configuration as trial {earlier.number}")
        for name, c in earlier.constraints.items():
            trial.set_constraint(name, c)
        self.study.tell(trial, earlier.values if self.multi else earlier.value)
        return TrialOutcome(trial.number, TrialState.COMPLETE, spec, earlier.user_attrs.get("tok_s"),
                            earlier.user_attrs.get("speedup"))

    def _constrain(self, trial: optuna.Trial, figures: dict[str, Any]) -> None:
        """The workload's SLOs as Optuna constraints (<= 0 is feasible)."""
        slo = self.workload.slo
        violations = []
        for key, limit in (("tpot_p99_ms", slo.tpot_p99_ms), ("ttft_p99_ms", slo.ttft_p99_ms)):
            if limit is None:
                continue
            measured = figures.get(key)
            c = (measured - limit) if measured is not None else 0.0
            trial.set_constraint(key, c)
            if c > 0:
                violations.append(f"{key}={measured:.1f} > {limit:g}")
        trial.set_user_attr("feasible", not violations)
        if violations:
            trial.set_user_attr("slo_violations", "; ".join(violations))

    def _fail(self, trial: optuna.Trial, reason: str) -> None:
        trial.set_user_attr(FAIL_REASON, reason)
        self.study.tell(trial, state=TrialState.FAIL)


def record_spec(trial: optuna.Trial, spec: SpecConfig) -> None:
    """Store the trial's SpecConfig in its user attrs: whole (for best.yaml) and by field (for trials.csv)."""
    trial.set_user_attr("spec", spec.key())
    trial.set_user_attr("spec_json", spec.model_dump(mode="json"))
    for k in ("method", "depth", "topk", "budget"):
        trial.set_user_attr(f"spec_{k}", getattr(spec, k) if spec.method != "off" else None)
    trial.set_user_attr("spec_method", spec.method)


def spec_of(trial: optuna.trial.FrozenTrial) -> SpecConfig | None:
    """The SpecConfig a trial measured (from its user attrs), None if it never got that far."""
    raw = trial.user_attrs.get("spec_json")
    return SpecConfig.model_validate(raw) if raw is not None else None
