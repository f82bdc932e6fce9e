"""Issue 25.10: the report tells the truth at a glance. Each figure is checked against the trials
it was drawn from (the artists' data, not only that a file exists)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from engine.measure.stats import log_interval
from tuner.report import figures
from tuner.schema.compose import load_config
from tuner.schema.config import BestResult, Figures, Provenance, SpecConfig

matplotlib.use("Agg")
DISTS = {"method": CategoricalDistribution(["off", "ngram", "eagle"]), "depth": IntDistribution(1, 8),
         "topk": CategoricalDistribution([1, 2, 4])}
# (state, role, method, depth, topk, speedup, extra attrs): chains complete, trees pruned after one
# repeat, one reuse of trial 2, one failure
TRIALS = [
    (TrialState.COMPLETE, "baseline", "off", None, None, 1.0, {}),
    (TrialState.COMPLETE, "default", "ngram", 4, 1, 1.30, {}),
    (TrialState.COMPLETE, "search", "ngram", 3, 1, 1.52, {}),
    (TrialState.PRUNED, "search", "eagle", 4, 4, 0.71, {"prune_reason": "hopeless after 1 repeat(s)"}),
    (TrialState.PRUNED, "search", "eagle", 3, 2, 0.83, {"prune_reason": "hopeless after 1 repeat(s)"}),
    (TrialState.COMPLETE, "search", "ngram", 3, 1, 1.52, {"reused_from": 2}),
    (TrialState.COMPLETE, "search", "ngram", 2, 1, 1.21, {"feasible": False, "slo_violations": "tpot"}),
    (TrialState.FAIL, "search", "eagle", 5, 2, None, {"fail_reason": "RuntimeError: boom"}),
]
REF = 20.0  # trial 0's baseline tok/s: the objective is speedup x REF


def _study() -> optuna.Study:
    study = optuna.create_study(study_name="report", direction="maximize")
    study.set_user_attr("reference_tok_s", REF)
    for state, role, method, depth, topk, sp, extra in TRIALS:
        attrs = {"role": role, "spec_method": method, "spec_depth": depth, "spec_topk": topk,
                 "spec": "off" if method == "off" else f"{method} d{depth} k{topk}", **extra}
        if method != "off":
            attrs["spec_json"] = SpecConfig(method=method, depth=depth, topk=topk, budget=depth + 1).model_dump(mode="json")
        if sp is not None:
            attrs.update(speedup=sp, tok_s=REF * sp, baseline_tok_s=REF, tpot_p99_ms=8.0, ratios=[sp * 1.02, sp / 1.02])
        params = {"method": method, "depth": depth or 1, "topk": topk or 1}
        study.add_trial(create_trial(state=state, value=REF * sp if state == TrialState.COMPLETE else None,
                                     params=params, distributions=DISTS, user_attrs=attrs))
    return study


def _best(**kw: object) -> BestResult:
    return BestResult(spec=SpecConfig(method="ngram", depth=3, topk=1), metrics=Figures(output_tokens_per_s=30.4),
                      baseline=Figures(output_tokens_per_s=20.0), speedup=1.52,
                      heldout=Figures(output_tokens_per_s=25.0), heldout_speedup=1.33,
                      provenance=Provenance(study="report", date="2026-12-01T00:00:00+00:00", model="smollm2-135m",
                                            hardware="cpu", engine="builtin", workload="code"), **kw)


def _scatter(ax, label: str) -> list[tuple[float, float]]:
    (c,) = [c for c in ax.collections if c.get_label() == label]
    return [tuple(map(float, xy)) for xy in c.get_offsets()]


def test_history_plots_the_speedup_of_every_trial_pruned_ones_marked() -> None:
    study = _study()
    fig = figures.draw_history(study)
    ax = fig.axes[0]
    by_state = {s: [(float(i), sp) for i, (st, _, _, _, _, sp, extra) in enumerate(TRIALS)
                    if st == s and sp is not None and "reused_from" not in extra] for s in TrialState}
    assert _scatter(ax, "measured") == by_state[TrialState.COMPLETE]
    assert _scatter(ax, "pruned (speedup at its last repeat)") == [(3.0, 0.71), (4.0, 0.83)]
    assert _scatter(ax, "reused (same configuration as an earlier trial)") == [(5.0, 1.52)]
    assert [x for x, _ in _scatter(ax, "failed (no speedup)")] == [7.0]
    assert ax.get_ylabel() == "speedup over the adjacent baseline (x)"  # what the points are, not "output tok/s"
    right = [a for a in ax.child_axes if a.get_ylabel()]  # the secondary axis: the same points as the objective
    assert right and "objective: drift-corrected output tok/s" in right[0].get_ylabel() and "20.0 tok/s" in right[0].get_ylabel()
    # the best-so-far line is the best one-sided lower bound (on log ratios) among complete feasible
    # speculative trials (trial 6 missed its SLO; trial 5 reused trial 2's measurement)
    (step,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("best so far by lower bound")]
    assert step.get_label() == "best so far by lower bound (now ngram d3 k1 b4)"
    low = {sp: log_interval([sp * 1.02, sp / 1.02])[3] for sp in (1.3, 1.52)}
    assert list(step.get_xdata()) == [1, 2, 3, 4, 5, 6, 7]
    assert list(step.get_ydata()) == pytest.approx([low[1.3]] + [low[1.52]] * 6)
    matplotlib.pyplot.close(fig)


def test_heatmap_keeps_the_tree_columns_of_pruned_trials() -> None:
    study = _study()
    cells = figures.heatmap_data(study)
    assert sorted(cells) == [(2, 1), (3, 1), (3, 2), (4, 1), (4, 4)]  # not one column: the pruned trees count
    assert cells[(3, 1)] == {"speedup": 1.52, "kind": "COMPLETE", "method": "ngram"}
    assert cells[(4, 4)]["kind"] == "PRUNED" and cells[(2, 1)]["kind"] == "INFEASIBLE"
    fig = figures.draw_heatmap(study)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]
    assert ax.images[0].get_array().shape == (3, 3)
    texts = {t.get_text() for t in ax.texts}
    assert "0.71x\neagle\npruned" in texts and "1.52x\nngram" in texts and "1.21x\nngram\nSLO missed" in texts
    matplotlib.pyplot.close(fig)


def test_importances_say_how_many_trials_they_come_from() -> None:
    study = _study()
    n = sum(1 for st, *_ in TRIALS if st == TrialState.COMPLETE)
    fig = figures.draw_importances(study)
    title = fig.axes[0].get_title()
    assert f"from {n} complete trials" in title and "few trials, indicative only" in title
    matplotlib.pyplot.close(fig)
    assert figures.importances_skip(optuna.create_study()) == "needs 2 complete trials that differ in a parameter (0 complete)"


def test_bars_put_the_held_out_winner_beside_the_held_out_baseline() -> None:
    study = _study()
    best = _best(heldout_baseline=Figures(output_tokens_per_s=18.8))
    rows = figures.bar_data(study, best)
    assert [(r["label"], r["split"], r["tok_s"]) for r in rows] == [
        ("baseline (off)", "tuning", 20.0), ("default\nngram d4 k1", "tuning", 26.0),
        ("winner\nngram d3 k1 b4", "tuning", 30.4),
        ("baseline (off)", "held-out", 18.8), ("winner", "held-out", 25.0)]
    fig = figures.draw_bars(rows, best)
    ax = fig.axes[0]
    assert [round(b.get_height(), 3) for b in ax.patches] == [20.0, 26.0, 30.4, 18.8, 25.0]
    assert ax.get_title() == "tuning prompts 1.52x, held-out prompts 1.33x"
    matplotlib.pyplot.close(fig)
    # a best.yaml without the held-out baseline: no held-out bar beside a tuning one
    assert all(r["split"] == "tuning" for r in figures.bar_data(study, _best()))


def test_write_figures_skips_for_missing_data_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = optuna.create_study(study_name="empty")
    skipped = figures.write_figures(empty, tmp_path, None)
    assert skipped["history.png"] == "no trial measured yet" and skipped["heatmap.png"].startswith("no speculative")
    assert not list(tmp_path.glob("*.png"))
    study = _study()
    assert figures.write_figures(study, tmp_path, _best()) == {
        "concurrency.png": "the workload has one concurrency level (workload.concurrency)",
        "rates.png": "no request rate was measured (workload.request_rate, search.capacity)"}

    def broken(*_: object) -> None:
        raise RuntimeError("a plotting bug")

    monkeypatch.setattr(figures, "plot_heatmap", broken)
    with pytest.raises(RuntimeError, match="a plotting bug"):  # never turned into "not drawn"
        figures.write_figures(study, tmp_path, _best())


def test_report_figures_false_draws_none_and_names_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """report.figures=false: no PNG (an earlier report's removed, as no longer true), none drawn, and
    report.html names each figure the data allows as not drawn, with the key that turned it off."""
    study, best = _study(), _best()
    (tmp_path / "history.png").write_bytes(b"\x89PNG an earlier report's")

    def drawing(*_: object) -> None:
        raise AssertionError("a figure was drawn with report.figures=false")

    for name in ("plot_history", "plot_heatmap", "plot_importances", "plot_bars", "plot_concurrency", "plot_rates"):
        monkeypatch.setattr(figures, name, drawing)
    figures.write_report(study, tmp_path, best, load_config(["+workload=code", "search=quick", "report.figures=false"]))
    assert not list(tmp_path.glob("*.png"))
    page = (tmp_path / "report.html").read_text()
    for name in ("history.png", "heatmap.png", "importances.png", "bars.png"):  # what this study's data allows
        assert f"{name}: not drawn (report.figures=false)" in page, name


def test_report_html_has_the_run_units_links_next_command_and_reuse(tmp_path: Path) -> None:
    cfg = load_config(["+workload=code", "search=quick"])
    study = _study()
    run = tmp_path / "run"
    (run / "k8s").mkdir(parents=True)
    (run / "k8s" / "kustomization.yaml").write_text("resources: []\n")
    best = _best(heldout_baseline=Figures(output_tokens_per_s=18.8))
    figures.write_best(best, run / "best.yaml")
    figures.plot_importances(study, run / "importances.png")  # the other figures are the tests above
    figures.write_html(study, run, best, {}, cfg)
    page = (run / "report.html").read_text()
    for label in ("model", "hardware", "engine", "workload", "search space", "trials"):
        assert f"<tr><th>{label}</th>" in page, label
    assert "smollm2-135m" in page and "methods " + ", ".join(cfg.search.methods) in page
    assert f"trials</th><td>{len(TRIALS)} of search.n_trials={cfg.search.n_trials}: 5 complete, 1 fail, 2 pruned" in page
    assert "<th>wall time</th>" in page
    assert "<a href='best.yaml'>best.yaml</a>" in page and "<a href='k8s/'>k8s/</a>" in page
    assert f"Next: <code>tuner apply {run / 'k8s'} --dry-run" in page
    assert "reused: the measurement of trial 2" in page
    assert "<th>TPOT p99 (ms)</th>" in page and "<th>speedup (x)</th>" in page and "output tok/s" in page
    assert "held-out prompts: 25.00 output tok/s against 18.80 tok/s off, speedup 1.330x" in page
    assert "Importances from 5 complete trials: indicative only" in page
    # elsewhere (tuner report RUN --out DIR): links and the next command point at the run
    out = tmp_path / "out"
    out.mkdir()
    figures.write_best(best, out / "best.yaml")
    figures.write_html(study, out, best, {}, cfg, source=run)
    page = (out / "report.html").read_text()
    assert "<a href='../run/k8s/'>k8s/</a>" in page and "<a href='best.yaml'>" in page
