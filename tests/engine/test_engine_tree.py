"""Draft-tree buffers, EAGLE-2 selection, one-forward tree attention and KV pruning on the tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from engine.models.cache import GrowingLayer, commit, new_cache
from engine.drafters.ngram import NgramDrafter
from engine.models.target import random_llama
from engine.trees.tree import Tree, build_dynamic_tree
from engine.trees.verify import argmax_rows, argmax_token
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return random_llama(load_config(["model=tiny-random"]).model).eval()


def _tree() -> Tree:
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    return Tree(tokens=[10, 11, 12, 13, 14, 15, 16], parents=[-1, 0, 0, 1, 1, 2, 3], depths=[0, 1, 1, 2, 2, 2, 3])


def test_tree_buffers() -> None:
    t = _tree()
    anc = t.ancestors()
    for i in range(t.size):
        expect = set()
        j = i
        while j >= 0:
            expect.add(j)
            j = t.parents[j]
        assert set(torch.nonzero(anc[i]).flatten().tolist()) == expect
    mask = t.attention_mask(4)
    assert mask.shape == (1, 1, 7, 11) and mask.dtype == torch.bool
    assert mask[0, 0, :, :4].all() and torch.equal(mask[0, 0, :, 4:], anc)
    assert t.position_ids(4).tolist() == [[4, 5, 5, 6, 6, 6, 7]]
    assert sorted(t.paths()) == [[0, 1, 3, 6], [0, 1, 4], [0, 2, 5]]
    assert not t.is_chain and Tree.chain(1, [2, 3]).is_chain
    assert t.children(1) == {13: 3, 14: 4}


def test_dynamic_tree_selection_is_ancestor_closed_and_budgeted() -> None:
    torch.manual_seed(0)
    vocab = 50
    table = torch.randn(vocab, vocab) * 3
    calls = []

    def expand(nodes, tokens, parents, level):
        calls.append(len(nodes))
        return table[tokens]

    for depth, topk, budget in [(4, 3, 9), (3, 4, 13), (5, 1, 6), (2, 2, 5)]:
        calls.clear()
        tree = build_dynamic_tree(0, table[0], expand, depth, topk, budget)
        assert tree.size == budget
        assert all(tree.parents[i] < i for i in range(1, tree.size))  # topological, ancestor-closed
        assert max(tree.depths) <= depth
        assert calls == [topk] * (depth - 1)  # only the frontier is expanded, once per level
        logp = torch.log_softmax(table, -1)

        def score(i):
            s = 0.0
            while tree.parents[i] >= 0:
                s += float(logp[tree.tokens[tree.parents[i]], tree.tokens[i]])
                i = tree.parents[i]
            return s

        # the root's best child is always kept, and every kept node outscores its dropped siblings' best
        best = int(torch.argmax(table[0]))
        assert tree.children(0).get(best) == 1
        assert all(score(i) <= score(tree.parents[i]) + 1e-6 for i in range(1, tree.size) if tree.parents[i] > 0)


def test_tree_forward_matches_each_path_alone(model: torch.nn.Module) -> None:
    torch.manual_seed(1)
    prefix = torch.randint(0, 49152, (1, 9))
    tree = _tree()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=prefix, cache=cache, use_cache=True)
        out = model(input_ids=torch.tensor([tree.tokens]), position_ids=tree.position_ids(9),
                    attention_mask=tree.attention_mask(9), cache=cache, use_cache=True).logits[0]
        for path in tree.paths():
            seq = torch.cat([prefix, torch.tensor([[tree.tokens[i] for i in path]])], 1)
            ref = model(input_ids=seq).logits[0, 9:]
            assert (out[path] - ref).abs().max() < 1e-4


@pytest.mark.parametrize("make_cache", [lambda c: DynamicCache(config=c), new_cache], ids=["dynamic", "growing"])
def test_continuation_after_pruning_matches_sequential(model: torch.nn.Module, make_cache) -> None:
    """Commit a non-prefix path (index_select), then decode on: same logits as running it in sequence."""
    torch.manual_seed(2)
    prefix = torch.randint(0, 49152, (1, 7))
    tree = _tree()
    path = [0, 2, 5]
    with torch.inference_mode():
        cache = make_cache(model.config)
        model(input_ids=prefix, cache=cache, use_cache=True)
        model(input_ids=torch.tensor([tree.tokens]), position_ids=tree.position_ids(7),
              attention_mask=tree.attention_mask(7), cache=cache, use_cache=True)
        commit(cache, 7, path)
        assert cache.get_seq_length() == 7 + len(path)
        nxt = model(input_ids=torch.tensor([[42, 43]]), cache=cache, use_cache=True).logits[0]
        seq = torch.cat([prefix, torch.tensor([[tree.tokens[i] for i in path] + [42, 43]])], 1)
        ref = model(input_ids=seq).logits[0, -2:]
    assert (nxt - ref).abs().max() < 1e-4
    # a prefix path is a crop
    cache2 = make_cache(model.config)
    with torch.inference_mode():
        model(input_ids=prefix, cache=cache2, use_cache=True)
        model(input_ids=torch.tensor([tree.tokens]), position_ids=tree.position_ids(7),
              attention_mask=tree.attention_mask(7), cache=cache2, use_cache=True)
    commit(cache2, 7, [0, 1, 3])
    assert cache2.get_seq_length() == 10


def test_ngram_lookup() -> None:
    d = NgramDrafter(SpecConfig(method="ngram", depth=3, topk=1, budget=4, ngram_min=2, ngram_max=3))
    ids = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    d.reset(ids)
    # suffix [2, 3, 6, 7] has no earlier 3-gram match; the 2-gram [6, 7] last occurred at 6..7 -> 2, 3, 6
    assert d.lookup(ids) == [2, 3, 6]
    d.reset([])
    assert d.lookup([1, 2, 3, 4]) == []
    d.reset([])
    ids = [1, 2, 3, 9, 9, 1, 2, 3]
    assert d.lookup(ids) == [9, 9, 1]  # 3-gram [1,2,3] matched
    tree = d.draft(ids, None)
    assert tree.tokens == [3, 9, 9, 1] and tree.is_chain


def test_growing_cache_equals_dynamic_cache_across_growth_crops_and_commits(model: torch.nn.Module) -> None:
    """Appends that outgrow the buffer (min capacity 256), crops and tree commits leave a GrowingLayer
    cache holding exactly what transformers' DynamicCache holds after the same steps."""
    torch.manual_seed(3)
    grow, ref = new_cache(model.config), DynamicCache(config=model.config)
    assert all(type(layer) is GrowingLayer for layer in grow.layers)
    tree = _tree()
    with torch.inference_mode():
        for cache in (grow, ref):
            torch.manual_seed(4)
            model(input_ids=torch.randint(0, 49152, (1, 200)), cache=cache, use_cache=True)
            for step in range(12):
                p = cache.get_seq_length()
                model(input_ids=torch.tensor([tree.tokens]), position_ids=tree.position_ids(p),
                      attention_mask=tree.attention_mask(p), cache=cache, use_cache=True)
                commit(cache, p, [0, 2, 5] if step % 2 else [0, 1])
                model(input_ids=torch.randint(0, 49152, (1, 9)), cache=cache, use_cache=True)
                cache.crop(-2)
        assert grow.get_seq_length() == ref.get_seq_length() > 256
        for a, b in zip(grow.layers, ref.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def test_greedy_argmax_is_torchs_first_maximum_in_every_layout() -> None:
    """The greedy pick (numpy's argmax on CPU fp32) must be torch.argmax's: the first of equal
    maxima (a tie taken from the other end would change greedy output), NaN as the maximum, strided
    views (a row of a step's logits), and the torch path for other dtypes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4096, generator=g)
    x[1, 10] = x[1, 4000] = x[1, 2000] = 99.0  # a three-way tie
    x[2] = 0.0  # all equal
    x[3, 3000] = float("nan")
    x[4, 4095] = 99.0  # the last column
    with torch.inference_mode():
        for t in (x, x[:, ::3], x.t().contiguous().t(), x.bfloat16(), x.double()):
            assert argmax_rows(t) == t.argmax(dim=-1).tolist()
            assert [argmax_token(row) for row in t] == t.argmax(dim=-1).tolist()
    assert argmax_rows(x)[:5] == [int(x[0].argmax()), 10, 0, 3000, 4095]
    assert isinstance(argmax_token(x[0]), int)


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_replayed_forwards_count_as_the_engine_counts(engine, depth: int) -> None:
    """The held-out check's proxy (tuner.projection.profiling.PromptProxy) replays a greedy answer
    under an n-gram chain: it counts the target forwards the engine itself takes (the prompt's
    forward gives the first token). Planted answers check the drafts it accepts; on the real model,
    whose answers repeat, tests/engine/test_engine_smollm2.py checks it against the engine with
    accepted drafts (a random model's answers repeat nothing)."""
    from engine.api import SamplingParams
    from engine.drafters.ngram import replayed_forwards

    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    engine.set_spec(SpecConfig(method="ngram", depth=depth, topk=1, budget=depth + 1))
    try:
        got = engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0))
    finally:
        engine.set_spec(SpecConfig(method="off"))
    assert replayed_forwards(prompt, got.tokens, depth) == got.stats.target_forwards
    # one forward a token with nothing to look up, none for no answer
    assert replayed_forwards([1], [2, 3, 4], depth) == 3 and replayed_forwards([1], [], depth) == 0
    # after the prompt's forward gives 1, the 2-gram (9, 1) seen before drafts 2, 3, 9, 1: all accepted
    assert replayed_forwards([9, 1, 2, 3, 9], [1, 2, 3, 9, 1], depth) == 1 + -(-4 // (depth + 1))
