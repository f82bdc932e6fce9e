"""KV-cache discipline shared by the target and the draft models: commit accepted tree nodes, drop the rest.

After a verification forward the cache holds the P committed tokens followed by the N tree nodes.
Committing keeps [0..P) + (P + accepted node indices) in every layer; when the accepted nodes are
the first ones (always for a chain) that is a plain crop, otherwise the accepted nodes' entries
move down to P.. in place.

`new_cache` gives transformers' DynamicCache with `GrowingLayer`s: keys and values live in a
buffer that doubles when full, so a step appends its few tokens instead of concatenating (copying)
the whole cache of every layer, as DynamicLayer does.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views [..., :length, :] of a doubling buffer."""

    _MIN_CAPACITY = 256

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, need: int) -> None:
        cap = 0 if self._kbuf is None else self._kbuf.shape[-2]
        if need <= cap:
            return
        cap = max(need, 2 * cap, self._MIN_CAPACITY)
        kb = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
        vb = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
        if self._len:
            kb[..., :self._len, :] = self._kbuf[..., :self._len, :]
            vb[..., :self._len, :] = self._vbuf[..., :self._len, :]
        self._kbuf, self._vbuf = kb, vb

    def _set_len(self, length: int) -> None:
        self._len = length
        self.keys = self._kbuf[..., :length, :]
        self.values = self._vbuf[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(key_states, value_states, self._len + n)
        self._kbuf[..., self._len:self._len + n, :] = key_states
        self._vbuf[..., self._len:self._len + n, :] = value_states
        self._set_len(self._len + n)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove (got {tokens_to_remove})")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._set_len(max(0, self._len + tokens_to_remove))

    @torch.inference_mode()  # the buffers are inference tensors when filled by an inference forward
    def keep(self, prefix_len: int, positions: torch.Tensor) -> None:
        """Keep [0..prefix_len) followed by the entries at `positions` (absolute, ascending)."""
        k = self._kbuf.index_select(-2, positions)  # a copy: the source and target ranges overlap
        v = self._vbuf.index_select(-2, positions)
        m = positions.numel()
        self._kbuf[..., prefix_len:prefix_len + m, :] = k
        self._vbuf[..., prefix_len:prefix_len + m, :] = v
        self._set_len(prefix_len + m)

    @torch.inference_mode()
    def batch_keep(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (batched generation drops the sequences that finished)."""
        self._kbuf = self._kbuf.index_select(0, rows)
        self._vbuf = self._vbuf.index_select(0, rows)
        self._set_len(self._len)

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._len = 0
        super().reset()


def new_cache(config) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers are GrowingLayers."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def cache_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer."""
    extra = cache_len(cache) - length
    if extra > 0:
        cache.crop(-extra)


def commit(cache: DynamicCache, prefix_len: int, accepted: list[int]) -> None:
    """Keep the prefix and the accepted tree nodes (indices relative to the tree, in path order)."""
    if accepted == list(range(len(accepted))):
        crop_to(cache, prefix_len + len(accepted))
        return
    pos = torch.tensor(accepted, device=cache.layers[0].keys.device) + prefix_len
    idx = None  # DynamicLayers keep prefix + accepted by index_select
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.keep(prefix_len, pos)
            continue
        if idx is None:
            idx = torch.cat([torch.arange(prefix_len, device=pos.device), pos])
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


class KVBuffer:
    """Keys/values [B, kv_heads, capacity, d] of a draft head in a buffer that doubles when full,
    `length` of them valid: appending writes in place, a rollback is a length change (the same
    discipline as GrowingLayer, for heads that are not transformers models). Keys that carry
    gradients (training-time-test unrolling) are concatenated instead, since autograd must not see
    a tensor it saved being overwritten."""

    _MIN_CAPACITY = 256

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add [B, kv, n, d] after the valid entries; returns all valid keys and values (views)."""
        n, at = k.shape[-2], self.length
        if k.requires_grad or v.requires_grad:
            if at:
                k = torch.cat([self.k[..., :at, :], k], dim=-2)
                v = torch.cat([self.v[..., :at, :], v], dim=-2)
            self.k, self.v, self.length = k, v, at + n
            return k, v
        need = at + n
        if self.k is None or need > self.k.shape[-2] or self.k.shape[:-2] != k.shape[:-2]:
            cap = max(need, 2 * (0 if self.k is None else self.k.shape[-2]), self._MIN_CAPACITY)
            kb = k.new_empty(*k.shape[:-2], cap, k.shape[-1])
            vb = v.new_empty(*v.shape[:-2], cap, v.shape[-1])
            if at:
                kb[..., :at, :] = self.k[..., :at, :]
                vb[..., :at, :] = self.v[..., :at, :]
            self.k, self.v = kb, vb
        self.k[..., at:need, :] = k
        self.v[..., at:need, :] = v
        self.length = need
        return self.k[..., :need, :], self.v[..., :need, :]

    def crop(self, length: int) -> None:
        """Keep the first `length` entries."""
        self.length = min(self.length, length)

    def reset(self) -> None:
        """Empty (the buffer is kept for the next generation)."""
        self.length = 0
