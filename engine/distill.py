"""Self-distillation data for draft heads: the target's own answers and its final hidden states.

A draft head must predict what *this* target says next, so its data is the target's own responses
(one greedy, `train.samples` sampled) to the workload's prompts plus the other packaged prompt sets
for diversity. Held-out prompts of every workload given are excluded, so held-out measurements stay
honest. Per sequence we keep the tokens (prompt + response, EOS included), the target's final
hidden state after its final norm at every position (the EAGLE feature), and the target's greedy
next token at every position (the label: at T=0 a draft is accepted iff it equals that token).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.workloads import Prompt, _pool, load_prompts
from tuner.schema import TrainConfig, UserError, WorkloadConfig

DATA_FILE = "data.safetensors"
Progress = Callable[[int, int], None]  # (done, total)


@dataclass
class DistillData:
    """Sequences laid end to end: sequence i is [offsets[i], offsets[i+1]); its response starts at
    offsets[i] + starts[i]. features[j] is the target's normed final hidden state at token j and
    labels[j] the target's greedy choice for token j+1."""

    tokens: torch.Tensor  # int64 [N]
    features: torch.Tensor  # float32 [N, h]
    labels: torch.Tensor  # int64 [N]
    offsets: torch.Tensor  # int64 [S+1]
    starts: torch.Tensor  # int64 [S]
    prompt_idx: torch.Tensor  # int64 [S]: which prompt a sequence answers
    sampled: torch.Tensor  # int64 [S]: 0 greedy, 1 sampled
    meta: dict

    @property
    def num_sequences(self) -> int:
        return len(self.starts)

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.features[a:b], self.labels[a:b], int(self.starts[i])

    def response_labels(self) -> torch.Tensor:
        """Labels at response positions (from the last prompt token on): what drafts must hit."""
        idx = [torch.arange(int(self.offsets[i]) + max(int(self.starts[i]) - 1, 0), int(self.offsets[i + 1]) - 1)
               for i in range(self.num_sequences)]
        return self.labels[torch.cat(idx)] if idx else self.labels[:0]

    def save(self, path: Path) -> None:
        """Write atomically (safetensors; features stored as float16 to halve the size)."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".data.")
        os.close(fd)
        save_file({"tokens": self.tokens.to(torch.int32), "features": self.features.to(torch.float16),
                   "labels": self.labels.to(torch.int32), "offsets": self.offsets, "starts": self.starts,
                   "prompt_idx": self.prompt_idx, "sampled": self.sampled},
                  tmp, metadata={"meta": json.dumps(self.meta)})
        os.replace(tmp, path / DATA_FILE)

    @classmethod
    def load(cls, path: Path) -> "DistillData":
        from safetensors import safe_open

        with safe_open(str(path / DATA_FILE), framework="pt") as f:
            meta = json.loads(f.metadata()["meta"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        return cls(tokens=t["tokens"].long(), features=t["features"].float(), labels=t["labels"].long(),
                   offsets=t["offsets"], starts=t["starts"], prompt_idx=t["prompt_idx"], sampled=t["sampled"], meta=meta)


def collect_prompts(primary: WorkloadConfig, others: Sequence[WorkloadConfig], n: int,
                    seed: int = 0) -> list[Prompt]:
    """Up to n distinct prompts, never a held-out prompt of `primary` or of `others`: the primary
    workload's tuning split first, then half of n from the rest of its source, the other half
    shared evenly by the other workloads' sources (what one source lacks, the next fills). The
    selection is deterministic given the seed and the order of `others`."""
    workloads = [primary, *[w for w in others if w.name != primary.name]]
    heldout = {p.text for w in workloads for p in load_prompts(w, "heldout")}
    rng = random.Random(seed)

    def pool(w: WorkloadConfig) -> list[Prompt]:
        if w.source == "gsm":  # generated: draw more than the tune+heldout the workload itself uses
            w = w.model_copy(update={"num_prompts": n + w.num_prompts + w.num_heldout})
        tune = load_prompts(w, "tune") if w is primary else []
        rest = _pool(w)
        rng.shuffle(rest)
        return [p for p in tune + rest if p.text not in heldout]

    pools = [pool(w) for w in workloads]
    out: list[Prompt] = []
    seen: set[str] = set()

    def take(src: list[Prompt], k: int) -> None:
        while src and k > 0 and len(out) < n:
            p = src.pop(0)
            if p.text not in seen:
                seen.add(p.text)
                out.append(p)
                k -= 1

    take(pools[0], max(n // 2, 1) if len(pools) > 1 else n)
    while len(out) < n and any(pools[1:]):
        left = [p for p in pools[1:] if p]
        share = max(1, (n - len(out)) // len(left))
        for p in left:
            take(p, share)
    take(pools[0], n - len(out))
    return out


def data_key(target_hash: str, prompts: Sequence[Prompt], chat_template: bool, train: TrainConfig) -> str:
    """Identity of a data set: target, prompts and the generation settings."""
    h = hashlib.sha256()
    h.update(json.dumps([target_hash, [p.text for p in prompts], chat_template, train.max_new_tokens,
                         train.samples, train.sample_temperature, train.seed]).encode())
    return h.hexdigest()[:16]


@torch.inference_mode()
def _generate(model, prompts: list[list[int]], max_new: int, eos: set[int], pad: int,
              sample: bool, temperature: float, seed: int) -> list[list[int]]:
    """Batched generation with left padding; each response ends at its first EOS (kept)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if sample else dict(do_sample=False)
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new, pad_token_id=pad,
                         eos_token_id=sorted(eos), **kw)[:, width:].tolist()
    res = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        res.append(row[:cut])
    return res


@torch.inference_mode()
def _features(model, seqs: list[list[int]], batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(final normed hidden states, greedy next tokens) of each full sequence, one forward each batch.
    Right padding needs no mask: causal attention never lets a real position see the padding."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(seqs)  # type: ignore[list-item]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for a in range(0, len(order), batch):
        idx = order[a:a + batch]
        width = max(len(seqs[i]) for i in idx)
        ids = torch.tensor([seqs[i] + [0] * (width - len(seqs[i])) for i in idx])
        hidden = model.model(input_ids=ids).last_hidden_state
        labels = model.lm_head(hidden).argmax(-1)
        for j, i in enumerate(idx):
            n = len(seqs[i])
            out[i] = (hidden[j, :n].float().clone(), labels[j, :n].clone())
    return out


def generate_data(model, tokenizer, encode: Callable[[str], list[int]], prompts: Sequence[Prompt],
                  train: TrainConfig, eos: set[int], on_progress: Progress | None = None,
                  meta: dict | None = None) -> DistillData:
    """Answer every prompt greedily and `train.samples` times sampled, then capture features."""
    if not prompts:
        raise UserError("train-draft: no training prompts (all were held out?)")
    encoded = [encode(p.text) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    # one sampling mode per batch; similar prompt lengths together for less padding
    batches = []
    for s in range(train.samples + 1):
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
        batches += [(order[a:a + train.gen_batch], s > 0) for a in range(0, len(order), train.gen_batch)]
    total = len(prompts) * (train.samples + 1)
    seqs: list[list[int]] = []
    starts: list[int] = []
    pidx: list[int] = []
    kinds: list[int] = []
    done = 0
    for k, (idx, sample) in enumerate(batches):
        plist = [encoded[i] for i in idx]
        resp = _generate(model, plist, train.max_new_tokens, eos, pad, sample, train.sample_temperature,
                         seed=train.seed * 100_003 + k)
        for p, r in zip(plist, resp):
            seqs.append(p + r)
            starts.append(len(p))
        pidx += idx
        kinds += [int(sample)] * len(idx)
        done += len(idx)
        if on_progress:
            on_progress(done, total)
    feats = _features(model, seqs, batch=max(1, train.gen_batch // 2))
    lens = torch.tensor([0] + [len(s) for s in seqs])
    info = dict(meta or {})
    info.update(prompts=len(prompts), sequences=len(seqs), tokens=int(lens.sum()),
                response_tokens=int(sum(len(s) - st for s, st in zip(seqs, starts))),
                sources=sorted({p.source.split("/")[0] for p in prompts}))
    return DistillData(tokens=torch.tensor([t for s in seqs for t in s]), features=torch.cat([f for f, _ in feats]),
                       labels=torch.cat([lb for _, lb in feats]), offsets=lens.cumsum(0),
                       starts=torch.tensor(starts), prompt_idx=torch.tensor(pidx), sampled=torch.tensor(kinds),
                       meta=info)
