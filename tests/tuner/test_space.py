"""The search space: every sampled point valid, defaults clipped, the grid complete, params round-trip."""

from __future__ import annotations

import json
import random

import optuna
import pytest

from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig, UserError
from tuner.search.space import SearchSpace
from tuner.study.studies import make_sampler

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _space(**kw) -> SearchSpace:
    base = dict(methods=("eagle",), depth_min=1, depth_max=8, topk=(1, 2, 4, 8), budget_max=64)
    base.update(kw)
    return SearchSpace(**base)


def _assert_valid(space: SearchSpace, spec: SpecConfig) -> None:
    SpecConfig.model_validate(spec.model_dump())  # the schema's own rules
    assert space.contains(spec), spec
    assert spec.depth + 1 <= spec.budget <= min(space.budget_max, 1 + spec.depth * spec.topk)
    if spec.topk == 1:
        assert spec.budget == spec.depth + 1
    if space.chain_only:
        assert spec.topk == 1
    assert spec.topk in space.topk_of(spec.method)  # n-gram: chains and trie trees; SGLang: trees only
    if spec.method == "medusa" and space.medusa_heads is not None:
        assert spec.depth <= space.medusa_heads  # H heads draft at most H tokens


SPACES = [
    _space(),
    _space(methods=("ngram",), depth_max=6, budget_max=8),
    _space(methods=("ngram", "eagle"), topk=(1, 2, 3), budget_max=10),
    _space(methods=("eagle",), topk=(2, 4), depth_max=16, budget_max=12),  # depth capped by budget_max-1
    _space(methods=("eagle",), chain_only=True, banded=True, concurrency=(1, 8, 32)),  # vLLM: chains + K per band
    _space(methods=("ngram", "medusa"), topk=(1, 2), budget_max=12, medusa_heads=3),  # Medusa capped by its heads
]


@pytest.mark.parametrize("sampler", ["tpe", "random"])
@pytest.mark.parametrize("idx", range(len(SPACES)))
def test_every_sampled_point_is_valid(idx: int, sampler: str) -> None:
    space = SPACES[idx]
    search = load_config(["search.n_trials=15", f"search.seed={idx}", f"search.sampler={sampler}"]).search
    s = make_sampler(search)  # the study's own sampler (TPE: multivariate, group)
    study = optuna.create_study(sampler=s, direction="maximize")
    rng = random.Random(idx)
    seen = set()
    for _ in range(60):
        t = study.ask()
        spec = space.suggest(t)
        _assert_valid(space, spec)
        seen.add(spec.key())
        study.tell(t, rng.random() + spec.depth * 0.1)  # a landscape TPE can follow
    assert len(seen) > 3  # it explored, not one point


def test_depth_never_exceeds_budget_max_minus_one() -> None:
    space = SPACES[3]
    assert space.depth_max == 11
    assert all(p.depth <= 11 and p.budget <= 12 for p in space.points())


def test_grid_is_exactly_the_valid_points() -> None:
    space = _space(methods=("eagle",), depth_max=3, topk=(1, 2), budget_max=6)
    pts = space.points()
    # brute force over every (depth, topk, budget) and keep those the schema accepts within budget_max
    expected = set()
    for d in range(1, 4):
        for k in (1, 2):
            for b in range(2, 7):
                try:
                    spec = SpecConfig(method="eagle", depth=d, topk=k, budget=b)
                except ValueError:
                    continue
                if b >= d + 1:
                    expected.add(spec.key())
    assert {p.key() for p in pts} == expected
    assert len(pts) == len(expected)  # no duplicates


def _assert_round_trip(space: SearchSpace) -> None:
    """Every point of the grid, enqueued by params_of, comes back from suggest unchanged."""
    study = optuna.create_study(direction="maximize")
    pts = space.points()
    for p in pts:
        study.enqueue_trial(space.params_of(p))
    for p in pts:
        t = study.ask()
        assert space.suggest(t) == p
        study.tell(t, 1.0)


def test_params_round_trip_through_enqueue() -> None:
    _assert_round_trip(SPACES[2])


def test_known_defaults_are_clipped_into_the_space() -> None:
    full = _space()
    assert [d.key() for d in full.defaults()] == ["eagle d5 k4 b8", "eagle d5 k8 b41"]  # 60 > 1+5*8
    small = _space(depth_max=4, topk=(1, 2), budget_max=8)
    for d in small.defaults():
        _assert_valid(small, d)
    assert [d.key() for d in small.defaults()] == ["eagle d4 k2 b8"]  # both defaults collapse
    ngram = _space(methods=("ngram",), depth_max=4, budget_max=8)
    # n-gram trees from the tree defaults, and the chain every engine serves
    assert [d.key() for d in ngram.defaults()] == ["ngram d4 k4 b8", "ngram d4 k8 b8", "ngram d4 k1 b5"]


def test_vllm_bands_become_k_per_batch_size() -> None:
    space = SPACES[4]
    assert space.k_bands == [(1, 1), (2, 8), (9, 32)]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(20):
        spec = space.suggest(study.ask())
        assert spec.topk == 1 and spec.k_per_batch_size is not None
        assert spec.k_per_batch_size[0] == (1, 1, spec.depth)
        assert all(0 <= k <= spec.depth for _, _, k in spec.k_per_batch_size)


def test_from_config_quick_and_vllm() -> None:
    quick = SearchSpace.from_config(load_config(["model=tiny-random", "+workload=code", "search=quick",
                                                 "workload.concurrency=[1]"]))
    assert quick.methods == ("ngram",) and quick.depth_max == 4 and not quick.chain_only
    assert all(p.topk == 1 for p in quick.points()) and len(quick.points()) == 4
    # two levels: a K for the second band (0..depth) beside each chain
    banded = SearchSpace.from_config(load_config(["model=tiny-random", "+workload=code", "search=quick",
                                                  "workload.concurrency=[1,4]"]))
    assert banded.k_bands == [(1, 1), (2, 4)] and len(banded.points()) == sum(d + 1 for d in range(1, 5))
    vllm = SearchSpace.from_config(load_config(["engine=vllm", "+workload=code", "search.methods=[eagle]",
                                                "workload.concurrency=[1,4]"]))
    assert vllm.chain_only and vllm.k_bands == [(1, 1), (2, 4)]
    # the built-in engine batches too: its trees and chains get a K per band
    builtin = SearchSpace.from_config(load_config(["+workload=code", "workload.concurrency=[1,4]"]))
    assert not builtin.chain_only and builtin.k_bands == [(1, 1), (2, 4)]
    sglang = SearchSpace.from_config(load_config(["engine=sglang", "+workload=code", "search.methods=[eagle]", "spec.method=eagle", "hardware=h100x8", "model=llama-3.1-8b-instruct",
                                                  "workload.concurrency=[1,4]"]))
    assert sglang.k_bands == []  # SGLang has no per-batch-size schedule


def test_impossible_depth_range_is_a_user_error() -> None:
    """Refused when the config loads (issue 37: config and optimize agree), and by the space itself."""
    with pytest.raises(UserError, match="search.depth.min=8 with search.budget_max=4"):
        load_config(["+workload=code", "search.depth.min=8", "search.depth.max=8", "search.budget_max=4"])
    with pytest.raises(UserError, match="search.depth.min=8"):
        _space(methods=("ngram",), depth_min=8, depth_max=8, budget_max=4)


MEDUSA = _space(methods=("eagle", "medusa"), topk=(1, 2), budget_max=16, medusa_heads=4)


@pytest.mark.parametrize("sampler", ["tpe", "random"])
def test_medusa_is_never_deeper_than_its_heads(sampler: str) -> None:
    search = load_config(["search.n_trials=15", "search.seed=3", f"search.sampler={sampler}"]).search
    study = optuna.create_study(sampler=make_sampler(search), direction="maximize")
    depths: dict[str, set[int]] = {"eagle": set(), "medusa": set()}
    for _ in range(80):
        t = study.ask()
        spec = MEDUSA.suggest(t)
        _assert_valid(MEDUSA, spec)
        depths[spec.method].add(spec.depth)
        study.tell(t, spec.depth * 0.1 + (spec.method == "medusa"))  # reward depth: push towards the cap
    assert depths["medusa"] and max(depths["medusa"]) <= 4
    assert max(depths["eagle"]) > 4  # the cap is Medusa's only
    # Optuna keeps one distribution per parameter name: Medusa's capped depth has a name of its own.
    for name in ("depth", "medusa_depth"):
        dists = {repr(t.distributions[name]) for t in study.trials if name in t.distributions}
        assert len(dists) == 1, (name, dists)


def test_medusa_points_defaults_and_round_trip() -> None:
    pts = MEDUSA.points()
    assert max(p.depth for p in pts if p.method == "medusa") == 4
    assert max(p.depth for p in pts if p.method == "eagle") == 8
    deep = SpecConfig(method="medusa", depth=5, topk=1, budget=6)
    assert not MEDUSA.contains(deep) and MEDUSA.contains(deep.model_copy(update={"depth": 4, "budget": 5}))
    assert all(d.depth <= 4 for d in MEDUSA.defaults() if d.method == "medusa")
    assert MEDUSA.clip("medusa", 8, 1, 9).key() == "medusa d4 k1 b5"
    _assert_round_trip(MEDUSA)


def _medusa_head(path, heads: int):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": heads}))
    return path


def test_from_config_reads_the_heads_of_the_trained_head(tmp_path) -> None:
    cfg = load_config(["+workload=code", "search.methods=[ngram,medusa]", "train.medusa_heads=5"])
    assert SearchSpace.from_config(cfg).medusa_heads == 5  # not trained yet: what train-draft trains
    head = _medusa_head(tmp_path / "h", 2)
    space = SearchSpace.from_config(cfg, head_paths={"medusa": str(head)})
    # (the grid holds a K per concurrency band, 14 s to enumerate: ask the space for its deepest point)
    deepest = space.clip("medusa", 9, 1, 10)
    assert space.medusa_heads == 2 and deepest.depth == 2 and space.contains(deepest)
    assert not space.contains(deepest.model_copy(update={"depth": 3, "budget": 4}))
    given = load_config(["+workload=code", "search.methods=[medusa]", "spec.method=medusa", "spec.depth=2",
                         "spec.budget=3", f"spec.head_path={head}"])
    assert SearchSpace.from_config(given).medusa_heads == 2  # spec.head_path, before any head_paths
    assert SearchSpace.from_config(load_config(["+workload=code"])).medusa_heads is None  # no Medusa searched


def test_medusa_depth_beyond_its_heads_is_a_user_error(tmp_path) -> None:
    with pytest.raises(UserError, match=r"search.depth.min=5 with medusa in search.methods: its head set has 4 heads"):
        SearchSpace.from_config(load_config(["+workload=code", "search.methods=[medusa]", "search.depth.min=5"]))
    head = _medusa_head(tmp_path / "h", 3)
    with pytest.raises(UserError, match=rf"spec.depth=4 with spec.method=medusa: spec.head_path={head} has 3 heads"):
        load_config(["spec.method=medusa", "spec.depth=4", "spec.budget=5", f"spec.head_path={head}"])
    load_config(["spec.method=medusa", "spec.depth=3", "spec.budget=4", f"spec.head_path={head}"])


FREE_SPACES = [
    _space(methods=("ngram", "suffix", "recycle"), topk=(1, 2, 4), budget_max=10, depth_max=4,
           ngram_match=("bfs", "prob"), suffix_spec_factor=(1.0, 2.0), suffix_min_prob=(0.0, 0.1)),
    _space(methods=("ngram", "eagle"), topk=(1, 2, 4), budget_max=10, depth_max=4, engine="sglang"),
    _space(methods=("ngram", "suffix"), topk=(1, 2), budget_max=8, depth_max=4, chain_only=True, engine="vllm"),
]


@pytest.mark.parametrize("idx", range(len(FREE_SPACES)))
def test_training_free_tree_points_are_valid_and_round_trip(idx: int) -> None:
    space = FREE_SPACES[idx]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=idx), direction="maximize")
    seen = set()
    for _ in range(80):
        spec = space.suggest(study.ask())
        _assert_valid(space, spec)
        seen.add(spec.key())
        if space.engine == "sglang" and spec.method == "ngram":
            assert spec.topk > 1  # SGLang's NGRAM is a tree
        if space.engine == "vllm":
            assert spec.topk == 1
    points = space.points()
    assert all(space.contains(p) for p in points)
    for p in points[:: max(1, len(points) // 40)]:
        study.enqueue_trial(space.params_of(p))
        assert space.suggest(study.ask()) == p
    if idx == 0:
        assert any(s.startswith("ngram") and " k2 " in s and s.endswith("prob") for s in seen)
        assert any(s.startswith("suffix") and " k4 " in s for s in seen)
        assert {(p.suffix_spec_factor, p.suffix_min_prob) for p in points if p.method == "suffix"} == {
            (1.0, 0.0), (1.0, 0.1), (2.0, 0.0), (2.0, 0.1)}


def test_default_study_searches_a_training_free_tree_and_engines_refuse_in_one_line() -> None:
    cfg = load_config(["+workload=code"])
    space = SearchSpace.from_config(cfg)
    # (the whole grid is millions of points: ask the space, do not enumerate it)
    tree = space.clip("suffix", 5, 4, 8)
    assert "suffix" in space.methods and max(space.topk_of("suffix")) > 1 and tree.topk == 4 and space.contains(tree)
    assert space.topk_of("ngram") == (1, 2, 4, 8)
    with pytest.raises(UserError, match="search.topk=\\[1\\] with ngram in search.methods and engine=sglang: sglang runs ngram as a tree only"):
        _space(methods=("ngram",), topk=(1,), engine="sglang")


# ---- K bands from the batch sizes the levels run (planted distributions) ---------------------------
# size -> steps of three request rates' baseline runs: medians 1, 3 and 6
PLANTED = {0.5: {1: 30, 2: 6}, 2.0: {2: 5, 3: 12, 4: 10, 5: 2}, 4.0: {4: 3, 5: 6, 6: 14, 7: 9, 8: 4}}


def _rates_space(concurrency: tuple[int, ...] = (), engine: str = "builtin") -> SearchSpace:
    return SearchSpace(methods=("ngram",), depth_min=1, depth_max=4, topk=(1,), budget_max=8, engine=engine,
                       banded=True, concurrency=concurrency, rates=tuple(PLANTED))


def test_k_bands_follow_the_batch_sizes_each_rate_ran() -> None:
    from tuner.search.space import batch_bands

    space = _rates_space()
    assert space.waits_for_rate_sizes and space.k_bands == []  # nothing measured yet: no bands
    space = space.with_rate_sizes(PLANTED)
    # 0.5 | 2: an edge at 1 puts 6/36 of 0.5's steps above it, at 2 puts 5/29 of 2's below: 1.
    # 2 | 4: at 3, 12/29 + 0; at 4, 2/29 + 3/36; at 5, 0 + 9/36: 4. The last band ends at 4's largest size.
    assert space.bands == [(1, 1, "k_r0.5"), (2, 4, "k_r2"), (5, 8, "k_r4")]
    assert space.k_params == ["k_r2", "k_r4"]
    # concurrency levels alone keep their bands: a level c ends its band at c
    assert batch_bands([("k_c1", ((1, 1),)), ("k_c8", ((8, 1),)), ("k_c32", ((32, 1),))]) == [
        (1, 1, "k_c1"), (2, 8, "k_c8"), (9, 32, "k_c32")]
    # beside a concurrency level 3 (between the rates' medians 1 and 6): 0.5 keeps its steps at 2
    mixed = _rates_space(concurrency=(3,)).with_rate_sizes({0.5: PLANTED[0.5], 4.0: PLANTED[4.0]})
    assert mixed.bands == [(1, 2, "k_r0.5"), (3, 3, "k_c3"), (4, 8, "k_r4")]
    # two rates that run the same median share one band (the lower rate's K); one band is no schedule
    same = _rates_space().with_rate_sizes({0.5: {1: 10}, 2.0: {1: 8, 2: 3}, 4.0: {1: 9}})
    assert same.k_bands == []
    # a rate without recorded sizes (no gauge over HTTP) gets no band of its own
    assert _rates_space().with_rate_sizes({0.5: PLANTED[0.5], 4.0: PLANTED[4.0]}).k_params == ["k_r4"]


def test_rate_bands_become_k_per_batch_size_and_defaults_keep_one_k() -> None:
    space = _rates_space(engine="vllm").with_rate_sizes(PLANTED)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    for _ in range(10):
        trial = study.ask()
        spec = space.suggest(trial)
        assert [(lo, hi) for lo, hi, _ in spec.k_per_batch_size] == [(1, 1), (2, 4), (5, 8)]
        assert spec.k_per_batch_size[0][2] == spec.depth and set(trial.params) >= {"k_r2", "k_r4"}
        assert all(space.params_of(spec)[name] == trial.params[name] for name in space.k_params)  # round trip
        study.tell(trial, 1.0)
    # a default enqueued before the sizes were known (one K everywhere) asks for its depth in every band
    before = _rates_space(engine="vllm")
    default = before.clip("ngram", 3, 1, 4)
    params = before.params_of(default)
    assert params["k_r2"] == params["k_r4"] == 3
    study.enqueue_trial(params)
    spec = space.suggest(study.ask())
    assert spec.depth == 3 and [k for _, _, k in spec.k_per_batch_size] == [3, 3, 3]
