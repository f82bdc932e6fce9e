"""Statistical losslessness of tree verification under sampling (engine.verify).

A small-vocabulary synthetic target p(next | last) and draft q(next | last) (Markov tables). Each
sample generates L tokens by repeatedly drafting a tree with topk > 1 and depth > 1 from q and
verifying it against p; the empirical distribution over the V**L sequences must match the exact
product of p (chi-square). The same harness with either known biased rule (DESIGN.md) must fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from engine import verify as V
from engine.api import SamplingParams
from engine.tree import Tree, build_dynamic_tree

VOCAB, LENGTH, START = 6, 2, 0
N_SAMPLES = 3000
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


def _empirical(kind: str, seed: int = 0, keep: tuple[int, ...] = (0, 1, 2)) -> torch.Tensor:
    p, q = _tables()
    logp = torch.log(p)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB ** LENGTH)
    for _ in range(N_SAMPLES):
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
    assert _pvalue(_empirical(kind)) < 1e-6


def test_processed_distribution_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    r = V.process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(r, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    r = V.process_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(r, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    r = V.process_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(r, torch.softmax(logits / 0.5, -1), atol=1e-6)
