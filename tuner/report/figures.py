"""The run directory's record of a study: trials.csv, best.yaml, PNG figures and report.html.

Everything here reads the study from its storage (and best.yaml), so `tuner report RUN_DIR`
re-renders the same files at any time, also while a study is still running elsewhere.
"""

from __future__ import annotations

import csv
import html
import json
import os
import warnings
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from tuner.schema.config import Arms, BestResult, Config, measured_weights, weights_reason
from tuner.study.selection import describe, leader
from tuner.study.studies import FAIL_REASON, NOISE_REL, role

CSV_FILE = "trials.csv"
BEST_FILE = "best.yaml"
HTML_FILE = "report.html"
CSV_ATTRS = ("spec", "spec_method", "spec_depth", "spec_topk", "spec_budget", "tok_s", "tok_s_ci_low",
             "tok_s_ci_high", "baseline_tok_s", "speedup", "speedup_ci_low", "speedup_ci_high", "speedup_lower", "tau",
             "ttft_p99_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "draft_mb", "repeats", "feasible", "slo_violations", FAIL_REASON, "prune_reason", "implausible",
             "duration_s", "reused_from")


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
# Each figure is drawn by a draw_* function from data a *_data function reads off the trials (what
# the tests compare with the trials), and saved by plot_*; write_figures skips a figure only for a
# reason its data gives, and lets any other error through.

IMPORTANCE_FEW = 20  # below this many complete trials, parameter importances are indicative only
SPEEDUP_LABEL = "speedup over the adjacent baseline (x)"


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def study_noise(study: optuna.Study) -> float:
    """The noise band the study's bounds use (search.noise_rel, stored at creation; 0 for a study
    created before it was stored: then the bounds are the repeats' intervals alone)."""
    return float(study.user_attrs.get(NOISE_REL, 0.0))


def history_data(study: optuna.Study) -> list[dict[str, Any]]:
    """Every finished trial in order: its speedup (a pruned trial's at its last repeat; a failed
    one has none) and 95% interval, its state, whether it reused an earlier trial's measurement,
    feasibility, and the best configuration by lower bound among the trials up to it (`best`,
    `best_lower`: selection.leader, what the progress line showed then)."""
    out = []
    done: list[FrozenTrial] = []
    noise = study_noise(study)
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
        a = t.user_attrs
        done.append(t)
        lead = leader(done, noise)
        out.append({"number": t.number, "state": t.state.name, "speedup": a.get("speedup"), "spec": a.get("spec"),
                    "ci_low": a.get("speedup_ci_low"), "ci_high": a.get("speedup_ci_high"),
                    "reused_from": a.get("reused_from"), "feasible": a.get("feasible", True),
                    "best": lead.spec.key() if lead is not None else None,
                    "best_lower": lead.bounds(noise)[0] if lead is not None else None})
    return out


def history_skip(study: optuna.Study) -> str | None:
    return None if any(p["speedup"] is not None for p in history_data(study)) else "no trial measured yet"


def draw_history(study: optuna.Study, objective: str = "speed") -> Any:
    """Speedup of every trial against its number, with its 95% interval: measured, pruned (at its
    last repeat), reused and failed marked apart; the best so far by lower bound as a step line
    (a lucky figure with a wide interval does not raise it); the right axis reads the same points
    as the study's objective value (speedup x trial 0's baseline: drift-corrected tok/s)."""
    import matplotlib.pyplot as plt

    pts = history_data(study)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    groups = (("measured", lambda p: p["state"] == "COMPLETE" and p["reused_from"] is None, "o", "#2a7"),
              ("pruned (speedup at its last repeat)", lambda p: p["state"] == "PRUNED", "x", "#d62"),
              ("reused (same configuration as an earlier trial)",
               lambda p: p["state"] == "COMPLETE" and p["reused_from"] is not None, "s", "#888"))
    for label, keep, marker, color in groups:
        sel = [p for p in pts if keep(p) and p["speedup"] is not None]
        if sel:
            ax.scatter([p["number"] for p in sel], [p["speedup"] for p in sel], marker=marker, color=color,
                       label=label, zorder=3)
            bars = [p for p in sel if p["ci_low"] is not None and p["ci_high"] is not None]
            if bars:  # intervals on log ratios: asymmetric, never below 0
                ax.errorbar([p["number"] for p in bars], [p["speedup"] for p in bars],
                            yerr=[[p["speedup"] - p["ci_low"] for p in bars], [p["ci_high"] - p["speedup"] for p in bars]],
                            fmt="none", ecolor=color, alpha=0.4, lw=1, zorder=2)
    ys = [p["speedup"] for p in pts if p["speedup"] is not None] or [1.0]
    failed = [p["number"] for p in pts if p["state"] == "FAIL" or p["speedup"] is None]
    if failed:
        ax.scatter(failed, [min(ys + [1.0]) * 0.95] * len(failed), marker="v", color="#b22",
                   label="failed (no speedup)", zorder=3)
    line = [(p["number"], p["best_lower"]) for p in pts if p["best_lower"] is not None]
    if line:
        last = next(p for p in reversed(pts) if p["best"] is not None)
        ax.step([x for x, _ in line], [y for _, y in line], where="post", color="#2a7", alpha=0.6,
                label=f"best so far by lower bound (now {last['best']})")
    lows = [p["ci_low"] for p in pts if p["ci_low"] is not None]
    highs = [p["ci_high"] for p in pts if p["ci_high"] is not None]
    if highs:  # an interval of two repeats can be very wide: keep the points readable
        ax.set_ylim(max(0.0, min(ys + lows + [1.0]) * 0.9), min(max(ys + highs), 2 * max(ys)) * 1.05)
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xlabel("trial")
    ax.set_ylabel(SPEEDUP_LABEL if objective == "speed" else "goodput ratio over the adjacent baseline (x)")
    ref = study.user_attrs.get("reference_tok_s")
    if ref:  # the objective Optuna ranks: the same points on another scale
        right = ax.secondary_yaxis("right", functions=(lambda v, r=ref: v * r, lambda v, r=ref: v / r))
        right.set_ylabel(f"objective: drift-corrected {'output tok/s' if objective == 'speed' else 'goodput'}\n"
                         f"(speedup x trial 0's baseline, {ref:.1f} tok/s)", fontsize=8)
    ax.set_title(f"speedup of every trial ({len(pts)}), 95% intervals")
    ax.legend(fontsize=7)
    return fig


def plot_history(study: optuna.Study, path: Path, objective: str = "speed") -> None:
    """history.png: draw_history."""
    _save(draw_history(study, objective), path)


def heatmap_data(study: optuna.Study) -> dict[tuple[int, int], dict[str, Any]]:
    """Per (depth, topk) of every speculative trial measured (complete or pruned): the best speedup
    of its complete feasible trials, else of its pruned ones (marked), else of its infeasible ones
    (marked), and the method that reached it. A tree pruned after one repeat keeps its column."""
    rank = {"COMPLETE": 0, "PRUNED": 1, "INFEASIBLE": 2}
    cells: dict[tuple[int, int], dict[str, Any]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        a = t.user_attrs
        d, k, sp = a.get("spec_depth"), a.get("spec_topk"), a.get("speedup")
        if d is None or k is None or sp is None:
            continue
        kind = "PRUNED" if t.state == TrialState.PRUNED else "COMPLETE" if a.get("feasible", True) else "INFEASIBLE"
        cur = cells.get((d, k))
        if cur is None or (rank[kind], -sp) < (rank[cur["kind"]], -cur["speedup"]):
            cells[(d, k)] = {"speedup": sp, "kind": kind, "method": a.get("spec_method")}
    return cells


def heatmap_skip(study: optuna.Study) -> str | None:
    return None if heatmap_data(study) else "no speculative trial measured yet"


def draw_heatmap(study: optuna.Study) -> Any:
    """Best speedup per depth x topk (see heatmap_data), each cell labelled with its method and
    marked when only pruned or SLO-infeasible trials measured it."""
    import matplotlib.pyplot as plt
    import numpy as np

    cells = heatmap_data(study)
    depths, topks = sorted({d for d, _ in cells}), sorted({k for _, k in cells})
    grid = np.full((len(depths), len(topks)), np.nan)
    for (d, k), c in cells.items():
        grid[depths.index(d), topks.index(k)] = c["speedup"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(topks), 1.4 + 0.55 * len(depths)))
    im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(topks)), [str(k) for k in topks])
    ax.set_yticks(range(len(depths)), [str(d) for d in depths])
    mark = {"COMPLETE": "", "PRUNED": "\npruned", "INFEASIBLE": "\nSLO missed"}
    for (d, k), c in cells.items():
        ax.text(topks.index(k), depths.index(d), f"{c['speedup']:.2f}x\n{c['method']}{mark[c['kind']]}",
                ha="center", va="center", color="w", fontsize=7)
    fig.colorbar(im, ax=ax, label=SPEEDUP_LABEL)
    ax.set_xlabel("topk (1: chain)")
    ax.set_ylabel("depth")
    ax.set_title("best speedup by depth x topk")
    return fig


def plot_heatmap(study: optuna.Study, path: Path) -> None:
    """heatmap.png: draw_heatmap."""
    _save(draw_heatmap(study), path)


def plot_pareto(study: optuna.Study, path: Path) -> None:
    """Pareto front of the objective (drift-corrected tok/s) vs TPOT p99 (multi-objective studies)."""
    from optuna.visualization.matplotlib import plot_pareto_front

    ax = plot_pareto_front(study, target_names=["objective: drift-corrected output tok/s", "TPOT p99 (ms)"])
    _save(ax.figure, path)


def importance_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The trials Optuna's importances are computed from: complete ones with a value (the
    confirmation round's pairs carry no parameters)."""
    return [t for t in complete(study) if t.values and role(t) != "confirm"]


def importances_skip(study: optuna.Study) -> str | None:
    trials = importance_trials(study)
    varied = {k for k in {k for t in trials for k in t.params}
              if len({json.dumps(t.params.get(k)) for t in trials}) > 1}
    if len(trials) < 2 or not varied:
        return f"needs 2 complete trials that differ in a parameter ({len(trials)} complete)"
    return None


def draw_importances(study: optuna.Study) -> Any:
    """Parameter importances for the objective, titled with the number of complete trials they
    come from and a caveat below IMPORTANCE_FEW."""
    from optuna.visualization.matplotlib import plot_param_importances

    n = len(importance_trials(study))
    target = (lambda t: t.values[0]) if len(study.directions) > 1 else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        ax = plot_param_importances(study, target=target, target_name="objective")
    caveat = f": few trials, indicative only (reliable from ~{IMPORTANCE_FEW})" if n < IMPORTANCE_FEW else ""
    ax.set_title(f"parameter importance from {n} complete trials{caveat}", fontsize=9)
    return ax.figure


def plot_importances(study: optuna.Study, path: Path) -> None:
    """importances.png: draw_importances."""
    _save(draw_importances(study), path)


def bar_data(study: optuna.Study, best: BestResult | None) -> list[dict[str, Any]]:
    """The bars of bars.png, in pairs measured together: on the tuning prompts the winner's own
    adjacent baseline, the engine default, the winner; on the held-out prompts the held-out
    baseline and the winner (never a held-out winner beside a tuning baseline)."""
    rows: list[dict[str, Any]] = []

    def bar(label: str, split: str, f: Any) -> None:
        rows.append({"label": label, "split": split, "tok_s": f.output_tokens_per_s, "lo": f.ci_low, "hi": f.ci_high})

    trials = complete(study)
    base = next((t for t in trials if role(t) == "baseline"), None)
    if best is not None and best.baseline is not None:  # the winner's adjacent baseline: trial 0 may have run under other load
        bar("baseline (off)", "tuning", best.baseline)
    elif base is not None:
        a = base.user_attrs
        rows.append({"label": "baseline (off)", "split": "tuning", "tok_s": a["tok_s"], "lo": a.get("tok_s_ci_low"),
                     "hi": a.get("tok_s_ci_high")})
    default = next((t for t in trials if role(t) == "default"), None)
    if default is not None:
        a = default.user_attrs
        rows.append({"label": f"default\n{a.get('spec', '')}", "split": "tuning", "tok_s": a["tok_s"],
                     "lo": a.get("tok_s_ci_low"), "hi": a.get("tok_s_ci_high")})
    if best is not None and best.metrics is not None:
        bar(f"winner\n{best.spec.key()}", "tuning", best.metrics)
    if best is not None and best.heldout is not None and best.heldout_baseline is not None:
        bar("baseline (off)", "held-out", best.heldout_baseline)
        bar("winner", "held-out", best.heldout)
    return rows


def bars_skip(study: optuna.Study, best: BestResult | None) -> str | None:
    return None if bar_data(study, best) else "no baseline measured yet"


def draw_bars(rows: list[dict[str, Any]], best: BestResult | None = None) -> Any:
    """Output tok/s bars (with their CI when known), grouped by prompt split; the title gives each
    split's speedup as best.yaml records it."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.8 + 1.2 * len(rows), 3.8))
    names = [f"{r['label']}\n({r['split']})" for r in rows]
    vals = [r["tok_s"] for r in rows]
    err = [[min(v, max(0.0, v - (r["lo"] if r["lo"] is not None else v))) for v, r in zip(vals, rows)],  # no bar below 0
           [max(0.0, (r["hi"] if r["hi"] is not None else v) - v) for v, r in zip(vals, rows)]]
    colors = ["#888" if r["label"].startswith("baseline") else "#6a9fd8" if r["label"].startswith("default")
              else "#2a7" if r["split"] == "tuning" else "#5c5" for r in rows]
    ax.bar(range(len(rows)), vals, yerr=err, capsize=4, color=colors)
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("output tok/s")
    title = "each winner beside the baseline measured with it"
    if best is not None and best.speedup is not None:
        title = f"tuning prompts {best.speedup:.2f}x"
        if best.heldout_speedup is not None and best.heldout_baseline is not None:
            title += f", held-out prompts {best.heldout_speedup:.2f}x"
    ax.set_title(title, fontsize=10)
    return fig


def plot_bars(rows: list[dict[str, Any]], path: Path, best: BestResult | None = None) -> None:
    """bars.png: draw_bars."""
    _save(draw_bars(rows, best), path)


def _conc_levels(t: FrozenTrial) -> list[dict[str, Any]]:
    """A trial's concurrency levels (its request-rate levels have their own table and figure)."""
    return [x for x in t.user_attrs.get("levels") or [] if "concurrency" in x]


def _level_trials(study: optuna.Study, best: BestResult) -> list[FrozenTrial]:
    key = best.spec.key()
    return [t for t in complete(study) if t.user_attrs.get("spec") == key and len(_conc_levels(t)) > 1]


def concurrency_skip(study: optuna.Study, best: BestResult | None) -> str | None:
    """Why the study has no throughput-against-concurrency curve, or None."""
    if best is None or best.spec.method == "off":
        return "no speculative winner to compare with off"
    if not _level_trials(study, best):
        return "the workload has one concurrency level (workload.concurrency)"
    return None


def concurrency_curve(study: optuna.Study, best: BestResult | None) -> tuple[list[int], list[float], list[float], int | None]:
    """Output tok/s against concurrency of speculation off and of the winner, from the winner's
    trial (both measured adjacent at every level), and the crossover: the lowest level at which
    off is at least as fast (None: speculation wins at every level)."""
    why = concurrency_skip(study, best)
    if why is not None:
        raise ValueError(why)
    assert best is not None
    t = max(_level_trials(study, best), key=lambda t: t.user_attrs.get("repeats", 0))
    levels = _conc_levels(t)
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


def _rate_trial(study: optuna.Study, best: BestResult | None) -> FrozenTrial | None:
    """The winner's trial (the baseline's when off won) with the most repeats that measured request rates."""
    if best is None:
        return None
    key = best.spec.key()
    ts = [t for t in complete(study) if t.user_attrs.get("spec") == key
          and any("rate" in x for x in t.user_attrs.get("levels") or [])]
    return max(ts, key=lambda t: t.user_attrs.get("repeats", 0)) if ts else None


def rate_rows(study: optuna.Study, best: BestResult | None) -> list[dict[str, Any]]:
    """The winner trial's figures per request rate (spec and adjacent baseline): the report's table."""
    t = _rate_trial(study, best)
    return [x for x in t.user_attrs["levels"] if "rate" in x] if t is not None else []


def rate_curves(study: optuna.Study, best: BestResult | None) -> dict[str, list[tuple[float, float | None, float | None]]]:
    """(rate, TTFT p99 ms, TPOT p99 ms) of off and of the winner, ascending in rate: the winner
    trial's rate levels and the capacity search's probes together."""
    out: dict[str, dict[float, tuple[float | None, float | None]]] = {"off": {}}
    win = best.spec.key() if best is not None else "off"
    out.setdefault(win, {})
    for x in rate_rows(study, best):
        out["off"][x["rate"]] = (x.get("baseline_ttft_p99_ms"), x.get("baseline_tpot_p99_ms"))
        out[win][x["rate"]] = (x.get("ttft_p99_ms"), x.get("tpot_p99_ms"))
    cap = best.capacity if best is not None else None
    for p in (cap.probes if cap is not None else []):
        if p.spec in out:
            out[p.spec][p.rate] = (p.ttft_p99_ms, p.tpot_p99_ms)
    return {k: [(r, *v[r]) for r in sorted(v)] for k, v in out.items() if v}


def rate_skip(study: optuna.Study, best: BestResult | None) -> str | None:
    """Why the study has no latency-against-rate figure, or None."""
    if not rate_curves(study, best):
        return "no request rate was measured (workload.request_rate, search.capacity)"
    return None


def plot_rates(study: optuna.Study, best: BestResult | None, path: Path) -> None:
    """rates.png: TTFT p99 and TPOT p99 against the request rate for off and the winner, the SLOs
    as horizontal lines and each capacity as a vertical one."""
    import matplotlib.pyplot as plt

    curves = rate_curves(study, best)
    slo = (best.capacity.slo_ttft_p99_ms, best.capacity.slo_tpot_p99_ms) if best and best.capacity else (None, None)
    caps = ({"off": best.capacity.baseline_rps, best.spec.key(): best.capacity.winner_rps}
            if best and best.capacity else {})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, i, name, limit in ((axes[0], 1, "TTFT p99 (ms)", slo[0]), (axes[1], 2, "TPOT p99 (ms)", slo[1])):
        for (label, pts), mark in zip(curves.items(), ("o-", "s-")):
            xs = [p[0] for p in pts if p[i] is not None]
            line = ax.plot(xs, [p[i] for p in pts if p[i] is not None], mark,
                           label="off" if label == "off" else f"winner: {label}")[0]
            if caps.get(label):
                ax.axvline(caps[label], color=line.get_color(), ls=":", lw=1)
        if limit is not None:
            ax.axhline(limit, color="red", ls="--", lw=1, label=f"SLO {limit:g} ms")
        ax.set_xscale("log")
        ax.set_xlabel("request rate (requests/s, open loop)")
        ax.set_ylabel(name)
        ax.legend(fontsize=8)
    fig.suptitle("Latency against request rate (dotted: capacity at the SLOs)")
    _save(fig, path)


FIGURES_OFF = "report.figures=false"  # why every figure is left out of a run that asked for none


def write_figures(study: optuna.Study, run_dir: Path, best: BestResult | None,
                  objective: str = "speed", draw_figures: bool = True) -> dict[str, str]:
    """Render every figure that the study's data allows; returns {file: why} for those its data
    does not allow (nothing measured yet, one concurrency level...). A figure that fails to draw
    for another reason raises: a report never hides a broken plot. `draw_figures=False`
    (report.figures=false) draws none: each is named with that reason, and matplotlib is not loaded."""
    jobs: list[tuple[str, Any, Any]] = [
        ("history.png", lambda: history_skip(study), lambda p: plot_history(study, p, objective)),
        ("heatmap.png", lambda: heatmap_skip(study), lambda p: plot_heatmap(study, p)),
        ("importances.png", lambda: importances_skip(study), lambda p: plot_importances(study, p)),
        ("bars.png", lambda: bars_skip(study, best), lambda p: plot_bars(bar_data(study, best), p, best)),
        ("concurrency.png", lambda: concurrency_skip(study, best), lambda p: plot_concurrency(study, best, p)),
        ("rates.png", lambda: rate_skip(study, best), lambda p: plot_rates(study, best, p)),
    ]
    if (run_dir / "prediction.json").is_file():  # search.sampler=model
        from tuner.search.guided import RANK, SURFACE_FILE, plot_predicted_surface, plot_predicted_vs_measured

        live = any(t.user_attrs.get(RANK) is not None and t.user_attrs.get("speedup") is not None for t in complete(study))
        jobs.append(("predicted.png", lambda: None if live else "no live trial of a predicted point",
                     lambda p: plot_predicted_vs_measured(study, run_dir, p)))
        jobs.append((SURFACE_FILE, lambda: None, lambda p: plot_predicted_surface(study, run_dir, p)))
    if len(study.directions) > 1:
        jobs.append(("pareto.png", lambda: None if complete(study) else "no complete trial yet",
                     lambda p: plot_pareto(study, p)))
    skipped: dict[str, str] = {}
    if not draw_figures:
        for name, _, _ in jobs:
            skipped[name] = FIGURES_OFF
            (run_dir / name).unlink(missing_ok=True)  # a figure of an earlier report is no longer true
        return skipped
    import matplotlib

    matplotlib.use("Agg")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # optuna's matplotlib plots
        # "Some regimes ... less than 2 trials": the importances' title carries the caveat instead
        warnings.filterwarnings("ignore", message="Some regimes", category=UserWarning)
        for name, why, draw in jobs:
            reason = why()
            if reason is not None:
                skipped[name] = reason
                (run_dir / name).unlink(missing_ok=True)  # a figure of an earlier report is no longer true
            else:
                draw(run_dir / name)
    return skipped


# ---- HTML ---------------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return html.escape(str(v))


def run_summary(study: optuna.Study, best: BestResult | None, cfg: Config | None) -> list[tuple[str, str]]:
    """(label, value) rows of the run: model, hardware, engine, workload, search space, trials,
    wall time (first trial start to last finish)."""
    pv = best.provenance if best is not None else None
    attrs = study.user_attrs
    rows: list[tuple[str, str]] = []
    if cfg is not None:
        measured = pv.measured_weights if pv is not None and pv.measured_weights else measured_weights(cfg)
        rows.append(("model", f"{cfg.model.name} ({cfg.model.hf_id}; measured: {measured})"))
        why = pv.weights_reason if pv is not None and pv.weights_reason else weights_reason(cfg)
        if why:
            rows.append(("weights", why))
        rows.append(("hardware", f"{cfg.hardware.name} ({cfg.hardware.accelerator}, "
                                 + (f"{cfg.hardware.gpu_count} GPU(s))" if cfg.hardware.accelerator == "cuda"
                                    else f"{cfg.hardware.cpu_cores} cores)")))
        rows.append(("engine", cfg.engine.kind))
        if cfg.workload is not None:
            w = cfg.workload
            rows.append(("workload", f"{w.name} ({w.source}: {w.num_prompts} tuning + {w.num_heldout} held-out prompts, "
                                     f"{w.max_new_tokens} new tokens, T={w.temperature:g}, concurrency "
                                     f"{','.join(map(str, w.concurrency)) or '-'}"
                                     + (f", request rates {','.join(f'{r:g}' for r in w.request_rate)}/s "
                                        f"({w.arrival} arrivals)" if w.request_rate else "") + ")"))
            if w.mix:
                rows.append(("mix", ", ".join(f"{p.label} (weight {p.weight:g})" for p in w.mix)))
            if w.source in ("file", "mix") and not w.private:
                rows.append(("request texts", "kept (workload.keep_text=true)"))
        sc = cfg.search
        rows.append(("search space", f"methods {', '.join(sc.methods)}; depth {sc.depth.min}-{sc.depth.max}; topk "
                                     f"{', '.join(map(str, sc.topk))}; budget <= {sc.budget_max}; sampler {sc.sampler}, "
                                     f"objective {sc.objective}"))
    else:
        for label, key, prov in (("model", "model", "model"), ("hardware", None, "hardware"),
                                 ("engine", "engine", "engine"), ("workload", "workload", "workload")):
            value = (getattr(pv, prov) if pv is not None else None) or (attrs.get(key) if key else None)
            if value:
                rows.append((label, str(value)))
    trials = study.get_trials(deepcopy=False)
    by_state: dict[str, int] = {}
    for t in trials:
        by_state[t.state.name.lower()] = by_state.get(t.state.name.lower(), 0) + 1
    reused = sum(1 for t in trials if "reused_from" in t.user_attrs)
    budget = f" of search.n_trials={cfg.search.n_trials}" if cfg is not None else ""
    rows.append(("trials", f"{len(trials)}{budget}: " + ", ".join(f"{n} {k}" for k, n in sorted(by_state.items()))
                 + (f" ({reused} reused an earlier measurement)" if reused else "")))
    starts = [t.datetime_start for t in trials if t.datetime_start is not None]
    ends = [t.datetime_complete for t in trials if t.datetime_complete is not None]
    if starts and ends:
        wall = (max(ends) - min(starts)).total_seconds()
        rows.append(("wall time", f"{wall / 60:.1f} min ({min(starts):%Y-%m-%d %H:%M} to {max(ends):%H:%M}, trials only; "
                                  "the held-out check and set-up are outside)"))
    return rows


def next_command(best: BestResult | None, run: Path, k8s: Path) -> str:
    """The command to run after reading this report."""
    if best is None:
        return f"tuner optimize --resume {run}  # the study has not finished"
    if (k8s / "kustomization.yaml").is_file():
        return f"tuner apply {k8s} --dry-run  # then without --dry-run, or kubectl apply -k {k8s}"
    return f"tuner render --from {run}  # the winner as Kubernetes manifests in {run / 'k8s'}"


def _link(target: Path, here: Path) -> str:
    return html.escape(os.path.relpath(target, here))


def arms_html(arms: Arms) -> str:
    """The adaptive arm, the best static schedule and off per level (best.yaml `arms`), as a table."""
    def cell(tok: float | None, sp: float | None) -> str:
        return "-" if sp is None else f"{tok:.1f} ({sp:.3f}x)" if tok is not None else f"{sp:.3f}x"

    static = arms.static.key() if arms.static is not None else "none measured"
    adaptive = arms.adaptive.key() if arms.adaptive is not None else "-"
    out = [f"<h3>Adaptive, static, off: chosen {html.escape(arms.choice)}</h3><table><tr><th>level</th>"
           f"<th>off tok/s</th><th>best static, {html.escape(static)}</th><th>adaptive, {html.escape(adaptive)}</th>"
           "</tr>"]
    for lv in arms.levels:
        off = "-" if lv.off_tok_s is None else f"{lv.off_tok_s:.1f}"
        out.append(f"<tr><td>{html.escape(lv.level)}</td><td>{off}</td>"
                   f"<td>{cell(lv.static_tok_s, lv.static_speedup)}</td>"
                   f"<td>{cell(lv.adaptive_tok_s, lv.adaptive_speedup)}</td></tr>")
    out.append(f"<tr><th>all levels</th><td>1.000x</td><td>{_fmt(arms.static_speedup)}x</td>"
               f"<td>{_fmt(arms.adaptive_speedup)}x</td></tr></table><p>Each arm's speedup over the baseline measured "
               "beside it at that level; tok/s is that speedup x the baseline trial's tok/s there.</p>")
    return "".join(out)


def write_html(study: optuna.Study, run_dir: Path, best: BestResult | None, skipped: dict[str, str],
               cfg: Config | None = None, source: Path | None = None) -> None:
    """report.html: the run summary, the verdict with its units, the next command, links to
    best.yaml and the manifests, the figures (a caveat on importances from few trials) and the
    table of trials (reused ones marked). `source`: the run directory when the report is written
    elsewhere (tuner report RUN --out DIR)."""
    run = source or run_dir
    k8s = run / "k8s"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>spectune: {html.escape(study.study_name)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}img{max-width:540px}"
             "code{background:#f4f4f4;padding:1px 4px}</style></head><body>",
             f"<h1>spectune study {html.escape(study.study_name)}</h1><h2>Run</h2><table>"]
    for label, value in run_summary(study, best, cfg):
        parts.append(f"<tr><th>{html.escape(label)}</th><td>{html.escape(value)}</td></tr>")
    parts.append("</table>")
    lead = leader(study.get_trials(deepcopy=False), study_noise(study))
    if lead is not None:
        parts.append(f"<p>Best by lower bound: {html.escape(describe(lead, study_noise(study)))} (the 95% interval of "
                     "its repeats' ratios, on logs; pruning and the progress line rank by that lower bound)</p>")
    if best is not None:
        parts.append(f"<h2>Winner: {html.escape(best.spec.key())}</h2><p>{html.escape(best.reason or '')}</p><ul>")
        if best.metrics:
            parts.append(f"<li>tuning prompts: {best.metrics.output_tokens_per_s:.2f} output tok/s, speedup "
                         f"{_fmt(best.speedup)}x over the adjacent baseline (tau {_fmt(best.metrics.tau)} tokens per "
                         "target forward)</li>")
        if best.baseline:
            parts.append(f"<li>baseline (off), tuning prompts: {best.baseline.output_tokens_per_s:.2f} output tok/s</li>")
        if best.heldout:
            base = (f" against {best.heldout_baseline.output_tokens_per_s:.2f} tok/s off"
                    if best.heldout_baseline is not None else "")
            parts.append(f"<li>held-out prompts: {best.heldout.output_tokens_per_s:.2f} output tok/s{base}, speedup "
                         f"{_fmt(best.heldout_speedup)}x</li>")
        if best.heldout_check is not None:
            from tuner.study.selection import describe_check

            parts.append(f"<li>{html.escape(describe_check(best.heldout_check))}</li>")
        if best.head_bounds:
            from tuner.study.headbound import describe as describe_bound

            parts += [f"<li>{html.escape(describe_bound(b))}</li>" for b in best.head_bounds]
        if best.chain_spec is not None:
            parts.append(f"<li>best chain (for vLLM): {html.escape(best.chain_spec.key())}</li>")
        if best.capacity is not None:
            from tuner.study.capacity import describe as describe_capacity

            parts.append(f"<li>{html.escape(describe_capacity(best.capacity, best.spec.key()))}</li>")
        if best.skipped_requests:
            parts.append(f"<li>{best.skipped_requests} request(s) of the workload were refused by the engine as such "
                         "(too long, a field it cannot honour): counted and skipped</li>")
        parts.append("</ul>")
        if best.arms is not None:
            parts.append(arms_html(best.arms))
        if best.parts:
            parts.append("<h3>Per part of the mix</h3><table><tr><th>part</th><th>weight</th><th>requests</th>"
                         "<th>tau</th><th>speedup</th><th>tok/s</th><th>tok/s off</th></tr>")
            for pr in best.parts:
                parts.append(f"<tr><td>{html.escape(pr.name)}</td><td>{pr.weight:g}</td><td>{pr.requests} "
                             f"({html.escape(pr.split)})</td><td>{_fmt(pr.tau)}</td><td>{_fmt(pr.speedup)}x</td>"
                             f"<td>{_fmt(pr.output_tokens_per_s)}</td><td>{_fmt(pr.baseline_tokens_per_s)}</td></tr>")
            parts.append("</table>")
    else:
        parts.append("<p>No winner yet: the study has not finished.</p>")
    links = []
    if (run_dir / BEST_FILE).is_file():
        links.append(f"<a href='{_link(run_dir / BEST_FILE, run_dir)}'>best.yaml</a> (the winner, read by "
                     "<code>tuner render --from</code>)")
    if (k8s / "kustomization.yaml").is_file():
        links.append(f"<a href='{_link(k8s, run_dir)}/'>k8s/</a> (the rendered manifests)")
    if links:
        parts.append("<p>" + "; ".join(links) + "</p>")
    parts.append(f"<p>Next: <code>{html.escape(next_command(best, run, k8s))}</code></p>")
    parts.append("<p>Speedup: a trial's output tok/s over speculation off measured adjacent in time (x). Objective "
                 "value: that speedup x the reference baseline of trial 0, i.e. output tok/s corrected for machine "
                 "drift. Times in ms, throughput in output tokens/s over all requests.</p><h2>Figures</h2>")
    rows = rate_rows(study, best)
    if rows:
        parts.append("<h2>Request rates (open loop)</h2><table><tr><th>rate (req/s)</th><th>tok/s off / winner</th>"
                     "<th>goodput off / winner (req/s)</th><th>TTFT p50 / p99 (ms) off</th><th>TTFT p50 / p99 (ms) "
                     "winner</th><th>TPOT p50 / p99 (ms) off</th><th>TPOT p50 / p99 (ms) winner</th>"
                     "<th>queue p99 (ms) off / winner</th><th>batch sizes run, winner (size: steps)</th></tr>")
        for x in rows:
            def pair(a: str, b: str) -> str:
                return f"{_fmt(x.get(a))} / {_fmt(x.get(b))}"
            sizes = ", ".join(f"{k}: {v}" for k, v in (x.get("batch_sizes") or {}).items())
            parts.append(f"<tr><td>{x['rate']:g}</td><td>{pair('baseline_tok_s', 'tok_s')}</td>"
                         f"<td>{pair('baseline_goodput', 'goodput')}</td>"
                         f"<td>{pair('baseline_ttft_p50_ms', 'baseline_ttft_p99_ms')}</td>"
                         f"<td>{pair('ttft_p50_ms', 'ttft_p99_ms')}</td>"
                         f"<td>{pair('baseline_tpot_p50_ms', 'baseline_tpot_p99_ms')}</td>"
                         f"<td>{pair('tpot_p50_ms', 'tpot_p99_ms')}</td>"
                         f"<td>{pair('baseline_queue_p99_ms', 'queue_p99_ms')}</td><td>{html.escape(sizes)}</td></tr>")
        parts.append("</table>")
    for name in ("history.png", "heatmap.png", "pareto.png", "importances.png", "bars.png", "concurrency.png",
                 "rates.png", "predicted.png", "predicted_surface.png"):
        if (run_dir / name).is_file():
            parts.append(f"<a href='{name}'><img src='{name}' alt='{name}'></a>")
            n = len(importance_trials(study))
            if name == "importances.png" and n < IMPORTANCE_FEW:
                parts.append(f"<p>Importances from {n} complete trials: indicative only (reliable from "
                             f"~{IMPORTANCE_FEW}).</p>")
        elif name in skipped:
            parts.append(f"<p>{name}: not drawn ({html.escape(skipped[name])})</p>")
    parts.append("<h2>Trials</h2><table><tr><th>#</th><th>state</th><th>role</th><th>spec</th>"
                 "<th>objective (tok/s, drift-corrected)</th><th>tok/s</th><th>baseline tok/s</th><th>speedup (x)</th>"
                 "<th>speedup CI (x)</th><th>tau (tokens/forward)</th><th>TPOT p99 (ms)</th><th>TTFT p99 (ms)</th>"
                 "<th>feasible</th><th>note</th></tr>")
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        ci = (f"[{_fmt(a.get('speedup_ci_low'))}, {_fmt(a.get('speedup_ci_high'))}]"
              if a.get("speedup_ci_low") is not None else "")
        note = a.get(FAIL_REASON) or a.get("prune_reason") or a.get("slo_violations") or ""
        if a.get("implausible"):  # kept after every re-measurement: it neither prunes nor wins
            note = f"implausible: {a['implausible']}" + (f"; {note}" if note else "")
        elif a.get("remeasured"):
            note = f"re-measured: {'; '.join(a['remeasured'])}" + (f"; {note}" if note else "")
        if "reused_from" in a:  # a sampler proposed the point again: no new measurement
            note = f"reused: the measurement of trial {a['reused_from']}" + (f"; {note}" if note else "")
        value = _fmt(t.values[0]) if t.values else ""
        parts.append(
            f"<tr><td>{t.number}</td><td>{t.state.name}</td><td>{role(t)}</td><td>{_fmt(a.get('spec'))}</td>"
            f"<td>{value}</td><td>{_fmt(a.get('tok_s'))}</td><td>{_fmt(a.get('baseline_tok_s'))}</td>"
            f"<td>{_fmt(a.get('speedup'))}</td><td>{ci}</td><td>{_fmt(a.get('tau'))}</td>"
            f"<td>{_fmt(a.get('tpot_p99_ms'))}</td><td>{_fmt(a.get('ttft_p99_ms'))}</td>"
            f"<td>{_fmt(a.get('feasible'))}</td><td>{html.escape(str(note))}</td></tr>")
    parts.append("</table></body></html>")
    (run_dir / HTML_FILE).write_text("\n".join(parts))


def write_report(study: optuna.Study, run_dir: Path, best: BestResult | None = None, cfg: Config | None = None,
                 source: Path | None = None) -> None:
    """trials.csv, best.yaml (when given), the PNGs and report.html into `run_dir`; `cfg`: the
    run's config (the summary; without it the study's own record), `source`: the run directory
    when `run_dir` is another (links and the next command point there)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_trials_csv(study, run_dir / CSV_FILE)
    if best is not None:
        write_best(best, run_dir / BEST_FILE)
    else:
        best = read_best(run_dir / BEST_FILE)
    skipped = write_figures(study, run_dir, best, cfg.search.objective if cfg is not None else "speed",
                            cfg is None or cfg.report.figures)
    write_html(study, run_dir, best, skipped, cfg, source)
