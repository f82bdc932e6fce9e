"""A winner to trust on a noisy machine (issue 39), with planted measurements: a fake MeasureFn
returns scripted figures, the study is a real Optuna study (in memory: a commit per user attr on
SQLite costs seconds on a busy machine; the confirmation round's on SQLite), the objective and the
selection are the real ones. A glitch cannot prune a better trial nor win; an implausible pair is
measured again; the confirmation round picks the truly better configuration, ties go to the
smaller budget, and a machine at its noise floor gets no extra repeats and, when its trials cannot
tell the winner apart, the floor's short round however its noise stood from the start."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from engine.measure.stats import log_spread
from tuner.schema.compose import load_config
from tuner.schema.config import Config, SpecConfig
from tuner.search.space import SearchSpace
from tuner.study.objective import Objective, Sample, spec_attrs
from tuner.study.selection import confirm, leader, pick_winner
from tuner.study.studies import PROBE_PASSES, ROLE, ROSE, make_pruner

optuna.logging.set_verbosity(optuna.logging.WARNING)

CFG = ["model=tiny-random", "+workload=code", "workload.concurrency=[1]", "search=quick", "search.repeats_min=2",
       "search.repeats_max=2", "search.ci_rel_width=0.0001", "search.depth.max=6", "search.budget_max=8"]


def ng(depth: int) -> SpecConfig:
    return SpecConfig(method="ngram", depth=depth, topk=1, budget=depth + 1)


Script = Callable[[SpecConfig, int], tuple[float, float]]  # (spec, its n-th pass) -> (tok/s, tau)


class Planted:
    """A MeasureFn whose figures are scripted: the baseline reads `base` tok/s, or the next of
    `base_script` while it lasts; a spec reads script(spec, n) for its n-th pass. Every call is
    recorded."""

    def __init__(self, script: Script, base: float = 10.0, base_script: list[float] | None = None) -> None:
        self.script, self.base, self.base_script = script, base, list(base_script or [])
        self.calls: list[str] = []
        self.passes: dict[str, int] = {}

    def __call__(self, spec: SpecConfig, split: str, concurrency: int) -> Sample:
        self.calls.append(spec.key())
        if spec.method == "off":
            return Sample(self.base_script.pop(0) if self.base_script else self.base, 1.0, 1.0, 1.0)
        n = self.passes.get(spec.key(), 0)
        self.passes[spec.key()] = n + 1
        tok_s, tau = self.script(spec, n)
        return Sample(tok_s, tau, 1.0, 1.0)


def study_of(tmp_path: Path, cfg: Config, measure: Planted, specs: list[SpecConfig],
             in_memory: bool = True, share: bool = True) -> tuple[optuna.Study, Objective]:
    """A study with the baseline and `specs` enqueued in that order, the study's own pruner;
    `share=False`: every pair measures its own baseline (the pass order those scripts were planted for)."""
    space = SearchSpace.from_config(cfg)
    study = optuna.create_study(storage=None if in_memory else f"sqlite:///{tmp_path}/s.db", direction="maximize",
                                pruner=make_pruner(cfg.search))
    study.enqueue_trial({}, user_attrs={ROLE: "baseline"})
    for spec in specs:
        study.enqueue_trial(space.params_of(spec), user_attrs={ROLE: "grid"})
    return study, Objective(study, space, measure, cfg.workload, cfg.search, share_baseline=share)


def test_a_glitch_cannot_prune_a_better_trial_nor_win(tmp_path: Path) -> None:
    """ngram d2 reads 2.9x in its first repeat (a glitch) and 1.1x in its second: compared by point
    values (the old HopelessPruner) its 2.0x mean pruned the 1.3x of every later trial after one
    repeat. Its one-sided lower bound is far below 1, so ngram d4 completes and wins."""
    cfg = load_config(CFG)
    glitch = {0: 29.0, 1: 11.0}
    measure = Planted(lambda spec, n: (glitch[n], 4.0) if spec.depth == 2 else (13.0, 2.0))
    study, objective = study_of(tmp_path, cfg, measure, [ng(2), ng(4)])
    outcomes = [objective.run_one() for _ in range(3)]
    assert [o.state for o in outcomes] == [TrialState.COMPLETE] * 3
    g, b = study.trials[1], study.trials[2]
    assert g.user_attrs["ratios"] == [2.9, 1.1] and g.user_attrs["speedup_lower"] < 1.0
    assert b.user_attrs["ratios"] == [1.3, 1.3] and b.user_attrs["repeats"] == 2
    win = pick_winner(study.trials, cfg.search.noise_rel, [1])
    assert win.spec == ng(4)
    best = leader(study.trials, cfg.search.noise_rel)
    assert best is not None and best.spec == ng(4)  # the progress line's best: by lower bound, not 2.0x


def test_a_trial_far_below_the_best_lower_bound_is_still_pruned(tmp_path: Path) -> None:
    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: (15.0, 2.0) if spec.depth == 4 else (10.5, 2.0))
    study, objective = study_of(tmp_path, cfg, measure, [ng(4), ng(2)])
    outcomes = [objective.run_one() for _ in range(3)]
    assert outcomes[2].state == TrialState.PRUNED  # 1.05 / 0.9 = 1.17 < 1.5 x 0.9
    assert "optimistic bound" in study.trials[2].user_attrs["prune_reason"]
    assert measure.passes["ngram d2 k1 b3"] == 1


def test_an_implausible_ratio_is_measured_again_and_the_trial_says_why(tmp_path: Path) -> None:
    """ngram d3 reads 2.7x with tau 1.7 (a speedup cannot exceed tau): that pair is measured again
    before it counts; ngram d5's paired baseline dips to 5 tok/s against a history at 10: an
    outlier, measured again too. Both trials record why; their kept ratios are the re-measured ones."""
    cfg = load_config(CFG)
    first = {"ngram d3 k1 b4": 27.0, "ngram d5 k1 b6": 7.0}
    # off passes: trial 0's two (its last is d3's first baseline, shared), d3's retry's, d3's second
    # pair's, d5's first (its first pair runs baseline first after d3 ended on a spec pass)
    measure = Planted(lambda spec, n: (first.get(spec.key(), 14.0) if n == 0 else 14.0, 1.7),
                      base_script=[10.0, 10.0, 10.0, 10.0, 5.0])
    study, objective = study_of(tmp_path, cfg, measure, [ng(3), ng(5)])
    for _ in range(3):
        objective.run_one()
    t3, t5 = study.trials[1], study.trials[2]
    (why,) = t3.user_attrs["remeasured"]
    assert why.startswith("repeat 1: speedup 2.700x at concurrency 1 exceeds tau 1.70")
    assert t3.user_attrs["ratios"] == [1.4, 1.4] and "implausible" not in t3.user_attrs
    (why,) = t5.user_attrs["remeasured"]
    assert "paired baseline 5.0 tok/s is an outlier" in why and "median 10.0 tok/s" in why
    assert t5.user_attrs["ratios"] == [1.4, 1.4]
    assert measure.passes == {"ngram d3 k1 b4": 3, "ngram d5 k1 b6": 3}  # 2 repeats + 1 re-measurement each


def test_a_figure_that_stays_implausible_never_prunes_nor_wins(tmp_path: Path) -> None:
    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: (27.0, 1.7) if spec.depth == 3 else (12.0, 2.0))
    study, objective = study_of(tmp_path, cfg, measure, [ng(3), ng(2)])
    outcomes = [objective.run_one() for _ in range(3)]
    t3 = study.trials[1]
    assert len(t3.user_attrs["remeasured"]) == 2 * 2  # two retries in each of two repeats
    assert "exceeds tau" in t3.user_attrs["implausible"]
    assert outcomes[2].state == TrialState.COMPLETE  # 1.2x is not pruned by a 2.7x no one can believe
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec == ng(2)


def _planted_trial(spec: SpecConfig, ratios: list[float], base: float = 10.0, passes: bool = False
                   ) -> optuna.trial.FrozenTrial:
    """A finished trial of `spec` with these ratios over a baseline at `base`; `passes`: with its spec
    passes' tok/s (`tok_s_samples`), as a measured trial has."""
    sp = sum(ratios) / len(ratios)
    return create_trial(
        state=TrialState.COMPLETE, value=base * sp, params={}, distributions={},
        user_attrs={**spec_attrs(spec), ROLE: "search", "ratios": ratios, "speedup": sp, "tau": 3.0,
                    "tok_s": base * sp, "baseline_tok_s": base, "baseline_samples": [base] * len(ratios),
                    "feasible": True, **({"tok_s_samples": [base * r for r in ratios]} if passes else {})})


# a machine quiet for the study's first 6 baseline passes (its floor), busy after them
NOISY = [10.0, 10.1, 9.9, 10.05, 10.0, 9.95, 12.5, 8.0, 12.0, 8.5, 12.5, 8.0]


def _noisy_study(tmp_path: Path, cfg: Config, measure: Planted, planted: list[tuple[SpecConfig, list[float]]],
                 baseline: list[float], in_memory: bool = True, seconds: float = 0.0
                 ) -> tuple[optuna.Study, Objective]:
    """A study of the baseline and `planted` trials (each taking `seconds`: what the confirmation
    round's share of time is measured against)."""
    study, objective = study_of(tmp_path, cfg, measure, [], in_memory)
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=10.0, params={}, distributions={},
                                 user_attrs={**spec_attrs(SpecConfig(method="off")), ROLE: "baseline",
                                             "tok_s_samples": baseline, "ratios": [1.0, 1.0], "speedup": 1.0}))
    for spec, ratios in planted:
        t = _planted_trial(spec, ratios)
        t.datetime_start = t.datetime_complete - timedelta(seconds=seconds)
        study.add_trial(t)
    return study, objective


def test_the_confirmation_round_picks_the_truly_better_of_two(tmp_path: Path) -> None:
    """On a machine that got busy (baseline passes 8-12.5 tok/s after a quiet start) ngram d2 was lucky in its trial (1.45x,
    1.40x) and ngram d4 unlucky (1.35x, 1.30x); truly they run at 1.3x and 1.5x. Head to head,
    interleaved with the baseline, they separate and ngram d4 wins."""
    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: (13.0 if spec.depth == 2 else 15.0, 3.0))
    study, objective = _noisy_study(tmp_path, cfg, measure, [(ng(2), [1.45, 1.40]), (ng(4), [1.35, 1.30])],
                                    NOISY, in_memory=False)  # the confirmation trials on real SQLite
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec == ng(2)  # the trials alone are fooled
    lines: list[str] = []
    pairs = confirm(study, objective, cfg.search.noise_rel, lines.append)
    assert pairs == 4 and measure.passes == {"ngram d2 k1 b3": 2, "ngram d4 k1 b5": 2}  # separated after 2 rounds
    confirms = [t for t in study.trials if t.user_attrs.get(ROLE) == "confirm"]
    assert len(confirms) == 4 and all(t.state == TrialState.COMPLETE for t in confirms)
    # interleaved: every pair has its baseline adjacent, the order alternating from pair to pair; a pair
    # baseline first shares the baseline pass of the pair before it
    tail = measure.calls[-6:]
    assert tail == ["ngram d2 k1 b3", "off", "ngram d4 k1 b5", "ngram d2 k1 b3", "off", "ngram d4 k1 b5"]
    assert "confirmation round" in lines[0]
    win = pick_winner(study.trials, cfg.search.noise_rel, [1])
    assert win.spec == ng(4) and "head to head in the confirmation round 1.500x over 2 pairs" in win.reason


def test_the_confirmation_round_declares_a_tie_and_it_goes_to_the_smaller_budget(tmp_path: Path) -> None:
    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: (14.0, 3.0))  # both truly 1.4x
    study, objective = _noisy_study(tmp_path, cfg, measure, [(ng(2), [1.35, 1.38]), (ng(5), [1.50, 1.45])],
                                    NOISY)
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec == ng(5)
    assert confirm(study, objective, cfg.search.noise_rel) == 4  # tied after two rounds: no third
    win = pick_winner(study.trials, cfg.search.noise_rel, [1])
    assert win.spec == ng(2) and "smallest budget" in win.reason


def test_a_quiet_machine_whose_trials_tell_the_winner_apart_gets_no_confirmation_round(tmp_path: Path) -> None:
    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: (14.0, 3.0))
    study, objective = _noisy_study(tmp_path, cfg, measure, [(ng(2), [1.10, 1.11]), (ng(5), [1.50, 1.45])],
                                    [10.0, 10.1, 9.9])
    assert confirm(study, objective, cfg.search.noise_rel) == 0 and measure.calls == []


def test_noise_costs_repeats_only_when_it_rises_above_the_machines_floor(tmp_path: Path) -> None:
    """The study's first 6 baseline passes are quiet (a floor below search.noise_rel, 5%); then the
    machine gets busy (passes 8-12.5 tok/s): one line says so with the figure and the trials after
    it may take up to 4 pairs instead of 2. The confirmation round is on for that study."""
    cfg = load_config(CFG)
    quiet6 = [10.0, 10.1, 9.95, 10.05, 10.0, 9.9]
    busy = Planted(lambda spec, n: (13.0, 2.0), base_script=quiet6 + [12.5, 8.0, 13.0, 7.5] + [12.0, 8.5] * 8)
    study, objective = study_of(tmp_path, cfg, busy, [ng(2), ng(3), ng(4), ng(5)], share=False)
    outcomes = [objective.run_one() for _ in range(5)]
    notes = [o.note for o in outcomes if o.note]
    assert [t.user_attrs["repeats"] for t in study.trials[1:]] == [2, 2, 2, 4]
    assert study.user_attrs["noise_floor"] == pytest.approx(log_spread(quiet6))
    assert len(notes) == 1 and notes[0].startswith("noise: the last 6 baseline passes spread ")
    assert notes[0].endswith(", above the floor 5.0% beyond chance: trials now repeat up to 4 pairs")
    # above the floor beyond chance: (spread / 5%)^2 past the F test's 95% quantile (5.05 at 5, 5 df)
    assert float(notes[0].split("spread ")[1].split("%")[0]) / 5.0 > 5.05 ** 0.5
    assert objective.noise_rose() is not None


def test_an_idle_machine_at_its_floor_pays_no_extra_repeats(tmp_path: Path) -> None:
    """A VM whose baseline passes always spread about 9% (above search.noise_rel) is at its floor:
    one line names the floor and every trial keeps 2 pairs, where a fixed 5% threshold would have
    taken extra pairs on every trial; the confirmation round is the floor's short one."""
    cfg = load_config(CFG)
    wobble = [10.0, 11.0, 9.2, 10.6, 9.4, 11.1] * 4
    idle = Planted(lambda spec, n: (13.0, 2.0), base_script=wobble)
    study, objective = study_of(tmp_path, cfg, idle, [ng(2), ng(3), ng(4), ng(5)])
    outcomes = [objective.run_one() for _ in range(5)]
    floor = log_spread(wobble[:6])
    assert floor > cfg.search.noise_rel
    assert [o.note for o in outcomes if o.note] == [
        f"noise floor: the study's first 6 baseline passes spread {floor:.1%} (above search.noise_rel=0.05): this "
        "machine's ordinary spread; trials repeat up to 2 pairs unless the noise rises above it"]
    assert [t.user_attrs["repeats"] for t in study.trials[1:]] == [2, 2, 2, 2]
    assert objective.noise_rose() is None
    # two pairs at 9% clear no one-sided bound: the trials alone name off, though all read 1.2-1.4x.
    # Not the busy machine's round (until told apart): the floor's, two rounds of the best by lower
    # bound and the (at least CONFIRM_TOP - 1) contenders its bounds do not tell apart from it, all
    # reading alike here: 6 pairs, 4 each for the best, which clears the bound
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec.method == "off"
    lines: list[str] = []
    assert confirm(study, objective, cfg.search.noise_rel, lines.append) == 6
    assert "none of them clears the baseline by the winner's rule yet" in lines[0]
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec.method == "ngram"

    quiet = Planted(lambda spec, n: (13.0, 2.0), base_script=[10.0, 10.1, 9.95, 10.05] * 4)
    study, objective = study_of(tmp_path / "q", cfg, quiet, [ng(2), ng(3)])
    outcomes = [objective.run_one() for _ in range(3)]
    assert all(o.note is None for o in outcomes) and "noise_rel_measured" not in study.user_attrs
    assert [t.user_attrs["repeats"] for t in study.trials[1:]] == [2, 2]


def test_contenders_are_the_best_by_lower_bound_and_pruned_trials_near_the_leader() -> None:
    from tuner.study.selection import contenders

    def trial(spec: SpecConfig, ratios: list[float], state: TrialState = TrialState.COMPLETE):
        t = _planted_trial(spec, ratios)
        return create_trial(state=state, value=t.value if state == TrialState.COMPLETE else None,
                            params={}, distributions={}, user_attrs=t.user_attrs)

    trials = [trial(ng(1), [1.30, 1.32]), trial(ng(2), [1.20, 1.22]), trial(ng(3), [1.10, 1.12]),
              trial(ng(4), [1.05, 1.06]),  # fourth by lower bound: not measured again
              trial(ng(5), [1.28], TrialState.PRUNED),  # pruned after one repeat within noise of 1.31: measured
              trial(ng(6), [0.90], TrialState.PRUNED)]  # pruned far below: not
    assert [(s.key(), r) for s, r in contenders(trials, 0.05)] == [
        ("ngram d1 k1 b2", [1.30, 1.32]), ("ngram d2 k1 b3", [1.20, 1.22]), ("ngram d3 k1 b4", [1.10, 1.12]),
        ("ngram d5 k1 b6", [1.28])]
    slow = [trial(ng(1), [0.70, 0.72]), trial(ng(2), [0.60, 0.61])]  # off beats both even optimistically
    assert contenders(slow, 0.05) == []


def test_a_configuration_pruned_once_and_completed_once_is_one_contender() -> None:
    """A configuration with a pruned trial near the leader and a complete one of its own is both a
    `_near` and a bound-ranked contender: it is measured once a round, not twice."""
    from tuner.study.selection import candidates, contenders

    def trial(spec: SpecConfig, ratios: list[float], state: TrialState = TrialState.COMPLETE):
        t = _planted_trial(spec, ratios)
        return create_trial(state=state, value=t.value if state == TrialState.COMPLETE else None,
                            params={}, distributions={}, user_attrs=t.user_attrs)

    trials = [trial(ng(1), [1.30, 1.32]), trial(ng(2), [1.28], TrialState.PRUNED), trial(ng(2), [1.27, 1.29]),
              trial(ng(3), [1.26, 1.28])]
    lead = next(c for c in candidates(trials, 0.05) if c.spec == ng(1))
    keys = [s.key() for s, _ in contenders(trials, 0.05, lead)]
    assert keys[0] == "ngram d1 k1 b2" and "ngram d2 k1 b3" in keys and len(keys) == len(set(keys))


def test_no_confirmation_round_when_nothing_reads_like_a_winner(tmp_path: Path) -> None:
    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: (10.0, 3.0))
    study, objective = _noisy_study(tmp_path, cfg, measure, [(ng(2), [1.00, 1.02]), (ng(5), [0.95, 0.98])],
                                    NOISY)
    assert confirm(study, objective, cfg.search.noise_rel) == 0 and measure.calls == []


def test_no_round_at_the_floor_for_a_lead_whose_drafts_are_not_accepted(tmp_path: Path) -> None:
    """The trials name off; the best by lower bound reads 1.3x with tau 1.0 (no draft accepted: a
    glitch, however often measured): the floor's round, which may take the best by lower bound when
    the trials name off, has no lead and measures nothing."""
    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: (13.0, 1.0))
    study, objective = _noisy_study(tmp_path, cfg, measure, [], [10.0, 10.1, 9.9])
    for spec, ratios in ((ng(2), [1.30, 1.32]), (ng(5), [1.25, 1.35])):
        t = _planted_trial(spec, ratios)
        study.add_trial(create_trial(state=TrialState.COMPLETE, value=t.value, params={}, distributions={},
                                     user_attrs={**t.user_attrs, "tau": 1.0}))
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec.method == "off"
    assert confirm(study, objective, cfg.search.noise_rel) == 0 and measure.calls == []


def test_search_confirm_always_runs_the_round_at_the_noise_floor_and_finds_the_better(tmp_path: Path) -> None:
    """At the floor, two pairs that agree by chance lead by lower bound (ngram d2: 1.45x, 1.40x; truly
    1.3x) over a truly better one (ngram d4: 1.35x, 1.30x; truly 1.5x). search.confirm=always measures
    them head to head anyway; auto leaves the trials' figures (the test above)."""
    cfg = load_config([*CFG, "search.confirm=always"])
    measure = Planted(lambda spec, n: (13.0 if spec.depth == 2 else 15.0, 3.0))
    study, objective = _noisy_study(tmp_path, cfg, measure, [(ng(2), [1.45, 1.40]), (ng(4), [1.35, 1.30])],
                                    [10.0, 10.1, 9.9])
    assert objective.noise_rose() is None  # the machine stayed at its floor
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec == ng(2)  # the trials alone are fooled
    lines: list[str] = []
    assert confirm(study, objective, cfg.search.noise_rel, lines.append) == 4
    assert "search.confirm=always" in lines[0]
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec == ng(4)


def _confirm_trial(spec: SpecConfig, ratio: float, round_: int) -> optuna.trial.FrozenTrial:
    t = _planted_trial(spec, [ratio])
    return create_trial(state=TrialState.COMPLETE, value=t.value, params={}, distributions={},
                        user_attrs={**t.user_attrs, ROLE: "confirm", "confirm_round": round_})


def _rounds(spec: SpecConfig, ratios: list[float]) -> list[optuna.trial.FrozenTrial]:
    return [_confirm_trial(spec, r, i) for i, r in enumerate(ratios)]


def test_a_tie_is_only_what_the_intervals_cannot_tell_apart_within_the_regret_goal() -> None:
    """The trials' figures tie when their intervals cannot tell them apart and they read within 3%
    (the regret goal): read 4.6% apart, two trials are no tie even with their wide bounds (the old
    rule gave it to ngram d2). Head to head a tie is an equivalence: the interval of the ratio
    between the two, round by round, lies within +-3%. 2.8% apart round after round, they are told
    apart and the better one wins; 0.6% apart with rounds that agree, a tie: the smaller budget."""
    from tuner.study.selection import head_verdict

    trials = [_planted_trial(ng(2), [1.44, 1.46]), _planted_trial(ng(5), [1.51, 1.53])]
    assert pick_winner(trials, 0.05, [1]).spec == ng(5)
    close = [_planted_trial(ng(2), [1.49, 1.51]), _planted_trial(ng(5), [1.51, 1.53])]
    win = pick_winner(close, 0.05, [1])
    assert win.spec == ng(2) and "could not be told apart and read within 3% of the best" in win.reason
    assert pick_winner(close, 0.01, [1]).spec == ng(5)  # a user's tighter noise_rel ties less

    apart = trials + _rounds(ng(2), [1.400, 1.430, 1.380]) + _rounds(ng(5), [1.440, 1.470, 1.420])
    assert head_verdict({0: 1.400, 1: 1.430, 2: 1.380}, {0: 1.440, 1: 1.470, 2: 1.420}, 0.05) == "apart"
    assert pick_winner(apart, 0.05, [1]).spec == ng(5)
    tie = trials + _rounds(ng(2), [1.40, 1.46, 1.42]) + _rounds(ng(5), [1.41, 1.47, 1.42])
    assert head_verdict({0: 1.40, 1: 1.46, 2: 1.42}, {0: 1.41, 1: 1.47, 2: 1.42}, 0.05) == "tie"
    win = pick_winner(tie, 0.05, [1])
    assert win.spec == ng(2) and "smallest budget" in win.reason


# The confirmation round of loaded seed 1 in benchmarks/fidelity.py at 2b74a58 (docs/results.md):
# three pairs each, d2, d4, d3 within 0.4% (reference: d3 1.470x, d4 1.464x, d2 1.383x)
LOADED = {2: [1.327, 1.511, 1.461], 4: [1.616, 1.459, 1.234], 3: [1.455, 1.502, 1.325]}
LATER = {2: [1.36, 1.40, 1.38, 1.39], 4: [1.49, 1.44, 1.47, 1.46], 3: [1.47, 1.45, 1.49, 1.46]}


def test_three_pairs_under_load_that_read_alike_are_no_tie_and_more_pairs_separate_them(tmp_path: Path) -> None:
    """Issue 39's last miss, planted: under load, three head-to-head pairs each put ngram d2, d4
    and d3 within 0.4% of each other; 'not told apart and within 3%' called that a tie and gave it
    to d2, 5.9% below the reference's best. The interval of the ratio between d2 and d4 over those
    three rounds spans far more than +-3%, so it is no tie: the round goes on (up to
    CONFIRM_PAIRS_MAX rounds) while d2 is neither told apart nor tied, and the better reading, d3
    or d4, wins."""
    from tuner.study.selection import CONFIRM_PAIRS_MAX, head_verdict

    cfg = load_config(CFG)
    script = {d: LOADED[d] + LATER[d] for d in LOADED}
    measure = Planted(lambda spec, n: (10 * script[spec.depth][n], 3.0))
    study, objective = _noisy_study(tmp_path, cfg, measure, [(ng(4), [1.50, 1.44]), (ng(2), [1.46, 1.42]),
                                                             (ng(3), [1.43, 1.47])], NOISY, seconds=30.0)
    study.set_user_attr(ROSE, 0.2)  # what the study recorded when its noise rose (the load came mid-study)
    by_round = {d: dict(enumerate(r)) for d, r in LOADED.items()}
    assert head_verdict(by_round[2], by_round[4], cfg.search.noise_rel) == "open"  # not a tie, as it was
    lines: list[str] = []
    pairs = confirm(study, objective, cfg.search.noise_rel, lines.append)
    assert 9 < pairs <= 3 * CONFIRM_PAIRS_MAX
    win = pick_winner(study.trials, cfg.search.noise_rel, [1])
    assert win.spec in (ng(3), ng(4)), win.reason
    assert "smallest budget" not in win.reason  # d3 and d4 0.4% apart read 1-2% apart: no tie proven
    # the loaded rounds' quotients (d2 over d4: 0.82, 1.04, 1.18) keep d2 from being told apart in
    # CONFIRM_PAIRS_MAX rounds: the better reading wins, never the smaller budget by default
    assert lines[-1].endswith(f"{CONFIRM_PAIRS_MAX} rounds, {win.spec.key()} read best, not told apart from "
                              f"{'ngram d4 k1 b5' if win.spec == ng(3) else 'ngram d3 k1 b4'}, ngram d2 k1 b3 nor "
                              "within 3% of it: the best reading wins")


def test_a_pruned_trial_that_read_above_the_winner_is_confirmed_at_the_noise_floor(tmp_path: Path) -> None:
    """The main command at the noise floor: ngram d3 read 1.27x on its one repeat and was pruned (the
    best lower bound then was a lucky trial's); the trials' winner reads 1.19x. Under
    search.confirm=auto no round ran, and 1.19x won. Now a pruned trial whose first repeat reads
    within the noise of the trials' winner joins a confirmation round with that winner only (the
    completed trials' figures stand at the floor), two rounds, and the truly faster d3 wins. Of the
    pruned trials near the winner only the one whose first repeat read best (d3, not d6 at 1.22x) is
    measured; a trial pruned far below is not; the completed runner-up d2 (1.11x), whose interval
    overlaps the winner's, is (CONFIRM_TOP - 1 contenders at least): 6 pairs."""
    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: ({3: 13.0, 5: 11.9, 2: 11.1}[spec.depth], 3.0))
    study, objective = _noisy_study(tmp_path, cfg, measure, [(ng(5), [1.19, 1.185]), (ng(2), [1.10, 1.12])],
                                    [10.0, 10.1, 9.9])
    for spec, ratio in ((ng(3), 1.27), (ng(6), 1.22), (ng(4), 0.95)):
        t = _planted_trial(spec, [ratio])
        study.add_trial(create_trial(state=TrialState.PRUNED, params={}, distributions={}, user_attrs=t.user_attrs))
    assert objective.noise_rose() is None and cfg.search.confirm == "auto"
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec == ng(5)
    lines: list[str] = []
    assert confirm(study, objective, cfg.search.noise_rel, lines.append) == 6
    assert measure.passes == {"ngram d5 k1 b6": 2, "ngram d3 k1 b4": 2, "ngram d2 k1 b3": 2}
    assert "pruned trial's one repeat read within the noise" in lines[0]
    win = pick_winner(study.trials, cfg.search.noise_rel, [1])
    assert win.spec == ng(3) and "head to head in the confirmation round 1.300x over 2 pairs" in win.reason


def test_the_confirmation_round_stops_at_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two configurations that stay neither told apart nor tied (their pairs wander) are measured for
    CONFIRM_PAIRS_MAX rounds while the round has taken less than the trials' time or
    CONFIRM_MIN_S; for two rounds only once it has taken that long (here: a bound of 0 s). Either
    way the better reading wins, not the smaller budget, and the log says why the round stopped."""
    from tuner.study import selection
    from tuner.study.selection import CONFIRM_PAIRS_MAX

    cfg = load_config(CFG)
    wander = {2: [1.30, 1.50] * 8, 4: [1.50, 1.32] * 8}
    for bound, rounds, why in ((None, CONFIRM_PAIRS_MAX, f"{CONFIRM_PAIRS_MAX} rounds"), (0.0, 2, "stopped after 0 s")):
        if bound is not None:
            monkeypatch.setattr(selection, "CONFIRM_MIN_S", bound)
        measure = Planted(lambda spec, n: (10 * wander[spec.depth][n], 3.0))
        study, objective = _noisy_study(tmp_path / str(bound), cfg, measure,
                                        [(ng(2), [1.45, 1.40]), (ng(4), [1.35, 1.40])], NOISY)
        lines: list[str] = []
        assert confirm(study, objective, cfg.search.noise_rel, lines.append) == 2 * rounds
        assert why in lines[-1] and "the best reading wins" in lines[-1]
        assert "smallest budget" not in pick_winner(study.trials, cfg.search.noise_rel, [1]).reason


def test_a_reused_point_does_not_consume_the_budget(tmp_path: Path) -> None:
    """A sampler that proposes a measured point again (the last of 10 trials re-proposed the
    enqueued adaptive point) gets its figures without a measurement, and that trial does not count
    against search.n_trials: the budget's trials are all measured ones. A sampler that finds
    nothing new ends the study once it has proposed measured points as often as the budget has
    trials."""
    from tuner.study.driver import run_trials
    from tuner.study.studies import Budget, create_study, finished_count

    cfg = load_config([*CFG, "search.depth.min=2", "search.depth.max=3", "search.n_trials=4", "search.repeats_min=1",
                       "search.repeats_max=1", "search.adaptive=false"])
    measure = Planted(lambda spec, n: (13.0, 2.0))
    space = SearchSpace.from_config(cfg)
    assert {p.key() for p in space.points()} == {"ngram d2 k1 b3", "ngram d3 k1 b4"}  # 2 points and off
    study = create_study(cfg, space, tmp_path, "reuse")
    study.enqueue_trial(space.params_of(ng(2)))  # proposed again right away
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    run_trials(study, objective, cfg.search)
    measured = [t for t in study.trials if "reused_from" not in t.user_attrs]
    reused = [t for t in study.trials if "reused_from" in t.user_attrs]
    assert len(measured) == 3 and finished_count(study) == 3  # off and both points: fewer than 4 exist
    assert len(reused) == 4 and Budget.of(cfg.search).spent(study.trials)  # the sampler found nothing new
    assert sorted(measure.passes.values()) == [1, 1]  # each point measured once

    study = create_study(cfg, space, tmp_path, "reuse-one")  # off, then the defaults
    for _ in range(2):
        study.enqueue_trial(space.params_of(ng(2)))
    outcomes = []
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    while any(t.state == TrialState.WAITING for t in study.trials):
        outcomes.append(objective.run_one())
    again = [o for o in outcomes if o.reused_from is not None]
    assert len(again) >= 1 and finished_count(study) == len(outcomes) - len(again)
    assert not Budget.of(cfg.search).spent(study.trials)  # 3 measured of 4: one more to measure


def test_the_heldout_check_compares_as_many_tuning_prompts_in_one_pass_until_both_are_tight(tmp_path: Path) -> None:
    """The winner's held-out check measures the held-out prompts and as many tuning prompts (6 and
    6, where trials play 2) in one pass, prompt by prompt, against the baseline's pass of the same
    prompts, the order within each pair alternating, until both speedup intervals are tight, at
    most as many pairs as a trial may take now: two when the figures agree, three when the held-out
    ones wander and the noise rose (a trial may then take 3). The gap is held-out over tuning, with
    both intervals; each side's tau is its prompts' tokens over their target forwards."""
    from tuner.projection.profiling import CHECK_PASS, check_order, check_prompt_count
    from tuner.study.selection import describe_check, gap_at_equal_tau, heldout_check, tau_gap

    cfg = load_config([*CFG, "search.ci_rel_width=0.10"])
    assert cfg.search.trial_prompts == 2 and check_prompt_count(cfg) == cfg.workload.num_heldout == 6
    at_t, at_h = check_order(6, 6)
    calls: list[tuple[str, str]] = []
    wander = iter([13.0, 14.5, 12.8, 14.2])  # within 3 noise bands of its own passes

    def measure(spec: SpecConfig, split: str, level: int) -> Sample:
        calls.append((spec.method, split))
        pp: list = [None] * 12
        fw: list = [None] * 12
        held = 10.0 if spec.method == "off" else next(wander) if noisy else 13.0
        for at, tok_s in ((at_t, 10.0 if spec.method == "off" else 14.0), (at_h, held)):
            for i in at:  # 10 tokens a prompt; tau 2.0 under the spec (5 forwards), 1.0 off
                pp[i], fw[i] = (10, 10 / tok_s), 10 if spec.method == "off" else 5
        return Sample(120 / sum(x for _, x in pp), 1.0 if spec.method == "off" else 2.0, per_prompt=pp,
                      per_prompt_forwards=fw)

    for noisy, pairs in ((False, 2), (True, 3)):
        calls.clear()
        study, objective = study_of(tmp_path, cfg, measure, [])
        objective.repeats_max = pairs  # what track_noise sets when the noise rose (2 at the floor)
        check, held = heldout_check(cfg, objective, ng(3))
        assert check.pairs == pairs and check.tuning.prompts == check.heldout.prompts == 6
        assert calls[:4] == [("ngram", CHECK_PASS), ("off", CHECK_PASS), ("off", CHECK_PASS), ("ngram", CHECK_PASS)]
        assert len(calls) == 2 * pairs
        assert check.tuning.speedup == pytest.approx(1.4) and held["speedup"] == check.heldout.speedup
        assert check.gap == pytest.approx(check.heldout.speedup / 1.4 - 1)
        # each side's tok/s, the winner's and off's, in the same passes
        assert check.tuning.tok_s == pytest.approx(14.0) and check.tuning.baseline_tok_s == pytest.approx(10.0)
        assert check.heldout.baseline_tok_s == pytest.approx(10.0) and check.heldout.tok_s == pytest.approx(held["tok_s"])
    assert check.heldout.ci_low < check.heldout.speedup < check.heldout.ci_high
    line = describe_check(check)
    assert line.startswith("held-out check: held-out ") and "on 6 prompts against tuning 1.400x" in line
    assert "(3 pairs, both sides in each pass, prompt by prompt)" in line
    # the prompts' own tau taken out: held-out tau 2.0 as the tuning prompts' -> the gap is all timing
    assert check.tuning.tau == check.heldout.tau == pytest.approx(2.0)
    assert tau_gap(check) == pytest.approx(0.0) and gap_at_equal_tau(check) == pytest.approx(check.gap)
    lower = check.model_copy(update={"heldout": check.heldout.model_copy(update={"tau": 1.6})})
    assert tau_gap(lower) == pytest.approx(-0.2)
    assert gap_at_equal_tau(lower) == pytest.approx((1 + check.gap) / 0.8 - 1)
    assert "tau 1.60 against 2.00 (20.0% below)" in describe_check(lower)


def _false_separations(verdict: Callable[[dict[int, float], dict[int, float]], str], n: int = 400) -> float:
    """Share of n seeded confirmation rounds between two equal configurations (log sd 0.1 a pair)
    that end "apart": one look after every round from the second, as `confirm` asks, stopping at
    the first verdict that is not "open"."""
    import math
    import random

    from tuner.study.selection import CONFIRM_PAIRS_MAX

    rng, apart = random.Random(0), 0
    for _ in range(n):
        a: dict[int, float] = {}
        b: dict[int, float] = {}
        for r in range(CONFIRM_PAIRS_MAX):
            a[r], b[r] = 1.4 * math.exp(rng.gauss(0, 0.1)), 1.4 * math.exp(rng.gauss(0, 0.1))
            v = verdict(a, b) if r > 0 else "open"
            if v != "open":
                apart += v == "apart"
                break
    return apart / n


def test_told_apart_over_several_looks_keeps_false_separations_near_five_percent() -> None:
    """The round asks "told apart?" after each of up to CONFIRM_PAIRS_MAX - 1 rounds. At one-sided
    95% per look (the old rule, planted here) two equal configurations were told apart in far more
    than 5% of rounds; the per-look bound (`head_alpha`) keeps it at about 5%. A difference that is
    real still separates."""
    import math

    from tuner.study.selection import head_to_head, head_verdict

    def old(a: dict[int, float], b: dict[int, float]) -> str:
        h = head_to_head(a, b, 0.05)
        assert h is not None
        _, lo, hi, _ = h
        if lo > 1.0 or hi < 1.0:
            return "apart"
        band = math.log(1.03)
        return "tie" if abs(math.log(lo)) <= band and abs(math.log(hi)) <= band else "open"

    assert _false_separations(old) > 0.15
    assert _false_separations(lambda a, b: head_verdict(a, b, 0.05)) <= 0.07
    # ratios 1.02-1.08 apart round after round: 95% at one look, not at the per-look bound yet
    a, b = {0: 1.50, 1: 1.46, 2: 1.52}, {0: 1.43, 1: 1.43, 2: 1.41}
    assert old(a, b) == "apart" and head_verdict(a, b, 0.05) == "open"
    a[3], b[3], a[4], b[4] = 1.49, 1.40, 1.51, 1.42
    assert head_verdict(a, b, 0.05) == "apart"


def test_the_floors_round_measures_every_close_contender_within_its_pair_budget() -> None:
    """Session 26's loaded fidelity run, planted: a short study (5 pairs: a quarter of them holds no
    contender), the trials' winner ngram d4 on one pair at 1.55x, d2 (two pairs, 1.46x) and d3 (one
    pair, 1.392x) both with intervals that overlap d4's. The round measured d4 against d2 only and
    never d3, the reference's best. Every contender whose interval overlaps the winner's is measured
    now, up to CONFIRM_TOP configurations; d1 (1.05x), told apart, is not."""
    from tuner.study.selection import CONFIRM_TOP, Candidate, contenders, floor_field

    trials = [_planted_trial(ng(4), [1.55]), _planted_trial(ng(2), [1.45, 1.47]), _planted_trial(ng(3), [1.392]),
              _planted_trial(ng(1), [1.05])]
    assert floor_field(trials) == 0
    lead = Candidate.of(ng(4), trials[:1])
    got = [s.key() for s, _ in contenders(trials, 0.05, lead)]
    assert got == ["ngram d4 k1 b5", "ngram d2 k1 b3", "ngram d3 k1 b4"]
    more = [*trials, _planted_trial(ng(5), [1.50]), _planted_trial(ng(6), [1.48])]
    assert len(contenders(more, 0.05, lead)) == CONFIRM_TOP, "the pair budget: CONFIRM_TOP configurations"
    # the main command at faa2076: the best reading (two pairs that disagree: the lowest pessimistic
    # bound) overlaps the winner's interval and is measured before steadier, lower readings
    wide = [*trials, _planted_trial(ng(8), [0.95, 2.3])]
    assert [s.key() for s, _ in contenders(wide, 0.05, lead)][:2] == ["ngram d4 k1 b5", "ngram d8 k1 b9"]


def test_auto_at_the_floor_measures_the_best_by_lower_bound_against_the_winner_when_time_allows(tmp_path: Path) -> None:
    """Session 20's main command, planted: at the noise floor the trials' winner (ngram d5, the best
    reading, 1.28x over three wide pairs) was not the progress line's best by lower bound (ngram d2,
    1.205x over two pairs that agree), the trials' bounds did not tell them apart, and auto ran no
    round. The reason now says why they differ; with the trials' pairs to spare (FLOOR_SHARE of them
    fits CONFIRM_FLOOR rounds of two contenders) auto measures both head to head and the truly faster
    d2 (1.3x against 1.2x) wins; without them (the study is too short for a quarter of its pairs to
    hold two contenders) the round still measures the winner and that one. A filler whose interval
    overlaps the winner's (d1, 1.01x over two pairs, against d5's wide three) is a close contender
    too (CONFIRM_TOP - 1 at least): 6 pairs with the fillers, 4 without."""
    cfg = load_config(CFG)
    planted = [(ng(5), [1.42, 1.14, 1.30]), (ng(2), [1.20, 1.21])]
    fillers = [(ng(d), [1.02, 1.00]) for d in (1, 3, 4, 6, 7)]
    for name, extra in (("fillers", fillers), ("short", [])):
        measure = Planted(lambda spec, n: ({5: 12.0, 2: 13.0, 1: 10.2}[spec.depth], 3.0))
        study, objective = _noisy_study(tmp_path / name, cfg, measure, planted + extra, [10.0, 10.1, 9.9])
        assert objective.noise_rose() is None and cfg.search.confirm == "auto"
        win = pick_winner(study.trials, cfg.search.noise_rel, [1])
        assert win.spec == ng(5) and leader(study.trials, cfg.search.noise_rel).spec == ng(2)
        assert "; the best by lower bound, ngram d2 k1 b3 1.205x" in win.reason
        assert "best reading wins (no confirmation round measured both head to head)" in win.reason
        lines: list[str] = []
        filler = {"ngram d1 k1 b2": 2} if name == "fillers" else {}
        assert confirm(study, objective, cfg.search.noise_rel, lines.append) == 4 + 2 * len(filler)
        assert measure.passes == {"ngram d5 k1 b6": 2, "ngram d2 k1 b3": 2, **filler}
        assert "the trials' bounds do not tell the top configurations apart" in lines[0]
        win = pick_winner(study.trials, cfg.search.noise_rel, [1])
        assert win.spec == ng(2) and "best by lower bound" not in win.reason


def test_a_load_there_from_the_study_start_still_gets_its_round(tmp_path: Path) -> None:
    """benchmarks/fidelity.py's loaded seed 0 at 1bcfc93, planted: search=quick (one pair a trial, a
    few trials), its background load running from the study's first pass. ngram d3 read 1.516x on its
    one pair and d4 1.417x, which the trials' bounds do not tell apart; the noise never rose above
    the floor the loaded passes set, and a quarter of the trials' pairs held no contender, so no round
    ran and d3 won, 4% below d4 in the reference. Now the floor's round measures the winner and the
    best contender not told apart from it, whatever the floor: a spread of 8% from the start (above
    search.noise_rel: the bounds' band, as the pruner's) or 1%. Truly d4 runs at 1.5x and d3 at 1.4x:
    pooled over its pairs d4 wins. A contender the bounds tell apart (d1, 1.05x) is not measured; d2
    (1.39x on one pair), whose interval overlaps d3's, is (session 26's loaded run measured d4 against
    d2 only, never the close d3: CONFIRM_TOP - 1 contenders at least now)."""
    cfg = load_config([*CFG, "search.repeats_min=1", "search.repeats_max=1"])
    planted = [(ng(1), [1.05]), (ng(3), [1.516]), (ng(2), [1.39]), (ng(4), [1.417])]
    wobble = [10.0, 11.0, 9.2, 10.6, 9.4, 11.1]
    for name, passes in (("loaded", wobble), ("flat", [10.0, 10.1, 9.9, 10.05, 10.0, 9.95])):
        measure = Planted(lambda spec, n: (10 * {3: 1.4, 4: 1.5, 2: 1.3}[spec.depth], 3.0))
        study, objective = _noisy_study(tmp_path / name, cfg, measure, planted, passes)
        objective.track_noise()  # the study's spread and floor, as its trials left them
        assert objective.noise_rose() is None and cfg.search.confirm == "auto"
        assert (study.user_attrs.get("noise_rel_measured", 0.0) > cfg.search.noise_rel) == (name == "loaded")
        assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec == ng(3)  # the trials alone: d3
        lines: list[str] = []
        assert confirm(study, objective, cfg.search.noise_rel, lines.append) == 6
        assert measure.passes == {"ngram d3 k1 b4": 2, "ngram d4 k1 b5": 2, "ngram d2 k1 b3": 2}
        assert "the trials' bounds do not tell the top configurations apart" in lines[0]
        assert ("; it never rose above its floor)" in lines[0]) == (name == "loaded")
        win = pick_winner(study.trials, cfg.search.noise_rel, [1])
        assert win.spec == ng(4) and "head to head in the confirmation round 1.500x over 2 pairs" in win.reason


def test_a_baseline_that_moved_and_stayed_is_no_outlier(tmp_path: Path) -> None:
    """benchmarks/fidelity.py's loaded seed 2 at 8398ead, planted: the background load ended mid-study,
    so every later baseline read faster than the study's history (41 against a median of 34 tok/s):
    "an outlier" three times in a row, and the truly best configuration (ngram d4) was kept
    implausible and could not win. A baseline that reads the same on every retry has moved, not
    glitched: the pair, measured back to back, counts; a baseline that dips once is still measured
    again (the test above), and a ratio above tau still never counts."""
    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: (16.0 if spec.depth == 2 else 12.0, 2.0),
                      base_script=[10.0, 10.1, 9.9, 10.05] + [12.5] * 8)
    study, objective = study_of(tmp_path, cfg, measure, [ng(3), ng(2)], share=False)
    for _ in range(3):
        objective.run_one()
    t2 = study.trials[2]
    assert "implausible" not in t2.user_attrs, t2.user_attrs.get("implausible")
    assert len(t2.user_attrs["remeasured"]) == 3  # measured twice more, then taken as the machine's new state
    assert all("paired baseline 12.5 tok/s is an outlier" in w for w in t2.user_attrs["remeasured"])
    assert t2.user_attrs["remeasured"][-1].endswith("every retry's baseline read alike: the machine changed, the pair counts")
    assert t2.user_attrs["ratios"] == [1.28, 1.28]
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec == ng(2)


def test_a_spec_pass_that_dipped_is_measured_again_and_cannot_cost_the_best_its_rank(tmp_path: Path) -> None:
    """benchmarks/fidelity.py's quiet seed 0 at 00647e4, planted: in the confirmation round one pass
    of the truly best configuration (ngram d4, 1.5x) read about half its other passes while its
    paired baseline read as usual. Nothing caught it (the baseline was no outlier, the ratio below
    tau), so d4's pooled ratio fell under d2's 1.3x and d2 won. A spec pass that far from the same
    configuration's own passes is measured again, as a dipped baseline is; d4 wins."""
    cfg = load_config(CFG)
    dips = {1}  # d4's second pass: its first confirmation pass

    def script(spec: SpecConfig, n: int) -> tuple[float, float]:
        if spec.depth == 4:
            return (6.0 if n in dips else 15.0), 3.0
        return 13.0, 3.0

    measure = Planted(script)
    study, objective = _noisy_study(tmp_path, cfg, measure, [(ng(2), [1.45, 1.40])], NOISY)
    study.add_trial(_planted_trial(ng(4), [1.35, 1.30], passes=True))  # its passes read 13.5 and 13.0 tok/s
    measure.passes[ng(4).key()] = 1  # the script's pass 1 is the round's first d4 pass
    assert objective.spec_history(ng(4)) == [13.5, 13.0] and objective.spec_history(ng(3)) == []
    confirm(study, objective, cfg.search.noise_rel)
    confirms = [t for t in study.trials if t.user_attrs.get(ROLE) == "confirm" and t.user_attrs["spec"] == ng(4).key()]
    (why,) = confirms[0].user_attrs["remeasured"]
    assert why.startswith("repeat 1: spec pass 6.0 tok/s is an outlier against this configuration's own passes "
                          "(median 13.2 tok/s over 2 passes")
    assert all(r == 1.5 for t in confirms for r in t.user_attrs["ratios"])
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec == ng(4)


def test_one_glitched_baseline_does_not_blind_the_outlier_rule(tmp_path: Path) -> None:
    """benchmarks/fidelity.py's quiet seed 1 at 00647e4, planted: the study's first baseline pass
    read a third of the others (a process started beside it). Judged by the standard deviation of
    the baseline passes, which that pass alone made wide, no later dip was an outlier; a robust
    spread keeps the band at the machine's ordinary noise, and a later dipped baseline (39 against
    a median of 47) is measured again."""
    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: (66.0, 2.0), base=47.0,
                      base_script=[16.5, 47.0, 48.5, 46.0, 47.0, 48.0, 38.9, 47.2])
    study, objective = study_of(tmp_path, cfg, measure, [ng(3), ng(4), ng(2)], share=False)
    for _ in range(4):
        objective.run_one()
    history = objective.baseline_history()
    assert history[0] == 16.5 and objective.noise(history) < 0.08
    t2 = study.trials[3]  # the ngram d2 trial: its first paired baseline dipped to 38.9
    (why,) = t2.user_attrs["remeasured"]
    assert "paired baseline 38.9 tok/s is an outlier" in why
    assert t2.user_attrs["baseline_samples"] == [47.2, 47.0]
    assert t2.user_attrs["baseline_passes"] == [38.9, 47.2, 47.0]  # the next trials' history: every pass


def test_a_trial_shares_the_baseline_pass_that_ended_the_trial_before(tmp_path: Path) -> None:
    """Trials run baseline first (off-spec spec-off): the first pair takes the baseline pass that
    ended the trial before, measured just before it, instead of a second one back to back, so a
    trial costs three passes, not four. Each pair still has its own baseline, the shared pass counts
    once in the study's baseline history, and one that ended too long ago is measured afresh."""
    from tuner.study.objective import SHARE_WITHIN_S

    cfg = load_config(CFG)
    measure = Planted(lambda spec, n: (13.0, 2.0), base_script=[10.0, 10.2, 9.8, 10.1, 9.9])
    study, objective = study_of(tmp_path, cfg, measure, [ng(2), ng(4), ng(3)])
    for _ in range(3):
        objective.run_one()
    off = "off"
    assert measure.calls == [off, off, "ngram d2 k1 b3", "ngram d2 k1 b3", off, "ngram d4 k1 b5", "ngram d4 k1 b5", off]
    trials = study.get_trials()[:3]
    assert [t.user_attrs.get("baseline_shared") for t in trials] == [None, True, True]
    # ngram d2's pairs: (trial 0's last pass, its first), (its second, its own baseline)
    assert trials[1].user_attrs["ratios"] == pytest.approx([13.0 / 10.2, 13.0 / 9.8])
    assert objective.baseline_history() == [10.0, 10.2, 9.8, 10.1]  # each pass once
    # the pass that ended the trial before is too old to share: a fresh one is measured first
    split, samples, ended = objective._tail
    objective._tail = (split, samples, ended - SHARE_WITHIN_S - 1)
    measure.calls.clear()
    objective.run_one()
    assert measure.calls == [off, "ngram d3 k1 b4", "ngram d3 k1 b4", off]
    assert study.get_trials()[3].user_attrs.get("baseline_shared") is None


# benchmarks/fidelity.py's loaded seed 0 at aa7b89a (docs/results.md): one pair a trial (search=quick),
# then four head-to-head rounds of d4 and d3. Reference: d3 1.222x, d2 1.202x, d1 1.200x, d4 1.111x.
AA7_TRIALS = {4: [1.447], 3: [1.254], 1: [1.158], 2: [0.981]}
AA7_ROUNDS = {4: [1.097, 1.115, 1.107, 1.190], 3: [1.122, 1.149, 1.171, 1.033]}


def test_a_lucky_trial_pair_does_not_outweigh_the_rounds_head_to_head_pairs() -> None:
    """The loaded run at aa7b89a, planted: d4's one trial pair read 1.447x, its four round pairs
    1.10-1.19x; d3 led three of the four rounds. Pooled with every trial pair, d4 (1.185x) beat d3
    (1.144x) and won 9.1% below the reference's best. A trial pair that is an outlier against its
    configuration's round pairs (more than OUTLIER_BANDS noise bands from their median) is left out
    of the ranking and the winner's figures, and the reason says so; d3's trial pair, which agrees
    with its round, still counts."""
    from tuner.study.selection import candidates

    trials = [_planted_trial(ng(d), r) for d, r in AA7_TRIALS.items()]
    trials += [t for d, r in AA7_ROUNDS.items() for t in _rounds(ng(d), r)]
    win = pick_winner(trials, 0.05, [1])
    assert win.spec == ng(3), win.reason
    assert "left out as outliers against the round's pairs: ngram d4 k1 b5's trial pair 1.447x" in win.reason
    by = {c.spec.depth: c for c in candidates(trials, 0.05)}
    assert by[4].dropped == [1.447] and by[4].ratios == AA7_ROUNDS[4]
    assert by[3].dropped == [] and by[3].ratios == [1.254, *AA7_ROUNDS[3]]
    # without the round, every trial pair counts as before
    assert all(c.dropped == [] for c in candidates(trials))


def test_the_noisy_round_measures_one_pair_trials_within_a_pairs_noise_of_the_leader(tmp_path: Path) -> None:
    """The same run's round: the noise rose (its baseline passes spread 5.2%), the trials' best by
    lower bound was d4's one lucky pair (1.447x), and d1 (one pair, 1.158x) was left out by a band of
    one pass's noise; a pruned trial (d5, one pair at 1.20x) joined only when it read within that
    noise of d4's point. A pair's ratio divides two passes: one-pair readings get a pair's band
    (sqrt(2) noise bands), so d1 and d5 are measured head to head; d2 (0.981x), told apart, is not.
    Truly d3 runs 1.30x, d5 1.25x, d1 1.20x, d4 1.11x: d3 wins."""
    cfg = load_config([*CFG, "search.repeats_min=1", "search.repeats_max=1"])
    truth = {3: 1.30, 5: 1.25, 1: 1.20, 4: 1.11, 2: 1.2}
    measure = Planted(lambda spec, n: (10 * truth[spec.depth], 3.0))
    study, objective = _noisy_study(tmp_path, cfg, measure, [(ng(d), r) for d, r in AA7_TRIALS.items()], NOISY)
    t = _planted_trial(ng(5), [1.20])
    study.add_trial(create_trial(state=TrialState.PRUNED, params={}, distributions={}, user_attrs=t.user_attrs))
    study.set_user_attr(ROSE, 0.052)
    study.set_user_attr("noise_rel_measured", 0.052)
    assert confirm(study, objective, cfg.search.noise_rel) > 0
    assert set(measure.passes) == {"ngram d4 k1 b5", "ngram d3 k1 b4", "ngram d1 k1 b2", "ngram d5 k1 b6"}
    assert pick_winner(study.trials, cfg.search.noise_rel, [1]).spec == ng(3)


def test_the_noisy_round_takes_in_a_trial_left_out_against_the_leaders_lucky_pair(tmp_path: Path) -> None:
    """The same run: d2's one trial pair read 0.981x (reference 1.202x), told apart from d4's lucky
    1.447x even with a pair's band, so it never got a second read. Once the round's pairs have placed
    the best (d4 reads 1.11x head to head, d3 leads), d2's reading is no longer told apart from the
    best's bounds: it is taken in and measured head to head. Truly d2 runs 1.26x, d3 1.22x: d2 wins,
    and the log says it was taken in."""
    cfg = load_config([*CFG, "search.repeats_min=1", "search.repeats_max=1"])
    truth = {3: 1.22, 1: 1.20, 4: 1.11, 2: 1.26}
    measure = Planted(lambda spec, n: (10 * truth[spec.depth], 3.0))
    study, objective = _noisy_study(tmp_path, cfg, measure, [(ng(d), r) for d, r in AA7_TRIALS.items()], NOISY)
    study.set_user_attr(ROSE, 0.052)
    study.set_user_attr("noise_rel_measured", 0.052)
    lines: list[str] = []
    assert confirm(study, objective, cfg.search.noise_rel, lines.append) > 0
    assert "head to head with ngram d3 k1 b4, ngram d1 k1 b2" in lines[0] and "ngram d2" not in lines[0]
    assert measure.passes.get("ngram d2 k1 b3", 0) >= 2
    assert "taken in once the round placed the best: ngram d2 k1 b3" in lines[-1]
    win = pick_winner(study.trials, cfg.search.noise_rel, [1])
    assert win.spec == ng(2), win.reason


@pytest.mark.parametrize("probe", [True, False])
def test_the_first_trials_dipped_baseline_is_judged_against_the_probes_passes(tmp_path: Path, probe: bool) -> None:
    """A quick study (one pair a trial): trial 1's pair has only trial 0's single pass behind it,
    fewer than OUTLIER_HISTORY, so its baseline, dipped to half (5 against 10 tok/s), went unjudged
    and read ngram d3 at 2.8x (below tau 3.0: the tau rule cannot see it). The baseline passes
    measured before trial 0 (study attr PROBE_PASSES, check_trial_fits) are its history now: the
    pair is measured again and reads 1.4x."""
    cfg = load_config([*CFG, "search.repeats_min=1", "search.repeats_max=1"])
    measure = Planted(lambda spec, n: (14.0, 3.0), base_script=[10.0, 5.0, 10.0])
    study, objective = study_of(tmp_path, cfg, measure, [ng(3)], share=False)
    if probe:
        study.set_user_attr(PROBE_PASSES, [10.1, 9.9])
    objective.run_one()
    objective.run_one()
    t = study.trials[1]
    if probe:
        (why,) = t.user_attrs["remeasured"]
        assert "paired baseline 5.0 tok/s is an outlier" in why and "over the last 3 passes" in why
        assert t.user_attrs["ratios"] == [1.4]
    else:  # the control: without them the dip decides the trial
        assert "remeasured" not in t.user_attrs and t.user_attrs["ratios"] == [2.8]


def test_the_probe_warms_up_then_measures_the_trials_prompts_at_every_level() -> None:
    """check_trial_fits: one prompt twice (the faster sizes the work, and a search that cannot fit is
    refused before anything longer runs), then PROBE_HISTORY baseline passes of the trials' prompts
    at every level, as a trial's baseline pass plays them; their per-pass means are the history."""
    from tuner.study.limits import PROBE_HISTORY, check_trial_fits

    cfg = load_config([*(c for c in CFG if not c.startswith("workload.concurrency")), "workload.concurrency=[1,2]"])
    calls: list[tuple[str, str, int]] = []
    reads = iter([5.0, 7.0, 9.0, 15.0, 11.0, 17.0])

    def measure(spec: SpecConfig, split: str, level: int) -> Sample:
        calls.append((spec.method, split, level))
        return Sample(next(reads), 1.0)

    prompts = {"tune": ["a", "b"]}
    work, passes = check_trial_fits(cfg, measure, prompts)
    assert PROBE_HISTORY == 2 and prompts["probe"] == ["a"]
    assert calls == [("off", "probe", 1), ("off", "probe", 1), ("off", "tune", 1), ("off", "tune", 2),
                     ("off", "tune", 1), ("off", "tune", 2)]
    assert passes == [12.0, 14.0] and work is not None and work.tok_s == 7.0


# Fidelity's loaded seed 7 in session 31 (docs/results.md): d4 ahead in the
# reference (1.468x against d2's 1.343x); the round at the floor, two rounds after one trial pair each
S31_TRIALS = {4: [1.629], 3: [1.456], 2: [1.449]}
S31_ROUNDS = {4: [1.482, 1.211], 3: [1.431, 1.481], 2: [1.506, 1.423]}


def test_one_bad_round_pair_does_not_decide_the_winner() -> None:
    """Session 31's loaded seed 7, planted: d4's pairs 1.629 / 1.482 / 1.211, d2's 1.449 / 1.506 /
    1.423. Pooled by their geometric mean d2 led (1.459x against 1.430x) and won 8.6% below the
    reference's best. Each pair held within CLIP_BANDS noise bands of its configuration's median,
    d4's 1.211 counts at that bound and d4 leads: the winner, and the reason says what it was ranked
    at. The reported speedup stays the pairs' geometric mean, and the winner rule is unchanged."""
    from tuner.study.selection import candidates

    trials = [_planted_trial(ng(d), r) for d, r in S31_TRIALS.items()]
    trials += [t for d, r in S31_ROUNDS.items() for t in _rounds(ng(d), r)]
    by = {c.spec.depth: c for c in candidates(trials, 0.05)}
    assert by[2].speedup > by[4].speedup  # what the plain pooling ranked by
    assert by[4].reading is not None and by[2].reading is not None and by[4].reading > by[2].reading
    assert by[2].reading == pytest.approx(by[2].speedup)  # pairs within the band count in full
    win = pick_winner(trials, 0.05, [1])
    assert win.spec == ng(4), win.reason
    assert f"ranked at {by[4].reading:.3f}x" in win.reason and win.candidate is not None
    assert win.candidate.speedup == pytest.approx(by[4].speedup)
    # a tighter band (a user's noise_rel of 1%) holds d4's low pair in harder still; a wider one
    # (20%) holds nothing in and the pooled mean decides, as before
    assert pick_winner(trials, 0.01, [1]).spec == ng(4)
    wide = {c.spec.depth: c for c in candidates(trials, 0.20)}
    assert all(c.reading == pytest.approx(c.speedup) for c in wide.values())


def test_the_held_in_mean_keeps_pairs_within_the_band_and_the_spread_leaves_out_the_furthest() -> None:
    """clipped_mean: pairs within CLIP_BANDS x scale of their median are the geometric mean; one
    further counts at the bound, above or below. spread_without_furthest: each group's furthest pair
    left out, groups of two add nothing (which of two strayed cannot be said)."""
    import math

    from tuner.study.selection import CLIP_BANDS, clipped_mean, spread_without_furthest

    assert clipped_mean([1.40, 1.45, 1.50], 0.05) == pytest.approx((1.40 * 1.45 * 1.50) ** (1 / 3))
    bound = 1.45 * math.exp(-CLIP_BANDS * 0.05)
    assert clipped_mean([1.00, 1.45, 1.50], 0.05) == pytest.approx((bound * 1.45 * 1.50) ** (1 / 3))
    assert clipped_mean([1.40, 1.45, 2.50], 0.05) == pytest.approx((1.40 * 1.45 * 1.45 * math.exp(CLIP_BANDS * 0.05))
                                                                   ** (1 / 3))
    assert clipped_mean([1.0, 2.0], 0.01) == pytest.approx(math.sqrt(2.0))  # two pairs: neither is held in
    assert spread_without_furthest([[1.5, 1.5, 0.9], [1.2, 1.2, 1.2, 3.0]]) == pytest.approx(0.0)
    assert spread_without_furthest([[1.0, 2.0]]) == 0.0
    s = spread_without_furthest([[1.0, 1.1, 5.0]])
    assert s == pytest.approx(abs(math.log(1.1) - math.log(1.0)) / math.sqrt(2))
