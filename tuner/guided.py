"""Model-guided search (`search.sampler=model`): predict the whole space, measure the best few live.

Acceptance is profiled once (engine.profile: the exact greedy tau of every point, an estimate at
T>0), the cost of this machine is measured (tuner.costmodel, cached), and every point's speedup is
predicted. The study then live-measures `off` and the `search.model_live` best predicted points;
the live measurements decide the winner as with any other sampler. When a live speedup disagrees
with its prediction by more than twice the noise band (`search.noise_rel`), the tuner says so and
enqueues the next `search.model_live` predicted points (up to `search.n_trials` trials).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from tuner.schema import Config, SpecConfig, UserError
from tuner.space import SearchSpace

PREDICTION_FILE = "prediction.json"
RANK = "predicted_rank"  # user attr of an enqueued predicted trial
PREDICTED = "predicted_speedup"


def predict_space(cfg: Config, space: SearchSpace, run_dir: Path) -> list[dict]:
    """Every point of the space ranked by predicted speedup at concurrency 1 on this machine
    (profile.json and prediction.json are written to the run directory)."""
    from engine.profile import profile_config
    from tuner.project import acceptance_from_profile, measured_here, project

    if cfg.engine.kind != "builtin":
        raise UserError(f"search.sampler=model with engine={cfg.engine.kind}: the cost model is measured with the "
                        "built-in engine (use engine=builtin, or another sampler)")
    points = [s for s in space.points() if s.k_per_batch_size is None]
    prof = profile_config(cfg, [SpecConfig(method="off"), *points])
    acc = acceptance_from_profile(prof.save(run_dir), cfg.model.name)
    # the profile's points carry the same head paths as the space's: same keys, same specs
    by_key = {s.key(): s for s in points}
    preds = project(measured_here(cfg, acc), acc, [1], acc.context or 256)
    ranked = sorted((p for p in preds if p.spec.method != "off"), key=lambda p: -p.speedup)
    out = [{"key": p.spec.key(), "spec": by_key[p.spec.key()].model_dump(mode="json"), "tau": p.tau,
            "estimate": acc.estimate, PREDICTED: p.speedup, "predicted_tok_s": p.tok_s} for p in ranked]
    (run_dir / PREDICTION_FILE).write_text(json.dumps(out, indent=1))
    return out


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
        pred = next((p[PREDICTED] for p in self.ranked if p["key"] == o.spec.key()), None)
        if pred is None:
            return
        err = o.speedup / pred - 1
        if abs(err) <= self.band:
            return
        start = self._enqueued()
        room = self.cfg.search.n_trials - len(self.study.get_trials(deepcopy=False))
        n = enqueue_predicted(self.study, self.space, self.ranked, start, min(self.cfg.search.model_live, room),
                              self.role_attr)
        self.log(f"prediction off for {o.spec.key()}: {pred:.2f}x predicted, {o.speedup:.2f}x measured "
                 f"({err:+.0%}, noise band ±{self.band:.0%}); "
                 + (f"widening the live sample by {n} more predicted points" if n else "no predicted point left"))


def plot_predicted_vs_measured(study: optuna.Study, run_dir: Path, path: Path) -> None:
    """Every live trial of a predicted point: measured speedup against the prediction, with its error."""
    import matplotlib.pyplot as plt

    ranked = read_prediction(run_dir)
    if not ranked:
        raise ValueError(f"no {PREDICTION_FILE} (search.sampler is not model)")
    pts = [(t.user_attrs[PREDICTED], t.user_attrs["speedup"], ranked[t.user_attrs[RANK]]["key"])
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
