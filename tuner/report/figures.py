"""The run directory's record of a study: trials.csv, best.yaml, PNG figures and report.html.

Everything here reads the study from its storage (and best.yaml), so `tuner report RUN_DIR`
re-renders the same files at any time, also while a study is still running elsewhere.
"""

from __future__ import annotations

import csv
import html
import json
import warnings
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from tuner.schema.config import BestResult
from tuner.study.studies import FAIL_REASON, role

CSV_FILE = "trials.csv"
BEST_FILE = "best.yaml"
HTML_FILE = "report.html"
CSV_ATTRS = ("spec", "spec_method", "spec_depth", "spec_topk", "spec_budget", "tok_s", "tok_s_ci_low",
             "tok_s_ci_high", "baseline_tok_s", "speedup", "speedup_ci_low", "speedup_ci_high", "tau",
             "ttft_p99_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "draft_mb", "repeats", "feasible", "slo_violations", FAIL_REASON, "prune_reason",
             "duration_s")


def write_trials_csv(study: optuna.Study, path: Path) -> None:
    """One row per trial: state, role, the measured figures and the reason of failures."""
    n_values = len(study.directions)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["number", "state", "role"] + [f"value_{i}" if n_values > 1 else "value" for i in range(n_values)]
                   + list(CSV_ATTRS) + ["params"])
        for t in study.get_trials(deepcopy=False):
            values = list(t.values) if t.values else [None] * n_values
            w.writerow([t.number, t.state.name, role(t)] + values
                       + [t.user_attrs.get(k) for k in CSV_ATTRS] + [json.dumps(t.params, sort_keys=True)])


def write_best(best: BestResult, path: Path) -> None:
    """best.yaml: the contract read by `tuner render --from RUN_DIR`."""
    path.write_text(yaml.safe_dump(best.model_dump(mode="json"), sort_keys=False))


def read_best(path: Path) -> BestResult | None:
    """best.yaml of a run directory, None when the study has not finished yet."""
    return BestResult.model_validate(yaml.safe_load(path.read_text())) if path.is_file() else None


def complete(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


# ---- figures ------------------------------------------------------------------------------------

def _save(fig_or_ax: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = fig_or_ax.figure if hasattr(fig_or_ax, "figure") and not hasattr(fig_or_ax, "savefig") else fig_or_ax
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_history(study: optuna.Study, path: Path) -> None:
    """Optimization history of the (drift-corrected) tokens/s."""
    from optuna.visualization.matplotlib import plot_optimization_history

    if len(study.directions) > 1:
        ax = plot_optimization_history(study, target=lambda t: t.values[0], target_name="output tok/s")
    else:
        ax = plot_optimization_history(study, target_name="output tok/s")
    _save(ax, path)


def plot_heatmap(study: optuna.Study, path: Path) -> None:
    """Best tokens/s per (depth, topk) over the complete feasible speculative trials."""
    import matplotlib.pyplot as plt
    import numpy as np

    best: dict[tuple[int, int], float] = {}
    for t in complete(study):
        d, k = t.user_attrs.get("spec_depth"), t.user_attrs.get("spec_topk")
        if d is None or k is None or not t.user_attrs.get("feasible", True):
            continue
        best[(d, k)] = max(best.get((d, k), 0.0), t.values[0])
    fig, ax = plt.subplots(figsize=(5.5, 4))
    if best:
        depths = sorted({d for d, _ in best})
        topks = sorted({k for _, k in best})
        grid = np.full((len(depths), len(topks)), np.nan)
        for (d, k), v in best.items():
            grid[depths.index(d), topks.index(k)] = v
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(topks)), [str(k) for k in topks])
        ax.set_yticks(range(len(depths)), [str(d) for d in depths])
        for i in range(len(depths)):
            for j in range(len(topks)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax, label="best output tok/s")
    else:
        ax.text(0.5, 0.5, "no complete speculative trial", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("topk")
    ax.set_ylabel("depth")
    ax.set_title("best tok/s by depth x topk")
    _save(fig, path)


def plot_pareto(study: optuna.Study, path: Path) -> None:
    """Pareto front of tokens/s vs TPOT p99 (multi-objective studies)."""
    from optuna.visualization.matplotlib import plot_pareto_front

    _save(plot_pareto_front(study, target_names=["output tok/s", "TPOT p99 (ms)"]), path)


def plot_importances(study: optuna.Study, path: Path) -> None:
    """Parameter importances for the tokens/s objective."""
    from optuna.visualization.matplotlib import plot_param_importances

    target = (lambda t: t.values[0]) if len(study.directions) > 1 else None
    _save(plot_param_importances(study, target=target, target_name="output tok/s"), path)


def plot_bars(rows: list[tuple[str, float, float | None, float | None]], path: Path) -> None:
    """Bars of tokens/s (with the CI when known): baseline, engine default, winner, winner held-out."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r[0] for r in rows]
    vals = [r[1] for r in rows]
    err = [[min(v, max(0.0, v - (lo if lo is not None else v))) for _, v, lo, _ in rows],  # no bar below 0
           [max(0.0, (hi if hi is not None else v) - v) for _, v, _, hi in rows]]
    ax.bar(names, vals, yerr=err, capsize=4, color=["#888", "#6a9fd8", "#2a7", "#5c5"][: len(rows)])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("output tok/s")
    ax.set_title("baseline vs default vs winner")
    _save(fig, path)


def _bar_rows(study: optuna.Study, best: BestResult | None) -> list[tuple[str, float, float | None, float | None]]:
    rows: list[tuple[str, float, float | None, float | None]] = []
    trials = complete(study)
    base = next((t for t in trials if role(t) == "baseline"), None)
    if best is not None and best.baseline is not None:
        # The winner's own adjacent baseline: trial 0 may have run under other load.
        b = best.baseline
        rows.append(("baseline (off)", b.output_tokens_per_s, b.ci_low, b.ci_high))
    elif base is not None:
        a = base.user_attrs
        rows.append(("baseline (off)", a["tok_s"], a.get("tok_s_ci_low"), a.get("tok_s_ci_high")))
    default = next((t for t in trials if role(t) == "default"), None)
    if default is not None:
        a = default.user_attrs
        rows.append((f"default\n{a.get('spec', '')}", a["tok_s"], a.get("tok_s_ci_low"), a.get("tok_s_ci_high")))
    if best is not None and best.metrics is not None:
        m = best.metrics
        rows.append((f"winner\n{best.spec.key()}", m.output_tokens_per_s, m.ci_low, m.ci_high))
        if best.heldout is not None:
            h = best.heldout
            rows.append(("winner\nheld-out", h.output_tokens_per_s, h.ci_low, h.ci_high))
    return rows


def concurrency_curve(study: optuna.Study, best: BestResult | None) -> tuple[list[int], list[float], list[float], int | None]:
    """Output tok/s against concurrency of speculation off and of the winner, from the winner's
    trial (both measured adjacent at every level), and the crossover: the lowest level at which
    off is at least as fast (None: speculation wins at every level)."""
    if best is None or best.spec.method == "off":
        raise ValueError("no speculative winner to compare with off")
    key = best.spec.key()
    trials = [t for t in complete(study) if t.user_attrs.get("spec") == key and len(t.user_attrs.get("levels") or []) > 1]
    if not trials:
        raise ValueError("the workload has one concurrency level (workload.concurrency)")
    t = max(trials, key=lambda t: t.user_attrs.get("repeats", 0))
    levels = t.user_attrs["levels"]
    cs = [int(x["concurrency"]) for x in levels]
    off = [float(x["baseline_tok_s"]) for x in levels]
    win = [float(x["tok_s"]) for x in levels]
    cross = next((c for c, o, w in zip(cs, off, win) if o >= w), None)
    return cs, off, win, cross


def plot_concurrency(study: optuna.Study, best: BestResult | None, path: Path) -> None:
    """Throughput against concurrency for off and the winner, the crossover marked."""
    import matplotlib.pyplot as plt

    cs, off, win, cross = concurrency_curve(study, best)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cs, off, "o-", label="off (autoregressive)")
    ax.plot(cs, win, "s-", label=f"winner: {best.spec.key()}")
    if cross is not None:
        ax.axvline(cross, color="grey", ls="--", lw=1)
        ax.annotate(f"crossover: off wins from {cross}", (cross, max(off + win) * 0.95), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tok/s (all requests)")
    ax.set_title("Throughput against concurrency")
    ax.legend(fontsize=8)
    _save(fig, path)


def write_figures(study: optuna.Study, run_dir: Path, best: BestResult | None) -> dict[str, str]:
    """Render every figure that the study's data allows; returns {file: note} for those skipped."""
    import matplotlib

    matplotlib.use("Agg")
    jobs: list[tuple[str, Any]] = [
        ("history.png", lambda p: plot_history(study, p)),
        ("heatmap.png", lambda p: plot_heatmap(study, p)),
        ("importances.png", lambda p: plot_importances(study, p)),
        ("bars.png", lambda p: plot_bars(_bar_rows(study, best), p)),
        ("concurrency.png", lambda p: plot_concurrency(study, best, p)),
    ]
    if (run_dir / "prediction.json").is_file():  # search.sampler=model
        from tuner.search.guided import SURFACE_FILE, plot_predicted_surface, plot_predicted_vs_measured

        jobs.append(("predicted.png", lambda p: plot_predicted_vs_measured(study, run_dir, p)))
        jobs.append((SURFACE_FILE, lambda p: plot_predicted_surface(study, run_dir, p)))
    if len(study.directions) > 1:
        jobs.append(("pareto.png", lambda p: plot_pareto(study, p)))
    skipped: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna.visualization.matplotlib is experimental
        for name, job in jobs:
            try:
                job(run_dir / name)
            except Exception as exc:  # e.g. importances need two complete trials that vary a parameter
                skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                (run_dir / name).unlink(missing_ok=True)
    return skipped


# ---- HTML ---------------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return html.escape(str(v))


def write_html(study: optuna.Study, run_dir: Path, best: BestResult | None, skipped: dict[str, str]) -> None:
    """report.html: the verdict, the figures and the table of trials."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>spectune: {html.escape(study.study_name)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}img{max-width:540px}</style></head><body>",
             f"<h1>spectune study {html.escape(study.study_name)}</h1>"]
    if best is not None:
        parts.append(f"<h2>Winner: {html.escape(best.spec.key())}</h2><p>{html.escape(best.reason or '')}</p><ul>")
        if best.metrics:
            parts.append(f"<li>tuning prompts: {best.metrics.output_tokens_per_s:.2f} tok/s, speedup "
                         f"{_fmt(best.speedup)}x (tau {_fmt(best.metrics.tau)})</li>")
        if best.baseline:
            parts.append(f"<li>baseline (off): {best.baseline.output_tokens_per_s:.2f} tok/s</li>")
        if best.heldout:
            parts.append(f"<li>held-out prompts: {best.heldout.output_tokens_per_s:.2f} tok/s, speedup "
                         f"{_fmt(best.heldout_speedup)}x</li>")
        if best.chain_spec is not None:
            parts.append(f"<li>best chain (for vLLM): {html.escape(best.chain_spec.key())}</li>")
        parts.append("</ul>")
    else:
        parts.append("<p>No winner yet: the study has not finished.</p>")
    parts.append("<p>Objective value: output tokens/s corrected for machine drift (speedup against the baseline "
                 "measured adjacent in time x the reference baseline of trial 0).</p><h2>Figures</h2>")
    for name in ("history.png", "heatmap.png", "pareto.png", "importances.png", "bars.png", "predicted.png",
                 "predicted_surface.png"):
        if (run_dir / name).is_file():
            parts.append(f"<a href='{name}'><img src='{name}' alt='{name}'></a>")
        elif name in skipped:
            parts.append(f"<p>{name}: not drawn ({html.escape(skipped[name])})</p>")
    parts.append("<h2>Trials</h2><table><tr><th>#</th><th>state</th><th>role</th><th>spec</th><th>value</th>"
                 "<th>tok/s</th><th>baseline</th><th>speedup</th><th>CI</th><th>tau</th><th>TPOT p99</th>"
                 "<th>TTFT p99</th><th>feasible</th><th>note</th></tr>")
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        ci = (f"[{_fmt(a.get('speedup_ci_low'))}, {_fmt(a.get('speedup_ci_high'))}]"
              if a.get("speedup_ci_low") is not None else "")
        note = a.get(FAIL_REASON) or a.get("prune_reason") or a.get("slo_violations") or ""
        value = _fmt(t.values[0]) if t.values else ""
        parts.append(
            f"<tr><td>{t.number}</td><td>{t.state.name}</td><td>{role(t)}</td><td>{_fmt(a.get('spec'))}</td>"
            f"<td>{value}</td><td>{_fmt(a.get('tok_s'))}</td><td>{_fmt(a.get('baseline_tok_s'))}</td>"
            f"<td>{_fmt(a.get('speedup'))}</td><td>{ci}</td><td>{_fmt(a.get('tau'))}</td>"
            f"<td>{_fmt(a.get('tpot_p99_ms'))}</td><td>{_fmt(a.get('ttft_p99_ms'))}</td>"
            f"<td>{_fmt(a.get('feasible'))}</td><td>{html.escape(str(note))}</td></tr>")
    parts.append("</table></body></html>")
    (run_dir / HTML_FILE).write_text("\n".join(parts))


def write_report(study: optuna.Study, run_dir: Path, best: BestResult | None = None) -> None:
    """trials.csv, best.yaml (when given), the PNGs and report.html into `run_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_trials_csv(study, run_dir / CSV_FILE)
    if best is not None:
        write_best(best, run_dir / BEST_FILE)
    else:
        best = read_best(run_dir / BEST_FILE)
    skipped = write_figures(study, run_dir, best)
    write_html(study, run_dir, best, skipped)
