"""Training-free tree drafters (issue 23): n-gram trie trees (SGLang NGRAM), SuffixDecoding and
Token Recycling. Greedy output identical to autoregressive decoding, the acceptance profile replays
each exactly (its trees and tau equal the live engine's), the suffix cache's snapshot/restore, and
the drafters' trees on hand-made contexts."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.decode.loop import Engine
from engine.drafters import make_drafter
from engine.drafters.base import Drafter
from engine.drafters.ngram import NgramTrieDrafter
from engine.drafters.recycle import RecycleDrafter, template
from engine.drafters.suffix import SuffixCache, SuffixDrafter, clear_caches, restore_caches, snapshot_caches, suffix_cache
from engine.drafters.trie import CountTrie
from engine.measure.profile import profile_points, reference_pass
from engine.trees.tree import Tree
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig

PROMPTS = ["def fib(n):", "Write a haiku about the sea.", "a b c d a b c d a b c d a b"]
N_NEW = 24
GREEDY = SamplingParams(max_new_tokens=N_NEW)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recorder(Drafter):
    """Wraps a drafter as it is (the profile hands it logits itself) and records every tree."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner.spec)
        self.inner, self.trees = inner, []
        self.aux_layers, self.wants_logits = inner.aux_layers, inner.wants_logits

    def reset(self, prompt_ids):
        self.inner.reset(prompt_ids)

    def observe(self, features, aux=None):
        self.inner.observe(features) if aux is None else self.inner.observe(features, aux)

    def observe_logits(self, tokens, logits):
        self.inner.observe_logits(tokens, logits)

    def draft(self, ids, params, generator=None) -> Tree:
        tree = self.inner.draft(ids, params, generator)
        self.trees.append((len(ids), tuple(tree.tokens), tuple(tree.parents)))
        return tree


SPECS = [
    SpecConfig(method="ngram", depth=4, topk=2, budget=8, ngram_min=1),
    SpecConfig(method="ngram", depth=3, topk=3, budget=7, ngram_min=1, ngram_max=2, ngram_match="prob"),
    SpecConfig(method="suffix", depth=4, topk=1, budget=5, suffix_min_prob=0.0, suffix_spec_factor=2.0),
    SpecConfig(method="suffix", depth=4, topk=3, budget=9, suffix_tree_depth=12),
    SpecConfig(method="recycle", depth=3, topk=2, budget=7),
    SpecConfig(method="recycle", depth=2, topk=1, budget=3),
]


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    """The prompts, then each with its own greedy continuation and itself again appended: a random
    target never repeats itself, so these give the lookups something to match."""
    engine.set_spec(SpecConfig(method="off"))
    plain = [engine.encode_prompt(p, True) for p in PROMPTS]
    return plain + [p + engine.generate(p, GREEDY).tokens + p for p in plain]


@pytest.fixture(scope="module")
def reference(engine: Engine, prompts) -> list[list[int]]:
    engine.set_spec(SpecConfig(method="off"))
    return [engine.generate(p, GREEDY).tokens for p in prompts]


def _hooked(engine: Engine, spec: SpecConfig) -> "Recorder":
    """The spec's drafter, fed by the engine itself (observe_logits included), its trees recorded."""
    return Recorder(make_drafter(spec, engine.target, engine.seed))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_greedy_identical_to_autoregressive(engine: Engine, prompts, reference, spec: SpecConfig) -> None:
    clear_caches(engine.target)
    drafter = _hooked(engine, spec)
    engine.set_drafter(drafter, spec)
    drafted = 0
    for p, ref in zip(prompts * 2, reference * 2):  # twice: the second pass meets the global caches
        res = engine.generate(p, GREEDY)
        assert res.tokens == ref
        st = res.stats
        assert st.accepted_tokens <= st.drafted_tokens and sum(st.accepted_per_pos) == st.accepted_tokens
        drafted += st.drafted_tokens
    assert drafted > 0


def test_recycle_learns_from_the_verify_logits(engine: Engine, prompts, reference) -> None:
    """The decode loop hands the drafter every committed position's logits (the prompt's last one,
    then each accepted path): its successor table fills, it drafts, and the output stays AR's."""
    spec = SpecConfig(method="recycle", depth=3, topk=2, budget=7)
    engine.set_spec(spec)
    first = engine.generate(prompts[0], GREEDY)
    assert first.tokens == reference[0]
    assert engine.drafter.updates == first.stats.target_forwards  # one update per forward's committed rows
    again = engine.generate(prompts[0], GREEDY)  # the table outlives a request: it now knows the successors
    assert again.tokens == reference[0] and again.stats.accepted_tokens > 0


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_profile_replays_the_live_engine_exactly(engine: Engine, prompts, spec: SpecConfig) -> None:
    refs = [reference_pass(engine.target, p, GREEDY, engine.eos, engine.max_context) for p in prompts]
    clear_caches(engine.target)
    live = _hooked(engine, spec)
    engine.set_drafter(live, spec)
    new = fwd = 0
    for p in prompts:
        st = engine.generate(p, GREEDY).stats
        new, fwd = new + st.new_tokens, fwd + st.target_forwards
    clear_caches(engine.target)
    replayed: list[Recorder] = []

    def factory(s):  # the profile's own observe_logits feed, not the test's
        replayed.append(Recorder(make_drafter(s, engine.target, engine.seed)))
        return replayed[-1]

    (res,) = profile_points(engine.target, refs, [spec], GREEDY, engine.max_context, drafter_factory=factory)
    assert replayed[0].trees == live.trees
    assert res.tau == new / fwd


def test_profile_calls_observe_logits_itself(engine: Engine, prompts) -> None:
    refs = [reference_pass(engine.target, p, GREEDY, engine.eos, engine.max_context) for p in prompts[2:]]
    spec = SpecConfig(method="recycle", depth=2, topk=2, budget=5)
    drafters: list[RecycleDrafter] = []

    def factory(s):
        drafters.append(make_drafter(s, engine.target))
        return drafters[-1]

    profile_points(engine.target, refs, [spec], GREEDY, engine.max_context, drafter_factory=factory)
    assert drafters[0].updates > 1 and int((drafters[0].table >= 0).any(-1).sum()) > 1


def test_suffix_cache_snapshot_and_restore_replays_identically(engine: Engine, prompts) -> None:
    spec = SpecConfig(method="suffix", depth=4, topk=2, budget=7)
    clear_caches(engine.target)
    engine.set_spec(spec)
    engine.generate(prompts[0], GREEDY)  # the cache now holds one response
    state = snapshot_caches(engine.target)
    assert len(state[spec.suffix_tree_depth]) == 1

    def run() -> list:
        restore_caches(engine.target, state)
        d = _hooked(engine, spec)
        engine.set_drafter(d, spec)
        for p in prompts:
            engine.generate(p, GREEDY)
        return d.trees

    first = run()
    assert len(suffix_cache(engine.target, spec.suffix_tree_depth)) == 1 + len(prompts)
    assert run() == first  # the same starting state: the same drafts
    restore_caches(engine.target, {})
    assert len(suffix_cache(engine.target, spec.suffix_tree_depth)) == 0


# ---- the structures on hand-made contexts ------------------------------------------------------

def test_count_trie_counts_match_and_remove() -> None:
    t = CountTrie(3)
    t.extend([], [1, 2, 3, 1, 2, 4])
    node, n = t.match([9, 1, 2], 1, 2)
    assert n == 2 and {k: c.count for k, c in node.children.items()} == {3: 1, 4: 1}
    t.remove([1, 2, 3, 1, 2, 4])
    assert t.root.children == {}
    assert t.match([1, 2], 1, 2) == (None, 0)


def test_ngram_trie_bfs_and_prob() -> None:
    ctx = [5, 1, 2, 7, 1, 2, 7, 1, 2, 8, 1, 2]
    bfs = NgramTrieDrafter(SpecConfig(method="ngram", depth=2, topk=2, budget=5, ngram_min=2, ngram_max=2))
    bfs.reset(ctx)
    tree = bfs.draft(ctx, GREEDY)
    # after "1 2": 7 twice, 8 once (most frequent first); then the continuations of each
    assert tree.tokens[:3] == [2, 7, 8] and tree.parents[:3] == [-1, 0, 0] and tree.size == 5
    prob = NgramTrieDrafter(SpecConfig(method="ngram", depth=3, topk=2, budget=4, ngram_min=2, ngram_max=2,
                                       ngram_match="prob"))
    prob.reset(ctx)
    tree = prob.draft(ctx, GREEDY)
    assert tree.tokens == [2, 7, 1, 2]  # the 2/3 branch, deepened before the 1/3 one


def test_suffix_factor_min_prob_and_global_tree() -> None:
    cache = SuffixCache(8)
    spec = SpecConfig(method="suffix", depth=6, topk=2, budget=7, suffix_tree_depth=8, suffix_spec_factor=1.0,
                      suffix_min_prob=0.3)
    old = SuffixDrafter(spec, cache)
    old.reset([100])
    old.draft([100, 1, 2, 3, 4, 5, 6], GREEDY)  # response 1..6 enters the global tree
    new = SuffixDrafter(spec, cache)
    new.reset([200, 1, 2])
    tree = new.draft([200, 1, 2], GREEDY)
    assert tree.tokens == [2, 3, 4]  # match "1 2" (2 tokens): at most 2 speculated, from the global tree
    strict = SuffixDrafter(spec.model_copy(update={"suffix_max_requests": 0}), SuffixCache(8))
    strict.reset([200, 1, 2])
    assert strict.draft([200, 1, 2], GREEDY).size == 1  # no global tree: nothing to match
    # min prob: after "1" the local tree saw 2 once and 9 three times: 2 (p=0.25) is dropped
    local = SuffixDrafter(spec.model_copy(update={"suffix_max_requests": 0, "suffix_spec_factor": 4.0}), SuffixCache(8))
    ctx = [1, 9, 1, 9, 1, 9, 1, 2, 0, 1]
    local.reset(ctx)
    tree = local.draft(ctx, GREEDY)
    assert 2 not in tree.tokens[1:] and tree.tokens[1] == 9


def test_suffix_cache_is_fifo_bounded() -> None:
    cache = SuffixCache(4)
    for i in range(5):
        e = cache.start(max_requests=3)
        cache.append(e, [i, i + 1])
    assert len(cache) == 3 and cache.snapshot() == ((2, 3), (3, 4), (4, 5))
    assert 0 not in cache.trie.root.children and 1 not in cache.trie.root.children


def test_recycle_template_and_table() -> None:
    tpl = template(depth=2, topk=2, budget=5)
    assert tpl == [(0, 0), (0, 1), (1, 0), (1, 1)]  # ranks 0 and 1 at the root, then under the first
    d = RecycleDrafter(SpecConfig(method="recycle", depth=2, topk=2, budget=5), vocab_size=10)
    assert d.draft([3], GREEDY).size == 1  # nothing known yet
    logits = torch.full((2, 10), -5.0)
    logits[0, 4], logits[0, 6] = 3.0, 2.0  # after 3: 4 then 6
    logits[1, 7], logits[1, 8] = 3.0, 1.0  # after 4: 7 then 8
    d.observe_logits([3, 4], logits)
    tree = d.draft([1, 3], GREEDY)
    assert tree.tokens == [3, 4, 6, 7, 8] and tree.parents == [-1, 0, 0, 1, 1]
