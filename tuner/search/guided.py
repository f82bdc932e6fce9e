"""Model-guided search (`search.sampler=model`): predict the whole space, measure the best few live.

Acceptance is profiled once (engine.measure.profile: the exact greedy tau of every point, an estimate at
T>0), the cost of this machine is measured (tuner.projection.costmodel, cached: one sequence, and a
batched step at each of the workload's concurrency levels), and every point's speedup is predicted at
every level, each level with the spec its band runs there (a point's K per band,
`k_per_batch_size`). A point's predicted speedup is the geometric mean over the levels, as a
trial's measured one is. The study then live-measures `off` and the `search.model_live` best
predicted points; the live measurements decide the winner as with any other sampler. When a live
speedup disagrees with its prediction by more than twice the noise band (`search.noise_rel`), the
tuner says so and enqueues the next `search.model_live` predicted points (up to `search.n_trials` trials).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from engine.measure.stats import geomean
from tuner.projection.costmodel import Prediction, StepCost, predict
from tuner.schema.config import Config, SpecConfig, UserError
from tuner.search.space import SearchSpace

PREDICTION_FILE = "prediction.json"
SURFACE_FILE = "predicted_surface.png"
RANK = "predicted_rank"  # user attr of an enqueued predicted trial
PREDICTED = "predicted_speedup"


def level_specs(spec: SpecConfig, levels: Sequence[int], max_batch: int) -> dict[int, SpecConfig]:
    """What `spec` runs at each concurrency level: the spec of its band there (the engine's own
    rule, engine.decode.batch), at most `max_batch` requests decoding together."""
    from engine.decode.batch import schedule_of, spec_for

    bands = schedule_of(spec, max_batch)
    return {c: spec_for(bands, min(c, max_batch)) for c in levels}


def label(spec: SpecConfig) -> str:
    """A point's key with its K per band when it has bands ('ngram d4 k1 b5 K 4/0'): the spec key
    alone does not tell two band schedules of one configuration apart."""
    ks = spec.k_per_batch_size
    return spec.key() + (" K " + "/".join(str(k) for _, _, k in ks) if ks else "")


def rank_points(cost: StepCost, taus: dict[str, float], points: Sequence[SpecConfig], levels: Sequence[int],
                context: int, max_batch: int, verified: dict[str, Any] | None = None) -> list[dict]:
    """Every point's predicted speedup at every level (its band's spec, `max_batch` sequences at
    most in a step) and over the levels (their geometric mean, what a trial measures), best first.
    `taus` and `verified` are by spec key (an acceptance profile's)."""
    ver = verified or {}
    memo: dict[tuple[str, int], Prediction] = {}

    def at(spec: SpecConfig, level: int) -> Prediction:
        k = (spec.key(), level)
        if k not in memo:
            tau = 1.0 if spec.method == "off" else taus[spec.key()]
            memo[k] = predict(cost, spec, tau, min(level, max_batch), context, ver.get(spec.key()))
        return memo[k]

    out = []
    for p in points:
        per = [(c, at(s, c)) for c, s in level_specs(p, levels, max_batch).items()]
        out.append({"key": p.key(), "label": label(p), "spec": p.model_dump(mode="json"),
                    "tau": per[0][1].tau, PREDICTED: geomean([x.speedup for _, x in per]),
                    "predicted_tok_s": per[0][1].tok_s,
                    "levels": [{"concurrency": c, "spec": x.spec.key(), "tau": x.tau, "speedup": x.speedup,
                                "tok_s": x.tok_s} for c, x in per]})
    return sorted(out, key=lambda e: -e[PREDICTED])


def predict_space(cfg: Config, space: SearchSpace, run_dir: Path) -> list[dict]:
    """Every point of the space ranked by predicted speedup over the workload's concurrency levels
    on this machine (profile.json and prediction.json are written to the run directory)."""
    from tuner.projection.profiling import profile_config
    from tuner.projection.projector import acceptance_from_profile, measured_here

    if cfg.engine.kind != "builtin":
        raise UserError(f"search.sampler=model with engine={cfg.engine.kind}: the cost model is measured with the "
                        "built-in engine (use engine=builtin, or another sampler)")
    levels = list(space.concurrency)
    max_batch = cfg.engine.builtin.max_batch
    points = [p for p in space.points() if not p.adaptive]  # the cost model predicts static schedules only
    # every spec some band runs: a point's lower bands run shallower specs that may not be points
    run: dict[str, SpecConfig] = {}
    for p in points:
        for s in level_specs(p, levels, max_batch).values():
            if s.method != "off":
                run.setdefault(s.key(), s)
    prof = profile_config(cfg, [SpecConfig(method="off"), *run.values()])
    acc = acceptance_from_profile(prof.save(run_dir), cfg.model.name)
    batches = tuple(sorted({min(c, max_batch) for c in levels}))
    cost = measured_here(cfg, acc, batches=batches)
    ranked = rank_points(cost, {s.key(): tau for s, tau in acc.points}, points, levels, acc.context or 256,
                         max_batch, acc.verified)
    (run_dir / PREDICTION_FILE).write_text(json.dumps(ranked, indent=1))
    return ranked


def read_prediction(run_dir: Path) -> list[dict]:
    path = run_dir / PREDICTION_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def enqueue_predicted(study: optuna.Study, space: SearchSpace, ranked: list[dict], start: int, n: int,
                      role_attr: str) -> int:
    """Enqueue ranked points [start, start+n); returns how many were enqueued."""
    chunk = ranked[start:start + n]
    for i, p in enumerate(chunk, start):
        spec = SpecConfig(**p["spec"])
        study.enqueue_trial(space.params_of(spec), user_attrs={role_attr: "predicted", RANK: i,
                                                                PREDICTED: p[PREDICTED]})
    return len(chunk)


class Widener:
    """Wraps the progress callback: after each live trial, compares its speedup with the prediction
    and widens the live sample when they disagree beyond the noise band."""

    def __init__(self, study: optuna.Study, space: SearchSpace, cfg: Config, run_dir: Path,
                 on_trial: Callable[[Any], None], log: Callable[[str], None], role_attr: str) -> None:
        self.study, self.space, self.cfg, self.on_trial, self.log = study, space, cfg, on_trial, log
        self.ranked = read_prediction(run_dir)
        self.role_attr = role_attr
        self.band = 2 * cfg.search.noise_rel

    def _enqueued(self) -> int:
        ranks = [t.user_attrs.get(RANK) for t in self.study.get_trials(deepcopy=False)]
        return 1 + max((r for r in ranks if r is not None), default=-1)

    def __call__(self, o: Any) -> None:
        self.on_trial(o)
        if o.state != TrialState.COMPLETE or o.speedup is None or o.spec.method == "off":
            return
        pred = next((p[PREDICTED] for p in self.ranked if SpecConfig(**p["spec"]) == o.spec), None)
        if pred is None:
            return
        err = o.speedup / pred - 1
        if abs(err) <= self.band:
            return
        start = self._enqueued()
        room = self.cfg.search.n_trials - len(self.study.get_trials(deepcopy=False))
        n = enqueue_predicted(self.study, self.space, self.ranked, start, min(self.cfg.search.model_live, room),
                              self.role_attr)
        self.log(f"prediction off for {label(o.spec)}: {pred:.2f}x predicted, {o.speedup:.2f}x measured "
                 f"({err:+.0%}, noise band ±{self.band:.0%}); "
                 + (f"widening the live sample by {n} more predicted points" if n else "no predicted point left"))


def plot_predicted_vs_measured(study: optuna.Study, run_dir: Path, path: Path) -> None:
    """Every live trial of a predicted point: measured speedup against the prediction, with its error."""
    import matplotlib.pyplot as plt

    ranked = read_prediction(run_dir)
    if not ranked:
        raise ValueError(f"no {PREDICTION_FILE} (search.sampler is not model)")
    pts = [(t.user_attrs[PREDICTED], t.user_attrs["speedup"], ranked[t.user_attrs[RANK]].get("label", ranked[t.user_attrs[RANK]]["key"]))
           for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
           if t.user_attrs.get(RANK) is not None and t.user_attrs.get("speedup") is not None]
    if not pts:
        raise ValueError("no live trial of a predicted point")
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.scatter(xs, ys)
    for x, y, k in pts:
        ax.annotate(f"{k} ({y / x - 1:+.0%})", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("predicted speedup (profile + measured cost)")
    ax.set_ylabel("measured speedup (live)")
    ax.set_title("search.sampler=model: predicted vs measured", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class SurfacePanel:
    """The predicted speedup of one method at one top-k over depth x budget (None: not a point of
    the space), and the measured speedups of the points measured live."""

    method: str
    topk: int
    depths: list[int]
    budgets: list[int]
    speedup: list[list[float | None]]  # [budget index][depth index]
    measured: dict[tuple[int, int], float] = field(default_factory=dict)  # (depth, budget) -> speedup

    def at(self, depth: int, budget: int) -> float | None:
        return self.speedup[self.budgets.index(budget)][self.depths.index(depth)]


def point_id(spec: dict) -> str:
    """The identity of a point of the space: its whole spec (JSON), not its key, which two points that
    differ only in their K per band share."""
    return json.dumps(spec, sort_keys=True)


def measured_speedups(study: optuna.Study) -> dict[str, float]:
    """The measured speedup of every configuration with a complete trial (mean over its trials), by
    `point_id`."""
    seen: dict[str, list[float]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        spec, sp = t.user_attrs.get("spec_json"), t.user_attrs.get("speedup")
        if spec and spec.get("method") != "off" and sp is not None:
            seen.setdefault(point_id(spec), []).append(float(sp))
    return {k: sum(v) / len(v) for k, v in seen.items()}


def predicted_surface(ranked: list[dict], measured: dict[str, float] | None = None) -> list[SurfacePanel]:
    """The prediction of a `search.sampler=model` study as one depth x budget grid per (method, top-k),
    in the order method, top-k. Two points of one cell (n-gram lookups of other lengths, K schedules)
    keep the higher prediction, and the cell's mark is that point's measurement (`measured`: by
    `point_id`, as measured_speedups gives)."""
    cells: dict[tuple[str, int], dict[tuple[int, int], float]] = {}
    keys: dict[tuple[str, int], dict[tuple[int, int], str]] = {}
    for p in ranked:
        s = p["spec"]
        panel, cell = (s["method"], s["topk"]), (s["depth"], s["budget"])
        grid = cells.setdefault(panel, {})
        if cell not in grid or p[PREDICTED] > grid[cell]:
            grid[cell] = p[PREDICTED]
            keys.setdefault(panel, {})[cell] = point_id(p["spec"])
    out = []
    for (method, topk), grid in sorted(cells.items()):
        depths = sorted({d for d, _ in grid})
        budgets = sorted({b for _, b in grid})
        out.append(SurfacePanel(
            method=method, topk=topk, depths=depths, budgets=budgets,
            speedup=[[grid.get((d, b)) for d in depths] for b in budgets],
            measured={cell: (measured or {})[k] for cell, k in keys[(method, topk)].items() if k in (measured or {})}))
    return out


def plot_surface(panels: list[SurfacePanel], path: Path, title: str = "") -> None:
    """One heatmap per (method, top-k): depth across, budget up, predicted speedup as colour (one
    scale for all panels, pale yellow at 1x); the points measured live are boxed, with their
    measured speedup under the predicted one ("m 1.40")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError(f"no predicted point in {PREDICTION_FILE}")
    with plt.style.context("default"):  # optuna's figures leave the ggplot style (grey, gridded) behind
        fig = _surface_figure(plt, panels)
        if title:
            fig.suptitle(title, fontsize=9)
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _surface_figure(plt: Any, panels: list[SurfacePanel]) -> Any:
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    methods = sorted({p.method for p in panels})
    ncols = max(sum(p.method == m for p in panels) for m in methods)
    values = [v for p in panels for row in p.speedup for v in row if v is not None]
    lo, hi = min(min(values), 0.99), max(max(values), 1.01)
    norm = TwoSlopeNorm(vcenter=1.0, vmin=lo, vmax=hi)
    fig, axes = plt.subplots(len(methods), ncols, squeeze=False, layout="constrained",
                             figsize=(max(6.0, 1.2 + 3.4 * ncols), 0.8 + 3.0 * len(methods)))
    for ax in axes.flat:
        ax.set_visible(False)
    im = None
    for row, m in enumerate(methods):
        for col, p in enumerate(q for q in panels if q.method == m):
            ax = axes[row][col]
            ax.set_visible(True)
            grid = np.array([[math.nan if v is None else v for v in r] for r in p.speedup], dtype=float)
            im = ax.imshow(np.ma.masked_invalid(grid), origin="lower", aspect="auto", cmap="RdYlGn", norm=norm)
            label = grid.size <= 120  # values written into the cells
            for i, b in enumerate(p.budgets):
                for j, d in enumerate(p.depths):
                    meas = p.measured.get((d, b))
                    if meas is not None:
                        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="k", linewidth=1.8))
                        if not label:  # cells too small for text: a dot and the measurement beside it
                            ax.plot([j], [i], "o", color="k", markersize=4)
                            ax.annotate(f"m {meas:.2f}", (j, i), xytext=(6, 6), textcoords="offset points", fontsize=7,
                                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
                    if label and not math.isnan(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.2f}" + (f"\nm {meas:.2f}" if meas is not None else ""),
                                ha="center", va="center", fontsize=6, fontweight="bold" if meas is not None else "normal")
            step = max(1, math.ceil(len(p.budgets) / 12))
            ax.set_xticks(range(len(p.depths)), [str(d) for d in p.depths])
            ax.set_yticks(range(0, len(p.budgets), step), [str(b) for b in p.budgets[::step]])
            ax.set_xlabel("depth")
            ax.set_ylabel("budget")
            ax.set_title(f"{m}, top-k {p.topk}", fontsize=9)
    nice = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0)
    ticks = [lo, *(t for t in nice if lo + 0.03 < t < hi - 0.03), hi]  # both halves of the two-slope scale
    fig.colorbar(im, ax=axes, ticks=ticks, format="{x:.2f}", shrink=0.9, label="predicted speedup")
    return fig


def plot_predicted_surface(study: optuna.Study, run_dir: Path, path: Path) -> None:
    """The predicted surface of a `search.sampler=model` study (prediction.json) with its live measurements."""
    ranked = read_prediction(run_dir)
    if not ranked:
        raise ValueError(f"no {PREDICTION_FILE} (search.sampler is not model)")
    plot_surface(predicted_surface(ranked, measured_speedups(study)), path,
                 "search.sampler=model: predicted speedup\nboxed: measured live (m)")
