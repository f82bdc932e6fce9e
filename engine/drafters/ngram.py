"""N-gram prompt lookup: draft the tokens that followed the most recent earlier occurrence of the
context's suffix (longest match first, `ngram_max` down to `ngram_min`). No model, a chain."""

from __future__ import annotations

import torch

from engine.api import SamplingParams
from engine.drafters.base import Drafter
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
