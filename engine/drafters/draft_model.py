"""An independent draft model: any HF causal LM sharing the target's tokenizer, with its own KV cache."""

from __future__ import annotations

import torch
from engine.cache import crop_to, new_cache
from engine.drafters.base import ModelDrafter
from tuner.schema import SpecConfig


class DraftModelDrafter(ModelDrafter):
    """Drafts with `model` (the oracle test passes the target itself). Its cache holds the committed
    tokens up to and including the root; tree nodes are run level by level and then dropped."""

    def __init__(self, spec: SpecConfig, model: torch.nn.Module) -> None:
        super().__init__(spec, next(model.parameters()).device)
        self.model = model
        self.cache = new_cache(model.config)

    def reset(self, prompt_ids: list[int]) -> None:
        self.cache = new_cache(self.model.config)
        self._ctx_len = 0

    def _catch_up(self, ids: list[int]) -> torch.Tensor:
        new = torch.tensor([ids[self._ctx_len:]], device=self.device)
        pos = torch.arange(self._ctx_len, len(ids), device=self.device)[None]
        out = self.model(input_ids=new, position_ids=pos, cache=self.cache, use_cache=True, logits_to_keep=1)
        self._ctx_len = len(ids)
        self._root_pos = len(ids) - 1
        return out.logits[0, -1]

    def _run(self, tokens: list[int], parent_slots: list[int], positions: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([tokens], device=self.device), position_ids=positions,
                         attention_mask=mask, cache=self.cache, use_cache=True)
        return out.logits[0]

    def _rollback(self) -> None:
        crop_to(self.cache, self._ctx_len)
