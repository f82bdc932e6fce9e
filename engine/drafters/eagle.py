"""The EAGLE-1 drafter: the head of engine.models.eagle_head over the target's features, embedding and lm_head."""

from __future__ import annotations

import torch

from engine.models.cache import KVBuffer
from engine.drafters.base import CatchUp, ModelDrafter
from engine.drafters.lean_head import HeadRows, lean_head
from engine.models.eagle_head import EagleHead
from engine.models.forward import lean_model_of
from engine.models.kernels import pack_weights
from engine.trees.tree import Expansion
from tuner.schema.config import SpecConfig


class EagleDrafter(ModelDrafter):
    """The head's cache holds position t = (token t+1, feature t) for every committed t < n, where
    ids[n] is the root. A tree node at depth d runs at position n-1+d with its parent's predicted
    feature. The head runs on the lean layer (engine.drafters.lean_head: fused weights, oneDNN
    linears, a static cache written by index); a head with extra biases runs its module over a
    KVBuffer. Either cache grows in place; a rollback is a length change.

    A head with a draft vocabulary scores only those rows of the target's lm_head (on CPU the full
    lm_head is most of a draft step) and the tree is built in draft ids (ModelDrafter.draft_vocab).

    Each forward is split in three so that several drafters of one head can share it
    (engine.drafters.lockstep): `_rows` (the step's inputs), the head forward, `_keep` (the outputs
    later steps need); `_logits` then scores them."""

    def __init__(self, spec: SpecConfig, head: EagleHead, target: torch.nn.Module) -> None:
        super().__init__(spec, next(target.parameters()).device)
        self.head = head
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = self.lm_head.weight.shape[0]
        ids = head.draft_ids
        self.draft_vocab = None if ids is None else ids.to(self.device)
        self._lm_rows = _draft_rows(head, target, self.lm_head.weight, self.draft_vocab)
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

    def lockstep_key(self) -> tuple[int, int] | None:
        """Drafters with equal keys can share a head forward (the same LeanHead and logits rows);
        None: this one drafts alone (its head runs as a module)."""
        return None if self.lean is None else (id(self.lean), id(self._lm_rows))

    def _first(self, pending: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The head's input features for committed positions and whether the head's fc still applies
        to them (EAGLE-1: the target's features, no)."""
        return pending.to(self._lm_rows.dtype), False

    def _step(self, rows: HeadRows) -> torch.Tensor:
        """One head forward over one draft's rows (appended to the cache); returns their output features [n, h]."""
        if self.lean is not None:
            return self.lean.step_batch([rows])[0]
        mask = None if rows.visible is None else rows.visible[None, None]
        return self.head(rows.embeds[None], rows.feats[None], rows.positions[None], mask, self.cache)[0][0]

    def _catch_up_rows(self, ids: list[int]) -> HeadRows:
        """The rows of the committed positions the head has not seen: (token t+1, feature t) at position t."""
        pending = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        c, n = self._ctx_len, len(ids) - 1
        assert c + pending.shape[0] == n, f"{type(self).__name__}: target states out of step with committed tokens"
        toks = torch.tensor(ids[c + 1:n + 1], device=self.device)
        t = n - c
        mask = None if c == 0 else torch.ones(t, c + t, dtype=torch.bool, device=self.device).tril(c)
        self._ctx_len, self._root_pos = n, n - 1
        feats, fuse = self._first(pending)
        return HeadRows(self.cache, self.embed(toks), feats, torch.arange(c, n, device=self.device), mask, fuse)

    def _level_rows(self, tokens: list[int], parent_slots: list[int], positions: torch.Tensor,
                    mask: torch.Tensor) -> HeadRows:
        """The rows of a tree level: each node's token with its parent's predicted feature."""
        feats = torch.stack([self._root_feat if s < 0 else self._slot_feat[s] for s in parent_slots])
        toks = torch.tensor(tokens, device=self.device)
        if self.draft_vocab is not None:  # the tree is built in draft ids
            toks = self.draft_vocab[toks]
        return HeadRows(self.cache, self.embed(toks), feats, positions[0], mask[0, 0])

    def _rows(self, step: CatchUp | Expansion) -> HeadRows:
        """The rows a draft step (a CatchUp or an Expansion) runs; an Expansion's nodes take their slots."""
        if isinstance(step, CatchUp):
            return self._catch_up_rows(step.ids)
        return self._level_rows(step.tokens, *self._place(step.nodes, step.parents, step.level))

    def _keep(self, out: torch.Tensor, catch_up: bool) -> torch.Tensor:
        """Keep a forward's output features for the levels after it; returns those to score: the
        root's after a catch-up, every node's after a level."""
        if catch_up:
            self._root_feat = out[-1]
            return out[-1:]
        self._slot_feat.extend(out.unbind(0))
        return out

    def _catch_up(self, ids: list[int]) -> torch.Tensor:
        return self._logits(self._keep(self._step(self._catch_up_rows(ids)), True))[0]

    def _run(self, tokens: list[int], parent_slots: list[int], positions: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
        return self._logits(self._keep(self._step(self._level_rows(tokens, parent_slots, positions, mask)), False))

    def _logits(self, feat: torch.Tensor) -> torch.Tensor:
        if self.lean is not None:
            return self.lean.logits(feat, self._lm_rows)
        return feat @ self._lm_rows.T

    def _rollback(self) -> None:
        self.cache.crop(self._ctx_len)
        self._slot_feat = []


def _draft_rows(head: EagleHead, target: torch.nn.Module, lm_weight: torch.Tensor,
                draft_vocab: torch.Tensor | None) -> torch.Tensor:
    """The lm_head rows the head scores (all, or those of its draft vocabulary), made once per head
    and lm_head: every request's drafter shares them (one copy in memory, one logits matmul for a
    batch of drafts). They read as the target's lm_head does in its format (2 bytes a weight beside
    bf16 and fp8 targets): the whole lm_head is most of a draft step's bytes."""
    cached = getattr(head, "_draft_rows", None)
    if cached is None or cached[0] is not lm_weight:
        lean = lean_model_of(target)
        if draft_vocab is None:  # the target's own lm_head, with its packed copies where its lean forward made them
            rows = lean.lm_head if lean is not None and lean.lm_head.data_ptr() == lm_weight.data_ptr() \
                else lm_weight.detach()
        else:  # the draft vocabulary's rows, packed as the target packs its lm_head (bf16 beside fp8 weights)
            rows = lm_weight[draft_vocab].detach().contiguous()
            weights = getattr(target, "spectune_weights", "fp32")
            pack_weights([rows], ["bf16" if weights == "fp8" else weights])
        cached = (lm_weight, rows)
        head._draft_rows = cached
    return cached[1]
