"""An independent draft model: any HF causal LM sharing the target's tokenizer, with its own KV cache.

A draft directory may ship `draft_vocab.json` (written by engine.heads.draft_model_train): the drafter
then scores only those rows of the draft's lm_head (the other tokens are never drafted), which on
CPU is most of a small draft model's cost per token. Chains and trees (EAGLE-2 expansion) alike.

A Llama-family draft runs on the target's lean blocks (engine.models.llama: fused weights, oneDNN linears,
a static KV cache written by index, `LeanForward.run` for tree levels that see earlier levels'
uncommitted slots); any other architecture runs transformers' model over a DynamicCache.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.models.cache import crop_to, new_cache
from engine.drafters.base import ModelDrafter
from engine.models.kernels import linear
from engine.models.forward import LeanForward, lean_forward_of
from engine.models.kvpool import KVCache
from engine.models.llama import check_supported
from tuner.schema.config import SpecConfig, UserError

DRAFT_VOCAB = "draft_vocab.json"


def read_draft_vocab(path: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary a draft-model directory ships (None: the full vocabulary)."""
    p = Path(path).expanduser() / DRAFT_VOCAB
    if not p.is_file():
        return None
    ids = json.loads(p.read_text()).get("target_ids") or []
    if not ids or min(ids) < 0 or max(ids) >= vocab_size:
        raise UserError(f"spec.draft_model={path}: {DRAFT_VOCAB} has token ids outside the vocabulary (0..{vocab_size - 1})")
    return torch.tensor(sorted(set(ids)), dtype=torch.long)


class DraftModelDrafter(ModelDrafter):
    """Drafts with `model` (the oracle test passes the target itself). Its cache holds the committed
    tokens up to and including the root; tree nodes are run level by level and then dropped."""

    def __init__(self, spec: SpecConfig, model: torch.nn.Module, draft_ids: torch.Tensor | None = None) -> None:
        super().__init__(spec, next(model.parameters()).device)
        self.model = model
        self.lean = _lean(model)
        self.cache = self._new_cache()
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.draft_ids = None if draft_ids is None else draft_ids.to(self.device)
        self._lm_rows = (None if draft_ids is None else
                         model.get_output_embeddings().weight[self.draft_ids].detach().contiguous())
        self.peak_tokens = 0  # most positions its KV cache held (draft memory)

    def _new_cache(self):
        return KVCache(self.lean.model, 256) if self.lean is not None else new_cache(self.model.config)

    def reset(self, prompt_ids: list[int]) -> None:
        if self.lean is not None and isinstance(self.cache, KVCache):
            self.cache.crop(0)  # the buffer is kept: a rollback, and a reset, are length changes
        else:
            self.cache = self._new_cache()
        self._ctx_len = 0

    def _lean_logits(self, tokens: list[int], positions: torch.Tensor, visible: torch.Tensor | None,
                     last_only: bool) -> torch.Tensor:
        hidden = self.lean.run(self.cache, tokens, positions, visible)
        if last_only:
            hidden = hidden[-1:]
        return linear(hidden, self.lean.model.lm_head) if self._lm_rows is None else self._subset_logits(hidden)

    def _forward(self, last_only: bool = False, **kw) -> torch.Tensor:
        """Logits of the new positions (only the last one with last_only), over the draft vocabulary
        when there is one."""
        if self._lm_rows is None:
            return self.model(**kw, use_cache=True, logits_to_keep=int(last_only)).logits[0]
        hidden = self.model.model(**kw, use_cache=True).last_hidden_state[0]
        return self._subset_logits(hidden[-1:] if last_only else hidden)

    def _subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits that are -inf outside the draft vocabulary."""
        full = hidden.new_full((hidden.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_ids] = linear(hidden, self._lm_rows)
        return full

    def _catch_up(self, ids: list[int]) -> torch.Tensor:
        if self.lean is not None:
            logits = self._lean_logits(ids[self._ctx_len:], torch.arange(self._ctx_len, len(ids), device=self.device),
                                       None, True)
            self._ctx_len = len(ids)
            self._root_pos = len(ids) - 1
            return logits[-1]
        new = torch.tensor([ids[self._ctx_len:]], device=self.device)
        pos = torch.arange(self._ctx_len, len(ids), device=self.device)[None]
        logits = self._forward(True, input_ids=new, position_ids=pos, cache=self.cache)
        self._ctx_len = len(ids)
        self._root_pos = len(ids) - 1
        return logits[-1]

    def _run(self, tokens: list[int], parent_slots: list[int], positions: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
        if self.lean is not None:
            logits = self._lean_logits(tokens, positions[0], mask[0, 0], False)
            self.peak_tokens = max(self.peak_tokens, self._ctx_len + self._n_slots)
            return logits
        logits = self._forward(input_ids=torch.tensor([tokens], device=self.device), position_ids=positions,
                               attention_mask=mask, cache=self.cache)
        self.peak_tokens = max(self.peak_tokens, self._ctx_len + self._n_slots)
        return logits

    def _rollback(self) -> None:
        self.peak_tokens = max(self.peak_tokens, self._ctx_len)
        if isinstance(self.cache, KVCache):
            self.cache.crop(self._ctx_len)
        else:
            crop_to(self.cache, self._ctx_len)


def _lean(model: torch.nn.Module) -> LeanForward | None:
    """The draft's lean forward (eager), or None for an architecture the lean blocks do not carry."""
    try:
        check_supported(model.config)
    except UserError:
        return None
    return lean_forward_of(model)
