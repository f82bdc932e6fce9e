"""Progress when output is redirected (CI, `kubectl logs`): a plain line at least every 30 s in
head training / data generation and in the trial loop (issue 24.5b)."""

from __future__ import annotations

import io

import optuna
import pytest


class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


def test_head_progress_prints_the_last_state_while_no_report_comes() -> None:
    from tuner.study.progress import head_progress

    clock, buf = Clock(), io.StringIO()
    with head_progress(stream=buf, interval=30, clock=clock, poll=3600) as report:  # ticks driven here
        beat = report.heartbeat
        report("generate", 1, 100, {"tokens": 10, "tok_s": 50.0})
        n = len(buf.getvalue().splitlines())
        clock.t += 29
        assert not beat.tick()
        clock.t += 2  # one slow batch: 31 s without a report
        assert beat.tick()
    lines = buf.getvalue().splitlines()
    assert len(lines) == n + 1
    assert lines[-1].startswith("answering prompts 1/100") and "31 s" in lines[-1] and "still working" in lines[-1]


def test_trial_loop_prints_while_a_long_trial_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from tuner.study.driver import Progress

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    clock = Clock()
    with Progress(study, 10, noise_rel=0.05, interval=30, clock=clock, poll=3600) as progress:  # stderr captured: no terminal
        assert progress.heartbeat.active
        progress.log("intro")
        clock.t += 45
        assert progress.heartbeat.tick()
        clock.t += 10
        assert not progress.heartbeat.tick()
        # the trials are done and the winner is being chosen: the line says so, not "trials 0/10" alone
        progress.after = "choosing the winner (confirmation round, held-out check)"
        clock.t += 31
        assert progress.heartbeat.tick()
    err = capsys.readouterr().err
    first, then = [ln for ln in err.splitlines() if "still working" in ln]
    assert first.startswith("trials 0/10 | best - | still working: 45 s since the last line")
    assert then.startswith("trials 0/10 done, choosing the winner (confirmation round, held-out check) | best - | "
                           "still working: 41 s since the last line")


def test_quiet_progress_has_no_heartbeat() -> None:
    from tuner.study.driver import Progress

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with Progress(optuna.create_study(), 3, quiet=True, noise_rel=0.05) as progress:
        assert not progress.heartbeat.active


def test_the_progress_line_shows_the_best_by_lower_bound(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 39.1: a glitch (2.9x then 1.1x) is not shown as the best; the steady trial is, with
    its interval and lower bound. history.png's step line follows the same leader."""
    from optuna.trial import TrialState, create_trial

    from tuner.report.figures import history_data
    from tuner.schema.config import SpecConfig
    from tuner.study.driver import Progress
    from tuner.study.objective import TrialOutcome, spec_attrs

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("noise_rel", 0.05)
    glitch, steady = (SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1) for d in (5, 4))
    with Progress(study, 10, noise_rel=0.05, interval=30, clock=Clock(), poll=3600) as progress:
        for spec, ratios in ((glitch, [2.9, 1.1]), (steady, [1.30, 1.32])):
            study.add_trial(create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs={
                **spec_attrs(spec), "ratios": ratios, "speedup": sum(ratios) / 2, "feasible": True,
                "speedup_ci_low": 0.1, "speedup_ci_high": 3.0}))
            progress(TrialOutcome(study.trials[-1].number, TrialState.COMPLETE, spec, 13.0, sum(ratios) / 2))
    first, second = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("trial ")]
    assert first.endswith("| best ngram d5 k1 b6 1.786x [0.00, 844.47], lower bound 0.08x")
    assert second.endswith("| best ngram d4 k1 b5 1.310x [1.19, 1.44], lower bound 1.18x")
    assert [p["best"] for p in history_data(study)] == ["ngram d5 k1 b6", "ngram d4 k1 b5"]
