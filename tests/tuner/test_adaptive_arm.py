"""Issue 36.5: spec.adaptive is an arm of the built-in engine's search. The space encodes it (bounds,
no K bands), the study enqueues it at the widest bounds, and best.yaml and the report compare the best
adaptive configuration with the best static schedule and off at every measured level."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tuner.report.figures import read_best, write_best, write_html
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig
from tuner.search.space import SearchSpace
from tuner.study.objective import Objective, Sample
from tuner.study.selection import compute_best
from tuner.study.studies import create_study, role

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_the_space_searches_adaptive_on_the_builtin_engine_only() -> None:
    space = SearchSpace.from_config(load_config(["+workload=code", "workload.concurrency=[1,4]"]))
    assert space.adaptive and space.k_bands
    arm, = space.arms()
    assert arm == SpecConfig(method="ngram", depth=8, topk=1, budget=9, adaptive=True)  # the widest chain, no bands
    study = optuna.create_study()
    for spec in (arm, space.defaults()[0]):  # an enqueued point comes back from suggest as it went in
        study.enqueue_trial(space.params_of(spec))
        assert space.suggest(study.ask()) == spec
    assert space.contains(arm) and not space.contains(arm.model_copy(update={"k_per_batch_size": [(1, 1, 8), (2, 4, 2)]}))
    # a sampled adaptive point draws no K per band; a static one does
    sampled = [space.suggest(study.ask()) for _ in range(24)]
    assert {s.adaptive for s in sampled} == {True, False}
    assert all((s.k_per_batch_size is None) == s.adaptive for s in sampled)
    for over in (["engine=vllm"], ["search.adaptive=false"]):
        other = SearchSpace.from_config(load_config(["+workload=code", *over]))
        assert not other.adaptive and other.arms() == [] and not other.contains(arm)
    grid = SearchSpace.from_config(load_config(["search=quick", "search.adaptive=true", "search.depth.max=2"])).points()
    assert [s.key() for s in grid] == ["ngram d1 k1 b2", "ngram d1 k1 b2 adaptive", "ngram d2 k1 b3",
                                       "ngram d2 k1 b3 adaptive"]


# Speedups per level (c=1, c=4): a static chain pays at 1 and loses at 4; the adaptive arm pays at both.
STATIC = {1: 1.5, 4: 0.9}
ADAPTIVE = {1: 1.4, 4: 1.1}


def _study(tmp_path: Path, adaptive: dict[int, float], static: dict[int, float] = STATIC) -> tuple[optuna.Study, object]:
    cfg = load_config(["+workload=code", "search=quick", "search.adaptive=true", "workload.concurrency=[1,4]",
                       "search.repeats_max=1", "workload.num_heldout=0"])

    def measure(spec: SpecConfig, split: str, c: int) -> Sample:
        off = 20.0 * c
        if spec.method == "off":
            return Sample(off, 1.0, 1.0, 1.0)
        return Sample(off * (adaptive if spec.adaptive else static)[c], 3.0, 1.0, 1.0)

    space = SearchSpace.from_config(cfg)
    study = create_study(cfg, space, tmp_path, "arms")
    assert [role(t) for t in study.trials] == ["baseline", "default", "adaptive"]
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    while any(t.state == TrialState.WAITING for t in study.trials):
        objective.run_one()
    return study, compute_best(cfg, study, tmp_path, None)


def test_best_yaml_and_the_report_compare_the_three_arms_per_level(tmp_path: Path) -> None:
    study, best = _study(tmp_path, ADAPTIVE)
    arms = best.arms
    assert best.spec.adaptive and arms.choice == "adaptive" and arms.adaptive == best.spec
    assert arms.static_beats_off and not arms.static.adaptive and arms.static.k_per_batch_size
    assert best.chain_spec == arms.static  # what vLLM serves is static
    assert [(lv.level, lv.off_tok_s) for lv in arms.levels] == [("c=1", 20.0), ("c=4", 80.0)]
    assert [lv.static_speedup for lv in arms.levels] == pytest.approx([1.5, 0.9])
    assert [lv.adaptive_speedup for lv in arms.levels] == pytest.approx([1.4, 1.1])
    assert [lv.adaptive_tok_s for lv in arms.levels] == pytest.approx([28.0, 88.0])
    assert arms.adaptive_speedup == pytest.approx((1.4 * 1.1) ** 0.5, rel=1e-3)
    write_best(best, tmp_path / "best.yaml")
    write_html(study, tmp_path, best, {})  # the page without its figures (drawn elsewhere): seconds less
    assert read_best(tmp_path / "best.yaml").arms == arms
    page = (tmp_path / "report.html").read_text()
    assert "chosen adaptive" in page and "best static, ngram d4 k1 b5" in page and "adaptive, ngram d4 k1 b5 adaptive" in page
    assert "<td>c=4</td><td>80.0</td><td>72.0 (0.900x)</td><td>88.0 (1.100x)</td>" in page


def test_a_static_schedule_ahead_of_the_adaptive_arm_is_chosen(tmp_path: Path) -> None:
    _, best = _study(tmp_path, {1: 1.2, 4: 0.95})
    assert best.arms.choice == "static" and not best.spec.adaptive and best.arms.static == best.spec
    assert [lv.adaptive_speedup for lv in best.arms.levels] == pytest.approx([1.2, 0.95])


def test_a_static_schedule_slower_than_off_is_shown_but_is_no_second_best(tmp_path: Path) -> None:
    _, best = _study(tmp_path, ADAPTIVE, {1: 0.9, 4: 0.8})
    arms = best.arms
    assert arms.choice == "adaptive" and arms.static is not None and not arms.static_beats_off
    assert [lv.static_speedup for lv in arms.levels] == pytest.approx([0.9, 0.8]) and best.chain_spec is None
