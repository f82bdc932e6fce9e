"""The one interface every drafter implements, and the shared machinery of model-based drafters."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass

import torch

from engine.api import SamplingParams
from engine.trees.tree import Expansion, Tree, grow_dynamic_tree, run_steps
from tuner.schema.config import SpecConfig


class Drafter(ABC):
    """Proposes a draft tree rooted at the last committed token.

    Per generation: `reset(prompt_ids)`, then repeatedly `observe(features)` with the target's
    final hidden states of newly committed positions (so len(features seen) == len(ids) - 1)
    and `draft(ids, params)` with all committed tokens, ids[-1] being the root.

    A drafter that sets `aux_layers` (target layer ids) is called `observe(features, aux)` instead,
    aux [m, len(aux_layers)*h] being the inputs of those target layers (residual stream) at the same
    positions; the engine computes them only for such a drafter."""

    aux_layers: tuple[int, ...] | None = None

    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec

    def reset(self, prompt_ids: list[int]) -> None:  # noqa: B027 - optional hook
        """A new generation starts."""

    def catch_up(self, ids: list[int]) -> None:  # noqa: B027 - optional hook
        """Bring what the drafter keeps about the committed context (an index over it) up to `ids`,
        as `draft` would first. Adaptive control (engine.decode.batch) calls it before timing
        `draft`: it prices a drafter per drafted node, and the work of indexing a context last seen
        many steps ago (a fresh request's whole prompt) is that context's, not a node's."""

    def observe(self, features: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Target features [m, h] (after the final norm) of the m newly committed positions."""

    def observe_logits(self, tokens: list[int], logits: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """The target's logits [m, V] at committed positions: row i is the next-token logits computed
        where `tokens[i]` was the input (after the prompt: its last token; after a verification: the
        accepted path's nodes, root first). Only drafters that read the target's outputs (Token
        Recycling) override it; `wants_logits` says which."""

    wants_logits = False

    @abstractmethod
    def draft(self, ids: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> Tree:
        """A tree whose root is ids[-1]."""


@dataclass(frozen=True)
class CatchUp:
    """A draft's first forward: feed the committed context `ids` the drafter has not cached yet."""

    ids: list[int]


# a draft under way: yields CatchUp, then an Expansion per tree level; is sent each one's logits
DraftSteps = Generator[CatchUp | Expansion, torch.Tensor, Tree]


class ModelDrafter(Drafter):
    """A drafter backed by a neural model with its own KV cache over the committed context.

    Subclasses implement `_catch_up(ids)` (feed committed context not yet cached, return the logits
    for the root's children) and `_run(tokens, parent_slots, positions, mask)` (run tree nodes,
    return their children's logits), plus `_rollback()` (drop the tree's cache entries).
    A draft is a sequence of steps (`drafting`): the catch-up, then the EAGLE-2 expansion
    (engine.trees.tree) asks for one level at a time, which `_expand` runs. `draft` answers the
    steps with the drafter's own forwards; engine.drafters.lockstep answers those of several
    drafters sharing a head with one forward per step.

    A drafter scoring a draft vocabulary only sets `draft_vocab` (the target id of each logits
    column) and `vocab_size` (the target's): the tree is then built in draft ids (`_run` gets draft
    ids) and mapped to target ids once at the end, so no step scatters into the full vocabulary."""

    draft_vocab: torch.Tensor | None = None
    vocab_size = 0

    def __init__(self, spec: SpecConfig, device: torch.device) -> None:
        super().__init__(spec)
        self.device = device
        n_slots = max(1, spec.depth * spec.topk)
        self._anc = torch.zeros(n_slots, n_slots, dtype=torch.bool, device=device)
        self._slot: dict[int, int] = {}
        self._n_slots = 0
        self._ctx_len = 0  # committed positions in the drafter's cache
        self._root_pos = 0  # rotary position of the first tree level minus 1

    @abstractmethod
    def _catch_up(self, ids: list[int]) -> torch.Tensor: ...

    @abstractmethod
    def _run(self, tokens: list[int], parent_slots: list[int], positions: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _rollback(self) -> None: ...

    def _expand(self, nodes: list[int], tokens: list[int], parents: list[int], level: int) -> torch.Tensor:
        return self._run(tokens, *self._place(nodes, parents, level))

    def _place(self, nodes: list[int], parents: list[int], level: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Give a level's nodes the next cache slots: (their parents' slots, -1 for the root; their
        rotary positions [1, k]; the visibility mask [1, 1, k, context + slots so far])."""
        first = self._n_slots
        k = len(nodes)
        parent_slots = [self._slot.get(p, -1) for p in parents]
        for j, (node, ps) in enumerate(zip(nodes, parent_slots)):
            s = first + j
            self._slot[node] = s
            self._anc[s].zero_()
            if ps >= 0:
                self._anc[s] = self._anc[ps]
            self._anc[s, s] = True
        self._n_slots = first + k
        mask = torch.ones(k, self._ctx_len + self._n_slots, dtype=torch.bool, device=self.device)
        mask[:, self._ctx_len:] = self._anc[first:self._n_slots, :self._n_slots]
        positions = torch.full((1, k), self._root_pos + level, device=self.device)
        return parent_slots, positions, mask[None, None]

    @torch.inference_mode()
    def draft(self, ids: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> Tree:
        return run_steps(self.drafting(ids, params, generator), self._answer)

    def _answer(self, step: CatchUp | Expansion) -> torch.Tensor:
        """Run one step of a draft with this drafter's own forward."""
        return self._catch_up(step.ids) if isinstance(step, CatchUp) else self._expand(*step)

    def drafting(self, ids: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> DraftSteps:
        """`draft` as steps: yields CatchUp(ids) and is sent the root's children's logits [V], then
        yields an Expansion per tree level and is sent [len(nodes), V]; returns the tree. Sampling
        draws from `generator` in the same order however the steps are answered."""
        root_logits = yield CatchUp(ids)
        self._slot, self._n_slots = {}, 0
        try:
            tree = yield from grow_dynamic_tree(ids[-1], root_logits, self.spec.depth, self.spec.topk,
                                                self.spec.budget, temperature=params.temperature, generator=generator)
        finally:
            self._rollback()
        return tree if self.draft_vocab is None else to_target_vocab(tree, self.draft_vocab, self.vocab_size)


def to_target_vocab(tree: Tree, draft_vocab: torch.Tensor, vocab_size: int) -> Tree:
    """A tree drafted in draft-vocabulary ids (the root excepted) with target ids; sampled draft
    distributions become full-vocabulary ones, zero outside the draft vocabulary."""
    dev = draft_vocab.device
    tokens = [tree.tokens[0]] + draft_vocab[torch.tensor(tree.tokens[1:], device=dev, dtype=torch.long)].tolist()
    q = {}
    for p, dist in tree.q.items():
        full = dist.new_zeros(vocab_size)
        full[draft_vocab] = dist
        q[p] = full
    sampled = {p: draft_vocab[torch.tensor(xs, device=dev, dtype=torch.long)].tolist() for p, xs in tree.sampled.items()}
    return Tree(tokens=tokens, parents=tree.parents, depths=tree.depths, q=q, sampled=sampled)
