"""search.sampler=model (tuner.search.guided): the whole space predicted from one profile and the measured
cost of this machine, `off` plus the best predicted points measured live, the live sample widened
when a measurement disagrees with its prediction beyond the noise band, and the
predicted-vs-measured figure and the predicted surface (depth x budget per top-k) in the report."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tuner.schema.compose import load_config
from tuner.search.guided import (PREDICTED, RANK, SURFACE_FILE, Widener, enqueue_predicted, measured_speedups, plot_surface,
                          point_id, predicted_surface, read_prediction)
from tuner.study.objective import TrialOutcome
from tuner.run.session import optimize
from tuner.schema.config import SpecConfig
from tuner.search.space import SearchSpace
from tuner.study.studies import ROLE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ["model=tiny-random", "+workload=code", "workload.concurrency=[1]", "search=quick", "workload.num_prompts=3",
         "workload.num_heldout=2", "workload.max_new_tokens=16", "engine.builtin.threads=1"]


@pytest.fixture(scope="module")
def model_run(tmp_path_factory: pytest.TempPathFactory, one_torch_thread) -> Path:
    """A search.sampler=model study of the tiny model (n-gram depth 1-4) at the default workload's
    two concurrency levels, run once for this module."""
    levels = [o for o in SMALL if not o.startswith("workload.concurrency=")] + ["workload.concurrency=[1,2]"]
    return optimize([*levels, f"run_dir={tmp_path_factory.mktemp('model')}", "search.study_name=m",
                     "search.sampler=model", "search.model_live=2", "search.n_trials=3"], quiet=True)


def test_model_sampler_measures_off_and_the_predicted_best(model_run: Path) -> None:
    """Two levels: every chain with each K of the band of 2 is ranked (each level's prediction
    recorded with its band's spec), and the live trials are the best predicted points, bands included."""
    run = model_run
    ranked = json.loads((run / "prediction.json").read_text())
    assert len(ranked) == 2 + 3 + 4 + 5  # quick: n-gram depth 1-4, K 0..depth at concurrency 2
    assert ranked == sorted(ranked, key=lambda p: -p[PREDICTED])
    for p in ranked:
        (lo, hi, k1), (lo2, hi2, k2) = p["spec"]["k_per_batch_size"]
        assert (lo, hi, k1, lo2, hi2) == (1, 1, p["spec"]["depth"], 2, 2)
        assert [lv["concurrency"] for lv in p["levels"]] == [1, 2]
        assert p["levels"][1]["spec"] == ("off" if k2 == 0 else f"ngram d{k2} k1 b{k2 + 1}")
        assert p[PREDICTED] == pytest.approx((p["levels"][0]["speedup"] * p["levels"][1]["speedup"]) ** 0.5)
    assert (run / "profile.json").is_file()
    study = optuna.load_study(study_name="m", storage=f"sqlite:///{run / 'study.db'}")
    trials = study.get_trials(deepcopy=False)
    assert trials[0].user_attrs[ROLE] == "baseline"
    live = [t for t in trials[1:] if t.user_attrs.get(RANK) is not None]
    assert [t.user_attrs[RANK] for t in live] == [0, 1]  # search.n_trials=3 leaves no room to widen
    for t in live:
        spec = ranked[t.user_attrs[RANK]]["spec"]
        assert (t.params["depth"], t.params["k_c2"]) == (spec["depth"], spec["k_per_batch_size"][1][2])
        assert [lv["concurrency"] for lv in t.user_attrs["levels"]] == [1, 2]  # measured at both levels
    assert (run / "predicted.png").is_file() and "predicted.png" in (run / "report.html").read_text()


def test_the_report_draws_the_predicted_surface_of_the_prediction(model_run: Path) -> None:
    """predicted_surface.png beside predicted.png, linked from the report; its grid is prediction.json's
    predictions cell by cell, and its marks are the live trials' measured speedups."""
    run = model_run
    png = run / SURFACE_FILE
    assert png.is_file() and png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
    assert f"<a href='{SURFACE_FILE}'><img src='{SURFACE_FILE}'" in (run / "report.html").read_text()
    ranked = read_prediction(run)
    study = optuna.load_study(study_name="m", storage=f"sqlite:///{run / 'study.db'}")
    measured = measured_speedups(study)
    panels = predicted_surface(ranked, measured)
    assert [(p.method, p.topk) for p in panels] == [("ngram", 1)]
    (panel,) = panels
    assert panel.depths == [1, 2, 3, 4] and panel.budgets == [2, 3, 4, 5]
    for p in ranked:  # every cell holds the best prediction of its K schedules, exactly
        d, b = p["spec"]["depth"], p["spec"]["budget"]
        assert panel.at(d, b) == max(q[PREDICTED] for q in ranked if (q["spec"]["depth"], q["spec"]["budget"]) == (d, b))
    cells = [v for row in panel.speedup for v in row]
    assert sum(v is not None for v in cells) == 4  # a chain: budget = depth + 1, the rest empty
    assert panel.speedup[0][1] is None  # depth 2 with budget 2 is no point of the space
    live = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get(RANK) is not None]
    assert live and {(t.params["depth"], t.params["depth"] + 1) for t in live} == set(panel.measured)
    # A cell draws its highest prediction and marks that point's measurement. The two live points may
    # share a cell (one depth, two K schedules at concurrency 2: which ones rank first depends on this
    # machine's measured step costs), so each mark is checked against the live trial of the drawn point.
    drawn: dict[tuple[int, int], dict] = {}
    for p in ranked:
        cell = (p["spec"]["depth"], p["spec"]["budget"])
        if cell not in drawn or p[PREDICTED] > drawn[cell][PREDICTED]:
            drawn[cell] = p
    by_key = {t.user_attrs["spec"]: t for t in live}
    assert all(drawn[cell]["key"] in by_key for cell in panel.measured)  # the top-ranked live point of its cell
    for cell, mark in panel.measured.items():
        assert mark == pytest.approx(by_key[drawn[cell]["key"]].user_attrs["speedup"])


def test_surface_of_a_tree_space_one_panel_per_method_and_topk(tmp_path: Path) -> None:
    def entry(method: str, d: int, k: int, b: int, sp: float) -> dict:
        spec = SpecConfig(method=method, depth=d, topk=k, budget=b, head_path="h" if method == "eagle" else None)
        return {"key": spec.key(), "spec": spec.model_dump(mode="json"), PREDICTED: sp}

    ranked = [entry("eagle", 3, 4, 8, 2.1), entry("eagle", 3, 4, 12, 2.3), entry("eagle", 5, 4, 8, 2.2),
              entry("eagle", 2, 1, 3, 1.6), entry("eagle", 4, 1, 5, 1.9), entry("ngram", 3, 1, 4, 0.9)]
    by_key = {p["key"]: point_id(p["spec"]) for p in ranked}
    panels = predicted_surface(ranked, {by_key["eagle d3 k4 b12"]: 2.05, by_key["ngram d3 k1 b4"]: 0.95})
    assert [(p.method, p.topk) for p in panels] == [("eagle", 1), ("eagle", 4), ("ngram", 1)]
    tree = panels[1]
    assert tree.depths == [3, 5] and tree.budgets == [8, 12]
    assert tree.speedup == [[2.1, 2.2], [2.3, None]] and tree.measured == {(3, 12): 2.05}
    assert panels[2].measured == {(3, 4): 0.95} and panels[0].measured == {}
    plot_surface(panels, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 5000


def test_a_cell_marks_the_measurement_of_the_point_it_draws() -> None:
    """Two K schedules of one chain share a cell and a key ('ngram d3 k1 b4'): the cell draws the
    higher prediction and marks that schedule's measurement, not the mean of both schedules'."""
    from optuna.trial import create_trial

    a = SpecConfig(method="ngram", depth=3, budget=4, k_per_batch_size=[(1, 1, 3), (2, 2, 1)])
    b = SpecConfig(method="ngram", depth=3, budget=4, k_per_batch_size=[(1, 1, 3), (2, 2, 0)])
    assert a.key() == b.key()
    study = optuna.create_study(direction="maximize")
    for spec, sp in ((a, 1.2), (b, 0.8), (a, 1.4)):
        study.add_trial(create_trial(state=TrialState.COMPLETE, value=sp, user_attrs={
            "spec": spec.key(), "spec_json": spec.model_dump(mode="json"), "speedup": sp}))
    ranked = [{"key": s.key(), "spec": s.model_dump(mode="json"), PREDICTED: p} for s, p in ((a, 1.5), (b, 1.4))]
    (panel,) = predicted_surface(ranked, measured_speedups(study))
    assert panel.at(3, 4) == 1.5 and panel.measured == {(3, 4): pytest.approx(1.3)}  # a's two trials, b's left out


def _study_with(space: SearchSpace, ranked: list[dict]) -> optuna.Study:
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({}, user_attrs={ROLE: "baseline"})
    enqueue_predicted(study, space, ranked, 0, 2, ROLE)
    return study


@pytest.mark.parametrize("measured,widened", [(1.80, True), (1.45, False), (1.00, True)])
def test_widener_enqueues_more_when_a_prediction_is_off(tmp_path: Path, measured: float, widened: bool) -> None:
    cfg = load_config([*SMALL, "search.model_live=2", "search.n_trials=10"])
    space = SearchSpace.from_config(cfg)
    ranked = [{"key": s.key(), "spec": s.model_dump(mode="json"), PREDICTED: 1.0 + 0.1 * (4 - i)}
              for i, s in enumerate(space.points())]
    (tmp_path / "prediction.json").write_text(json.dumps(ranked))
    study = _study_with(space, ranked)
    seen, logs = [], []
    w = Widener(study, space, cfg, tmp_path, seen.append, logs.append, ROLE)
    top = SpecConfig(**ranked[0]["spec"])
    assert ranked[0][PREDICTED] == pytest.approx(1.4)  # the noise band: 2 x noise_rel = ±10%, 1.26-1.54x
    w(TrialOutcome(number=1, state=TrialState.COMPLETE, spec=top, tok_s=1.0, speedup=measured))
    ranks = [t.user_attrs.get(RANK) for t in study.get_trials(deepcopy=False)]
    assert len(seen) == 1  # the progress display still sees every trial
    if widened:
        assert ranks == [None, 0, 1, 2, 3] and "widening the live sample by 2" in logs[0]
    else:
        assert ranks == [None, 0, 1] and not logs


CHAINS = {"ngram d1 k1 b2": 1.5, "ngram d2 k1 b3": 1.9, "ngram d3 k1 b4": 2.2, "ngram d4 k1 b5": 2.4}


def _banded_space() -> SearchSpace:
    """n-gram chains of depth 1-4 at the default workload's two levels: each point a K per band."""
    cfg = load_config(["model=tiny-random", "+workload=code", "search=quick", "workload.concurrency=[1,2]"])
    space = SearchSpace.from_config(cfg)
    assert space.k_bands == [(1, 1), (2, 2)]
    return space


@pytest.mark.parametrize("steep", [True, False])
def test_the_ranking_per_level_follows_the_batched_cost(steep: bool) -> None:
    """Planted profile (tau per chain) and cost: verifying more tokens is nearly free for one
    sequence. When a batched step of two sequences pays for every row (steep), speculation loses
    at concurrency 2, so the best point is the deepest chain alone and off in the band of 2 (K 4/0);
    when the batched step stays cheap, the deepest chain in both bands. A point's prediction is
    the geometric mean of its levels', each level priced with its band's spec at that batch."""
    from tuner.projection.costmodel import Measured
    from tuner.search.guided import rank_points

    two = {"1,128": 0.012, "2,128": 0.030, "5,128": 0.060} if steep else {"1,128": 0.012, "2,128": 0.013, "5,128": 0.0145}
    cost = Measured(forward={"1,128": 0.010, "2,128": 0.011, "5,128": 0.012}, batched={2: two},
                    draft={k: 0.0005 for k in CHAINS})
    space = _banded_space()
    ranked = rank_points(cost, CHAINS, space.points(), [1, 2], 128, 8)
    assert len(ranked) == 2 + 3 + 4 + 5  # depth d: K 0..d in the band of 2
    top = ranked[0]
    alone = 2.4 * 0.010 / (0.012 + 0.0005)  # d4 at concurrency 1
    assert top["spec"]["depth"] == 4 and top["levels"][0] == pytest.approx(
        {"concurrency": 1, "spec": "ngram d4 k1 b5", "tau": 2.4, "speedup": alone, "tok_s": 2.4 / 0.0125})
    if steep:
        assert top["spec"]["k_per_batch_size"] == [[1, 1, 4], [2, 2, 0]] and top["label"] == "ngram d4 k1 b5 K 4/0"
        assert top["levels"][1]["spec"] == "off" and top["levels"][1]["speedup"] == pytest.approx(1.0)
        assert top[PREDICTED] == pytest.approx(alone ** 0.5)
    else:
        assert top["spec"]["k_per_batch_size"] == [[1, 1, 4], [2, 2, 4]]
        together = 2.4 * 0.012 / (0.0145 + 2 * 0.0005)  # two n-gram lookups one after the other
        assert top["levels"][1]["spec"] == "ngram d4 k1 b5"
        assert top[PREDICTED] == pytest.approx((alone * together) ** 0.5)
    assert ranked == sorted(ranked, key=lambda e: -e[PREDICTED])
    # the best spec at each level on its own: the same at 1 either way, differing at 2 when steep
    best_at = [max(ranked, key=lambda e: e["levels"][i]["speedup"])["levels"][i]["spec"] for i in (0, 1)]
    assert best_at == ["ngram d4 k1 b5", "off" if steep else "ngram d4 k1 b5"]
