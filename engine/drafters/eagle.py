"""The EAGLE-1 drafter: the head of engine.eagle over the target's features, embedding and lm_head."""

from __future__ import annotations

import torch

from engine.drafters.base import ModelDrafter
from engine.eagle import EagleHead
from tuner.schema import SpecConfig


class EagleDrafter(ModelDrafter):
    """The head's cache holds position t = (token t+1, feature t) for every committed t < n, where
    ids[n] is the root. A tree node at depth d runs at position n-1+d with its parent's predicted
    feature."""

    def __init__(self, spec: SpecConfig, head: EagleHead, target: torch.nn.Module) -> None:
        super().__init__(spec, next(target.parameters()).device)
        self.head = head
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        # a head with a draft vocabulary scores only those rows of the lm_head (most of a draft
        # step's cost on CPU); the other tokens get -inf, so the tree never proposes them
        self._vocab = head.draft_ids
        self._lm_rows = None if self._vocab is None else self.lm_head.weight[self._vocab].detach().contiguous()
        self._pending: list[torch.Tensor] = []
        self._past: tuple[torch.Tensor, torch.Tensor] | None = None
        self._root_feat: torch.Tensor | None = None
        self._slot_feat: list[torch.Tensor] = []

    def reset(self, prompt_ids: list[int]) -> None:
        self._pending, self._past, self._ctx_len, self._slot_feat = [], None, 0, []

    def observe(self, features: torch.Tensor) -> None:
        self._pending.append(features)

    def _catch_up(self, ids: list[int]) -> torch.Tensor:
        feats = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        c, n = self._ctx_len, len(ids) - 1
        assert c + feats.shape[0] == n, "EAGLE drafter: features out of step with committed tokens"
        toks = torch.tensor([ids[c + 1:n + 1]], device=self.device)
        pos = torch.arange(c, n, device=self.device)[None]
        t = n - c
        mask = None if self._past is None else torch.ones(t, c + t, dtype=torch.bool, device=self.device).tril(c)[None, None]
        out, self._past = self.head(self.embed(toks), feats[None], pos, mask, self._past)
        self._ctx_len, self._root_pos = n, n - 1
        self._root_feat = out[0, -1]
        return self._logits(self._root_feat)

    def _run(self, tokens: list[int], parent_slots: list[int], positions: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
        feats = torch.stack([self._root_feat if s < 0 else self._slot_feat[s] for s in parent_slots])
        toks = torch.tensor([tokens], device=self.device)
        out, self._past = self.head(self.embed(toks), feats[None], positions, mask, self._past)
        self._slot_feat.extend(out[0].unbind(0))
        return self._logits(out[0])

    def _logits(self, feat: torch.Tensor) -> torch.Tensor:
        if self._lm_rows is None:
            return self.lm_head(feat)
        full = feat.new_full((*feat.shape[:-1], self.lm_head.weight.shape[0]), float("-inf"))
        full[..., self._vocab] = feat @ self._lm_rows.T
        return full

    def _rollback(self) -> None:
        k, v = self._past
        self._past = (k[:, :, :self._ctx_len], v[:, :, :self._ctx_len])
        self._slot_feat = []
