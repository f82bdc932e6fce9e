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
        # occurrences of each n-gram with a continuation, and of each (n-gram, next token): the
        # frequency of the drafted continuation, the draft's confidence
        self._seen: dict[tuple[int, ...], int] = {}
        self._next: dict[tuple[tuple[int, ...], int], int] = {}
        self._indexed = 0  # positions whose preceding n-grams are indexed
        self.last_conf: float | None = None  # the last lookup's confidence (None: nothing found)

    def reset(self, prompt_ids: list[int]) -> None:
        self._index.clear()
        self._seen.clear()
        self._next.clear()
        self._indexed = 0

    def _update(self, ids: list[int]) -> None:
        # An n-gram ending just before position j is indexed once token j exists (it has a continuation).
        lo, hi = self.spec.ngram_min, self.spec.ngram_max
        for j in range(max(self._indexed, 1), len(ids)):
            for n in range(lo, min(hi, j) + 1):
                key = tuple(ids[j - n:j])
                self._index[key] = j
                self._seen[key] = self._seen.get(key, 0) + 1
                self._next[(key, ids[j])] = self._next.get((key, ids[j]), 0) + 1
        self._indexed = len(ids)

    def catch_up(self, ids: list[int]) -> None:
        self._update(ids)

    def lookup(self, ids: list[int]) -> list[int]:
        """Up to `depth` tokens predicted to follow ids (the latest occurrence's continuation of
        the longest match); `last_conf`: the share of the match's occurrences followed by the first."""
        self._update(ids)
        self.last_conf = None
        for n in range(min(self.spec.ngram_max, len(ids)), self.spec.ngram_min - 1, -1):
            key = tuple(ids[-n:])
            j = self._index.get(key)
            if j is not None:
                out = ids[j:j + self.spec.depth]
                if out:
                    self.last_conf = self._next[(key, out[0])] / self._seen[key]
                return out
        return []

    def draft(self, ids: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> Tree:
        tree = Tree.chain(ids[-1], self.lookup(ids))
        tree.conf = self.last_conf
        return tree


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

    def catch_up(self, ids: list[int]) -> None:
        self._open = self._trie.extend(self._open, ids[self._seen:])
        self._seen = len(ids)

    def draft(self, ids: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> Tree:
        self.catch_up(ids)
        s = self.spec
        node, _ = self._trie.match(ids, s.ngram_min, s.ngram_max)
        if node is None:
            return Tree.chain(ids[-1], [])
        if s.ngram_match == "prob":
            return best_first_tree(ids[-1], node, s.depth, s.topk, s.budget)[0]
        return bfs_tree(ids[-1], node, s.depth, s.topk, s.budget)


def replayed_forwards(prompt_ids: list[int], answer_ids: list[int], depth: int) -> int:
    """Target forwards a greedy n-gram chain of `depth` (topk 1) takes to commit `answer_ids` after
    `prompt_ids`, counted as the engine counts them (GenStats.target_forwards): the prompt's forward
    gives the first token, then each step drafts what NgramDrafter would and commits the draft's
    longest prefix that the answer continues with plus the target's own token. Exact for greedy
    decoding (the answer is then every configuration's output); for a sampled answer a proxy of how
    much of it repeats what came before."""
    if not answer_ids:
        return 0
    drafter = NgramDrafter(SpecConfig(method="ngram", depth=depth, topk=1, budget=depth + 1))
    drafter.reset(prompt_ids)
    ids, pos, end, forwards = [*prompt_ids, answer_ids[0]], 1, len(answer_ids), 1
    while pos < end:
        draft = drafter.lookup(ids)
        k = 0
        while k < len(draft) and pos + k < end and draft[k] == answer_ids[pos + k]:
            k += 1
        step = min(k + 1, end - pos)
        ids += answer_ids[pos:pos + step]
        pos += step
        forwards += 1
    return forwards
