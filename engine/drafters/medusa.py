"""The Medusa drafter: K heads over the target's last feature propose every level of the tree at once.

Head k scores depth k+1. Candidates are the heads' top-k tokens combined into a tree by
engine.trees.tree's expansion: each level keeps the top-`topk` paths by cumulative head log-prob (a
Medusa head does not see the drafted tokens, so every frontier node gets the same head's
distribution), and the `budget-1` best nodes plus the root are verified. No KV cache of its own.
"""

from __future__ import annotations

import torch

from engine.api import SamplingParams
from engine.drafters.base import Drafter
from engine.models.medusa_head import MedusaHeads
from engine.trees.tree import Tree, build_dynamic_tree
from tuner.schema.config import SpecConfig, UserError


class MedusaDrafter(Drafter):
    """Drafts from the target's final normed hidden state of the position before the root."""

    def __init__(self, spec: SpecConfig, heads: MedusaHeads) -> None:
        super().__init__(spec)
        if spec.depth > heads.num_heads:
            raise UserError(f"spec.depth={spec.depth} with spec.method=medusa: the head at {spec.head_path} has "
                            f"{heads.num_heads} heads, so depth must be <= {heads.num_heads}")
        self.heads = heads
        self._feat: torch.Tensor | None = None

    def reset(self, prompt_ids: list[int]) -> None:
        self._feat = None

    def observe(self, features: torch.Tensor) -> None:
        self._feat = features[-1]  # only the newest position feeds the heads

    @torch.inference_mode()
    def draft(self, ids: list[int], params: SamplingParams, generator: torch.Generator | None = None) -> Tree:
        assert self._feat is not None, "Medusa drafter: draft() before any observed feature"
        logits = self.heads.full_logits(self._feat)[: self.spec.depth]  # [depth, V]

        def expand(nodes: list[int], tokens: list[int], parents: list[int], level: int) -> torch.Tensor:
            return logits[level].expand(len(nodes), -1)

        return build_dynamic_tree(ids[-1], logits[0], expand, self.spec.depth, self.spec.topk, self.spec.budget,
                                  temperature=params.temperature, generator=generator)
