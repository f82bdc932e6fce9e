"""Trial time limits (tuner.study.limits): server start-ups never count against search.trial_timeout_s,
a search whose trials cannot fit is refused before the first trial (one line, exit 2), and
repeats are cut to the limit instead of failing the trial. The vLLM path runs against the fake
server with a start-up longer than the trial limit."""

from __future__ import annotations

import os
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from helpers import fake_engine_exe, free_port
from tuner.cli import main
from tuner.run.rundir import open_run_study
from tuner.schema.compose import load_config
from tuner.study.limits import TrialClock, TrialTimeout, fits_or_refuse, startup_excluded, trial_work
from tuner.study.objective import Objective, Sample
from tuner.schema.config import SpecConfig, UserError
from tuner.search.space import SearchSpace

TINY = ["model=tiny-random", "+workload=code", "search=quick", "workload.num_prompts=3", "workload.num_heldout=1",
        "workload.max_new_tokens=16", "engine.builtin.threads=1", "report.figures=false"]  # no test here checks a PNG


def test_a_paused_startup_is_not_measuring_time() -> None:
    with TrialClock(0.3) as clock:
        with startup_excluded():
            time.sleep(0.6)  # past the limit, but paused: no alarm
        assert clock.elapsed() < 0.2
        with pytest.raises(TrialTimeout, match="search.trial_timeout_s=0.3"), clock.measuring():
            time.sleep(1.0)  # measuring time: the alarm fires


def test_the_alarm_never_cuts_a_storage_call_and_fails_the_next_measurement() -> None:
    """Fired outside a measurement (the trial's storage calls: an exception there cut a SQLite
    transaction and left the file locked, on CI) the alarm is held; the next measurement or check
    raises it."""
    with TrialClock(0.05) as clock:
        time.sleep(0.2)  # a slow storage call past the limit: not interrupted
        with pytest.raises(TrialTimeout), clock.measuring():
            pytest.fail("the held alarm must fail the measurement before it starts")
    with TrialClock(0.05) as clock:
        time.sleep(0.2)
        with pytest.raises(TrialTimeout):
            clock.check()


def test_the_clock_is_checked_between_repeats_off_the_main_thread() -> None:
    import threading

    caught: list[BaseException] = []

    def run() -> None:
        try:
            with TrialClock(0.05) as clock:
                time.sleep(0.1)
                clock.check()
        except BaseException as exc:  # noqa: BLE001: what the thread saw
            caught.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(caught) == 1 and isinstance(caught[0], TrialTimeout)


@pytest.mark.parametrize("limit,fits", [(160, True), (20, False)])
def test_the_work_of_a_trial_sizes_the_check(limit: float, fits: bool) -> None:
    cfg = load_config([*TINY, f"search.trial_timeout_s={limit}", "workload.max_new_tokens=128",
                       "workload.concurrency=[1,4]", "search.repeats_min=2", "search.repeats_max=2"])
    work = trial_work(cfg, n_prompts=3, tok_s=20.0)
    assert work.tokens == 3 * 128 * 2 * 2 * 2  # prompts x tokens x (config + baseline) x levels x repeats
    assert work.seconds == pytest.approx(3 * 128 * 8 / 20.0)  # 153.6 s
    if fits:
        fits_or_refuse(cfg, work)
        return
    with pytest.raises(UserError) as exc:
        fits_or_refuse(cfg, work)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("search.trial_timeout_s=20 cannot fit one trial")
    assert "20.0 tok/s" in msg and "search.trial_timeout_s>=192" in msg
    assert "search.trial_prompts<=" not in msg  # one prompt alone (51 s) does not fit either


def test_a_search_that_cannot_fit_is_refused_before_the_first_trial(tmp_path: Path, capsys) -> None:
    rc = main(["optimize", *TINY, f"run_dir={tmp_path}", "search.study_name=r", "search.trial_timeout_s=0.01"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: search.trial_timeout_s=0.01 cannot fit one trial"), err
    study = open_run_study(tmp_path / "r")
    assert [t for t in study.trials if t.state != TrialState.WAITING] == []  # no trial ran


def test_repeats_are_cut_to_fit_the_limit_and_the_trial_completes(tmp_path: Path) -> None:
    cfg = load_config([*TINY, "search.repeats_min=1", "search.repeats_max=20", "search.ci_rel_width=1e-9",
                       "search.trial_timeout_s=2", "search.noise_rel=0.5"])
    import scipy.stats  # noqa: F401: imported by the first interval; not part of what is timed here
    study = optuna.create_study(direction="maximize")
    calls: list[str] = []

    def measure(spec: SpecConfig, split: str, concurrency: int) -> Sample:
        calls.append(spec.method)
        time.sleep(0.15)
        return Sample(10.0 + len(calls) % 3, tau=2.0)  # some noise: the interval never gets tight

    space = SearchSpace.from_config(cfg)
    out = Objective(study, space, measure, cfg.workload, cfg.search).run_one()
    t = study.trials[0]
    assert out.state == TrialState.COMPLETE, out.reason
    assert 2 <= t.user_attrs["repeats"] < 20  # each repeat ~0.3 s: cut before 2 s, not failed
    assert t.user_attrs["repeats_cut"] == "search.trial_timeout_s=2"



def test_vllm_trials_complete_when_startup_is_longer_than_the_trial_limit(tmp_path: Path, monkeypatch) -> None:
    """A vLLM start-up longer than search.trial_timeout_s is bounded by engine.vllm.startup_timeout_s
    alone: every trial completes and records its start-ups. The measuring itself is made tiny (2
    prompts of 16 tokens from a fast fake, one concurrency level) so that it fits the limit many
    times over on a loaded machine; only a start-up counted against the limit overruns it."""
    limit_s = 3.0
    exe = fake_engine_exe(tmp_path)
    monkeypatch.setenv("FAKE_MODE", "ok")
    monkeypatch.setenv("FAKE_RECORD", str(tmp_path / "record.jsonl"))
    monkeypatch.setenv("FAKE_STARTUP_S", str(limit_s + 0.5))
    # 16 tokens: 128 ms a request (64 ms with speculation), so a loaded machine's per-request overhead
    # (HTTP, streaming) must pass ~300 ms before the 2x fake measures below 1.3x; 4 ms left it ~70 ms
    monkeypatch.setenv("FAKE_TOKEN_S", "0.008")
    from tuner.run.session import optimize

    small = [o for o in TINY if not o.startswith("engine.builtin")]
    run_dir = optimize([*small, "workload.concurrency=[1]", "engine=vllm",
                        f"engine.vllm.executable={exe}", f"engine.vllm.port={free_port()}",
                        "engine.vllm.startup_timeout_s=60", f"search.trial_timeout_s={limit_s:g}", "search.n_trials=2",
                        "workload.num_heldout=0", f"run_dir={tmp_path}", "search.study_name=v"], quiet=True)
    study = open_run_study(run_dir)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2, \
        [t.user_attrs.get("fail_reason") for t in study.trials]
    spec_trials = [t for t in study.trials if t.user_attrs["spec_method"] != "off"]
    # each speculative trial restarted the server (its flags changed) and still completed
    assert all(t.user_attrs["server_starts"] >= 1 and t.user_attrs["server_startup_s"] > limit_s
               for t in spec_trials)
    assert max(t.user_attrs["speedup"] for t in spec_trials) > 1.3  # the fake is 2x faster with speculation
    assert os.path.isfile(run_dir / "best.yaml")
