"""search.sampler=model (tuner.guided): the whole space predicted from one profile and the measured
cost of this machine, `off` plus the best predicted points measured live, the live sample widened
when a measurement disagrees with its prediction beyond the noise band, and the
predicted-vs-measured figure in the report."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tuner.config import load_config
from tuner.guided import PREDICTED, RANK, Widener, enqueue_predicted
from tuner.objective import TrialOutcome
from tuner.optimize import optimize
from tuner.schema import SpecConfig
from tuner.space import SearchSpace
from tuner.study import ROLE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ["model=tiny-random", "+workload=code", "search=quick", "workload.num_prompts=3",
         "workload.num_heldout=2", "workload.max_new_tokens=16", "engine.builtin.threads=1"]


def test_model_sampler_measures_off_and_the_predicted_best(tmp_path: Path) -> None:
    run = optimize([*SMALL, f"run_dir={tmp_path}", "search.study_name=m", "search.sampler=model",
                    "search.model_live=2", "search.n_trials=4"], quiet=True)
    ranked = json.loads((run / "prediction.json").read_text())
    assert [p["key"] for p in ranked] and len(ranked) == 4  # quick: n-gram depth 1-4
    assert ranked == sorted(ranked, key=lambda p: -p[PREDICTED])
    assert (run / "profile.json").is_file()
    study = optuna.load_study(study_name="m", storage=f"sqlite:///{run / 'study.db'}")
    trials = study.get_trials(deepcopy=False)
    assert trials[0].user_attrs[ROLE] == "baseline"
    live = [t for t in trials[1:] if t.user_attrs.get(RANK) is not None]
    assert [t.user_attrs[RANK] for t in live] == list(range(len(live)))
    assert 2 <= len(live) <= 3 and len(trials) <= 4  # widening never exceeds search.n_trials
    for t in live:
        assert t.params["depth"] == ranked[t.user_attrs[RANK]]["spec"]["depth"]
    assert (run / "predicted.png").is_file() and "predicted.png" in (run / "report.html").read_text()


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
