"""The one data object of the head pipeline: the target's answers with features and labels.

Sequences are laid end to end: sequence i is tokens[offsets[i]:offsets[i+1]] (prompt, then the
target's answer, EOS included when reached); its answer starts at offsets[i] + starts[i]. Per token j:
features[j] the target's final hidden state after its final norm (float16; the last token of a
sequence has none: zeros), labels[j] the target's greedy choice for token j+1 (-100 where unknown:
prompt positions before the last one), topk_ids / topk_probs [j, k] the target's top-k next-token
distribution (soft labels; zeros where unknown). In a teacher-forced fixed-text sequence the
"answer" is the fixed reply and labels[j] is still the target's own greedy choice there.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

DATA_FILE = "data.safetensors"
IGNORE = -100
FIXED_TEXT = 2  # `sampled` of a teacher-forced fixed-text sequence (0: the target's greedy answer)


@dataclass
class DistillData:
    tokens: torch.Tensor  # int64 [N]
    features: torch.Tensor  # float16 [N, h]
    labels: torch.Tensor  # int64 [N]
    topk_ids: torch.Tensor  # int64 [N, k]
    topk_probs: torch.Tensor  # float16 [N, k]
    offsets: torch.Tensor  # int64 [S+1]
    starts: torch.Tensor  # int64 [S]
    prompt_idx: torch.Tensor  # int64 [S]: which prompt a sequence answers
    sampled: torch.Tensor  # int64 [S]: 0 greedy answer, 1 sampled answer, FIXED_TEXT teacher-forced text
    meta: dict
    aux: torch.Tensor | None = None  # float16 [N, 3h]: EAGLE-3's target layer inputs (None unless asked)

    @property
    def num_sequences(self) -> int:
        return len(self.starts)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(tokens, features, labels, answer start) of sequence i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.features[a:b], self.labels[a:b], int(self.starts[i])

    def response_labels(self) -> torch.Tensor:
        """Greedy labels at answer positions (from the last prompt token on): what drafts must hit."""
        keep = self.labels != IGNORE
        return self.labels[keep]

    @classmethod
    def from_answers(cls, prompts: Sequence[Sequence[int]], answers: Sequence[dict], prompt_idx: Sequence[int],
                     meta: dict) -> "DistillData":
        """Lay out the answers of engine.heads.answers.answer_batch as one DistillData."""
        toks, feats, labels, tki, tkp, lens, starts, auxs = [], [], [], [], [], [0], [], []
        h = answers[0]["features"].shape[1]
        k = answers[0]["topk_ids"].shape[1]
        for p, a in zip(prompts, answers):
            seq = list(p) + a["answer"]
            n, m = len(seq), len(a["answer"])
            f = torch.zeros(n, h, dtype=torch.float16)
            f[: n - 1] = a["features"]
            if "aux" in a:
                x = torch.zeros(n, a["aux"].shape[1], dtype=torch.float16)
                x[: n - 1] = a["aux"]
                auxs.append(x)
            lab = torch.full((n,), IGNORE, dtype=torch.long)
            ids = torch.zeros(n, k, dtype=torch.long)
            pr = torch.zeros(n, k, dtype=torch.float16)
            lab[len(p) - 1: n - 1] = a["labels"] if "labels" in a else torch.tensor(a["answer"])
            ids[len(p) - 1: n - 1] = a["topk_ids"]
            pr[len(p) - 1: n - 1] = a["topk_probs"]
            toks.append(torch.tensor(seq))
            feats.append(f)
            labels.append(lab)
            tki.append(ids)
            tkp.append(pr)
            lens.append(n)
            starts.append(len(p))
        info = dict(meta)
        info.update(sequences=len(prompts), tokens=int(sum(lens)))
        return cls(tokens=torch.cat(toks), features=torch.cat(feats), labels=torch.cat(labels),
                   topk_ids=torch.cat(tki), topk_probs=torch.cat(tkp),
                   offsets=torch.tensor(lens).cumsum(0), starts=torch.tensor(starts),
                   prompt_idx=torch.tensor(list(prompt_idx)), sampled=torch.zeros(len(prompts), dtype=torch.long),
                   meta=info, aux=torch.cat(auxs) if auxs else None)

    def subset(self, seqs: Sequence[int]) -> "DistillData":
        """The sequences `seqs` only (e.g. a training-size sweep)."""
        idx = torch.cat([torch.arange(int(self.offsets[i]), int(self.offsets[i + 1])) for i in seqs])
        lens = torch.tensor([0] + [int(self.offsets[i + 1] - self.offsets[i]) for i in seqs])
        return DistillData(tokens=self.tokens[idx], features=self.features[idx], labels=self.labels[idx],
                           topk_ids=self.topk_ids[idx], topk_probs=self.topk_probs[idx], offsets=lens.cumsum(0),
                           starts=self.starts[list(seqs)], prompt_idx=self.prompt_idx[list(seqs)],
                           sampled=self.sampled[list(seqs)], meta=dict(self.meta, subset=len(seqs)),
                           aux=None if self.aux is None else self.aux[idx])

    @classmethod
    def concat(cls, parts: Sequence["DistillData"]) -> "DistillData":
        """The sequences of every part, in order; prompt indices of later parts are shifted past the
        earlier ones (a prompt of one part is never a prompt of another)."""
        shift, pidx, lens = 0, [], [torch.zeros(1, dtype=torch.long)]
        for d in parts:
            pidx.append(d.prompt_idx + shift)
            shift += int(d.prompt_idx.max()) + 1 if d.num_sequences else 0
            lens.append(d.offsets[1:] - d.offsets[:-1])
        auxs = [d.aux for d in parts]
        meta = dict(parts[0].meta, parts=[d.meta for d in parts], tokens=sum(d.num_tokens for d in parts))
        return cls(tokens=torch.cat([d.tokens for d in parts]), features=torch.cat([d.features for d in parts]),
                   labels=torch.cat([d.labels for d in parts]), topk_ids=torch.cat([d.topk_ids for d in parts]),
                   topk_probs=torch.cat([d.topk_probs for d in parts]), offsets=torch.cat(lens).cumsum(0),
                   starts=torch.cat([d.starts for d in parts]), prompt_idx=torch.cat(pidx),
                   sampled=torch.cat([d.sampled for d in parts]), meta=meta,
                   aux=None if any(a is None for a in auxs) else torch.cat(auxs))

    def save(self, path: Path) -> None:
        """Write atomically (safetensors)."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".data.")
        os.close(fd)
        extra = {} if self.aux is None else {"aux": self.aux.to(torch.float16).contiguous()}
        save_file({**extra, "tokens": self.tokens.to(torch.int32), "features": self.features.to(torch.float16).contiguous(),
                   "labels": self.labels.to(torch.int32), "topk_ids": self.topk_ids.to(torch.int32).contiguous(),
                   "topk_probs": self.topk_probs.to(torch.float16).contiguous(), "offsets": self.offsets,
                   "starts": self.starts, "prompt_idx": self.prompt_idx, "sampled": self.sampled},
                  tmp, metadata={"meta": json.dumps(self.meta)})
        os.replace(tmp, path / DATA_FILE)

    @classmethod
    def load(cls, path: Path) -> "DistillData":
        from safetensors import safe_open

        with safe_open(str(path / DATA_FILE), framework="pt") as f:
            meta = json.loads(f.metadata()["meta"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        return cls(tokens=t["tokens"].long(), features=t["features"], labels=t["labels"].long(),
                   topk_ids=t["topk_ids"].long(), topk_probs=t["topk_probs"], offsets=t["offsets"],
                   starts=t["starts"], prompt_idx=t["prompt_idx"], sampled=t["sampled"], meta=meta, aux=t.get("aux"))
