"""A head's bound before its training (tuner.study.headbound): a head that cannot beat speculation
off even at the published tau is not trained and leaves the search; one that can is trained; a
pinned head and a shared study are never bounded; the decision is kept with the cache."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engine.measure.workloads import encode, sampling_params
from tuner.schema.compose import load_config
from tuner.schema.config import HeadBound, SpecConfig
from tuner.search.space import SearchSpace
from tuner.study import headbound, measurer
from tuner.study.headbound import PUBLISHED_TAU, chain_depths, measure_bound, probed_methods
from tuner.study.measurer import get_drafts, without_methods

BASE = ["model=tiny-random", "+workload=code", "search.methods=[ngram,eagle]"]


def planted(trained: bool) -> HeadBound:
    b = 1.4 if trained else 0.6
    return HeadBound(method="eagle", tau=5.41, off_step_ms=10.0, step_ms={"eagle d5 k1 b6": 10 * 5.41 / b},
                     bounds={"eagle d5 k1 b6": b}, bound=b, trained=trained)


def test_who_is_bounded() -> None:
    assert probed_methods(load_config(BASE)) == ["eagle"]
    assert probed_methods(load_config([*BASE, "search.methods=[eagle]"])) == [], "heads alone: the user asked for them"
    assert probed_methods(load_config([*BASE, "spec.method=eagle"])) == [], "pinned by spec.method"
    assert probed_methods(load_config([*BASE, "search.storage=journal:/tmp/x.log"])) == [], "a shared study: one space"
    assert probed_methods(load_config([*BASE, "search.head_bound=false"])) == [], "turned off"
    assert chain_depths(load_config(BASE), 5.41) == [1, 4, 5]
    assert chain_depths(load_config(BASE), 4.0) == [1, 3], "an integer tau: one depth reaches it"
    assert chain_depths(load_config([*BASE, "search.depth.max=3"]), 5.41) == [1, 3], "within the space's depths"


@pytest.mark.parametrize("trained", [False, True])
def test_bound_decides_training(tmp_path: Path, monkeypatch, trained: bool) -> None:
    """Below 1.0: no answers, no training, the method out of the space, the line printed and kept;
    at or above: trained as before. A second run with the same cache measures nothing again."""
    cfg = load_config([*BASE, f"cache_dir={tmp_path}"])
    measured, trainings = [], []
    monkeypatch.setattr(headbound, "measure_bound", lambda c, e, m: measured.append(m) or planted(trained))

    def fake_train(job, method, engine, **kw):
        trainings.append(method)
        out = tmp_path / "head"
        out.mkdir(exist_ok=True)
        return out

    monkeypatch.setattr("engine.heads.drafts.ensure_draft", fake_train)
    monkeypatch.setattr("engine.heads.pipeline.read_meta", lambda p: {"data_seconds": 1.0, "total_seconds": 2.0})
    for run in range(2):
        bounds: list[HeadBound] = []
        phases: dict[str, float] = {}
        drafts = get_drafts(cfg, object(), quiet=True, phases=phases, bounds=bounds)
        assert [b.trained for b in bounds] == [trained]
        assert ("eagle" in drafts) == trained and ("eagle answers" in phases) == trained
        space = SearchSpace.from_config(without_methods(cfg, bounds), head_paths=drafts)
        assert ("eagle" in space.methods) == trained and "ngram" in space.methods
    assert measured == ["eagle"], "the kept decision is read back, not measured again"
    assert trainings == (["eagle", "eagle"] if trained else [])


def test_no_bound_without_an_engine(tmp_path: Path, monkeypatch) -> None:
    """train-draft and project look drafts up without an engine: they train, never bound."""
    cfg = load_config([*BASE, f"cache_dir={tmp_path}"])
    monkeypatch.setattr(headbound, "measure_bound", lambda *a: pytest.fail("bounded without an engine"))
    monkeypatch.setattr("engine.heads.drafts.ensure_draft", lambda *a, **k: tmp_path)
    monkeypatch.setattr("engine.heads.pipeline.read_meta", lambda p: {"data_seconds": 1.0, "total_seconds": 2.0})
    assert get_drafts(cfg, None, quiet=True, bounds=[]) == {"eagle": str(tmp_path)}


def test_measured_bound_on_the_engine(engine, one_torch_thread) -> None:
    """On the tiny model: every chain timed, each bound min(depth + 1, tau) x off step / its step, and
    the untrained head has the trained head's draft vocabulary; its output is the target's."""
    cfg = load_config([*BASE, "train.draft_vocab=512", "search.depth.max=3"])
    b = measure_bound(cfg, engine, "eagle")
    assert set(b.bounds) == {"eagle d1 k1 b2", "eagle d3 k1 b4"} and b.off_step_ms > 0
    for key, d in (("eagle d1 k1 b2", 1), ("eagle d3 k1 b4", 3)):
        assert b.bounds[key] == pytest.approx(min(d + 1, PUBLISHED_TAU["eagle"]) * b.off_step_ms / b.step_ms[key],
                                              rel=1e-2)
    assert b.bound == max(b.bounds.values()) and b.trained == (b.bound >= 1.0)
    assert engine.spec.method == "off", "the engine is left as it was found"

    from engine.drafters import untrained_drafter

    spec = SpecConfig(method="eagle", depth=3, topk=1, budget=4)
    drafter = untrained_drafter(spec, engine.target, 512)
    assert drafter.draft_vocab is not None and drafter.draft_vocab.numel() == 512
    ids = encode(engine, measurer.tuning_prompts(cfg, n=1)[0], True)
    params = replace(sampling_params(cfg.workload, seed=0), max_new_tokens=12)
    off = engine.generate(ids, params).tokens
    engine.set_drafter(drafter, spec)
    try:
        got = engine.generate(ids, params)
    finally:
        engine.set_spec(SpecConfig(method="off"))
    assert got.tokens == off and got.stats.draft_steps > 0
