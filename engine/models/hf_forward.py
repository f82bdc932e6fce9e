"""transformers' own forward (engine.builtin.forward=hf) behind the lean forward's interface, so the
one decode driver (engine.decode.batch) runs either without asking which: `pool` hands out caches,
`step_batch` runs a step, a cache's `commit` / `crop` keep what verification accepted.

It is the reference path for architectures the lean forward refuses: sequences run one after the
other (no rows are shared), and the engine gives it a batch of one place (engine.decode.loop)."""

from __future__ import annotations

import torch

from engine.models.cache import commit, crop_to, new_cache
from engine.models.eagle3_head import aux_features


class HFCache:
    """A transformers DynamicCache (engine.models.cache) with `KVCache`'s interface: `length`
    positions are valid; `commit` keeps the prefix and the accepted nodes, `crop` rolls back."""

    def __init__(self, config) -> None:
        self.cache = new_cache(config)
        self.length = 0

    def commit(self, prefix_len: int, accepted: list[int]) -> None:
        """Keep [0, prefix_len) and the accepted tree nodes (indices relative to the tree, in path order)."""
        commit(self.cache, prefix_len, accepted)
        self.length = prefix_len + len(accepted)

    def crop(self, length: int) -> None:
        """Roll back to the first `length` positions."""
        crop_to(self.cache, length)
        self.length = min(self.length, length)


class HFPool:
    """`KVPool`'s interface over caches of their own: each acquired cache grows as it fills."""

    def __init__(self, config) -> None:
        self.config = config

    def acquire(self, need: int) -> HFCache:
        """An empty cache (a DynamicCache grows, so `need` sizes nothing)."""
        return HFCache(self.config)

    def release(self, cache: HFCache) -> None:
        """Nothing to free: the cache goes with its last reference."""


class HFForward:
    """The HF model's forward as the decode driver calls the lean one (`LeanForward.step_batch`)."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.model = hf_model
        self.device = next(hf_model.parameters()).device

    def pool(self, slots: int, capacity: int) -> HFPool:
        """Where a batch's requests get their caches."""
        return HFPool(self.model.config)

    def new_cache(self, need: int) -> HFCache:
        """An empty cache for one sequence."""
        return HFCache(self.model.config)

    def step_batch(self, caches: list[HFCache], tokens: list[list[int]], depths: list[list[int] | None],
                   ancestors: list[torch.Tensor | None], last_only: list[bool],
                   aux_layers: tuple[int, ...] | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Sequence i runs tokens[i] after caches[i]'s `length` positions (positions length +
        depths[i], attention along ancestors[i]; causal when None), one forward each. Returns
        (final normed hidden [n, h], logits [n or 1, V], the inputs of `aux_layers` side by side
        [n, len*h] or None) per sequence, as `LeanForward.step_batch` does."""
        return [self._step(*a, aux_layers) for a in zip(caches, tokens, depths, ancestors, last_only)]

    def _step(self, cache: HFCache, tokens: list[int], depths: list[int] | None, ancestors: torch.Tensor | None,
              last_only: bool, aux_layers: tuple[int, ...] | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        dev, p, n = self.device, cache.length, len(tokens)
        ids = torch.tensor([tokens], device=dev)
        pos = (torch.arange(p, p + n, device=dev) if depths is None else torch.tensor(depths, device=dev) + p)[None]
        mask = None  # causal: transformers builds that mask itself
        if ancestors is not None:  # a branching tree: the prefix visible to all, each node sees its ancestors
            mask = torch.ones(n, p + n, dtype=torch.bool, device=dev)
            mask[:, p:] = ancestors.to(dev)
            mask = mask[None, None]
        out = self.model.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache.cache,
                               use_cache=True, output_hidden_states=bool(aux_layers))
        hidden = out.last_hidden_state[0]
        logits = self.model.lm_head(hidden[-1:] if last_only else hidden)
        cache.length = p + n
        return hidden, logits, aux_features(out.hidden_states, aux_layers, 0)
