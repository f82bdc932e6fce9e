"""Draft trees: the buffers one verification forward needs, and EAGLE-2 dynamic expansion.

Node 0 is the root: the last committed token, not yet in the target's KV cache. Nodes are in
topological order (a parent's index is lower than its children's), so position ids are
P + depth and the attention mask lets each node see the whole prefix plus its ancestors.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import torch


@dataclass
class Tree:
    """A draft tree. `q[p]` is the draft distribution node p's children were drafted from and
    `sampled[p]` the tokens drawn from it in order (all of them, kept in the tree or not) when
    the children were *sampled without replacement*; without `sampled[p]` they are deterministic
    (top-k or a lookup) and verification uses the matching rule (verify.py)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    sampled: dict[int, list[int]] = field(default_factory=dict)
    # the drafter's confidence in its first node, in [0, 1], where it has one (an n-gram lookup:
    # how often the matched context was followed by that token); adaptive control calibrates it
    conf: float | None = None
    _children: list[dict[int, int]] | None = None

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> "Tree":
        n = len(drafts) + 1
        return cls(tokens=[root, *drafts], parents=list(range(-1, n - 1)), depths=list(range(n)))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def first(self, n: int) -> "Tree":
        """The tree of its first n nodes (ancestor-closed: a parent comes before its children). A
        sampled node keeps its draws: a draw whose node is dropped is skipped as one outside the tree."""
        if n >= self.size:
            return self
        return Tree(tokens=self.tokens[:n], parents=self.parents[:n], depths=self.depths[:n],
                    q={p: v for p, v in self.q.items() if p < n},
                    sampled={p: v for p, v in self.sampled.items() if p < n}, conf=self.conf)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, node: int) -> dict[int, int]:
        """token -> child node index (in node order, which is the drafting order)."""
        if self._children is None:
            ch: list[dict[int, int]] = [dict() for _ in self.tokens]
            for i in range(1, self.size):
                ch[self.parents[i]].setdefault(self.tokens[i], i)
            self._children = ch
        return self._children[node]

    def ancestors(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, N] bool: [i, j] when j is i or an ancestor of i."""
        n = self.size
        par = torch.tensor([max(p, 0) for p in self.parents], device=device)
        anc = torch.eye(n, dtype=torch.bool, device=device)
        rows = torch.arange(n, device=device)
        hop = par.clone()
        for _ in range(max(self.depths)):
            anc[rows, hop] = True  # the root is everyone's ancestor, so clamping root->0 is harmless
            hop = par[hop]
        return anc

    def attention_mask(self, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[1, 1, N, P+N] bool (True = attend): the prefix is visible to all, each node sees its ancestors.
        Use with SDPA attention: eager attention treats a bool mask as 0/1 additive (silently wrong)."""
        n = self.size
        mask = torch.ones(n, prefix_len + n, dtype=torch.bool, device=device)
        mask[:, prefix_len:] = self.ancestors(device)
        return mask[None, None]

    def position_ids(self, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return (torch.tensor(self.depths, device=device) + prefix_len)[None]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths."""
        has_child = {p for p in self.parents if p >= 0}
        out = []
        for leaf in range(self.size):
            if leaf in has_child:
                continue
            path = [leaf]
            while self.parents[path[-1]] >= 0:
                path.append(self.parents[path[-1]])
            out.append(path[::-1])
        return out


class Expansion(NamedTuple):
    """One tree level to run: the frontier `nodes` (indices into the candidate pool, 0 = root), their
    tokens and parents, and their depth `level` (1: the root's children)."""

    nodes: list[int]
    tokens: list[int]
    parents: list[int]
    level: int


# expand(nodes, tokens, parents, level) -> draft logits [len(nodes), V] for the children of each node
ExpandFn = Callable[[list[int], list[int], list[int], int], torch.Tensor]
# a tree under construction: yields each level to run, is sent its logits, returns the tree
TreeGrowth = Generator[Expansion, torch.Tensor, Tree]

Ask = TypeVar("Ask")
Reply = TypeVar("Reply")
Done = TypeVar("Done")


def run_steps(steps: Generator[Ask, Reply, Done], answer: Callable[[Ask], Reply]) -> Done:
    """Drive a steppable computation on its own: answer each request it yields, return its result.
    If `answer` raises, the computation is closed first (its `finally` blocks run now, not at
    garbage collection)."""
    reply: Reply | None = None
    while True:
        try:
            ask = steps.send(reply)  # type: ignore[arg-type]  # None starts the generator
        except StopIteration as done:
            return done.value
        try:
            reply = answer(ask)
        except BaseException:
            steps.close()
            raise


def build_dynamic_tree(root: int, root_logits: torch.Tensor, expand: ExpandFn, depth: int, topk: int,
                       budget: int, temperature: float = 0.0,
                       generator: torch.Generator | None = None) -> Tree:
    """`grow_dynamic_tree` with every level run by `expand`."""
    return run_steps(grow_dynamic_tree(root, root_logits, depth, topk, budget, temperature, generator),
                     lambda e: expand(*e))


def grow_dynamic_tree(root: int, root_logits: torch.Tensor, depth: int, topk: int, budget: int,
                      temperature: float = 0.0, generator: torch.Generator | None = None) -> TreeGrowth:
    """EAGLE-2 expansion, one level per step: yields an `Expansion` for each level after the first
    and is sent the draft logits [len(nodes), V] of its nodes' children; returns the Tree. Being a
    generator lets several trees grow in lockstep, their levels run in one forward
    (engine.drafters.lockstep); `build_dynamic_tree` grows one.

    Each level, every frontier node proposes its top-`topk` children scored by
    cumulative draft log-prob, and the global top-`topk` of those become the next frontier (the only
    nodes the drafter runs on). Finally the `budget-1` best candidates plus the root are kept; since a
    child never scores above its parent and ties keep the parent first, the kept set is ancestor-closed.

    Chains (`topk == 1`) at `temperature > 0` *sample* each draft from the tempered draft distribution
    and record it for the q-ratio verification rule; trees stay deterministic top-k because which
    nodes survive depends on their scores, and a sampled sibling kept *because* of its value would no
    longer be a sample of q_j."""
    sample_chain = topk == 1 and temperature > 0
    tokens, parents, depths = [root], [-1], [0]
    scores: list[float] = [0.0]
    q: dict[int, torch.Tensor] = {}
    sampled: dict[int, list[int]] = {}

    def children_of(node_ids: list[int], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        if sample_chain:
            probs = torch.softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=generator)
            for row, nid in enumerate(node_ids):
                q[nid] = probs[row]
                sampled[nid] = [int(tok[row, 0])]
            return torch.log(probs.gather(-1, tok).clamp_min(1e-30)), tok
        logp = torch.log_softmax(logits, dim=-1)
        return torch.topk(logp, topk, dim=-1)

    vals, toks = children_of([0], root_logits[None])
    frontier = []
    for t, v in zip(toks[0].tolist(), vals[0].tolist()):
        tokens.append(t); parents.append(0); depths.append(1); scores.append(v)
        frontier.append(len(tokens) - 1)
    for level in range(2, depth + 1):
        logits = yield Expansion(frontier, [tokens[i] for i in frontier], [parents[i] for i in frontier], level - 1)
        vals, toks = children_of(frontier, logits)
        cum = vals + torch.tensor([scores[i] for i in frontier], device=vals.device)[:, None]
        flat_cum, flat_tok = cum.flatten().tolist(), toks.flatten().tolist()
        k = toks.shape[1]
        first = len(tokens)
        for j, (t, s) in enumerate(zip(flat_tok, flat_cum)):
            tokens.append(t); parents.append(frontier[j // k]); depths.append(level); scores.append(s)
        # host-side on purpose: the scores are Python floats already (one .tolist() per level)
        best = torch.topk(torch.tensor(flat_cum, device="cpu"), min(topk, len(flat_cum))).indices.tolist()
        frontier = [first + b for b in best]
    # Keep the budget-1 best candidates: a stable sort keeps lower (shallower) indices first on ties.
    order = torch.sort(torch.tensor(scores[1:], device="cpu"), descending=True, stable=True).indices[: budget - 1]
    keep = [0] + sorted(int(i) + 1 for i in order)
    remap = {old: new for new, old in enumerate(keep)}
    return Tree(
        tokens=[tokens[i] for i in keep],
        parents=[-1] + [remap[parents[i]] for i in keep[1:]],
        depths=[depths[i] for i in keep],
        q={remap[p]: v for p, v in q.items() if p in remap},
        sampled={remap[p]: v for p, v in sampled.items() if p in remap},
    )
