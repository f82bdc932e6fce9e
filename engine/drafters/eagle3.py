"""The EAGLE-3 drafter: the head of engine.models.eagle3_head over the target's fused low/mid/high features."""

from __future__ import annotations

import torch

from engine.models.cache import KVBuffer
from engine.drafters.base import ModelDrafter
from engine.drafters.eagle import EagleDrafter
from engine.drafters.lean_head import HeadRows, lean_head
from engine.models.eagle3_head import Eagle3Head
from tuner.schema.config import SpecConfig


class Eagle3Drafter(EagleDrafter):
    """EagleDrafter's loop with an EAGLE-3 head: the cache holds position t = (token t+1, fc(aux t))
    for every committed t < n, where aux are the inputs of the head's three target layers; a tree
    node at depth d runs at position n-1+d with its parent's output as the feature. The head scores
    its own draft vocabulary; the tree is built in draft ids and mapped to target ids once."""

    def __init__(self, spec: SpecConfig, head: Eagle3Head, target: torch.nn.Module) -> None:
        ModelDrafter.__init__(self, spec, next(target.parameters()).device)
        self.head = head
        self.aux_layers = head.aux_layers  # asks the engine for these target layers' inputs
        self.embed = head.embed_tokens if head.embed_tokens is not None else target.get_input_embeddings()
        self.vocab_size = head.t2d.numel()
        full = head.draft_vocab_size == self.vocab_size and not bool(head.d2t.any())
        self.draft_vocab = None if full else head.target_ids()
        self.lean = lean_head(head)
        self.cache = self.lean.new_cache() if self.lean is not None else KVBuffer()
        self._lm_rows = None  # the head scores its own lm_head
        self._pending: list[torch.Tensor] = []
        self._root_feat: torch.Tensor | None = None
        self._slot_feat: list[torch.Tensor] = []

    def observe(self, features: torch.Tensor, aux: torch.Tensor | None = None) -> None:
        if aux is None:
            raise RuntimeError("the EAGLE-3 drafter needs the target's aux hidden states (observe(features, aux))")
        self._pending.append(aux)

    def _first(self, pending: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return pending, True  # the aux states: the head's fc fuses them in the forward

    def _step(self, rows: HeadRows) -> torch.Tensor:
        if self.lean is not None:
            return super()._step(rows)
        feats = self.head.fuse(rows.feats) if rows.fuse else rows.feats
        mask = None if rows.visible is None else rows.visible[None, None]
        return self.head(rows.embeds[None], feats[None], rows.positions[None], mask, self.cache)[0]

    def _logits(self, feat: torch.Tensor) -> torch.Tensor:
        return self.head.logits(feat) if self.lean is None else self.lean.logits(feat)
