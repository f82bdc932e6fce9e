"""Open-loop load (workload.request_rate) in the one load generator: the arrival schedules, the
queueing a planted service time makes computable, the batch sizes the built-in engine really ran
(in process and through its own server over HTTP, tiny-random), and rates as levels of a study."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.api import GenResult, GenStats, SamplingParams
from engine.measure.runner import arrival_times, run_http, run_inprocess
from engine.measure import runner as runner_module
from engine.measure.workloads import Prompt
from helpers import engine_for, serving
from tuner.schema.compose import load_config
from tuner.schema.config import Rate, SpecConfig, UserError


class ServiceEngine:
    """An engine whose scheduler runs one request at a time, each taking exactly `service_s` over
    two steps (its first token after half of it)."""

    def __init__(self, service_s: float) -> None:
        self.service_s = service_s

    def encode_prompt(self, text: str, chat_template: bool) -> list[int]:
        return [1, 2, 3]

    def batcher(self) -> "OneAtATime":
        return OneAtATime(self.service_s)


class OneAtATime:
    """The scheduler interface the load generator drives (submit, step, waiting, active)."""

    def __init__(self, service_s: float) -> None:
        self.service_s, self.waiting, self.active = service_s, [], []

    def submit(self, prompt_ids, params, on_tokens=None, on_done=None) -> SimpleNamespace:
        req = SimpleNamespace(arrival=time.perf_counter(), result=None, error=None, on_tokens=on_tokens,
                              on_done=on_done, steps=0)
        self.waiting.append(req)
        return req

    def step(self) -> None:
        if not self.active:
            self.active.append(self.waiting.pop(0))
        req = self.active[0]
        time.sleep(self.service_s / 2)
        req.steps += 1
        if req.steps == 1:
            req.on_tokens([7])
            return
        st = GenStats(new_tokens=2, target_forwards=2)
        req.result = GenResult(tokens=[7, 7], text="ab", finish_reason="length", stats=st)
        self.active.clear()
        req.on_done(req)


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(id=f"p{i}", text=f"Tell me about the number {i}.", source="t") for i in range(n)]


def test_arrival_schedules() -> None:
    assert arrival_times(4, 2.0, "constant") == [0.0, 0.5, 1.0, 1.5]
    a = arrival_times(4000, 5.0, "poisson", seed=3)
    assert a == arrival_times(4000, 5.0, "poisson", seed=3)  # seeded: a spec and its baseline meet the same traffic
    assert a != arrival_times(4000, 5.0, "poisson", seed=4)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0.0 and min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.06)
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.1)  # exponential: sd = mean
    # a trace keeps its shape, scaled so the mean rate is the one asked for
    assert arrival_times(3, 4.0, "trace", stamps=[100.0, 101.0, 104.0]) == pytest.approx([0.0, 0.125, 0.5])
    with pytest.raises(UserError, match="arrival=trace"):
        arrival_times(2, 1.0, "trace", stamps=[1.0, None])


@pytest.mark.parametrize("service_s,rate", [(0.05, 40.0), (0.02, 5.0)])
def test_queueing_of_a_planted_service_time(service_s: float, rate: float) -> None:
    """One server, constant arrivals: below capacity (rate x service < 1) nobody waits; above it
    request i waits i x (service - 1/rate) (at least: a loaded machine only lengthens the service),
    and its TTFT counts that wait from its arrival."""
    n = 8
    m = run_inprocess(ServiceEngine(service_s), _prompts(n), SamplingParams(max_new_tokens=2),
                      arrivals_s=arrival_times(n, rate, "constant"), rate=rate)
    assert m.rate == rate and m.n_requests == n and m.batch_sizes == {1: 2 * n}
    assert m.ttft_p99_ms >= m.queue_p99_ms + service_s / 2 * 1000 * 0.9
    if rate * service_s < 1:
        assert m.queue_p99_ms < 1000 / rate / 2
        assert m.wall_s == pytest.approx((n - 1) / rate + service_s, abs=0.15)
    else:
        last = (n - 1) * (service_s - 1 / rate) * 1000
        assert m.queue_p99_ms >= 0.85 * last and m.queue_p50_ms < m.queue_p99_ms
        assert m.waiting_mean > 1


@pytest.fixture(scope="module")
def batched():
    cfg = load_config(["model=tiny-random", "engine.builtin.max_batch=4", "serve.max_tokens_limit=64"])
    return cfg, engine_for(cfg)


def test_the_batch_sizes_the_engine_ran_in_process(batched) -> None:
    cfg, eng = batched
    params = SamplingParams(max_new_tokens=12)
    burst = run_inprocess(eng, _prompts(6), params, arrivals_s=[0.0] * 6, rate=1000.0)
    assert burst.n_requests == 6 and not burst.errors
    assert max(burst.batch_sizes) == 4  # six at once: four decode together, two wait for a slot
    assert burst.queue_p99_ms > 0 and burst.waiting_mean > 0
    one = run_inprocess(eng, _prompts(1), params, arrivals_s=[0.0], rate=1.0)
    assert set(one.batch_sizes) == {1} and one.texts == burst.texts[:1]  # alone; greedy: the same text


def test_open_loop_over_http_samples_the_servers_batch(batched, monkeypatch) -> None:
    cfg, eng = batched
    # tiny-random's six requests can end within a few gauge periods on a fast host: sample ten times as often
    monkeypatch.setattr(runner_module, "GAUGE_PERIOD_S", runner_module.GAUGE_PERIOD_S / 10)
    seen = []
    with serving(cfg, eng) as url:
        # The gauges are sampled every 100 ms: on a loaded machine a pass may catch only its single-request
        # tail (a full run saw {1: 1}), so the timing part -- a batch of two or more caught -- gets up to
        # three passes, while every pass must hold the rest.
        for _ in range(3):
            m = run_http(url, cfg.model.name, _prompts(6), SamplingParams(max_new_tokens=24),
                         arrivals_s=arrival_times(6, 200.0, "constant"), rate=200.0)
            assert m.n_requests == 6 and not m.errors and m.rate == 200.0
            assert m.batch_sizes and max(m.batch_sizes) <= 4
            assert m.ttft_p50_ms is not None and m.tpot_p99_ms is not None
            seen.append(max(m.batch_sizes))
            if seen[-1] >= 2:
                break
    assert max(seen) >= 2, seen


def test_rates_are_levels_of_a_study(tmp_path: Path) -> None:
    """Rates flow through the trial like concurrency levels: per-rate figures land in the trial's
    `levels`, the ratio spans every level, and an SLO broken at one rate makes the trial infeasible."""
    from tuner.search.space import SearchSpace
    from tuner.study.objective import Objective, Sample
    from tuner.study.studies import create_study

    cfg = load_config(["+workload=code", "search=quick", "workload.concurrency=[1]", "workload.request_rate=[2,8]",
                       "search.repeats_max=1", "workload.slo.ttft_p99_ms=500"])
    assert cfg.workload.levels == [1, Rate(2.0), Rate(8.0)]
    seen: list[object] = []

    def measure(spec: SpecConfig, split: str, level) -> Sample:
        seen.append(level)
        off = spec.method == "off"
        if isinstance(level, Rate):  # the spec serves 8 req/s within the TTFT SLO, off does not
            ttft = 100.0 if (not off or level.rps < 4) else 900.0
            return Sample(10.0 * level.rps * (1 if off else 1.5), 2.0, ttft, 20.0, goodput=level.rps,
                          ttft_p50_ms=ttft / 2, tpot_p50_ms=10.0, queue_p50_ms=1.0, queue_p99_ms=5.0,
                          waiting_mean=0.5, batch_sizes={1: 3, 2: 5})
        return Sample(10.0 if off else 15.0, 2.0, 50.0, 20.0)

    space = SearchSpace.from_config(cfg)
    study = create_study(cfg, space, tmp_path, "rates")
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    objective.run_one()  # the baseline
    objective.run_one()
    base, spec = study.trials[0], study.trials[1]
    assert Rate(8.0) in seen and 1 in seen
    rates = [x for x in spec.user_attrs["levels"] if "rate" in x]
    assert [x["rate"] for x in rates] == [2.0, 8.0]
    assert rates[1]["batch_sizes"] == {"1": 3, "2": 5} and rates[1]["baseline_ttft_p99_ms"] == 900.0
    assert rates[1]["goodput"] == 8.0 and rates[0]["queue_p99_ms"] == 5.0
    assert spec.user_attrs["speedup"] == pytest.approx(1.5)
    assert base.user_attrs["feasible"] is False and spec.user_attrs["feasible"] is True


def test_k_bands_of_a_study_follow_the_batch_sizes_its_baseline_ran_per_rate(tmp_path: Path) -> None:
    """Planted batch sizes: off runs mostly 1 at 0.5 req/s, 3 at 2 req/s and 6 at 4 req/s (as in
    tests/tuner/test_space.py); every trial after the baseline draws a K per band of those sizes, not
    per rate label nor per the configuration's own (smaller) batches, which are never pooled in."""
    from tuner.search.space import SearchSpace
    from tuner.study.objective import K_BANDS, Objective, Sample, baseline_rate_sizes, spec_of
    from tuner.study.studies import create_study

    planted = {0.5: {1: 30, 2: 6}, 2.0: {2: 5, 3: 12, 4: 10, 5: 2}, 4.0: {4: 3, 5: 6, 6: 14, 7: 9, 8: 4}}
    cfg = load_config(["+workload=code", "search=quick", "workload.concurrency=[]",
                       "workload.request_rate=[0.5,2,4]", "search.repeats_max=1"])

    def measure(spec: SpecConfig, split: str, level) -> Sample:
        off = spec.method == "off"
        sizes = planted[level.rps] if off else {1: 50}  # a configuration's own batches are not the bands
        return Sample(10.0 * level.rps * (1 if off else 1.3), 1.6, 100.0, 20.0, goodput=level.rps, batch_sizes=sizes)

    space = SearchSpace.from_config(cfg)
    study = create_study(cfg, space, tmp_path, "bands")
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    for _ in range(3):  # the baseline, the enqueued default, one sampled point
        objective.run_one()
    assert study.user_attrs[K_BANDS] == [[1, 1, "k_r0.5"], [2, 4, "k_r2"], [5, 8, "k_r4"]]
    specs = [spec_of(t) for t in study.trials[1:]]
    assert all([(lo, hi) for lo, hi, _ in s.k_per_batch_size] == [(1, 1), (2, 4), (5, 8)] for s in specs)
    default = study.trials[1]  # enqueued before anything was measured: one K everywhere
    assert default.user_attrs["role"] == "default" and {k for _, _, k in specs[0].k_per_batch_size} == {specs[0].depth}
    assert all({"k_r2", "k_r4"} <= set(t.params) for t in study.trials[1:])
    # trial 0's sizes pooled with each trial's paired baseline: three passes of off in all
    assert baseline_rate_sizes(study) == {r: {k: 3 * v for k, v in sizes.items()} for r, sizes in planted.items()}


def test_a_worker_waits_for_the_baseline_s_batch_sizes_and_a_failed_baseline_fails_its_trial() -> None:
    import threading

    import optuna
    from optuna.trial import TrialState

    from tuner.study.objective import baseline_rate_sizes

    study = optuna.create_study()
    study.enqueue_trial({}, user_attrs={"role": "baseline"})
    base = study.ask()  # another worker's trial 0, still measuring

    def finish() -> None:
        time.sleep(0.3)
        base.set_user_attr("levels", [{"concurrency": 1}, {"rate": 2.0, "batch_sizes": {"1": 4, "3": 2}}])
        study.tell(base, 1.0)

    threading.Thread(target=finish).start()
    t0 = time.monotonic()
    assert baseline_rate_sizes(study, poll_s=0.05) == {2.0: {1: 4, 3: 2}}
    assert time.monotonic() - t0 >= 0.25
    failed = optuna.create_study()
    failed.enqueue_trial({}, user_attrs={"role": "baseline"})
    failed.tell(failed.ask(), state=TrialState.FAIL)
    with pytest.raises(RuntimeError, match="did not complete"):
        baseline_rate_sizes(failed)


def test_tuner_bench_measures_request_rates(capsys) -> None:
    import json

    from tuner.cli import main

    rc = main(["bench", "model=tiny-random", "+workload=code", "workload.num_prompts=2", "workload.max_new_tokens=16",
               "workload.concurrency=[1]", "workload.request_rate=[10000]", "workload.rate_requests=5",
               "workload.arrival=constant", "engine.builtin.max_batch=4", "bench.repeats=1", "bench.warmup=0", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    conc, rate = out["levels"]
    assert conc["concurrency"] == 1 and "batch_sizes" not in conc
    # 10,000 req/s: all five arrive within a step of the first, so the engine must batch them
    assert rate["rate"] == 10000 and rate["n_requests"] == 5 and max(int(k) for k in rate["batch_sizes"]) >= 2
    assert rate["queue_ms"]["p99"] is not None


def test_trace_arrivals_replay_a_files_timestamps(tmp_path: Path) -> None:
    """A request log's "timestamp" becomes each prompt's arrival; workload.arrival=trace replays
    its gaps scaled to the rate, and a log without timestamps is refused before any trial."""
    import json

    from engine.measure.workloads import humaneval_prompts
    from tuner.study.measurer import study_prompts

    texts = [p.text for p in humaneval_prompts()[:30]]
    stamped, bare = tmp_path / "log.jsonl", tmp_path / "bare.jsonl"
    stamped.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}], "max_tokens": 8,
                                           "timestamp": 1_700_000_000 + 3 * i * i}) + "\n"
                               for i, t in enumerate(texts)))
    bare.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}], "max_tokens": 8}) + "\n"
                            for t in texts))
    common = ["model=tiny-random", "+workload=file", "workload.request_rate=[2]", "workload.arrival=trace",
              "workload.num_prompts=4", "workload.num_heldout=2"]
    prompts = study_prompts(load_config([*common, f"workload.path={stamped}"]))
    tune = prompts["tune"]
    assert all(p.arrival_s is not None and p.arrival_s >= 1_700_000_000 for p in tune)
    at = arrival_times(len(tune), 2.0, "trace", stamps=[p.arrival_s for p in tune])
    ts = sorted(p.arrival_s for p in tune)
    assert at[0] == 0.0 and at[-1] == pytest.approx((len(tune) - 1) / 2.0)  # mean rate 2 req/s
    assert [b - a for a, b in zip(at, at[1:])] == pytest.approx(
        [(b - a) * at[-1] / (ts[-1] - ts[0]) for a, b in zip(ts, ts[1:])])  # the trace's shape kept
    with pytest.raises(UserError, match="arrival=trace"):
        study_prompts(load_config([*common, f"workload.path={bare}"]))
