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
    with Progress(study, 10, interval=30, clock=clock, poll=3600) as progress:  # stderr captured: no terminal
        assert progress.heartbeat.active
        progress.log("intro")
        clock.t += 45
        assert progress.heartbeat.tick()
        clock.t += 10
        assert not progress.heartbeat.tick()
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "still working" in ln]
    assert line.startswith("trials 0/10 | best - | still working: 45 s since the last line")


def test_quiet_progress_has_no_heartbeat() -> None:
    from tuner.study.driver import Progress

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with Progress(optuna.create_study(), 3, quiet=True) as progress:
        assert not progress.heartbeat.active
