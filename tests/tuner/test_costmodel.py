"""Cost model (tuner.projection.costmodel): the roofline responds to every hardware field it reads in the
right direction; the measured model interpolates and refuses what it did not measure; predicted
throughput is tau over verify plus draft time."""

from __future__ import annotations

import pytest

from tuner.schema.compose import load_config
from tuner.projection.costmodel import Measured, Roofline, draft_params_b, measured_cost, predict, roofline_for
from tuner.schema.config import SpecConfig, UserError

EAGLE = SpecConfig(method="eagle", depth=5, topk=4, budget=8)
CHAIN = SpecConfig(method="draft_model", depth=4, topk=1, budget=5, draft_model="meta-llama/Llama-3.2-1B-Instruct")
OFF = SpecConfig(method="off")


def _roof(tp: int = 4, fp8: bool = True, **hw) -> Roofline:
    cfg = load_config(["hardware=h100x8", "model=llama-3.3-70b-instruct"])
    return Roofline(model=cfg.model, hw=cfg.hardware.model_copy(update=hw), tp=tp, fp8_weights=fp8, fp8_kv=fp8)


def _tpot(r: Roofline, spec: SpecConfig = EAGLE, conc: int = 1, tau: float = 3.5) -> float:
    return predict(r, spec, tau, conc, 2048).tpot_ms


@pytest.mark.parametrize("field,lo,hi", [
    ("hbm_bandwidth_tbs", 2.0, 4.0),
    ("interconnect_gbs", 100, 900),
    ("bandwidth_efficiency", 0.5, 0.9),
])
def test_more_bandwidth_lowers_tpot(field: str, lo: float, hi: float) -> None:
    assert _tpot(_roof(**{field: hi})) < _tpot(_roof(**{field: lo}))


@pytest.mark.parametrize("field,lo,hi", [
    ("allreduce_latency_us", 1, 30),
    ("step_overhead_ms", 0.1, 2.0),
    ("layer_overhead_us", 1, 50),
])
def test_more_overhead_raises_tpot(field: str, lo: float, hi: float) -> None:
    assert _tpot(_roof(**{field: hi})) > _tpot(_roof(**{field: lo}))


@pytest.mark.parametrize("field", ["fp8_tflops", "compute_efficiency"])
def test_more_compute_helps_only_when_compute_bound(field: str) -> None:
    big = {"fp8_tflops": 4000, "compute_efficiency": 0.9}[field]
    small = {"fp8_tflops": 500, "compute_efficiency": 0.2}[field]
    # batch 64 x 8 tree tokens is compute-bound: more FLOP/s lowers TPOT
    assert _tpot(_roof(**{field: big}), conc=64) < _tpot(_roof(**{field: small}), conc=64)
    # one sequence autoregressive is bandwidth-bound: FLOP/s do not matter
    assert _tpot(_roof(**{field: big}), OFF) == pytest.approx(_tpot(_roof(**{field: small}), OFF))


def test_bf16_peak_used_without_fp8_weights() -> None:
    a, b = _roof(fp8=False, bf16_tflops=200), _roof(fp8=False, bf16_tflops=2000)
    assert _tpot(b, conc=64) < _tpot(a, conc=64)
    assert _tpot(_roof(fp8=False, fp8_tflops=100), conc=64) == _tpot(_roof(fp8=False, fp8_tflops=4000), conc=64)


def test_fp8_weights_and_tensor_parallel_make_decode_faster() -> None:
    assert _tpot(_roof(fp8=True), OFF) < _tpot(_roof(fp8=False), OFF)
    assert _tpot(_roof(tp=8), OFF) < _tpot(_roof(tp=2), OFF)


def test_speculation_pays_at_batch_one_and_less_at_high_batch() -> None:
    r = _roof(fp8=False)
    p1, p64 = predict(r, EAGLE, 3.8, 1, 1024), predict(r, EAGLE, 3.8, 64, 1024)
    assert p1.speedup > 2.0
    assert p64.speedup < p1.speedup  # verifying 8 tokens per sequence turns compute-bound
    assert predict(r, OFF, 1.0, 8, 1024).speedup == pytest.approx(1.0)
    assert p1.tok_s == pytest.approx(p1.tau / p1.step_s) and p1.tpot_ms == pytest.approx(1e3 * p1.step_s / p1.tau)


def test_k_schedule_picks_the_k_of_the_batch() -> None:
    r = _roof()
    sched = SpecConfig(method="eagle", depth=4, topk=1, budget=5, k_per_batch_size=[(1, 4, 4), (5, 64, 0)])
    assert predict(r, sched, 3.0, 32, 1024).speedup == pytest.approx(1.0)
    assert predict(r, sched, 3.0, 2, 1024).speedup > 1.5


def test_draft_model_size_from_its_name_and_costs() -> None:
    assert draft_params_b("meta-llama/Llama-3.2-1B-Instruct") == 1.0
    assert draft_params_b("Qwen/Qwen2.5-0.5B-Instruct") == 0.5
    assert draft_params_b(None, 2.0) == 2.0
    big = Roofline(model=_roof().model, hw=_roof().hw, tp=4, draft_model_b=8.0)
    small = Roofline(model=_roof().model, hw=_roof().hw, tp=4, draft_model_b=1.0)
    assert big.draft_s(CHAIN, 1, 512) > small.draft_s(CHAIN, 1, 512) > 0
    assert small.draft_s(SpecConfig(method="ngram", depth=4, budget=5), 1, 512) == 0.0


def test_roofline_refuses_a_profile_without_numbers() -> None:
    cfg = load_config(["hardware=a100-80gbx4", "model=llama-3.1-8b-instruct"])
    with pytest.raises(UserError, match="hbm_bandwidth_tbs"):
        roofline_for(cfg.model, cfg.hardware.model_copy(update={"hbm_bandwidth_tbs": 0}), 1, "none", "auto")
    with pytest.raises(UserError, match="interconnect_gbs"):
        predict(Roofline(model=cfg.model, hw=cfg.hardware.model_copy(update={"interconnect_gbs": 0}), tp=4), OFF, 1, 1, 512)


def test_measured_interpolates_and_refuses_batches_and_unknown_drafts() -> None:
    m = Measured(forward={"1,128": 0.010, "8,128": 0.017, "1,512": 0.012, "8,512": 0.021},
                 draft={"ngram d4 k1 b5": 0.001})
    assert m.verify_s(1, 1, 128) == pytest.approx(0.010)
    assert m.verify_s(8, 1, 512) == pytest.approx(0.021)
    assert 0.010 < m.verify_s(4, 1, 128) < 0.017
    assert 0.017 < m.verify_s(8, 1, 300) < 0.021
    assert m.verify_s(16, 1, 128) > 0.017  # extrapolated from the last segment
    spec = SpecConfig(method="ngram", depth=4, budget=5)
    p = predict(m, spec, 2.0, 1, 128)
    assert p.tok_s == pytest.approx(2.0 / (m.verify_s(5, 1, 128) + 0.001))
    with pytest.raises(UserError, match="concurrency"):
        m.verify_s(1, 4, 128)
    with pytest.raises(UserError, match="no measured draft time"):
        m.draft_s(EAGLE, 1, 128)


def test_measured_cost_is_cached_per_machine(tmp_path, monkeypatch) -> None:
    import engine.measure.microbench as mb

    calls = []
    monkeypatch.setattr(mb, "measure_forward", lambda target, builtin=None, cache_dir=None: calls.append(1) or {"1,128": 0.01, "2,128": 0.02})
    a = measured_cost(None, "tiny|fp32", tmp_path)
    b = measured_cost(None, "tiny|fp32", tmp_path)
    c = measured_cost(None, "tiny|bf16", tmp_path)
    assert a.forward == b.forward and len(calls) == 2 and a.key == b.key != c.key


@pytest.mark.parametrize("forward", ["lean", "hf"])
def test_the_microbenchmark_times_the_forward_the_engine_verifies_with(forward, monkeypatch) -> None:
    """The cost model times the engine's own forward (engine.builtin.forward), not always
    transformers': the lean forward is ~15% faster per step here, so timing the wrong one made
    every prediction of `tuner project hardware=cpu` and search.sampler=model too slow."""
    import engine.models.forward as L
    from engine.models.target import load_target
    from engine.measure.profile import engine_key
    from engine.measure.microbench import TOKENS, measure_forward

    cfg = load_config(["model=tiny-random", f"engine.builtin.forward={forward}"])
    target = load_target(cfg.model, cfg.engine.builtin, cfg.cache_dir, cfg.seed)
    steps = []
    real = L.LeanForward.step
    monkeypatch.setattr(L.LeanForward, "step", lambda self, *a, **k: steps.append(len(a[1])) or real(self, *a, **k))
    out = measure_forward(target, tokens=(1, 4), contexts=(16,), repeats=1, builtin=cfg.engine.builtin)
    assert set(out) == {"1,16", "4,16"} and all(v > 0 for v in out.values())
    assert (steps == [16, 1, 4]) == (forward == "lean") and (steps == []) == (forward == "hf")
    assert engine_key(target, forward).endswith(f"forward={forward}") and TOKENS[0] == 1


def test_measured_batched_steps_and_draft_times_per_batch() -> None:
    """A batched step is priced from its own table (not the single sequence's), a batch size never
    measured is refused; drafters that draft alone cost once per sequence, EAGLE heads in lockstep
    as the forward grows from one sequence's top-k rows to all of theirs."""
    m = Measured(forward={"1,128": 0.010, "4,128": 0.012, "8,128": 0.016},
                 batched={2: {"1,128": 0.013, "4,128": 0.030}},
                 draft={"ngram d3 k1 b4": 0.001, "eagle d3 k4 b8": 0.004})
    assert m.verify_s(1, 2, 128) == pytest.approx(0.013)
    assert m.verify_s(4, 2, 128) == pytest.approx(0.030)
    assert m.verify_s(4, 1, 128) == pytest.approx(0.012)
    with pytest.raises(UserError, match="concurrency 4: .* batched steps of 1, 2 sequences only"):
        m.verify_s(1, 4, 128)
    ngram = SpecConfig(method="ngram", depth=3, budget=4)
    eagle = SpecConfig(method="eagle", depth=3, topk=4, budget=8)
    assert m.draft_s(ngram, 2, 128) == pytest.approx(0.002)
    assert m.draft_s(eagle, 2, 128) == pytest.approx(0.004 * 0.016 / 0.012)  # 4 rows alone, 8 rows together
    assert m.draft_s(eagle, 1, 128) == pytest.approx(0.004)


def test_measured_cost_adds_a_missing_batch_to_the_cached_table(tmp_path, monkeypatch) -> None:
    import engine.measure.microbench as mb

    calls = []

    def fake(target, builtin=None, cache_dir=None, batch=1):
        calls.append(batch)
        return {"1,128": 0.01 * batch, "2,128": 0.02 * batch}

    monkeypatch.setattr(mb, "measure_forward", fake)
    a = measured_cost(None, "tiny|fp32", tmp_path)
    b = measured_cost(None, "tiny|fp32", tmp_path, batches=(1, 2))
    c = measured_cost(None, "tiny|fp32", tmp_path, batches=(2,))
    assert calls == [1, 2]  # batch 1 once, batch 2 once: the second and third calls read the cache
    assert a.batched == {} and b.batched == c.batched == {2: {"1,128": 0.02, "2,128": 0.04}}
    assert b.forward == a.forward and c.verify_s(2, 2, 128) == pytest.approx(0.04)


def test_the_microbenchmark_times_a_batched_step_of_the_lean_forward(monkeypatch) -> None:
    """batch=2 times one step_batch of two sequences (each its own prompt in a slot of one pool);
    the hf forward, which decodes one request at a time, is refused in one line."""
    import engine.models.forward as L
    from engine.models.target import load_target
    from engine.measure.microbench import measure_forward

    cfg = load_config(["model=tiny-random", "engine.builtin.threads=1"])
    target = load_target(cfg.model, cfg.engine.builtin, cfg.cache_dir, cfg.seed)
    batches = []
    real = L.LeanForward.step_batch
    monkeypatch.setattr(L.LeanForward, "step_batch", lambda self, caches, tokens, *a, **k:
                        batches.append([len(t) for t in tokens]) or real(self, caches, tokens, *a, **k))
    out = measure_forward(target, tokens=(1, 4), contexts=(16,), repeats=1, builtin=cfg.engine.builtin, batch=2)
    assert set(out) == {"1,16", "4,16"} and all(v > 0 for v in out.values())
    assert batches == [[1, 1], [4, 4]]
    hf = cfg.engine.builtin.model_copy(update={"forward": "hf"})
    with pytest.raises(UserError, match="concurrency 2: only engine.builtin.forward=lean"):
        measure_forward(target, tokens=(1,), contexts=(16,), repeats=1, builtin=hf, batch=2)
