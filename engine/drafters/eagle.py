"""The EAGLE-1 drafter: the head of engine.models.eagle_head over the target's features, embedding and lm_head."""

from __future__ import annotations

import torch

from engine.models.cache import KVBuffer
from engine.drafters.base import ModelDrafter
from engine.drafters.lean_head import lean_head
from engine.models.eagle_head import EagleHead
from tuner.schema.config import SpecConfig


class EagleDrafter(ModelDrafter):
    """The head's cache holds position t = (token t+1, feature t) for every committed t < n, where
    ids[n] is the root. A tree node at depth d runs at position n-1+d with its parent's predicted
    feature. The head runs on the lean layer (engine.drafters.lean_head: fused weights, oneDNN
    linears, a static cache written by index); a head with extra biases runs its module over a
    KVBuffer. Either cache grows in place; a rollback is a length change.

    A head with a draft vocabulary scores only those rows of the target's lm_head (on CPU the full
    lm_head is most of a draft step) and the tree is built in draft ids (ModelDrafter.draft_vocab)."""

    def __init__(self, spec: SpecConfig, head: EagleHead, target: torch.nn.Module) -> None:
        super().__init__(spec, next(target.parameters()).device)
        self.head = head
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        ids = head.draft_ids
        self.draft_vocab = None if ids is None else ids.to(self.device)
        self._lm_rows = (self.lm_head.weight if ids is None else self.lm_head.weight[self.draft_vocab]).detach().contiguous()
        self._pending: list[torch.Tensor] = []
        self.lean = lean_head(head)
        self.cache = self.lean.new_cache() if self.lean is not None else KVBuffer()
        self._root_feat: torch.Tensor | None = None
        self._slot_feat: list[torch.Tensor] = []

    def reset(self, prompt_ids: list[int]) -> None:
        self._pending, self._ctx_len, self._slot_feat = [], 0, []
        self.cache.crop(0)

    def observe(self, features: torch.Tensor) -> None:
        self._pending.append(features)

    def _first(self, pending: torch.Tensor) -> torch.Tensor:
        """The head's input features for committed positions (EAGLE-1: the target's features)."""
        return pending.to(self._lm_rows.dtype)

    def _step(self, embeds: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One head forward over new positions (appended to the cache); returns their output features."""
        if self.lean is not None:
            return self.lean.step(self.cache, embeds[0], feats[0], pos[0], None if mask is None else mask[0, 0])[None]
        return self.head(embeds, feats, pos, mask, self.cache)[0]

    def _catch_up(self, ids: list[int]) -> torch.Tensor:
        pending = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        c, n = self._ctx_len, len(ids) - 1
        assert c + pending.shape[0] == n, f"{type(self).__name__}: target states out of step with committed tokens"
        toks = torch.tensor([ids[c + 1:n + 1]], device=self.device)
        pos = torch.arange(c, n, device=self.device)[None]
        t = n - c
        mask = None if c == 0 else torch.ones(t, c + t, dtype=torch.bool, device=self.device).tril(c)[None, None]
        out = self._step(self.embed(toks), self._first(pending)[None], pos, mask)
        self._ctx_len, self._root_pos = n, n - 1
        self._root_feat = out[0, -1]
        return self._logits(self._root_feat)

    def _run(self, tokens: list[int], parent_slots: list[int], positions: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
        feats = torch.stack([self._root_feat if s < 0 else self._slot_feat[s] for s in parent_slots])
        toks = torch.tensor([tokens], device=self.device)
        if self.draft_vocab is not None:  # the tree is built in draft ids
            toks = self.draft_vocab[toks]
        out = self._step(self.embed(toks), feats[None], positions, mask)
        self._slot_feat.extend(out[0].unbind(0))
        return self._logits(out[0])

    def _logits(self, feat: torch.Tensor) -> torch.Tensor:
        if self.lean is not None:
            return self.lean.logits(feat, self._lm_rows)
        return feat @ self._lm_rows.T

    def _rollback(self) -> None:
        self.cache.crop(self._ctx_len)
        self._slot_feat = []
