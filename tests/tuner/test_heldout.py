"""The held-out check's accounting and rule, with planted per-prompt figures: both sides' speedups are
ratios of sums over their prompts (as the load generator's tok/s is), the gap's interval resamples
each side's prompts and pairs, the verdict follows the interval; and every split's prompts have their
prefill cached before a timed pass (the first pass over a set of prompts used to run their whole
prefill, and whichever side of a pair came first paid for it)."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest

from engine.measure.workloads import Prompt
from tuner.projection.profiling import CHECK, CHECK_PASS, check_order, check_prompt_count
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig
from tuner.search.space import SearchSpace
from tuner.study.measurer import Measurer, per_prompt
from tuner.study.objective import Objective, Sample
from tuner.study.selection import (_side_log_speedup, describe_check, gap_interval, heldout_check, heldout_excess,
                                   verdict)

CFG = ["model=tiny-random", "+workload=code", "workload.concurrency=[1]", "search=quick"]
D3 = SpecConfig(method="ngram", depth=3, topk=1, budget=4)


def side(speedups: list[float], pairs: int = 2, seconds: list[float] | None = None, jitter: float = 0.0):
    """One side's passes: per pair one level, each prompt 100 tokens, off taking `seconds` (1 s
    each by default) and the spec that over its speedup; pair j's spec `jitter` x j slower."""
    seconds = seconds or [1.0] * len(speedups)
    return [[([(100, s / x * (1 + jitter * j)) for x, s in zip(speedups, seconds)], [(100, s) for s in seconds])]
            for j in range(pairs)]


def test_a_side_is_a_ratio_of_sums_over_its_prompts() -> None:
    # a prompt twice as long in time weighs twice: (3 s off) / (1 s + 1 s spec), not the mean of 2x and 1x
    s = side([2.0, 1.0], pairs=1, seconds=[2.0, 1.0])
    assert math.exp(_side_log_speedup(s, [0, 1], [0])) == pytest.approx(3.0 / 2.0)
    assert math.exp(_side_log_speedup(s, [0, 0], [0])) == pytest.approx(2.0)  # a draw may repeat a prompt
    # tokens count: a spec that wrote fewer tokens in the same time is slower
    short = [[([(50, 1.0)], [(100, 1.0)])]]
    assert math.exp(_side_log_speedup(short, [0], [0])) == pytest.approx(0.5)


def test_the_gap_interval_holds_the_prompts_spread_and_shrinks_with_more_prompts() -> None:
    spread = [1.1, 2.9, 1.5, 2.2, 0.9, 1.8]
    tune, held = side(spread), side(spread[::-1])
    lo, hi = gap_interval(tune, held, 0.0)
    assert lo < -0.15 and hi > 0.15  # 6 prompts of tau 1-3 a side: two such sets read far apart
    lo12, hi12 = gap_interval(side(spread * 4), side(spread[::-1] * 4), 0.0)
    assert lo < lo12 < 0 < hi12 < hi  # 4x the prompts: about half as wide
    # every prompt alike and the pairs agreeing: nothing to resample, the interval is the gap itself
    flat_lo, flat_hi = gap_interval(side([1.5] * 6), side([1.2] * 6), 1.2 / 1.5 - 1)
    assert flat_lo == pytest.approx(-0.2) and flat_hi == pytest.approx(-0.2)
    # the pairs' disagreement widens it too
    j_lo, j_hi = gap_interval(side([1.5] * 6), side([1.2] * 6, jitter=0.2), -0.2)
    assert j_hi - j_lo > 0.05
    # centred on the measured gap, whatever the per-prompt statistic read
    a = gap_interval(tune, held, 0.0, seed=1)
    b = gap_interval(tune, held, 0.1, seed=1)
    assert (1 + b[0]) / (1 + a[0]) == pytest.approx(1.1) and (1 + b[1]) / (1 + a[1]) == pytest.approx(1.1)


def test_no_interval_without_per_prompt_figures() -> None:
    assert gap_interval([[(None, None)]], side([1.5, 1.5]), 0.0) is None
    assert gap_interval(side([1.5]), side([1.5]), 0.0) is None  # one prompt a side: nothing to resample
    # a request refused as such (no seconds) leaves its prompt out, not the interval
    refused = side([1.5, 1.5, 1.5])
    refused[0][0] = (refused[0][0][0][:2] + [(0, 0.0)], refused[0][0][1])
    assert gap_interval(side([1.5] * 3), refused, 0.0) == pytest.approx((0.0, 0.0))
    assert gap_interval(side([1.5] * 3), [[([(0, 0.0)] * 2 + [(1, 1.0)], [(1, 1.0)] * 3)]], 0.0) is None
    assert verdict(None, None, 1.5) is None


def test_the_verdict_follows_the_interval() -> None:
    assert verdict(-0.10, 0.12, 1.5) == "holds"
    assert verdict(-0.30, -0.02, 1.5) == "below"  # held-out slower beyond the prompts' spread
    assert verdict(0.01, 0.30, 1.5) == "above"
    # holds 0 but also a held-out speedup of 1.0 (1 / 1.5 - 1 = -33%): too wide to say it still pays
    assert verdict(-0.40, 0.30, 1.5) == "inconclusive"
    assert verdict(-0.01, 0.01, 0.95) == "inconclusive"  # a tuning side that does not beat off
    check = heldout_check_of([1.5] * 6, [1.2] * 6)
    assert check.verdict == "below" and heldout_excess(check) == pytest.approx(0.2)
    assert heldout_excess(heldout_check_of([1.1, 2.9, 1.5, 2.2, 0.9, 1.8], [1.5, 1.8, 2.0, 1.2, 2.5, 1.4])) == 0.0


def one_pass(cfg, side_of):
    """A planted MeasureFn of the check's pass (CHECK_PASS): each side's per-prompt (tokens, seconds),
    `side_of(spec, side)` for side CHECK and "heldout", laid out in the order check_order plays them;
    tok/s the pass's tokens over its seconds (one request in flight)."""
    at_t, at_h = check_order(check_prompt_count(cfg), cfg.workload.num_heldout)

    def measure(spec: SpecConfig, split: str, level: int) -> Sample:
        assert split == CHECK_PASS
        pp: list = [None] * (len(at_t) + len(at_h))
        for at, side in ((at_t, CHECK), (at_h, "heldout")):
            xs = side_of(spec, side)
            assert len(xs) == len(at)
            for i, x in zip(at, xs):
                pp[i] = x
        return Sample(sum(t for t, _ in pp) / sum(s for _, s in pp), 2.0, per_prompt=pp)

    return measure


def heldout_check_of(tune: list[float], held: list[float]):
    """The check run end to end through Objective.check over planted per-prompt figures."""
    cfg = load_config(CFG)

    def side_of(spec: SpecConfig, side: str) -> list[tuple[int, float]]:
        return [(100, 1.0 / (x if spec.method != "off" else 1.0)) for x in (tune if side == CHECK else held)]

    measure = one_pass(cfg, side_of)

    study = optuna.create_study(direction="maximize")
    objective = Objective(study, SearchSpace.from_config(cfg), measure, cfg.workload, cfg.search)
    check, _ = heldout_check(cfg, objective, D3)
    return check


def test_the_check_reports_its_interval_and_verdict() -> None:
    check = heldout_check_of([1.5] * 6, [1.5] * 6)
    assert check.gap == pytest.approx(0.0) and check.gap_ci_low == pytest.approx(0.0)
    assert check.verdict == "holds"
    line = describe_check(check)
    assert "0.0% above [+0.0%, +0.0%] over prompts and pairs: holds" in line


def test_per_prompt_sums_the_requests_that_played_each_prompt() -> None:
    assert per_prompt([(10, 1.0), (20, 2.0), (30, 3.0)], 2) == [(40, 4.0), (20, 2.0)]
    assert per_prompt([], 3) is None


def test_a_side_of_the_checks_pass_is_drawn_from_its_prompts() -> None:
    """A side of the check's pass: its prompts' per-prompt figures, tok/s the pass's scaled by its
    tokens over seconds against the pass's, tau its tokens over its target forwards (none where the
    engine counted forwards over the pass only); a pass without per-prompt figures for every
    position is refused, never split by guess. The Measurer passes each request's forwards on, summed
    per prompt as its tokens and seconds are."""
    from engine.measure.runner import RequestRecord, _measurement
    from tuner.study.objective import side_sample

    x = Sample(30.0, 1.5, per_prompt=[(10, 1.0), (20, 1.0), (30, 1.0)], per_prompt_forwards=[10, 5, 20],
               ttft_p99_ms=40.0, tpot_p99_ms=9.0, itl_p99_ms=12.0, draft_mb=3.0, goodput=2.0, wall_s=3.0)
    a, b = side_sample(x, [0, 2]), side_sample(x, [1])
    # latencies and the draft's memory are the pass's (a step's time is the level's, not a prompt's);
    # goodput is not split by prompt: none
    assert (a.ttft_p99_ms, a.tpot_p99_ms, a.itl_p99_ms, a.draft_mb) == (40.0, 9.0, 12.0, 3.0) and a.goodput is None
    assert a.per_prompt == [(10, 1.0), (30, 1.0)] and a.tok_s == pytest.approx(30.0 * 20 / 20)
    assert b.tok_s == pytest.approx(30.0 * 20 / 20) and side_sample(x, [0]).tok_s == pytest.approx(15.0)
    assert a.tau == pytest.approx(40 / 30) and b.tau == pytest.approx(4.0) and b.per_prompt_forwards == [5]
    assert side_sample(Sample(30.0, 1.5, per_prompt=x.per_prompt), [1]).tau is None  # a server's pass
    with pytest.raises(RuntimeError, match="per-prompt figures for positions up to 3"):
        side_sample(x, [1, 3])
    with pytest.raises(RuntimeError, match="it recorded 0"):
        side_sample(Sample(30.0), [0])

    recs = [RequestRecord("a", 10, e2e_s=1.0, forwards=4), RequestRecord("b", 6, e2e_s=1.0, forwards=3),
            RequestRecord("a", 8, e2e_s=1.0, forwards=2), RequestRecord("b", error="boom")]
    m = _measurement(recs, 2.0, 2, None, [])
    assert m.request_forwards == [4, 3, 2, 0] and "request_forwards" not in m.to_dict()
    assert _measurement([RequestRecord("a", 10, e2e_s=1.0)], 1.0, 1, None, []).request_forwards == []

    class Played(_Run):
        def run(self, prompts, params, concurrency, arrivals_s=None, rate=None):
            super().run(prompts, params, concurrency)
            return _measurement(recs[:3], 2.0, 2, None, [])

    cfg = load_config(CFG)
    got = Measurer(lambda spec: Played(), cfg, {"tune": [Prompt("a", "a", "x"), Prompt("b", "b", "x")]})(D3, "tune", 2)
    assert got.per_prompt == [(18, 2.0), (6, 1.0)] and got.per_prompt_forwards == [6, 3]


class _Run:
    def __init__(self) -> None:
        self.runs: list[tuple[list[str], list[int | None]]] = []

    def run(self, prompts, params, concurrency, arrivals_s=None, rate=None):
        from engine.measure.runner import _measurement

        self.runs.append(([p.id for p in prompts], [p.params.max_new_tokens if p.params else None for p in prompts]))
        return _measurement([], 1.0, concurrency, None, [])


class _Drafter:
    def __init__(self, aux_layers: tuple[int, ...] | None) -> None:
        self.aux_layers = aux_layers


class _Engine:
    """What the Measurer reads of the built-in engine: its prefix cache and the drafter set_spec made."""

    def __init__(self, cached: bool) -> None:
        self.prefix_cache = object() if cached else None
        self.drafter: _Drafter | None = None

    def target_for(self, target: _Run):
        def set_spec(spec: SpecConfig) -> _Run:
            self.drafter = None if spec.method == "off" else _Drafter((2, 5) if spec.method == "eagle3" else None)
            return target
        return set_spec


def test_each_split_is_warmed_once_before_its_first_timed_pass() -> None:
    cfg = load_config(CFG)
    prompts = {"tune": [Prompt("t0", "a", "x"), Prompt("t1", "b", "x")], "heldout": [Prompt("h0", "c", "x")]}
    target, engine = _Run(), _Engine(cached=True)
    m = Measurer(engine.target_for(target), cfg, prompts, engine=engine)  # type: ignore[arg-type]
    m(D3, "tune", 2)
    # the warm pass: every prompt once, one new token each; then the timed pass (2 in flight)
    assert target.runs == [(["t0", "t1"], [1, 1]), (["t0", "t1"], [None, None])]
    m(D3, "tune", 2)
    m(SpecConfig(method="off"), "tune", 1)  # off and the n-gram drafter share the cache entries
    assert len(target.runs) == 4  # warmed already: only timed passes
    m(D3, "heldout", 1)
    assert [r[1] for r in target.runs[4:]] == [[1], [None]]
    # a drafter that reads inner target layers (EAGLE-3) has entries of its own: its first pass warms them
    eagle3 = SpecConfig(method="eagle3", depth=3, topk=1, budget=4, head_path="h")
    m(eagle3, "tune", 1)
    m(eagle3, "tune", 1)
    assert [r[1] for r in target.runs[6:]] == [[1, 1], [None, None], [None, None]]
    bare = _Run()  # no prefix cache (or a launched server: empty at every start): nothing to warm
    plain = _Engine(cached=False)
    Measurer(plain.target_for(bare), cfg, prompts, engine=plain)(D3, "tune", 1)  # type: ignore[arg-type]
    assert len(bare.runs) == 1


def _trial(spec: SpecConfig, ratios: list[float]) -> optuna.trial.FrozenTrial:
    from tuner.study.objective import spec_attrs

    return optuna.trial.create_trial(value=1.0, user_attrs={**spec_attrs(spec), "ratios": ratios,
                                                            "speedup": math.prod(ratios) ** (1 / len(ratios))})


def test_at_the_floor_the_check_measures_two_pairs_a_side_widened_by_the_pooled_pair_noise() -> None:
    """The trials measured how far one pair's ratio strays (pooled per configuration): with that
    known and the noise at its floor the check measures two pairs a side (never one: one pair is one
    draw of the machine's state), and its intervals carry that noise pooled with the check's own
    pairs'; when the noise rose, or the trials measured too few pairs, it measures until its own
    intervals are tight, two pairs at least."""
    from tuner.study.selection import pair_noise, pooled_noise, widen

    cfg = load_config(CFG)
    n = cfg.workload.num_heldout
    calls: list[str] = []

    def side_of(spec: SpecConfig, side: str) -> list[tuple[int, float]]:
        xs = [1.5, 1.2, 1.8, 1.4, 1.6, 1.3] if side == CHECK else [1.4, 1.5, 1.3, 1.6, 1.2, 1.5]
        return [(100, 1.0 / (x if spec.method != "off" else 1.0)) for x in xs]

    planted = one_pass(cfg, side_of)

    def measure(spec: SpecConfig, split: str, level: int) -> Sample:
        calls.append(split)
        return planted(spec, split, level)

    spread = 0.05  # each configuration's two pairs read exp(+-0.05) about its centre
    pairs = [(D3, [1.3 * math.exp(spread), 1.3 * math.exp(-spread)]),
             (SpecConfig(method="ngram", depth=5, topk=1, budget=6), [1.1 * math.exp(spread), 1.1 * math.exp(-spread)])]

    def run(trials: int, repeats_max: int):
        calls.clear()
        study = optuna.create_study(direction="maximize")
        for spec, ratios in pairs * trials:
            study.add_trial(_trial(spec, ratios))
        objective = Objective(study, SearchSpace.from_config(cfg), measure, cfg.workload, cfg.search)
        objective.repeats_max = repeats_max
        return heldout_check(cfg, objective, D3)[0], study

    check, study = run(trials=3, repeats_max=cfg.search.repeats_max)
    noise, df = pair_noise(study.trials)
    # pooled per configuration: 6 ratios each at +-0.05 about its own centre, 5 degrees of freedom each
    assert df == 10 and noise == pytest.approx(math.sqrt(12 * spread ** 2 / 10), rel=1e-6)
    # the check's own two pairs a side agree exactly: they add degrees of freedom, no spread
    pooled, pooled_df = pooled_noise((noise, df), [[1.0, 1.0], [1.0, 1.0]])
    assert pooled_df == df + 2 and pooled == pytest.approx(noise * math.sqrt(df / (df + 2)))
    assert check.pairs == 2 and calls == [CHECK_PASS] * 4 and check.pair_noise == pytest.approx(pooled, abs=1e-4)
    assert check.tuning.ci_low < check.tuning.speedup < check.tuning.ci_high  # the pairs agree, yet an interval
    # the interval over prompts alone is narrower: the pairs' noise is added to it
    per_side = [[[([(100, 1.0 / x) for x in xs], [(100, 1.0)] * n)]] * 2 for xs in
                ([1.5, 1.2, 1.8, 1.4, 1.6, 1.3], [1.4, 1.5, 1.3, 1.6, 1.2, 1.5])]
    lo, hi = gap_interval(per_side[0], per_side[1], check.gap, seed=cfg.seed, resample_pairs=False)
    assert check.gap_ci_low < lo < check.gap < hi < check.gap_ci_high
    assert (check.gap_ci_low, check.gap_ci_high) == pytest.approx(widen(lo, hi, check.gap, pooled, pooled_df, pairs=2))
    assert f"(2 pairs, both sides in each pass, prompt by prompt, sized by the pair noise {pooled:.1%}" in describe_check(check)
    # too few pairs measured to know their noise, or the noise rose: two pairs (or more) as before
    # (the planted figures agree: tight after two)
    for trials, repeats_max in ((1, cfg.search.repeats_max), (3, cfg.search.repeats_max + 1)):
        check = run(trials=trials, repeats_max=repeats_max)[0]
        assert check.pairs == 2 and len(calls) == 4 and check.pair_noise is None


def _study_with_pair_noise(baseline_tok_s: float = 40.0) -> optuna.Study:
    """A study whose baseline ran at `baseline_tok_s` on its trials' prompts and whose trials measured
    a pair noise at the floor (two configurations, three trials each, their pairs +-5%)."""
    from tuner.study.studies import ROLE

    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(value=baseline_tok_s, user_attrs={
        ROLE: "baseline", "tok_s_samples": [baseline_tok_s] * 3}))
    for _ in range(3):
        for spec, centre in ((D3, 1.5), (SpecConfig(method="ngram", depth=5, topk=1, budget=6), 1.2)):
            study.add_trial(_trial(spec, [centre * math.exp(0.05), centre * math.exp(-0.05)]))
    return study


def test_a_pass_the_machine_slowed_falls_on_both_sides_alike() -> None:
    """Both sides play in one pass, so a pass the machine slowed (a load that came for its minute)
    moves both sides' speedups alike and leaves their gap (none planted) untouched. Played side
    after side, as before, the slowed pass was one side's and made a gap of its own."""
    cfg = load_config(CFG)
    passes: list[str] = []

    def side_of(spec: SpecConfig, side: str) -> list[tuple[int, float]]:
        slow = 1 / 0.85 if len(passes) == 3 else 1.0  # the second pair's baseline (off-spec): 0.85x
        return [(100, slow * 2.5 / (1.5 if spec.method != "off" else 1.0))] * cfg.workload.num_heldout

    planted = one_pass(cfg, side_of)

    def measure(spec: SpecConfig, split: str, level: int) -> Sample:
        passes.append(spec.method)
        return planted(spec, split, level)

    objective = Objective(_study_with_pair_noise(), SearchSpace.from_config(cfg), measure, cfg.workload, cfg.search)
    check, _ = heldout_check(cfg, objective, D3)
    assert passes == ["ngram", "off", "off", "ngram"] and check.pairs == 2 and check.remeasured is None
    assert check.gap == pytest.approx(0.0, abs=1e-12)
    both = math.sqrt(1.5 * 1.5 / 0.85)  # the slowed baseline inflates the second pair's ratio on both sides
    assert check.tuning.speedup == pytest.approx(both) and check.heldout.speedup == pytest.approx(both)


def test_prompt_by_prompt_a_machine_that_drifts_during_a_pass_leaves_no_gap() -> None:
    """The check's pass plays a tuning prompt and a held-out one next to each other, in turn, each
    side first every other time (check_order). On a machine that slows steadily as it works (each
    second of work 2% slower than the one before) both sides meet the same minutes and their gap
    (none planted) stays near zero; the sides played
    one after the other within the pass (a planted fault) read the held-out side several percent
    faster: its baseline ran later, when the machine was slower, for longer than its spec did."""
    cfg = load_config(CFG)
    n = cfg.workload.num_heldout
    interleaved = check_order(n, n)
    assert interleaved == ([0, 3, 4, 7, 8, 11], [1, 2, 5, 6, 9, 10])  # t h h t t h ...: the same mean position
    assert check_order(2, 4) == ([0, 3], [1, 2, 4, 5])  # the longer side's rest at the end

    def gap(at_t: list[int], at_h: list[int]) -> float:
        clock = [0.0]

        def measure(spec: SpecConfig, split: str, level: int) -> Sample:
            pp = []
            for _ in range(2 * n):  # every prompt 1.5x under the spec, whichever side
                secs = (1.0 / (1.5 if spec.method != "off" else 1.0)) * (1 + 0.02 * clock[0])
                clock[0] += secs
                pp.append((100, secs))
            return Sample(100 * len(pp) / sum(x for _, x in pp), 2.0, per_prompt=pp)

        objective = Objective(optuna.create_study(direction="maximize"), SearchSpace.from_config(cfg), measure,
                              cfg.workload, cfg.search)
        got = objective.check(D3, CHECK_PASS, {CHECK: at_t, "heldout": at_h}, 2)
        return got["heldout"]["speedup"] / got[CHECK]["speedup"] - 1

    assert abs(gap(*interleaved)) < 0.002
    assert gap(list(range(n)), list(range(n, 2 * n))) > 0.03


def test_the_checks_baselines_are_judged_against_their_own_prompts_not_the_trials() -> None:
    """Off runs at another speed on the check's prompts than on the trials' (on one host 137-143
    tok/s against 109-110: other lengths, other answers). Judged against the trials' passes, as
    before, every check baseline read as an outlier and was measured again, up to three times a
    pair, for nothing. Judged against the check's own passes on its prompts (the band the study's
    spread), it measures two pairs, nothing again; a pass that dipped among the check's own is
    still measured again."""
    cfg = load_config(CFG)
    study = _study_with_pair_noise(baseline_tok_s=110.0)
    offs: list[float] = []
    dip = [False]

    def measure(spec: SpecConfig, split: str, level: int) -> Sample:
        assert split == CHECK_PASS
        off_s = 100 / 140.0
        if spec.method == "off":
            offs.append(140.0)
            if dip[0] and len(offs) == 3:
                offs[-1], off_s = 90.0, 100 / 90.0  # the third pair's baseline dipped
        wander = 1.0 if spec.method == "off" or not dip[0] else (1.0, 1.0, 1.1, 1.05, 1.05)[len(offs) % 5]
        secs = off_s / (1.5 * wander if spec.method != "off" else 1.0)
        pp = [(100, secs)] * (2 * cfg.workload.num_heldout)
        return Sample(100 / secs, 3.0, per_prompt=pp)

    objective = Objective(study, SearchSpace.from_config(cfg), measure, cfg.workload, cfg.search)
    b = [Sample(140.0, 1.0)]
    # the old rule, planted: the study's passes place the centre, and 140 lies beyond 3 bands of 110
    assert objective.implausible([Sample(210.0, 3.0)], b, objective.outlier_history()) is not None
    check, _ = heldout_check(cfg, objective, D3)
    assert offs == [140.0, 140.0] and check.pairs == 2 and check.remeasured is None
    assert check.tuning.baseline_tok_s == pytest.approx(140.0) and check.gap == pytest.approx(0.0)
    # more pairs (the spec's passes wander), the third pair's baseline dipped: measured again
    offs.clear()
    dip[0] = True
    got = objective.check(D3, CHECK_PASS, dict(zip((CHECK, "heldout"), check_order(6, 6))), 4)
    again = got["heldout"]["remeasured"]
    assert again[0].startswith("pair 3: paired baseline 90.0 tok/s is an outlier against the baseline's passes on "
                               "these prompts (median 140.0 tok/s")
    assert offs[:4] == [140.0, 140.0, 90.0, 140.0] and 90.0 not in got[CHECK]["baseline_samples"]


def _proxy(tau: float, prompt: int = 150, answer: int = 120) -> "PromptProxy":
    from tuner.projection.profiling import PROXY_DEPTHS, PromptProxy

    # deeper chains commit a little more of the same answer: tau grows with depth as measured ones do
    return PromptProxy(prompt, answer, tuple(round(answer / (tau * (1 + 0.05 * k))) for k in range(len(PROXY_DEPTHS))))


def test_the_checks_tuning_side_is_matched_to_the_heldout_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 28's finding, planted: the held-out prompts' tau lies below the first tuning prompts'
    (today's check side, 1.9-2.3 against 1.5-1.7) and they are shorter. The matched side takes the
    tuning prompts that answer alike, so the sides' tau and context agree within a few percent where
    the first ones missed by about a fifth; the choice is deterministic and leaves the held-out
    prompts alone."""
    from tuner.projection.profiling import PROXY_DEPTHS, matched_check, mismatch, side_context, side_tau

    tune = [_proxy(t, p) for t, p in [(2.3, 300), (1.9, 260), (2.1, 280), (1.6, 160), (2.0, 240), (1.5, 150),
                                      (2.2, 310), (1.7, 170), (1.4, 140), (2.4, 330), (1.8, 200), (1.55, 120)]]
    held = [_proxy(t, p) for t, p in [(1.6, 150), (1.5, 140), (1.7, 170)]]
    first = tune[:3]
    pick = matched_check(tune, held, 3)
    side = [tune[i] for i in pick]
    assert pick == sorted(pick) and len(set(pick)) == 3 and pick == matched_check(tune, held, 3)
    for k in range(len(PROXY_DEPTHS)):
        assert abs(side_tau(first, k) / side_tau(held, k) - 1) > 0.15
        assert abs(side_tau(side, k) / side_tau(held, k) - 1) < 0.03
    assert abs(side_context(side) / side_context(held) - 1) < 0.1 < abs(side_context(first) / side_context(held) - 1)
    assert mismatch(side, held) < mismatch(first, held) / 5
    assert matched_check(tune[:3], held, 3) == [0, 1, 2]  # nothing to choose from
    # the nearest of every set of 3; past EXHAUSTIVE_SETS a swap descent, near it and as deterministic
    import itertools

    import tuner.projection.profiling as P

    best = min(itertools.combinations(range(len(tune)), 3), key=lambda c: mismatch([tune[i] for i in c], held))
    assert pick == list(best)
    monkeypatch.setattr(P, "EXHAUSTIVE_SETS", 0)
    descent = matched_check(tune, held, 3)
    assert descent == matched_check(tune, held, 3) and mismatch([tune[i] for i in descent], held) < 0.02


def test_the_study_compares_the_heldout_prompts_with_the_matched_tuning_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """match_check_side replaces the check's tuning side (the first prompts) with the matched ones,
    tuning prompts only, none of them held out, and says so in one line; without the built-in engine
    (a launched server: no answers to match on) the first prompts stay and the line says why."""
    import tuner.study.measurer as M
    from engine.measure.workloads import load_prompts

    cfg = load_config(["model=tiny-random", "+workload=code", "workload.num_prompts=8", "workload.num_heldout=3"])
    tune, held = load_prompts(cfg.workload, "tune"), load_prompts(cfg.workload, "heldout")
    taus = [2.4, 2.2, 1.5, 2.3, 1.6, 2.1] + [1.55, 1.6, 2.1]  # the first 2 x 3 tuning prompts are the candidates
    asked: list[list[str]] = []

    def proxies(cfg_, engine, prompts):
        asked.append([p.id for p in prompts])
        return [_proxy(t) for t in taus]

    monkeypatch.setattr(M, "check_proxies", proxies)
    prompts = {"tune": tune[:2], "heldout": held, CHECK: tune[:3]}
    line = M.match_check_side(cfg, object(), prompts)
    assert asked == [[p.id for p in tune[:6] + held]]
    assert [p.id for p in prompts[CHECK]] == [tune[1].id, tune[2].id, tune[4].id]  # the nearest three, by brute force
    assert not {p.id for p in prompts[CHECK]} & {p.id for p in held}
    # the check's pass plays the matched side and the held-out prompts in turn (check_order)
    assert [p.id for p in prompts[CHECK_PASS]] == [tune[1].id, held[0].id, held[1].id, tune[2].id, tune[4].id, held[2].id]
    assert line.startswith("3 of 6 tuning prompts matched to the 3 held-out ones (tuning prompts 1, 2, 4)")
    kept = {"tune": tune[:2], "heldout": held, CHECK: tune[:3]}
    assert "needs the built-in engine" in M.match_check_side(cfg, None, kept) and kept[CHECK] == tune[:3]


def test_the_pairs_noise_sizes_the_checks_pairs_as_the_spread_sizes_a_trials_repeats() -> None:
    """Two pairs a side while a pair's log ratio strays no more than two passes at search.noise_rel
    would make it; above that 2 x (noise / that)^2 pairs, at most twice search.repeats_max, never
    fewer than two; nothing to size by when the noise is known on too few degrees of freedom or the
    baseline spread rose."""
    from tuner.study.selection import CHECK_PAIRS_MIN, PAIR_NOISE_MIN_DF, check_pairs

    search = load_config([*CFG, "search=default"]).search  # repeats_max 2, noise_rel 0.05
    at = math.sqrt(2) * search.noise_rel
    assert CHECK_PAIRS_MIN == 2
    assert check_pairs((0.0, 20), search, search.repeats_max) == 2
    assert check_pairs((at, 20), search, search.repeats_max) == 2
    assert check_pairs((at * math.sqrt(1.5), 20), search, search.repeats_max) == 3
    assert check_pairs((0.2, 20), search, search.repeats_max) == 2 * search.repeats_max
    quick = load_config(CFG).search  # repeats_max 1: two at most, and never fewer
    assert check_pairs((0.2, 20), quick, quick.repeats_max) == check_pairs((0.0, 20), quick, quick.repeats_max) == 2
    assert check_pairs((0.2, PAIR_NOISE_MIN_DF - 1), search, search.repeats_max) is None
    assert check_pairs((0.045, 20), search, search.repeats_max + 1) is None
    assert check_pairs(None, search, search.repeats_max) is None


def test_above_the_floor_the_check_measures_more_pairs_and_its_interval_carries_their_noise() -> None:
    """Trials whose pairs strayed 10% (a loaded machine): the check measures two pairs a side, not
    one. Its intervals are the prompts' (every pair kept) widened by the pair noise pooled over the
    trials' pairs and the check's own, for two pairs: a bootstrap over the two pairs alone shows half
    their variance and would read narrower."""
    from engine.measure.stats import t95
    from tuner.study.selection import pair_noise, pooled_noise, widen

    cfg = load_config(CFG)  # quick: repeats_max 1, so two pairs at most
    n = cfg.workload.num_heldout
    calls: list[str] = []
    xs = {CHECK: [1.5, 1.2, 1.8, 1.4, 1.6, 1.3], "heldout": [1.4, 1.5, 1.3, 1.6, 1.2, 1.5]}

    def side_of(spec: SpecConfig, side: str) -> list[tuple[int, float]]:
        slow = 1.08 if spec.method != "off" and len(calls) > 2 else 1.0  # the second pair's spec: 8% slower
        return [(100, slow / (x if spec.method != "off" else 1.0)) for x in xs[side]]

    planted = one_pass(cfg, side_of)

    def measure(spec: SpecConfig, split: str, level: int) -> Sample:
        calls.append(split)
        return planted(spec, split, level)

    spread = 0.1
    study = optuna.create_study(direction="maximize")
    for _ in range(3):
        for spec, centre in ((D3, 1.3), (SpecConfig(method="ngram", depth=5, topk=1, budget=6), 1.1)):
            study.add_trial(_trial(spec, [centre * math.exp(spread), centre * math.exp(-spread)]))
    trials_noise = pair_noise(study.trials)
    objective = Objective(study, SearchSpace.from_config(cfg), measure, cfg.workload, cfg.search)
    check, _ = heldout_check(cfg, objective, D3)
    assert check.pairs == 2 and len(calls) == 4  # two pairs, not one
    # each side's two ratios differ by the planted 8%: the check's own pairs' share of the noise
    noise, df = pooled_noise(trials_noise, [[1.0, 1 / 1.08], [1.0, 1 / 1.08]])
    assert noise < trials_noise[0] and df == trials_noise[1] + 2  # the check's own pairs agreed better
    assert check.pair_noise == pytest.approx(noise, abs=1e-4)
    assert "2 pairs, both sides in each pass, prompt by prompt, sized by the pair noise" in describe_check(check)
    # the interval: the prompts' with both pairs kept, widened for two pairs of that noise
    per_side = [[[([(100, (1.08 if j else 1.0) / x) for x in xs[sp]], [(100, 1.0)] * n)] for j in range(2)]
                for sp in (CHECK, "heldout")]
    prompts_only = gap_interval(per_side[0], per_side[1], check.gap, seed=cfg.seed, resample_pairs=False)
    lo, hi = widen(prompts_only[0], prompts_only[1], check.gap, noise, df, pairs=2)
    assert (check.gap_ci_low, check.gap_ci_high) == pytest.approx((lo, hi))
    boot = gap_interval(per_side[0], per_side[1], check.gap, seed=cfg.seed)
    assert check.gap_ci_low < boot[0] and check.gap_ci_high > boot[1]
    half = math.exp(t95(df + 1) * noise / math.sqrt(2))
    assert check.tuning.ci_high / check.tuning.speedup == pytest.approx(half)


@pytest.mark.parametrize("others, pairs", [
    ([0.0], 2),  # a quiet machine: the pairs the study's noise asked for, no more
    ([0.3], 6),  # fidelity's background load throughout: every pair contended, up to CHECK_PAIRS_LOADED
    ([0.0, 0.3, 0.0], 3),  # a load that came for one pair: one more pair, until two were quiet
    ([0.08, 0.08], 2),  # at LOAD_CORES a pair still counts as quiet
    ([None], 2),  # a machine that cannot be read: as many pairs as without load
])
def test_the_check_adds_pairs_only_while_other_processes_load_the_machine(
        monkeypatch: pytest.MonkeyPatch, others: list[float | None], pairs: int) -> None:
    """The check reads what other processes ran during each of its pairs (engine.models.cpuload.others_cores,
    planted here), not the pairs' timing: two pairs on a quiet machine, as before; a pair during which
    they kept more than LOAD_CORES cores busy does not count towards them, and pairs go on up to
    CHECK_PAIRS_LOADED. The check records each pair's reading. The timing is the same in every case
    (the spec 1.5x throughout), so only the planted load can add pairs."""
    from helpers import PlantedLoad

    from engine.models import cpuload
    from tuner.study.selection import CHECK_PAIRS_LOADED, LOAD_CORES

    assert LOAD_CORES == 0.08 and CHECK_PAIRS_LOADED == 6
    cfg = load_config(CFG)
    study = _study_with_pair_noise(baseline_tok_s=140.0)

    def measure(spec: SpecConfig, split: str, level: int) -> Sample:
        secs = (100 / 140.0) / (1.5 if spec.method != "off" else 1.0)
        return Sample(100 / secs, 3.0, per_prompt=[(100, secs)] * (2 * cfg.workload.num_heldout))

    planted = PlantedLoad(others)
    monkeypatch.setattr(cpuload, "others_cores", planted)
    objective = Objective(study, SearchSpace.from_config(cfg), measure, cfg.workload, cfg.search)
    check, _ = heldout_check(cfg, objective, D3)
    assert check.pairs == pairs and planted.calls == pairs
    seen = [others[min(i, len(others) - 1)] for i in range(pairs)]
    assert check.load_cores == (seen if None not in seen else [None] * pairs)
    assert check.gap == pytest.approx(0.0) and check.tuning.speedup == pytest.approx(1.5)


def test_under_load_the_checks_re_measurements_are_capped_over_the_whole_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load throughout: the check goes on to CHECK_PAIRS_LOADED pairs, and every pair reads
    implausible (a speedup above tau, planted). Each pair could be measured three times
    (PLAUSIBILITY_RETRIES), 18 passes of off here; over the whole check at most CHECK_RETRIES
    re-measurements are spent, then each pair is measured once and kept as it reads, flagged, and
    best.yaml's check says why."""
    from helpers import PlantedLoad

    from engine.models import cpuload
    from tuner.study.objective import CHECK_RETRIES, PLAUSIBILITY_RETRIES
    from tuner.study.selection import CHECK_PAIRS_LOADED

    assert CHECK_RETRIES == 4 and PLAUSIBILITY_RETRIES == 2
    cfg = load_config(CFG)
    study = _study_with_pair_noise(baseline_tok_s=140.0)
    offs: list[float] = []

    def measure(spec: SpecConfig, split: str, level: int) -> Sample:
        secs = (100 / 140.0) / (1.0 if spec.method == "off" else 4.0)  # 4x at tau 3: implausible every time
        if spec.method == "off":
            offs.append(100 / secs)
        return Sample(100 / secs, 3.0, per_prompt=[(100, secs)] * (2 * cfg.workload.num_heldout))

    monkeypatch.setattr(cpuload, "others_cores", PlantedLoad([0.3]))
    objective = Objective(study, SearchSpace.from_config(cfg), measure, cfg.workload, cfg.search)
    check, _ = heldout_check(cfg, objective, D3)
    assert check.pairs == CHECK_PAIRS_LOADED
    assert len(offs) == CHECK_PAIRS_LOADED + CHECK_RETRIES  # one pass of off per pair measured
    assert check.remeasured is not None and len(check.remeasured) == CHECK_RETRIES
    flagged = (check.implausible or "").split("; pair ")
    assert len(flagged) == CHECK_PAIRS_LOADED and all("cannot exceed tau" in f for f in flagged)
    # pairs 1 and 2 spent the re-measurements; 3 to 6 were measured once
    assert sum("the check's re-measurements were spent" in f for f in flagged) == CHECK_PAIRS_LOADED - 2
    assert describe_check(check).endswith(
        f"; {CHECK_PAIRS_LOADED} pairs counted as read, still implausible (best.yaml heldout_check.implausible says why)")


@pytest.mark.parametrize("others, call_s, pairs, cut", [
    ([0.3], 40.0, 3, True),  # a load throughout, 80 s pairs: a fourth would end past the 300 s limit
    ([0.3], 1.0, 6, False),  # the same load, short pairs: up to CHECK_PAIRS_LOADED, as before
    ([0.0], 400.0, 2, False),  # pairs each past the limit: never fewer than the two asked for
])
def test_the_checks_pairs_stop_where_one_more_would_not_fit_the_trial_limit(
        monkeypatch: pytest.MonkeyPatch, others: list[float], call_s: float, pairs: int, cut: bool) -> None:
    """Pairs past the first two are measured only while one more like the last fits in
    search.trial_timeout_s (search=quick: 300 s), as a trial's repeats: a loaded check once took
    507 s after a 39 s study. Each pass advances a planted clock by `call_s`; the check records the
    limit that cut it and its line says so."""
    import time as real_time

    from helpers import PlantedLoad

    from engine.models import cpuload
    from tuner.study import objective as objective_module

    cfg = load_config(CFG)
    assert cfg.search.trial_timeout_s == 300
    study = _study_with_pair_noise(baseline_tok_s=140.0)
    offset = [0.0]
    monotonic = real_time.monotonic
    monkeypatch.setattr(objective_module.time, "monotonic", lambda: monotonic() + offset[0])

    def measure(spec: SpecConfig, split: str, level: int) -> Sample:
        offset[0] += call_s
        secs = (100 / 140.0) / (1.5 if spec.method != "off" else 1.0)
        return Sample(100 / secs, 3.0, per_prompt=[(100, secs)] * (2 * cfg.workload.num_heldout))

    monkeypatch.setattr(cpuload, "others_cores", PlantedLoad(others))
    objective = Objective(study, SearchSpace.from_config(cfg), measure, cfg.workload, cfg.search)
    check, figures = heldout_check(cfg, objective, D3)
    assert check.pairs == pairs
    assert check.pairs_cut == ("search.trial_timeout_s=300" if cut else None)
    assert "pairs_cut" not in figures
    assert ("; pairs stopped at search.trial_timeout_s=300, as a trial's repeats" in describe_check(check)) == cut
