"""KV-cache discipline shared by the target and the draft models: commit accepted tree nodes, drop the rest.

After a verification forward the cache holds the P committed tokens followed by the N tree nodes.
Committing keeps [0..P) + (P + accepted node indices) in every layer; when the accepted nodes are
the first ones (always for a chain) that is a plain crop, otherwise one index_select per layer.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


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
    keep = torch.cat([torch.arange(prefix_len), torch.tensor(accepted) + prefix_len])
    for layer in cache.layers:
        idx = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)
