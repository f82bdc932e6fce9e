"""The lean forward's KV caches: one sequence's static cache (`KVCache`) and the pool of slots
that batched decoding shares (`KVPool`), whose slots are `KVCache` views."""

from __future__ import annotations

import torch

from engine.models.llama import LeanLlama

# token-count buckets of the compiled layer: a step of n tokens runs padded to the next bucket, so a
# cache keeps room for the largest bucket's padding past its sequence
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def padded_capacity(need: int) -> int:
    """The capacity a cache for `need` positions gets: room for bucket padding, rounded up to 256."""
    return -(-(need + BUCKETS[-1]) // 256) * 256


class KVCache:
    """Static keys/values [layers, kv_heads, capacity, d] written by index; `length` positions are valid.

    A forward of N tokens writes slots length..length+N-1 (padding rows of a bucket write past them,
    never read). After verification, `commit` keeps the prefix plus the accepted nodes, moving them
    down in place when they are not already the first ones; dropping the rest is a length change."""

    def __init__(self, model: LeanLlama, capacity: int, pool: "KVPool | None" = None, slot: int = -1) -> None:
        self.pool, self.slot = pool, slot
        if pool is not None:  # a view of one slot of a pool (batched decoding)
            self.k, self.v = pool.k[:, slot], pool.v[:, slot]
        else:
            shape = (len(model.blocks), model.n_kv, capacity, model.head_dim)
            # empty, not zeros: a step attends only to slots that are committed or written by itself
            self.k = torch.empty(shape, device=model.device, dtype=model.dtype)
            self.v = torch.empty(shape, device=model.device, dtype=model.dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def commit(self, prefix_len: int, accepted: list[int]) -> None:
        """Keep [0, prefix_len) and the accepted tree nodes (indices relative to the tree, in path order)."""
        m = len(accepted)
        if accepted != list(range(m)):
            src = torch.tensor(accepted, device=self.k.device) + prefix_len
            # index_select copies first: source and destination ranges may overlap
            self.k[:, :, prefix_len:prefix_len + m] = self.k.index_select(2, src)
            self.v[:, :, prefix_len:prefix_len + m] = self.v.index_select(2, src)
        self.length = prefix_len + m

    def crop(self, length: int) -> None:
        """Roll back to the first `length` positions."""
        self.length = min(self.length, length)

    def reserve(self, need: int) -> None:
        """Room for `need` positions: a full cache doubles, keeping its valid entries (draft heads,
        whose sequence length is not known up front; the target's cache is sized per request)."""
        if need <= self.capacity:
            return
        if self.pool is not None:
            raise ValueError(f"KV cache full: a pool slot holds {self.capacity} positions, {need} asked")
        cap = max(need, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], cap, old.shape[3])
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)


class KVPool:
    """The KV caches of up to `slots` sequences in one tensor pair [layers, slots, kv_heads, capacity, d].

    Each sequence's `KVCache` is a view of its slot, so everything a lone cache does (step, commit,
    crop) works unchanged, while a batched step writes every sequence's new keys in one indexed
    copy and attends over a range of slots in one SDPA call instead of one call per sequence.
    Zero-initialised: a batched call reads past a sequence's length (masked), and never-written
    memory could hold NaN bit patterns that a mask does not cancel. Memory is slots x capacity
    positions; `fit` grows the capacity (copying, re-pointing the views) for a longer request."""

    def __init__(self, model: LeanLlama, slots: int, capacity: int) -> None:
        self.model, self.slots = model, slots
        self.k = self.v = torch.empty(0, device=model.device)  # the model's device: never the default one
        self.capacity = 0
        self.views: dict[int, KVCache] = {}
        self.fit(capacity)

    def fit(self, capacity: int) -> None:
        """Hold at least `capacity` positions per slot (rounded up by `padded_capacity`)."""
        capacity = padded_capacity(capacity)
        if capacity <= self.capacity:
            return
        m = self.model
        shape = (len(m.blocks), self.slots, m.n_kv, capacity, m.head_dim)
        k = torch.zeros(shape, device=m.device, dtype=m.dtype)
        v = torch.zeros(shape, device=m.device, dtype=m.dtype)
        if self.capacity:
            k[:, :, :, :self.capacity] = self.k
            v[:, :, :, :self.capacity] = self.v
        self.k, self.v, self.capacity = k, v, capacity
        for slot, view in self.views.items():
            view.k, view.v = k[:, slot], v[:, slot]

    def acquire(self, need: int) -> KVCache:
        """The lowest free slot's cache, empty, for a sequence of up to `need` positions."""
        free = next((s for s in range(self.slots) if s not in self.views), None)
        if free is None:
            raise ValueError(f"KV pool: all {self.slots} slots are in use")
        self.fit(need)
        view = KVCache(self.model, self.capacity, pool=self, slot=free)
        self.views[free] = view
        return view

    def release(self, cache: KVCache) -> None:
        """Free the cache's slot (its contents stay until a later sequence overwrites them)."""
        if self.views.get(cache.slot) is cache:
            del self.views[cache.slot]
