"""Continuous batching (engine/decode/batch.py) on the tiny random Llama: greedy output at any batch
size token-identical to batch 1 for every drafter, with mixed prompt lengths and requests joining
mid-flight; EAGLE heads draft in lockstep, one head forward per draft step; a request's output
never depends on its neighbours; seeded sampling identical to batch 1; bands switch the spec by
batch size; max_batch and the KV budget hold; a cancelled or failing request leaves the others alone."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.decode.batch import BatchEngine, check_schedule, schedule_of, spec_for
from engine.decode.loop import Engine
from engine.drafters.lean_head import LeanHead
from tuner.study.measurer import open_engine
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig, UserError

PROMPTS = ["def fib(n):", "Write a haiku about the sea and the sky, with a word about the wind.",
           "a b c d a b c d a b c d a b", "x", "for i in range(10): print(i) for i in range(10):"]
N_NEW = 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    return [engine.encode_prompt(p, False) for p in PROMPTS]


SPECS = [SpecConfig(method="off"),
         SpecConfig(method="ngram", depth=3, topk=1, budget=4, ngram_min=1, ngram_max=3),
         SpecConfig(method="eagle", depth=3, topk=1, budget=4),
         SpecConfig(method="eagle", depth=3, topk=3, budget=8)]


def _alone(engine: Engine, spec: SpecConfig, prompts, params: SamplingParams) -> list[list[int]]:
    engine.set_spec(spec)
    return [engine.generate(p, params).tokens for p in prompts]


@pytest.mark.parametrize("prefill", ["mixed", "separate"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_greedy_in_a_batch_equals_batch_1(engine: Engine, prompts, spec: SpecConfig, prefill: str) -> None:
    params = SamplingParams(max_new_tokens=N_NEW)
    ref = _alone(engine, spec, prompts, params)
    be = BatchEngine(engine, max_batch=3, schedule=schedule_of(spec, 3), prefill=prefill)
    seen = []
    real = engine.lean.step_batch

    def spy(caches, *a, **k):
        seen.append(len(caches))
        return real(caches, *a, **k)

    engine.lean.step_batch = spy
    try:
        reqs = be.closed_loop(prompts, params, concurrency=3)  # 5 prompts, 3 clients: two join mid-flight
    finally:
        del engine.lean.step_batch
    assert [r.error for r in reqs] == [None] * len(prompts)
    assert [r.result.tokens for r in reqs] == ref
    assert not be.pool.views  # every finished request gave its slot back
    assert max(seen) == 3 and 1 < len(set(seen))  # really batched, and the batch size changed
    if spec.method != "off":
        assert sum(r.result.stats.drafted_tokens for r in reqs) > 0


HEAD_SPECS = [SpecConfig(method="eagle", depth=3, topk=2, budget=6),
              SpecConfig(method="eagle3", depth=3, topk=2, budget=6)]


@pytest.mark.parametrize("spec", HEAD_SPECS, ids=lambda s: s.key())
def test_heads_draft_in_lockstep_and_greedy_equals_batch_1(engine: Engine, prompts, spec: SpecConfig,
                                                            monkeypatch) -> None:
    """Requests of one EAGLE head draft together (engine.drafters.lockstep): one head forward per
    draft step whatever the batch size, and the output at batch 4 is that of batch 1."""
    params = SamplingParams(max_new_tokens=N_NEW)
    ref = _alone(engine, spec, prompts, params)
    be = BatchEngine(engine, max_batch=4, schedule=schedule_of(spec, 4))
    drafts, per_step = [], []  # drafts in each head forward; head forwards before each target forward
    real_head = LeanHead.step_batch
    monkeypatch.setattr(LeanHead, "step_batch", lambda self, rows: drafts.append(len(rows)) or real_head(self, rows))
    real = engine.lean.step_batch

    def spy(caches, *a, **k):
        per_step.append(len(drafts) - sum(per_step))
        return real(caches, *a, **k)

    engine.lean.step_batch = spy
    try:
        reqs = be.closed_loop(prompts, params, concurrency=4)
    finally:
        del engine.lean.step_batch
    assert [r.result.tokens for r in reqs] == ref
    assert max(per_step) == spec.depth  # a catch-up and depth-1 levels, never one set per request
    assert max(drafts) == 4  # four requests' drafts in one head forward


def test_a_requests_output_does_not_depend_on_its_neighbours(engine: Engine, prompts) -> None:
    engine.set_spec(SpecConfig(method="off"))
    params = SamplingParams(max_new_tokens=N_NEW)
    outs = []
    for neighbours in ([prompts[1], prompts[2]], [prompts[3], prompts[4], prompts[2]]):
        be = BatchEngine(engine, max_batch=4)
        reqs = be.closed_loop([prompts[0], *neighbours], params, concurrency=4)
        outs.append(reqs[0].result.tokens)
    assert outs[0] == outs[1] == engine.generate(prompts[0], params).tokens


def test_seeded_sampling_in_a_batch_equals_batch_1(engine: Engine, prompts) -> None:
    """The same seed draws the same tokens alone and in a batch: each request keeps its own
    generator, and verification runs on its own rows only."""
    spec = SpecConfig(method="ngram", depth=3, topk=1, budget=4, ngram_min=1, ngram_max=3)
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0.8, top_k=20, seed=11)
    ref = _alone(engine, spec, prompts, params)
    be = BatchEngine(engine, max_batch=5, schedule=schedule_of(spec, 5))
    assert [r.result.tokens for r in be.closed_loop(prompts, params, concurrency=5)] == ref


def test_bands_switch_the_spec_by_batch_size(engine: Engine, prompts) -> None:
    """K bands (vLLM's num_speculative_tokens_per_batch_size): drafting at batch 1, off above; the
    output stays that of AR and drafting happens only while one request runs."""
    spec = SpecConfig(method="eagle", depth=3, topk=1, budget=4, k_per_batch_size=[(1, 1, 3), (2, 4, 0)])
    bands = schedule_of(spec, 4)
    assert [(lo, hi, s.key()) for lo, hi, s in bands] == [(1, 1, "eagle d3 k1 b4"), (2, 4, "off")]
    assert spec_for(bands, 1).method == "eagle" and spec_for(bands, 3).method == "off"
    params = SamplingParams(max_new_tokens=N_NEW)
    three = [prompts[0], prompts[1], prompts[4]]  # the first two finish together, the third then runs alone
    ref = _alone(engine, SpecConfig(method="off"), three, params)
    be = BatchEngine(engine, max_batch=4, schedule=bands)
    steps = []
    real = engine.lean.step_batch
    engine.lean.step_batch = lambda caches, toks, *a, **k: steps.append((len(caches), sum(map(len, toks)))) or real(caches, toks, *a, **k)
    try:
        reqs = be.closed_loop(three, params, concurrency=2)
    finally:
        del engine.lean.step_batch
    assert [r.result.tokens for r in reqs] == ref
    decode = steps[1:]  # the first step runs both prompts
    assert all(rows == 2 for n, rows in decode if n == 2)  # two requests: off, one row each
    assert any(rows == 4 for n, rows in decode if n == 1)  # one left: it drafts 3 tokens again


def test_max_batch_and_the_kv_budget_hold(engine: Engine, prompts) -> None:
    engine.set_spec(SpecConfig(method="off"))
    params = SamplingParams(max_new_tokens=8)
    be = BatchEngine(engine, max_batch=2)
    for p in prompts:
        be.submit(p, params)
    most = 0
    while be.waiting or be.active:
        be.step()
        most = max(most, be.running)
    assert most == 2
    need = max(len(p) for p in prompts) + 8 + 1
    tight = BatchEngine(engine, max_batch=8, kv_tokens=need + 2)  # room for one request at a time
    for p in prompts:
        tight.submit(p, params)
    most = 0
    while tight.waiting or tight.active:
        tight.step()
        most = max(most, tight.running)
    assert most == 1  # the rest waited; none was truncated:
    with pytest.raises(UserError, match="kv_tokens"):
        BatchEngine(engine, kv_tokens=64).submit(list(range(60)), SamplingParams(max_new_tokens=32))


def test_cancel_frees_the_slot_and_a_failing_request_leaves_the_others(engine: Engine, prompts) -> None:
    engine.set_spec(SpecConfig(method="off"))
    params = SamplingParams(max_new_tokens=N_NEW)
    be = BatchEngine(engine, max_batch=2)
    a, b, c = (be.submit(p, params) for p in prompts[:3])
    be.step()
    assert be.running == 2 and be.queued == 1
    be.cancel(a)
    be.step()
    assert a.error == "cancelled" and c.state is not None  # c took a's slot at once
    assert c.cache.slot == 0 and a.cache is None and sorted(be.pool.views) == [0, 1]
    # a drafter that crashes fails its own request only
    spec = SpecConfig(method="ngram", depth=3, topk=1, budget=4)
    be2 = BatchEngine(engine, max_batch=3, schedule=schedule_of(spec, 3))
    ok, bad = be2.submit(prompts[0], params), be2.submit(prompts[1], params)
    be2.step()  # prefill; the drafters are made at the first decode step
    be2.step()
    bad.drafters[spec.key()].draft = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    while be2.waiting or be2.active:
        be2.step()
    assert bad.error == "RuntimeError: boom" and ok.result is not None and not be2.pool.views
    assert ok.result.tokens == _alone(engine, SpecConfig(method="off"), prompts[:1], params)[0]


@pytest.mark.parametrize("bands,msg", [
    ([(1, 2, SpecConfig()), (4, 8, SpecConfig())], "contiguous"),
    ([(1, 4, SpecConfig()), (3, 8, SpecConfig())], "contiguous"),
    ([(1, 4, SpecConfig())], "max_batch=8"),
])
def test_bad_schedules_are_one_line(bands, msg: str) -> None:
    with pytest.raises(UserError, match=msg):
        check_schedule(bands, 8)


def test_bad_batch_settings_are_one_line(engine: Engine) -> None:
    with pytest.raises(UserError, match="max_batch=0"):
        BatchEngine(engine, max_batch=0)
    with pytest.raises(UserError, match="prefill=chunky"):
        BatchEngine(engine, prefill="chunky")
    hf = open_engine(load_config(["model=tiny-random", "spec.method=off", "engine.builtin.forward=hf"]))
    with pytest.raises(UserError, match="forward=lean"):
        BatchEngine(hf)


@pytest.mark.parametrize("layout", ["own caches", "pool slots", "pool slots, sdpa"])
def test_step_batch_rows_equal_separate_steps(engine: Engine, prompts, layout: str, monkeypatch) -> None:
    """One batched forward of a long prompt, a short prompt, a one-row decode, a chain and a branching
    tree gives each sequence the logits its own step gives (fp32: equal to rounding), whether each
    has its own cache or all are slots of one pool (one slot left empty between them, and the
    pool's group limited to 4 rows so that the long prompt attends alone). The pool's short
    sequences attend through the CPU decode attention kernel, or (where it is not used: CUDA, no
    compiler) in pooled SDPA calls. This is the torch path (native_step=false, or a step of more
    rows than the native step takes); tests/engine/test_decode_step.py checks the native one."""
    from engine.models import attention, batchplan, kvpool

    lean = engine.lean
    monkeypatch.setattr(lean, "native", None)
    monkeypatch.setattr(batchplan, "POOL_ROWS", 4)
    kernel = layout == "pool slots"
    if kernel and attention.library() is None:
        pytest.skip(f"no C++ compiler: {attention.error()}")
    if layout == "pool slots, sdpa":
        monkeypatch.setattr(attention, "usable", lambda *a: False)
    assert len(prompts[1]) > 4
    toks = [prompts[1], prompts[3][:2], [8], [5, 6, 7], [9, 10, 11, 12]]
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    deps = [None, None, None, None, [0, 1, 1, 2]]
    ancs = [None, None, None, None, anc]
    pre = [None, None, prompts[4], prompts[0], prompts[2]]
    pool = kvpool.KVPool(lean.model, 7, 64)
    one, many = [], []
    for c_list in (one, many):
        for i, pfx in enumerate(pre):
            c = lean.new_cache(200)
            if c_list is many and layout != "own caches":
                c = pool.acquire(200)
                if i == 2:
                    c = pool.acquire(200)  # slot 2 stays empty: the pooled call spans a hole
            if pfx:
                lean.step(c, pfx)
            c_list.append(c)
    planned = []
    real = batchplan.batch_plan
    monkeypatch.setattr(batchplan, "batch_plan", lambda *a: planned.append(real(*a)) or planned[-1])
    alone = [lean.step(c, t, d, a) for c, t, d, a in zip(one, toks, deps, ancs)]
    batched = lean.step_batch(many, toks, deps, ancs, [False] * 5)
    for (h1, l1, _), (h2, l2, _), c1, c2 in zip(alone, batched, one, many):
        torch.testing.assert_close(l2, l1, rtol=1e-4, atol=1e-4)
        assert c1.length == c2.length
    plan = planned[0]
    if kernel:  # the four short sequences attended in one kernel call, each over its own length
        assert plan.pool is pool and len(plan.alone) == 1 and plan.alone[0].cache is many[0] and plan.pooled == []
        meta = plan.decode.meta.tolist()
        assert sorted(m[0] for m in meta) == [1, 3, 4, 5]
        assert {(m[2], m[3]) for m in meta} == {(len(t), c.length) for t, c in zip(toks[1:], many[1:])}
        assert [m[4] >= 0 for m in sorted(meta)] == [False, False, False, True]  # only the tree brings a matrix
    elif layout == "pool slots, sdpa":  # the four short sequences attended in pooled calls, the long prompt alone
        assert plan.pool is pool and len(plan.alone) == 1 and plan.alone[0].cache is many[0] and plan.decode is None
        calls = [(pa.lo, pa.hi, pa.nmax) for pa in plan.pooled]
        assert calls[0][0] == 1 and calls[-1][1] == 6 and all(hi <= lo2 for (_, hi, _), (lo2, _, _) in zip(calls, calls[1:]))
        assert 2 not in {slot for lo, hi, _ in calls for slot in range(lo, hi)}  # no call spans the free slot
    else:
        assert plan.pool is None and plan.pooled == [] and len(plan.alone) == 5


@pytest.mark.parametrize("hole", [False, True])
def test_one_row_decodes_attend_as_views_in_slot_order(engine: Engine, prompts, hole: bool, monkeypatch) -> None:
    """In pooled SDPA calls (the path without the CPU kernel), decode rows of sequences in consecutive
    pool slots attend with no gather ("direct"), even when the caller lists them out of slot order; a
    free slot between them takes the gathering path. Either way each sequence gets the logits of its
    own step."""
    from engine.models import attention, batchplan, kvpool

    monkeypatch.setattr(attention, "usable", lambda *a: False)
    lean = engine.lean
    monkeypatch.setattr(lean, "native", None)  # the torch path's batched attention
    pool = kvpool.KVPool(lean.model, 5, 64)
    caches = [pool.acquire(64) for _ in range(4)]
    if hole:
        pool.release(caches.pop(1))
    own = [lean.new_cache(64) for _ in caches]
    for i, (a, b) in enumerate(zip(caches, own)):
        lean.step(a, prompts[i][:3 + 2 * i])
        lean.step(b, prompts[i][:3 + 2 * i])
    planned = []
    real = batchplan.batch_plan
    monkeypatch.setattr(batchplan, "batch_plan", lambda *a: planned.append(real(*a)) or planned[-1])
    order = [2, 0, 1] if hole else [2, 0, 3, 1]
    batched = lean.step_batch([caches[i] for i in order], [[7 + i] for i in order], [None] * len(order),
                              [None] * len(order), [True] * len(order))
    for i, (_, logits, _) in zip(order, batched):
        torch.testing.assert_close(logits, lean.step(own[i], [7 + i])[1], rtol=1e-4, atol=1e-4)
    assert all(pa.direct for pa in planned[0].pooled)
    assert len(planned[0].pooled) == 1 + hole  # the free slot splits the run


def test_pooled_calls_split_where_padding_would_cost_more_than_a_call() -> None:
    """Runs of consecutive slots; a short sequence beside a long one gets a call of its own, similar
    lengths share one, and no run spans a free slot."""
    from engine.models import batchplan

    class _C:
        def __init__(self, slot: int) -> None:
            self.slot = slot

    def seqs(slots_lengths):
        return [batchplan.BatchRows(_C(s), i, i + 1, torch.tensor([n - 1]), n, None) for i, (s, n) in enumerate(slots_lengths)]

    def runs(slots_lengths):
        return [[s.cache.slot for s in run] for run in batchplan._partition(seqs(slots_lengths))]

    assert runs([(0, 300), (1, 310), (2, 290), (3, 305)]) == [[0, 1, 2, 3]]
    assert runs([(0, 40), (1, 900), (2, 910)]) == [[0], [1, 2]]
    assert runs([(0, 300), (1, 300), (3, 300)]) == [[0, 1], [3]]


def test_the_pool_grows_keeps_its_contents_and_reuses_slots(engine: Engine, prompts) -> None:
    from engine.models.kvpool import KVPool

    lean = engine.lean
    pool = KVPool(lean.model, 2, 8)
    a = pool.acquire(8)
    lean.step(a, prompts[0])
    keys = a.k[:, :, :a.length].clone()
    old = pool.capacity
    b = pool.acquire(old + 100)  # longer than the pool: it grows, a's view follows
    assert b.capacity == a.capacity == pool.capacity >= old + 100 and (a.slot, b.slot) == (0, 1)
    torch.testing.assert_close(a.k[:, :, :a.length], keys, rtol=0, atol=0)
    with pytest.raises(ValueError, match="all 2 slots"):
        pool.acquire(8)
    pool.release(a)
    assert pool.acquire(8).slot == 0
    with pytest.raises(ValueError, match="pool slot holds"):
        b.reserve(pool.capacity + 1)


def test_a_failing_forward_fails_its_requests_and_the_scheduler_goes_on(engine: Engine, prompts) -> None:
    engine.set_spec(SpecConfig(method="off"))
    params = SamplingParams(max_new_tokens=4)
    be = BatchEngine(engine, max_batch=2)
    a, b = be.submit(prompts[0], params), be.submit(prompts[1], params)
    engine.lean.step_batch = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("kernel"))
    try:
        be.step()
    finally:
        del engine.lean.step_batch
    assert a.error == b.error == "RuntimeError: kernel" and be.running == 0
    c = be.submit(prompts[2], params)
    while be.waiting or be.active:
        be.step()
    assert c.result is not None and len(c.result.tokens) == 4
    # a step that raised outside the forward (the server's guard): every active request fails, slots freed
    d, e = be.submit(prompts[0], params), be.submit(prompts[1], params)
    be.step()
    assert be.abort("RuntimeError: step") == [d, e] and d.error == e.error == "RuntimeError: step"
    assert be.running == 0 and not be.pool.views


def test_the_hf_forward_runs_in_the_same_driver_and_is_greedy_identical(prompts) -> None:
    """engine.builtin.forward=hf decodes through this driver too (a batch of one place,
    engine.models.hf_forward): with a drafter that drafts with the target (its logits sharpened so
    that the greedy path survives the budget cut) every step accepts a whole chain (transformers'
    cache kept by a crop) or a whole branching path (kept by index), and the output is its own
    autoregressive output, as it is with n-gram drafts."""
    from engine.drafters.draft_model import DraftModelDrafter

    class Oracle(DraftModelDrafter):
        def _catch_up(self, ids):
            return super()._catch_up(ids) * 100

        def _run(self, *args):
            return super()._run(*args) * 100

    hf = open_engine(load_config(["model=tiny-random", "spec.method=off", "engine.builtin.forward=hf"]))
    assert hf.lean is None
    params = SamplingParams(max_new_tokens=N_NEW)
    ref = [hf.generate(p, params).tokens for p in prompts]
    for topk, budget in ((1, 4), (2, 7)):  # a chain (kept by a crop), a branching tree (kept by index)
        oracle = SpecConfig(method="draft_model", depth=3, topk=topk, budget=budget, draft_model="oracle")
        hf.set_drafter(Oracle(oracle, hf.model), oracle)
        for p, r in zip(prompts, ref):
            res = hf.generate(p, params)
            assert res.tokens == r and res.stats.accepted_tokens == 3 * res.stats.draft_steps
            assert res.stats.draft_steps > 0 or len(r) <= 1
    hf.set_spec(SpecConfig(method="ngram", depth=3, topk=1, budget=4, ngram_min=1, ngram_max=3))
    assert [hf.generate(p, params).tokens for p in prompts] == ref
