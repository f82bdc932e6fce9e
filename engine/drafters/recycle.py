"""Token Recycling (Luo et al., arXiv 2408.08696): no model. A successor table (token -> its `topk`
most likely next tokens) is refreshed from the target's own logits at every verification (the top
`topk` of each committed position's logits replace the row of its input token; `observe_logits`),
and each step fills a static tree template from it: node (parent, rank r) holds the r-th successor
of its parent's token. The template is fixed by (depth, topk, budget): the `budget-1` rank paths of
highest prior (rank r weighs 2^-(r+1), so near-root and first-rank nodes come first), ancestor-closed.
A template node whose parent token has no known successor is dropped with its subtree. The table
outlives a generation (the paper keeps it across queries) and lives as long as the drafter.

This implementation refreshes the table from the committed positions' logits only (the paper also
uses the rejected candidates'): those are exactly what the acceptance profile knows (the target's
logits at the reference's committed positions), so the profile replays this drafter exactly."""

from __future__ import annotations

import heapq

import torch

from engine.api import SamplingParams
from engine.drafters.base import Drafter
from engine.trees.tree import Tree
from tuner.schema.config import SpecConfig


def template(depth: int, topk: int, budget: int) -> list[tuple[int, int]]:
    """The static tree: (parent index, rank) of nodes 1.. in topological order (node 0 the root)."""
    nodes: list[tuple[int, int]] = [(-1, 0)]
    level = [0]
    heap = [(-(2.0 ** -(r + 1)), 1, 0, r, 0) for r in range(topk)]  # (-prior, depth, parent, rank, order)
    order = topk
    while heap and len(nodes) < budget:
        neg, d, parent, rank, _ = heapq.heappop(heap)
        nodes.append((parent, rank))
        level.append(d)
        idx = len(nodes) - 1
        if d < depth:
            for r in range(topk):
                heapq.heappush(heap, (neg * 2.0 ** -(r + 1), d + 1, idx, r, order))
                order += 1
    return nodes[1:]


class RecycleDrafter(Drafter):
    wants_logits = True

    def __init__(self, spec: SpecConfig, vocab_size: int) -> None:
        super().__init__(spec)
        self.vocab_size = vocab_size
        self.table = torch.full((vocab_size, spec.topk), -1, dtype=torch.long)
        self._template = template(spec.depth, spec.topk, spec.budget)
        self.updates = 0  # observe_logits calls: 0 means the engine never handed it logits

    def observe_logits(self, tokens: list[int], logits: torch.Tensor) -> None:
        top = torch.topk(logits.float(), self.spec.topk, dim=-1).indices.cpu()
        for t, row in zip(tokens, top):  # in order: a token committed twice keeps its latest row
            self.table[t] = row
        self.updates += 1

    def state(self) -> torch.Tensor:
        """A copy of the successor table (what `load_state` takes back)."""
        return self.table.clone()

    def load_state(self, table: torch.Tensor) -> None:
        self.table = table.clone()

    def draft(self, ids: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> Tree:
        rows: dict[int, list[int]] = {}
        tokens, parents, depths = [ids[-1]], [-1], [0]
        remap = {0: 0}  # template index -> tree index (absent: dropped)
        for i, (parent, rank) in enumerate(self._template, start=1):
            p = remap.get(parent)
            if p is None:
                continue
            tok = tokens[p]
            row = rows.get(tok)
            if row is None:
                row = rows[tok] = self.table[tok].tolist()
            succ = row[rank]
            if succ < 0:
                continue
            remap[i] = len(tokens)
            tokens.append(succ); parents.append(p); depths.append(depths[p] + 1)
        return Tree(tokens=tokens, parents=parents, depths=depths)
