"""Verification of a draft tree against the target's logits at every node (one forward).

Greedy: follow the child whose token is the target's argmax; the argmax after the last accepted
node is the bonus token. Sampling: at each node r = the processed target distribution; its
children are tried in drafting order with the rule that matches how they were drafted:
- deterministic siblings (top-k, lookup): accept x with probability r(x), else r(x) <- 0, renormalise;
- siblings sampled without replacement from q: accept with min(1, r(x)/q_j(x)), q_j = q with the
  earlier draws removed and renormalised, else r <- norm(max(0, r - q_j)).
When every child fails (or the node is a leaf) the bonus token is sampled from r. Both rules
leave the output distributed exactly as the target's (tests/engine/test_engine_lossless.py).
"""

from __future__ import annotations

import torch

from engine.api import SamplingParams
from engine.trees.tree import Tree


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target logits [..., V] -> the distribution r a sampler would draw from (temperature, top-k, top-p)."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sp.cumsum(-1) - sp) >= params.top_p
        drop[..., 0] = False  # also when top_p rounds to 0 in float32 (e.g. 1e-300)
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _normalise(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    s = r.sum()
    return r / s if s > 0 else fallback


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=generator.device if generator is not None else device))


def accept_topk(r: torch.Tensor, x: int, q: torch.Tensor | None, u: float) -> tuple[bool, torch.Tensor]:
    """Deterministic sibling x: accept with probability r(x); otherwise remove x from r."""
    if u < float(r[x]):
        return True, r
    r2 = r.clone()
    r2[x] = 0.0
    return False, _normalise(r2, r)


def accept_sampled(r: torch.Tensor, x: int, q: torch.Tensor, q_j: torch.Tensor, u: float) -> tuple[bool, torch.Tensor]:
    """Sibling x drawn from q_j (q without the earlier draws): accept with min(1, r/q_j), else the residual."""
    if u * float(q_j[x]) < float(r[x]):
        return True, r
    return False, _normalise((r - q_j).clamp_min(0.0), r)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest logit ([N, V] -> N ints), the first of equal ones, as
    `torch.argmax`. On CPU fp32 through numpy's vectorised argmax: torch's runs element by element,
    an order of magnitude slower over a 49k vocabulary (docs/results.md), and it is paid on every
    token decoded and every verified row."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def argmax_token(logits: torch.Tensor) -> int:
    """The greedy token of one row of logits [V] (`argmax_rows`)."""
    return argmax_rows(logits[None])[0]


def verify_greedy(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """logits [N, V] of the tree's nodes -> (accepted node path starting at the root, bonus token)."""
    best = argmax_rows(logits)
    path = [0]
    while True:
        child = tree.children(path[-1]).get(best[path[-1]])
        if child is None:
            return path, best[path[-1]]
        path.append(child)


def verify_sample(tree: Tree, logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Lossless sampling verification: (accepted node path starting at the root, bonus token)."""
    path = [0]
    while True:
        node = path[-1]
        r = process_logits(logits[node], params)
        children = tree.children(node)
        nxt = None
        if children:
            if node in tree.sampled:
                q = tree.q[node].float()
                q_j = q
                for x in tree.sampled[node]:
                    if x in children:
                        u = _uniform(generator, r.device)
                        ok, r = accept_sampled(r, x, q, q_j, u)
                        if ok:
                            nxt = children[x]
                            break
                    # the next draw came from q without this one (whether it was verified or not)
                    q_j = q_j.clone()
                    q_j[x] = 0.0
                    q_j = _normalise(q_j, q_j)
            else:
                q = tree.q.get(node)
                for x, child in children.items():
                    u = _uniform(generator, r.device)
                    ok, r = accept_topk(r, x, q, u)
                    if ok:
                        nxt = child
                        break
        if nxt is None:
            return path, int(torch.multinomial(r, 1, generator=generator))
        path.append(nxt)


def verify(tree: Tree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Greedy when temperature is 0, the lossless sampling rule otherwise."""
    if params.temperature <= 0:
        return verify_greedy(tree, logits)
    return verify_sample(tree, logits, params, generator)
