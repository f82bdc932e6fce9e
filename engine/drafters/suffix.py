"""SuffixDecoding (Oliaro et al., arXiv 2411.04975; vLLM `method: suffix` through arctic-inference):
no model. Two suffix trees (counting tries of every substring up to `suffix_tree_depth` tokens):
this request's own (prompt and generated tokens) and a global one over the responses of earlier
requests, the last `suffix_max_requests` of them (FIFO; the active responses grow in it as they are
generated). Each step matches the longest suffix of the context that occurred before with a
continuation in each tree, grows a best-first tree from it by frequency-estimated probability
(topk children per node, `depth` levels, the budget, at most `suffix_spec_factor` x the match length
speculated tokens, none below `suffix_min_prob`) and keeps the tree of the higher score (expected
accepted tokens; the request's own wins ties). Siblings are deterministic (top-k verification rule).

The global cache lives as long as the process, one per target and tree depth (`suffix_cache`). A
study that wants every trial to start from the same cache state snapshots it once and restores it
before each measurement (`snapshot_caches` / `restore_caches`); `clear_caches` empties them.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from engine.api import SamplingParams
from engine.drafters.base import Drafter
from engine.drafters.trie import CountTrie, Node, best_first_tree
from engine.trees.tree import Tree
from tuner.schema.config import SpecConfig


class SuffixCache:
    """The global suffix tree over cached responses, FIFO-bounded by request count.

    Its drafts depend only on the cached responses (engine.drafters.trie breaks ties by token id),
    so a snapshot is the responses themselves and a restore rebuilds the trie from them."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._lock = threading.Lock()
        self._trie = CountTrie(depth)
        self._entries: OrderedDict[int, list[int]] = OrderedDict()  # entry id -> its response so far
        self._open: dict[int, list[Node]] = {}
        self._next = 0

    @property
    def trie(self) -> CountTrie:
        return self._trie

    def __len__(self) -> int:
        return len(self._entries)

    def start(self, max_requests: int) -> int | None:
        """A new response; the oldest are evicted so that at most max_requests stay (None: 0, no cache)."""
        if max_requests <= 0:
            return None
        with self._lock:
            while len(self._entries) >= max_requests:
                old, tokens = self._entries.popitem(last=False)
                self._open.pop(old, None)
                self._trie.remove(tokens)
            eid, self._next = self._next, self._next + 1
            self._entries[eid] = []
            self._open[eid] = []
            return eid

    def append(self, eid: int | None, tokens: list[int]) -> None:
        """Tokens generated for response `eid` (ignored once it was evicted)."""
        if eid is None or not tokens:
            return
        with self._lock:
            if eid not in self._entries:
                return
            self._entries[eid].extend(tokens)
            self._open[eid] = self._trie.extend(self._open[eid], tokens)

    def snapshot(self) -> tuple[tuple[int, ...], ...]:
        """The cached responses, oldest first: what `restore` rebuilds the same cache from."""
        with self._lock:
            return tuple(tuple(t) for t in self._entries.values())

    def restore(self, state: tuple[tuple[int, ...], ...]) -> None:
        """Back to a snapshot's state (responses growing now are dropped from the cache)."""
        with self._lock:
            self._trie = CountTrie(self.depth)
            self._entries.clear()
            self._open.clear()
            for tokens in state:
                eid, self._next = self._next, self._next + 1
                self._entries[eid] = list(tokens)
                self._open[eid] = self._trie.extend([], list(tokens))

    def clear(self) -> None:
        self.restore(())


_LOCK = threading.Lock()
_CACHES: dict[tuple[int, int], SuffixCache] = {}


def suffix_cache(target, depth: int) -> SuffixCache:
    """The process's global suffix cache for `target` and a tree depth."""
    key = (id(target.model), depth)
    with _LOCK:
        if key not in _CACHES:
            _CACHES[key] = SuffixCache(depth)
        return _CACHES[key]


def snapshot_caches(target) -> dict[int, tuple[tuple[int, ...], ...]]:
    """Every suffix cache of `target` (by tree depth), as `restore_caches` takes it back."""
    with _LOCK:
        caches = {d: c for (m, d), c in _CACHES.items() if m == id(target.model)}
    return {d: c.snapshot() for d, c in caches.items()}


def restore_caches(target, state: dict[int, tuple[tuple[int, ...], ...]]) -> None:
    """Every suffix cache of `target` back to `state` (a depth absent from it: emptied)."""
    with _LOCK:
        caches = {d: c for (m, d), c in _CACHES.items() if m == id(target.model)}
    for d, c in caches.items():
        c.restore(state.get(d, ()))
    for d, tokens in state.items():
        if d not in caches:
            suffix_cache(target, d).restore(tokens)


def clear_caches(target) -> None:
    restore_caches(target, {})


class SuffixDrafter(Drafter):
    """One request's suffix tree plus the shared global cache (engine.drafters.suffix)."""

    def __init__(self, spec: SpecConfig, cache: SuffixCache) -> None:
        super().__init__(spec)
        self.cache = cache
        self._local = CountTrie(spec.suffix_tree_depth)
        self._open: list[Node] = []
        self._seen = 0
        self._prompt_len = 0
        self._entry: int | None = None

    def reset(self, prompt_ids: list[int]) -> None:
        self._local = CountTrie(self.spec.suffix_tree_depth)
        self._open, self._seen, self._prompt_len = [], 0, len(prompt_ids)
        self._entry = self.cache.start(self.spec.suffix_max_requests)

    def _tree(self, trie: CountTrie, ids: list[int]) -> tuple[Tree, float]:
        s = self.spec
        node, n = trie.match(ids, 1, s.suffix_tree_depth - 1)
        if node is None:
            return Tree.chain(ids[-1], []), 0.0
        cap = min(s.budget - 1, math.floor(s.suffix_spec_factor * n))  # at most factor x match tokens
        if cap < 1:
            return Tree.chain(ids[-1], []), 0.0
        return best_first_tree(ids[-1], node, min(s.depth, s.suffix_tree_depth - n), s.topk, cap + 1,
                               s.suffix_min_prob)

    def catch_up(self, ids: list[int]) -> None:
        self._open = self._local.extend(self._open, ids[self._seen:])
        self.cache.append(self._entry, ids[max(self._seen, self._prompt_len):])  # the response only
        self._seen = len(ids)

    def draft(self, ids: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> Tree:
        self.catch_up(ids)
        local, local_score = self._tree(self._local, ids)
        if self._entry is None and self.spec.suffix_max_requests <= 0:
            return local
        glob, glob_score = self._tree(self.cache.trie, ids)
        return glob if glob_score > local_score else local
