"""Automatic prefix caching (engine/decode/prefix.py) on the tiny random Llama: a prompt that starts
like an earlier one runs only its tail, and its greedy output is token-identical to the same prompt
decoded from scratch, for drafters that read only tokens and for those fed every prompt feature
(EAGLE, EAGLE-3); matches are exact-token, longest first, bounded, and keyed by the features kept."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.decode.batch import BatchEngine, schedule_of
from engine.decode.loop import Engine
from engine.decode.prefix import MIN_REUSE, PrefixCache
from tuner.schema.config import SpecConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = ("You are a careful assistant. Answer in one short paragraph, in plain words, and say what you "
        "assumed. Question: ")
QUESTIONS = ["what is a hash map?", "why is the sky blue?", "what is a hash map?", "how do tides work?"]
SPECS = [SpecConfig(method="off"),
         SpecConfig(method="ngram", depth=3, topk=1, budget=4, ngram_min=1, ngram_max=3),
         SpecConfig(method="eagle", depth=3, topk=3, budget=8),
         SpecConfig(method="eagle3", depth=2, topk=2, budget=5)]


@pytest.fixture
def prompts(engine: Engine) -> list[list[int]]:
    return [engine.encode_prompt(BASE + q, False) for q in QUESTIONS]


def _fed(monkeypatch, spec: SpecConfig) -> list[torch.Tensor]:
    """Every feature batch the spec's drafter class is fed (hidden states, with EAGLE-3's aux beside)."""
    from engine.drafters import eagle, eagle3

    cls = {"eagle": eagle.EagleDrafter, "eagle3": eagle3.Eagle3Drafter}[spec.method]
    fed: list[torch.Tensor] = []
    real = cls.observe

    def spy(self, features, *aux):
        fed.append(torch.cat([features, *[a for a in aux if a is not None]], -1).clone())
        return real(self, features, *aux)

    monkeypatch.setattr(cls, "observe", spy)
    return fed


def _prefill_rows(engine: Engine, run) -> list[int]:
    """Rows of every prompt forward the scheduler ran (a spy on step_batch)."""
    rows: list[int] = []
    real = engine.lean.step_batch

    def spy(caches, tokens, depths, ancestors, last_only, *a, **k):
        rows.extend(len(t) for t, last in zip(tokens, last_only) if last and len(t) > 1)
        return real(caches, tokens, depths, ancestors, last_only, *a, **k)

    engine.lean.step_batch = spy
    try:
        run()
    finally:
        del engine.lean.step_batch
    return rows


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_a_reused_prefix_decodes_as_from_scratch(engine: Engine, prompts, spec: SpecConfig, monkeypatch) -> None:
    params = SamplingParams(max_new_tokens=16)
    heads = spec.method in ("eagle", "eagle3")
    fed = _fed(monkeypatch, spec) if heads else []
    engine.set_spec(spec)
    ref = [engine.generate(p, params).tokens for p in prompts]  # no prefix cache on this path
    prompt_feats = [f for f in fed if f.shape[0] > 8]  # the prefill: one row per prompt position (a step commits at most depth + 1)
    fed.clear()
    saved, engine.prefix_cache = engine.prefix_cache, PrefixCache(4096)
    try:
        be = BatchEngine(engine, max_batch=2, schedule=schedule_of(spec, 2))
        out: list = []
        rows = _prefill_rows(engine, lambda: out.extend(be.closed_loop(prompts, params, concurrency=2)))
        pc = engine.prefix_cache
    finally:
        engine.prefix_cache = saved
    assert [r.error for r in out] == [None] * len(prompts)
    assert [r.result.tokens for r in out] == ref
    if heads:  # a head drafts from every prompt position's features, the reused ones included
        got = [f for f in fed if f.shape[0] > 8]
        assert len(got) == len(prompts) and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, prompt_feats))
    shared = min(len(p) for p in prompts) - 8  # the common instruction is most of each prompt
    # the first two run whole (nothing cached yet); the repeated prompt runs one token, the last its question
    assert rows[:2] == [len(prompts[0]), len(prompts[1])]
    assert len(rows) == 3 and rows[2] < len(prompts[3]) - shared  # the repeat ran one row: not a prompt forward
    assert pc.hits >= (len(prompts[2]) - 1) + shared and pc.queries == sum(len(p) for p in prompts)


def test_lookup_is_the_longest_exact_prefix_and_never_the_whole_prompt(engine: Engine, prompts) -> None:
    pc = PrefixCache(4096)
    cache = engine.lean.new_cache(256)
    with torch.inference_mode():
        engine.lean.step(cache, prompts[0], None, None, True)
    h = torch.randn(len(prompts[0]), 8)
    pc.store(prompts[0], cache, h, None)
    n, e = pc.lookup(prompts[0])
    assert n == len(prompts[0]) - 1 and e is not None and torch.equal(e.hidden, h)  # the last token still runs
    n, _ = pc.lookup(prompts[1])
    common = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    assert n == common  # exactly the shared tokens, not one more
    assert pc.lookup(prompts[0][:MIN_REUSE - 1] + [1, 2, 3]) == (0, None)  # too short to be worth a copy
    assert pc.lookup(prompts[0], aux_layers=(1, 2)) == (0, None)  # an entry without EAGLE-3's features
    other = engine.lean.new_cache(256)
    pc.restore(e, 20, other)
    assert other.length == 20 and torch.equal(other.k[:, :, :20], cache.k[:, :, :20])


def test_least_recently_used_entries_go_past_the_bound(engine: Engine, prompts) -> None:
    n0 = len(prompts[0])
    pc = PrefixCache(max_tokens=2 * n0 + 1)
    cache = engine.lean.new_cache(256)
    cache.length = 200  # stored positions need only be committed here
    variants = [[7 + i] + prompts[0][1:] for i in range(3)]  # no common prefix between them
    for v in variants[:2]:
        pc.store(v, cache, torch.zeros(n0, 8), None)
    pc.lookup(variants[0])  # the first is used again: the second is now the oldest
    pc.store(variants[2], cache, torch.zeros(n0, 8), None)
    assert pc.held <= pc.max_tokens and [e.ids[0] for e in pc.entries.values()] == [7, 9]
    pc.store(variants[0][:MIN_REUSE + 2], cache, torch.zeros(n0, 8), None)  # covered by a longer entry
    assert len(pc.entries) == 2


def test_a_long_prompt_decodes_alike_from_scratch_and_from_the_cache(engine: Engine, monkeypatch) -> None:
    """A prompt of more rows than one native call takes (decode_step.MAX_ROWS): its first pass runs
    it whole, the second copies all but its last token from the prefix cache and runs that token
    alone; the first token's logits are bit-identical and so is the output. Before, the whole
    prompt took the torch path (another summation order than the lone row's), so a near-tie at bf16
    made a prompt's first pass differ from every later one (docs/results.md, issue 40)."""
    import random

    from engine.decode.loop import Decoding
    from engine.models import decode_step

    rng = random.Random(2)
    prompt = [rng.randrange(49152) for _ in range(decode_step.MAX_ROWS + 30)]
    first: list[torch.Tensor] = []
    real = Decoding.absorb

    def spy(self, tree, hidden, logits, aux):
        if tree is None:
            first.append(logits[-1].clone())
        return real(self, tree, hidden, logits, aux)

    monkeypatch.setattr(Decoding, "absorb", spy)
    monkeypatch.setattr(engine, "prefix_cache", PrefixCache(4096))
    engine.set_spec(SpecConfig(method="off"))
    params = SamplingParams(max_new_tokens=8)
    outs = []
    for _ in range(2):
        rows = _prefill_rows(engine, lambda: outs.append(engine.batcher().closed_loop([prompt], params, concurrency=1)[0]))
        assert rows == ([len(prompt)] if len(outs) == 1 else [])  # the second pass: one row, no prompt forward
    assert engine.prefix_cache.hits == len(prompt) - 1
    assert torch.equal(first[0], first[1])
    assert outs[0].result.tokens == outs[1].result.tokens and len(outs[0].result.tokens) == 8
