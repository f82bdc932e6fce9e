"""N-gram lookup, no model. topk 1 (vLLM's prompt lookup): draft the tokens that followed the most
recent earlier occurrence of the context's suffix (longest match first, `ngram_max` down to
`ngram_min`), a chain. topk > 1 (SGLang's NGRAM): a trie tree of every continuation of the match."""

from __future__ import annotations

import torch

from engine.api import SamplingParams
from engine.drafters.base import Drafter
from engine.drafters.trie import CountTrie, best_first_tree, bfs_tree
from engine.trees.tree import Tree
from tuner.schema.config import SpecConfig


class NgramDrafter(Drafter):
    """Index of every n-gram (n in [ngram_min, ngram_max]) -> the position right after its latest
    occurrence, updated incrementally as tokens are committed: O(1) work per token and per lookup."""

    def __init__(self, spec: SpecConfig) -> None:
        super().__init__(spec)
        self._index: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # positions whose preceding n-grams are indexed

    def reset(self, prompt_ids: list[int]) -> None:
        self._index.clear()
        self._indexed = 0

    def _update(self, ids: list[int]) -> None:
        # An n-gram ending just before position j is indexed once token j exists (it has a continuation).
        lo, hi = self.spec.ngram_min, self.spec.ngram_max
        for j in range(max(self._indexed, 1), len(ids)):
            for n in range(lo, min(hi, j) + 1):
                self._index[tuple(ids[j - n:j])] = j
        self._indexed = len(ids)

    def lookup(self, ids: list[int]) -> list[int]:
        """Up to `depth` tokens predicted to follow ids."""
        self._update(ids)
        for n in range(min(self.spec.ngram_max, len(ids)), self.spec.ngram_min - 1, -1):
            j = self._index.get(tuple(ids[-n:]))
            if j is not None:
                return ids[j:j + self.spec.depth]
        return []

    def draft(self, ids: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> Tree:
        return Tree.chain(ids[-1], self.lookup(ids))


class NgramTrieDrafter(Drafter):
    """SGLang's NGRAM drafter (topk > 1): a trie of every substring of the prompt and the generated
    tokens up to ngram_max + depth long; the longest suffix of the context (ngram_max down to
    ngram_min tokens) that occurred before with a continuation is matched, and the tree is grown
    from every continuation seen after it, breadth `topk` per node, within the budget and `depth`
    levels: by frequency level by level (`ngram_match=bfs`) or by estimated probability best first
    (`prob`). Siblings are deterministic (verified with the top-k rule)."""

    def __init__(self, spec: SpecConfig) -> None:
        super().__init__(spec)
        self._trie = CountTrie(spec.ngram_max + spec.depth)
        self._open: list = []
        self._seen = 0  # context tokens inserted

    def reset(self, prompt_ids: list[int]) -> None:
        self._trie = CountTrie(self.spec.ngram_max + self.spec.depth)
        self._open, self._seen = [], 0

    def draft(self, ids: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> Tree:
        self._open = self._trie.extend(self._open, ids[self._seen:])
        self._seen = len(ids)
        s = self.spec
        node, _ = self._trie.match(ids, s.ngram_min, s.ngram_max)
        if node is None:
            return Tree.chain(ids[-1], [])
        if s.ngram_match == "prob":
            return best_first_tree(ids[-1], node, s.depth, s.topk, s.budget)[0]
        return bfs_tree(ids[-1], node, s.depth, s.topk, s.budget)
