"""Stage 3 of the head pipeline: the reduced draft vocabulary (EAGLE-3's d2t / t2d idea).

A draft step on CPU is dominated by its lm_head over 49k rows, while a few thousand tokens cover
almost everything a target says on a workload. The draft vocabulary is the N most frequent greedy
tokens of the training answers, plus tokens that must always be draftable: EOS and the other special
(chat-template) tokens, and pure-whitespace tokens (indentation in code). Drafts over the subset are
verified against the full target distribution, so losslessness never depends on it: a token outside
the subset is simply never proposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.heads.data import IGNORE, DistillData


@dataclass
class DraftVocab:
    ids: torch.Tensor  # int64 [n]: target ids, ascending (draft id i <-> target id ids[i])
    vocab_size: int  # the target's

    @property
    def t2d(self) -> torch.Tensor:
        """int64 [vocab]: draft id of each target id, -1 outside the subset."""
        out = torch.full((self.vocab_size,), -1, dtype=torch.long)
        out[self.ids] = torch.arange(len(self.ids))
        return out

    @property
    def d2t(self) -> torch.Tensor:
        """int64 [n]: offsets so that target id = draft id + d2t[draft id] (vLLM's EAGLE-3 layout)."""
        return self.ids - torch.arange(len(self.ids))

    def coverage(self, labels: torch.Tensor) -> float:
        """Share of `labels` (target greedy tokens) inside the subset."""
        return float((self.t2d[labels] >= 0).float().mean()) if len(labels) else 0.0


def always_kept(tokenizer, vocab_size: int, eos: Sequence[int]) -> list[int]:
    """EOS, special tokens, and tokens that decode to whitespace only."""
    keep = set(int(e) for e in eos) | {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i < vocab_size}
    for tok, i in tokenizer.get_vocab().items():
        if i < vocab_size and tokenizer.convert_tokens_to_string([tok]).strip() == "" and tokenizer.convert_tokens_to_string([tok]) != "":
            keep.add(int(i))
    return sorted(keep)


def build_vocab(data: DistillData, n: int, vocab_size: int, forced: Sequence[int] = ()) -> DraftVocab | None:
    """The n most frequent greedy answer tokens plus `forced`; None when n covers the whole vocabulary."""
    if n <= 0 or n >= vocab_size:
        return None
    counts = torch.bincount(data.response_labels(), minlength=vocab_size).float()
    forced_t = torch.tensor(sorted(set(forced)), dtype=torch.long)
    counts[forced_t] = float("inf")
    n = max(n, len(forced_t))
    return DraftVocab(ids=torch.sort(torch.topk(counts, n).indices).values, vocab_size=vocab_size)


def token_map(labels: torch.Tensor, n: int, vocab_size: int, eos: Sequence[int] = ()) -> torch.Tensor | None:
    """Sorted target ids of a Medusa head's or draft model's vocabulary: EOS plus the n most
    frequent `labels` (None: the full vocabulary)."""
    if n <= 0 or n >= vocab_size:
        return None
    lab = labels[labels >= 0]
    counts = torch.bincount(lab, minlength=vocab_size).float()
    for e in eos:
        counts[e] = float("inf")
    return torch.sort(torch.topk(counts, n).indices).values


def label_index(ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """int64 [vocab_size]: the draft id of each target id of `ids`, IGNORE (a loss's ignored label)
    outside them; None for the full vocabulary."""
    if ids is None:
        return None
    out = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    out[ids] = torch.arange(len(ids))
    return out
