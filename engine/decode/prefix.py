"""Automatic prefix caching for the batch scheduler (vLLM's `enable_prefix_caching`, on by default
there): the keys and values a prompt's prefill wrote are kept, and a later prompt that starts with
the same tokens copies them into its slot and runs only the rest of its prompt.

Clients resend the same system prompt, chat template and few-shot examples, and a benchmark or a
study replays its prompts; without this the built-in engine re-runs those prefills that vLLM skips.
An entry holds one prompt's KV [layers, kv_heads, n, d] plus the final hidden states (and EAGLE-3's
inner-layer features) of its positions, because drafters that read target features are fed every
prompt position, reused or not. At least the prompt's last token always runs, so its logits (the
first new token) come from a forward. Entries are matched by exact token ids, longest common
prefix first; least recently used entries go once the kept positions pass `max_tokens`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.models.kvpool import KVCache

MIN_REUSE = 16  # positions below which copying is not worth a lookup's bookkeeping


@dataclass
class Entry:
    """One prompt's cached prefill: its ids, KV and features of every prompt position."""

    ids: tuple[int, ...]
    aux_layers: tuple[int, ...] | None  # the inner target layers whose inputs `aux` holds
    k: torch.Tensor  # [layers, kv_heads, n, d]
    v: torch.Tensor
    hidden: torch.Tensor  # [n, h]
    aux: torch.Tensor | None  # [n, len(aux_layers) * h] or None

    @property
    def tokens(self) -> int:
        return len(self.ids)


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Prompts' prefill KV and features by token ids, bounded by `max_tokens` positions (LRU)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.entries: OrderedDict[tuple[tuple[int, ...] | None, tuple[int, ...]], Entry] = OrderedDict()
        self.held = 0  # positions kept over all entries
        self.queries = 0  # prompt positions looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # positions reused (vLLM's prefix_cache_hits)

    def lookup(self, prompt: list[int], aux_layers: tuple[int, ...] | None = None) -> tuple[int, Entry | None]:
        """(n, entry): the first n positions of `prompt` can be copied from `entry` (n < len(prompt),
        so the last prompt token still runs), an entry with the features of `aux_layers`; (0, None)
        without a match worth copying."""
        self.queries += len(prompt)
        best, best_n = None, 0
        for entry in self.entries.values():
            if entry.aux_layers != aux_layers:
                continue
            n = _common(entry.ids, prompt)
            if n > best_n:
                best, best_n = entry, n
        best_n = min(best_n, len(prompt) - 1)
        if best is None or best_n < MIN_REUSE:
            return 0, None
        self.entries.move_to_end((best.aux_layers, best.ids))
        self.hits += best_n
        return best_n, best

    def restore(self, entry: Entry, n: int, cache: KVCache) -> None:
        """Copy the entry's first n positions into `cache` (empty) and mark them committed."""
        cache.k[:, :, :n] = entry.k[:, :, :n]
        cache.v[:, :, :n] = entry.v[:, :, :n]
        cache.length = n

    def store(self, prompt: list[int], cache: KVCache, hidden: torch.Tensor, aux: torch.Tensor | None,
              aux_layers: tuple[int, ...] | None = None) -> None:
        """Keep the prompt's prefill (its positions in `cache`, its features) unless an entry covers it."""
        n = len(prompt)
        if n < MIN_REUSE or n > self.max_tokens or cache.length < n or (aux is None) != (aux_layers is None):
            return
        ids = tuple(prompt)
        key = (aux_layers, ids)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if any(e.aux_layers == aux_layers and len(e.ids) >= n and e.ids[:n] == ids for e in self.entries.values()):
            return  # a longer cached prompt starts with this one
        self.entries[key] = Entry(ids, aux_layers, cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone(),
                                  hidden[:n].clone(), None if aux is None else aux[:n].clone())
        self.held += n
        while self.held > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.held -= old.tokens
