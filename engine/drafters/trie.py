"""A counting trie of every substring (up to a depth) of the sequences inserted, and the two ways
training-free tree drafters grow a draft from it: breadth-first by frequency (SGLang NGRAM `BFS`)
and best-first by estimated probability (SGLang NGRAM `PROB`, SuffixDecoding).

A node's count is how many times its substring occurs. The probability of a continuation t after a
matched node is count(child t) / sum of its children's counts: occurrences without a continuation
(the context's own end) do not dilute it. Ties are broken by the smaller token id, so a trie's
drafts depend only on the multiset of sequences inserted, never on insertion order (a cache rebuilt
from a snapshot drafts exactly as the original)."""

from __future__ import annotations

import heapq

from engine.trees.tree import Tree


class Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}

    def ranked(self) -> list[tuple[int, "Node"]]:
        """Children by count, most frequent first (ties: smaller token first)."""
        return sorted(self.children.items(), key=lambda kv: (-kv[1].count, kv[0]))


class CountTrie:
    """Substrings of length <= depth with their occurrence counts, extended one token at a time."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node()

    def extend(self, active: list[Node], tokens: list[int]) -> list[Node]:
        """Append `tokens` to a sequence whose open suffix nodes are `active` (the nodes of its last
        1, 2, ... tokens, shortest first, each shorter than depth); returns the new open nodes."""
        root, depth = self.root, self.depth
        for t in tokens:
            nxt = []
            for node in [root, *active]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node()
                child.count += 1
                if len(nxt) + 1 < depth:
                    nxt.append(child)
            active = nxt
        return active

    def remove(self, tokens: list[int]) -> None:
        """Take one inserted sequence out again (counts down, empty nodes pruned)."""
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i:i + self.depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    break
                node = child

    def match(self, context: list[int], lo: int, hi: int) -> tuple[Node | None, int]:
        """The node of the longest suffix of `context` with length in [lo, hi] (and < depth) that
        occurred before with a continuation, and its length; (None, 0) when none did."""
        hi = min(hi, self.depth - 1, len(context))
        for n in range(hi, lo - 1, -1):
            node = self.root
            for t in context[len(context) - n:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, n
        return None, 0


def bfs_tree(root_token: int, node: Node, depth: int, breadth: int, budget: int) -> Tree:
    """Level by level, each node's `breadth` most frequent continuations, until `budget` nodes
    (root included) or `depth` levels (SGLang NGRAM BFS)."""
    tokens, parents, depths = [root_token], [-1], [0]
    frontier = [(0, node)]
    for level in range(1, depth + 1):
        nxt = []
        for idx, trie_node in frontier:
            for tok, child in trie_node.ranked()[:breadth]:
                if len(tokens) >= budget:
                    break
                tokens.append(tok); parents.append(idx); depths.append(level)
                nxt.append((len(tokens) - 1, child))
        frontier = nxt
        if not frontier or len(tokens) >= budget:
            break
    return Tree(tokens=tokens, parents=parents, depths=depths, conf=first_share(node) if len(tokens) > 1 else None)


def first_share(node: Node) -> float | None:
    """The share of a node's continuations that its most frequent one takes (a draft's confidence
    in its first node; None: no continuation)."""
    ranked = node.ranked()
    total = sum(c.count for c in node.children.values())
    return ranked[0][1].count / total if ranked and total > 0 else None


def best_first_tree(root_token: int, node: Node, depth: int, breadth: int, budget: int,
                    min_prob: float = 0.0) -> tuple[Tree, float]:
    """The `budget-1` most probable continuations (a path's probability: the product of its
    frequency ratios), each node at most `breadth` children, none below `min_prob`; ancestor-closed
    because a child is never more probable than its parent. Returns the tree and its score (the
    sum of the kept nodes' probabilities: the expected accepted length if the counts are right)."""
    tokens, parents, depths = [root_token], [-1], [0]
    score = 0.0
    heap: list[tuple[float, int, int, int, Node]] = []  # (-prob, order, token, parent idx, trie node)
    order = 0

    def push(idx: int, trie_node: Node, prob: float, level: int) -> None:
        nonlocal order
        if level > depth:
            return
        total = sum(c.count for c in trie_node.children.values())
        for tok, child in trie_node.ranked()[:breadth]:
            p = prob * child.count / total
            if p >= min_prob and p > 0:
                heapq.heappush(heap, (-p, order, tok, idx, child))
                order += 1

    push(0, node, 1.0, 1)
    while heap and len(tokens) < budget:
        neg, _, tok, parent, child = heapq.heappop(heap)
        tokens.append(tok); parents.append(parent); depths.append(depths[parent] + 1)
        score -= neg
        push(len(tokens) - 1, child, -neg, depths[-1] + 1)
    return Tree(tokens=tokens, parents=parents, depths=depths, conf=first_share(node) if len(tokens) > 1 else None), score
