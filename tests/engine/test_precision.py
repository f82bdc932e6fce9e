"""engine.builtin.weights (fp32 | bf16 | fp8) end to end on the tiny random Llama: the native step runs
at each format; speculative greedy output (chain and tree, alone and in a batch) equals the engine's
own AR output at the same format token for token (the native step's rows are bit-identical whatever
else a step runs: tests/engine/test_decode_step.py); the rounding is real (each format's greedy output
differs from fp32's on a long run); the near-tie check (tests/helpers.py) refuses a real difference."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.decode.batch import BatchEngine, schedule_of
from engine.models import decode_step
from engine.models.target import hf_checkpoint_dir
from helpers import TIE_MARGIN, assert_same_or_near_tie
from tests.conftest import TINY
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig
from tuner.study.measurer import open_engine

PROMPTS = ["def fib(n):", "a b c d a b c d a b c d a b", "for i in range(10): print(i) for i in range(10):"]
N_NEW = 32
# the drafts: the target's own fp32 checkpoint as a draft model (drafts every step, mostly accepted:
# multi-row verification at every step), in a chain and a tree; n-gram (drafts only on a match)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(decode_step.library() is None, reason=f"no C++ compiler: {decode_step.error()}")]


@pytest.fixture(scope="module", params=["fp32", "bf16", "fp8"])
def at(request):
    """(weights, the engine at those weights, the prompts' ids)."""
    engine = open_engine(load_config([*TINY, f"engine.builtin.weights={request.param}"]))
    assert engine.lean.native is not None and engine.lean.model.weights == request.param
    return request.param, engine, [engine.encode_prompt(p, False) for p in PROMPTS]


def _outputs(engine, spec: SpecConfig, prompts) -> list[list[int]]:
    engine.set_spec(spec)
    return [engine.generate(p, SamplingParams(max_new_tokens=N_NEW)).tokens for p in prompts]


@pytest.mark.parametrize("kind", ["chain", "tree", "ngram", "eagle"])
def test_speculative_greedy_equals_ar_at_the_same_weights(at, kind: str) -> None:
    """A chain and a tree of drafts, alone and 3 in a batch, equal the engine's AR output token for token."""
    weights, engine, prompts = at
    if kind == "eagle" and weights == "fp32":
        pytest.skip("the head at fp32: tests/engine/test_engine_greedy.py; here its bf16 copies beside bf16 / fp8")
    cfg = load_config(TINY)
    own = str(hf_checkpoint_dir(cfg.model, cfg.cache_dir))
    spec = {"chain": SpecConfig(method="draft_model", depth=3, topk=1, budget=4, draft_model=own),
            "tree": SpecConfig(method="draft_model", depth=3, topk=2, budget=6, draft_model=own),
            "ngram": SpecConfig(method="ngram", depth=4, topk=1, budget=5, ngram_min=1, ngram_max=3),
            "eagle": SpecConfig(method="eagle", depth=3, topk=2, budget=5)}[kind]  # a seeded random head
    ar = _outputs(engine, SpecConfig(method="off"), prompts)
    alone = _outputs(engine, spec, prompts)
    be = BatchEngine(engine, max_batch=3, schedule=schedule_of(spec, 3))
    reqs = be.closed_loop(prompts, SamplingParams(max_new_tokens=N_NEW), concurrency=3)
    assert [r.error for r in reqs] == [None] * len(prompts)
    if kind in ("chain", "tree"):  # drafts really were verified and accepted (several rows a step)
        assert sum(r.result.stats.accepted_tokens for r in reqs) > len(prompts) * N_NEW // 4
    for p, a, s, r in zip(prompts, ar, alone, reqs):
        assert len(a) == N_NEW
        assert s == a and r.result.tokens == a


def test_each_format_computes_with_its_own_weights(at) -> None:
    """The rounding is real: the logits of a prompt differ from fp32's by more than summation order
    (so a test at bf16 or fp8 does not silently run fp32 weights), and by less than the format's
    rounding could plausibly move them."""
    weights, engine, prompts = at
    full = open_engine(load_config(TINY))
    with torch.inference_mode():
        got = [e.lean.step(e.lean.new_cache(64), prompts[0], last_only=True)[1][-1] for e in (engine, full)]
    diff = float((got[0] - got[1]).abs().max())
    if weights == "fp32":
        assert diff == 0.0
    else:
        assert 1e-3 < diff < 0.2 * float(got[1].abs().max()), diff


def test_a_real_difference_is_not_a_tie(at) -> None:
    """Negative control of the near-tie check: swap the first AR token for the runner-up of a clear
    lead, or for a token outside the top 2, and the check fails naming the token."""
    weights, engine, prompts = at
    ar = _outputs(engine, SpecConfig(method="off"), prompts[:1])[0]
    with torch.inference_mode():
        _, logits, _ = engine.lean.step(engine.lean.new_cache(64), prompts[0], last_only=True)
    top = torch.topk(logits[-1], 3)
    # the tiny model's logits are peaked: the lead is wider than any rounding tie, so the swap is no tie
    assert float(top.values[0] - top.values[1]) > 2 * TIE_MARGIN[weights], top.values
    for other in top.indices[1:].tolist():
        with pytest.raises(AssertionError, match="differ at token 0"):
            assert_same_or_near_tie(engine, prompts[0], ar, [other] + ar[1:], weights)


def test_the_eagle_head_runs_at_the_served_precision(at) -> None:
    """Beside a bf16 or fp8 target the EAGLE head holds bf16 values (the dtype it is served in: vLLM
    quantizes only the target under fp8), its linears have the few-row kernel's bf16 copies, and its
    draft logits read the target's packed lm_head itself (no second copy) and equal F.linear over its
    values from features rounded to bf16 (every bf16 / fp8 linear's input); beside fp32 the head keeps
    its fp32 values, packed in fp32."""
    weights, engine, prompts = at
    engine.set_spec(SpecConfig(method="eagle", depth=2, topk=1, budget=3))
    drafter = engine.drafter
    params = [p for p in drafter.head.parameters()]
    rounded = all(torch.equal(p, p.bfloat16().float()) for p in params)
    assert rounded == (weights != "fp32")
    lean, fmt = drafter.lean, torch.float32 if weights == "fp32" else torch.bfloat16
    assert lean.weights == ("fp32" if weights == "fp32" else "bf16")
    assert all(w._smallm_packed.dtype == fmt for w in (lean.fc_w, lean.block.wqkv, lean.block.wo, lean.block.w13,
                                                        lean.block.w2))
    assert drafter._lm_rows is engine.lean.model.lm_head and drafter._lm_rows._smallm_packed.dtype == fmt
    feat = torch.randn(3, drafter._lm_rows.shape[1])
    inputs = feat if weights == "fp32" else feat.bfloat16().float()
    with torch.inference_mode():
        torch.testing.assert_close(drafter._logits(feat), torch.nn.functional.linear(inputs, drafter._lm_rows),
                                   rtol=1e-4, atol=1e-4)
