"""The EAGLE-3 drafter: the head of engine.eagle3 over the target's fused low/mid/high features."""

from __future__ import annotations

import torch

from engine.cache import KVBuffer
from engine.drafters.base import ModelDrafter
from engine.eagle3 import Eagle3Head
from tuner.schema import SpecConfig


class Eagle3Drafter(ModelDrafter):
    """The head's cache holds position t = (token t+1, fc(aux t)) for every committed t < n, where
    ids[n] is the root. A tree node at depth d runs at position n-1+d with its parent's output as
    the feature. The head scores its draft vocabulary only; the tree is built in draft ids and
    mapped to target ids once (ModelDrafter.draft_vocab)."""

    def __init__(self, spec: SpecConfig, head: Eagle3Head, target: torch.nn.Module) -> None:
        super().__init__(spec, next(target.parameters()).device)
        self.head = head
        self.aux_layers = head.aux_layers  # asks the engine for these target layers' inputs
        self.embed = head.embed_tokens if head.embed_tokens is not None else target.get_input_embeddings()
        self.vocab_size = head.t2d.numel()
        full = head.draft_vocab_size == self.vocab_size and not bool(head.d2t.any())
        self.draft_vocab = None if full else head.target_ids()
        self.cache = KVBuffer()
        self._pending: list[torch.Tensor] = []
        self._root_feat: torch.Tensor | None = None
        self._slot_feat: list[torch.Tensor] = []

    def reset(self, prompt_ids: list[int]) -> None:
        self._pending, self._ctx_len, self._slot_feat = [], 0, []
        self.cache.reset()

    def observe(self, features: torch.Tensor, aux: torch.Tensor | None = None) -> None:
        if aux is None:
            raise RuntimeError("the EAGLE-3 drafter needs the target's aux hidden states (observe(features, aux))")
        self._pending.append(aux)

    def _catch_up(self, ids: list[int]) -> torch.Tensor:
        aux = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        c, n = self._ctx_len, len(ids) - 1
        assert c + aux.shape[0] == n, "EAGLE-3 drafter: aux states out of step with committed tokens"
        toks = torch.tensor([ids[c + 1:n + 1]], device=self.device)
        pos = torch.arange(c, n, device=self.device)[None]
        out = self.head(self.embed(toks), self.head.fuse(aux[None]), pos, None, self.cache)
        self._ctx_len, self._root_pos = n, n - 1
        self._root_feat = out[0, -1]
        return self.head.logits(self._root_feat)

    def _run(self, tokens: list[int], parent_slots: list[int], positions: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
        feats = torch.stack([self._root_feat if s < 0 else self._slot_feat[s] for s in parent_slots])
        toks = torch.tensor([tokens], device=self.device)
        if self.draft_vocab is not None:  # the tree is built in draft ids
            toks = self.draft_vocab[toks]
        out = self.head(self.embed(toks), feats[None], positions, mask, self.cache)
        self._slot_feat.extend(out[0].unbind(0))
        return self.head.logits(out[0])

    def _rollback(self) -> None:
        self.cache.crop(self._ctx_len)
        self._slot_feat = []
