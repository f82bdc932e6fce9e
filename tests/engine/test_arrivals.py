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


@pytest.mark.parametrize("service_s,rate", [(0.05, 40.0), (0.05, 10.0)])
def test_queueing_of_a_planted_service_time(service_s: float, rate: float) -> None:
    """One server, constant arrivals: below capacity (rate x service < 1) nobody waits; above it
    request i waits i x (service - 1/rate), and its TTFT counts that wait from its arrival."""
    n = 8
    m = run_inprocess(ServiceEngine(service_s), _prompts(n), SamplingParams(max_new_tokens=2),
                      arrivals_s=arrival_times(n, rate, "constant"), rate=rate)
    assert m.rate == rate and m.n_requests == n and m.batch_sizes == {1: 2 * n}
    expect_last = max(0.0, (n - 1) * (service_s - 1 / rate)) * 1000
    assert m.queue_p99_ms == pytest.approx(expect_last * 0.99 + 0.01 * max(0.0, (n - 2) * (service_s - 1 / rate)) * 1000,
                                           abs=25)
    assert m.ttft_p99_ms >= m.queue_p99_ms + service_s / 2 * 1000 - 5
    if rate * service_s < 1:
        assert m.queue_p99_ms < 20 and m.wall_s == pytest.approx((n - 1) / rate + service_s, abs=0.1)
    else:
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


def test_open_loop_over_http_samples_the_servers_batch(batched) -> None:
    cfg, eng = batched
    with serving(cfg, eng) as url:
        m = run_http(url, cfg.model.name, _prompts(6), SamplingParams(max_new_tokens=24),
                     arrivals_s=arrival_times(6, 200.0, "constant"), rate=200.0)
    assert m.n_requests == 6 and not m.errors and m.rate == 200.0
    assert m.batch_sizes and max(m.batch_sizes) >= 2 and max(m.batch_sizes) <= 4
    assert m.ttft_p50_ms is not None and m.tpot_p99_ms is not None


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


def test_tuner_bench_measures_request_rates(capsys) -> None:
    import json

    from tuner.cli import main

    rc = main(["bench", "model=tiny-random", "+workload=code", "workload.num_prompts=2", "workload.max_new_tokens=4",
               "workload.concurrency=[1]", "workload.request_rate=[100]", "workload.rate_requests=5",
               "workload.arrival=constant", "engine.builtin.max_batch=4", "bench.repeats=1", "bench.warmup=0", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    conc, rate = out["levels"]
    assert conc["concurrency"] == 1 and "batch_sizes" not in conc
    assert rate["rate"] == 100 and rate["n_requests"] == 5 and max(int(k) for k in rate["batch_sizes"]) >= 2
    assert rate["queue_ms"]["p99"] is not None
