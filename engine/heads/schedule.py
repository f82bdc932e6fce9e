"""What every draft trainer (EAGLE heads, Medusa heads, draft models) shares: the split of prompts
into training and validation, the batches of an epoch, the learning-rate schedule and early
stopping. One copy, so the three trainers read train.* the same way.

- Split: whole prompts go to validation (`train.eval_fraction` of them, seeded), so no answer is
  half seen; fixed text never validates (validation measures what serving meets: the target's own
  answers) and stays in training.
- Steps: `train.epochs` passes over the training examples, capped by `train.steps`; an epoch's
  batches come from a permutation seeded by (seed, epoch), so any step's batch is known without
  replaying the ones before (a resumed run is exact).
- LR: linear warm-up for `train.warmup` steps, then cosine decay to 10% of the peak.
- Early stop: the validation loss every `train.eval_every` steps (and at the last); the best
  weights are kept; training stops after `train.patience` validations without improvement.
- Precision: a training step's matmuls run in bfloat16 (autocast; fp32 weights, optimizer and
  validation) where the hardware multiplies bf16 natively (`train.precision=auto`: a GPU, or a CPU
  with avx512_bf16 or AMX), else in fp32: emulated bf16 is slower than fp32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.heads.data import FIXED_TEXT, DistillData
from tuner.schema.config import TrainConfig

Report = Callable[[str, int, int, dict], None]  # report(phase, done, total, info), e.g. ("train", step, steps, {"loss"})
MIN_GAIN = 1e-4  # a validation loss must fall by more than this to count as an improvement


def split_prompts(data: DistillData, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training sequences, validation sequences) of `data`, split by whole prompts."""
    prompts = sorted({int(p) for p, s in zip(data.prompt_idx.tolist(), data.sampled.tolist()) if s != FIXED_TEXT})
    g = torch.Generator().manual_seed(seed)
    perm = [prompts[i] for i in torch.randperm(len(prompts), generator=g).tolist()]
    n_val = max(1, int(round(fraction * len(prompts)))) if len(prompts) > 1 and fraction > 0 else 0
    val = set(perm[:n_val])
    pidx = data.prompt_idx.tolist()
    return [i for i, p in enumerate(pidx) if p not in val], [i for i, p in enumerate(pidx) if p in val]


def epoch_steps(n_examples: int, per_step: int) -> int:
    """Whole batches of `per_step` examples in one pass over `n_examples` (at least one)."""
    return max(1, n_examples // max(per_step, 1))


def total_steps(tc: TrainConfig, per_epoch: float) -> int:
    """Steps of a run: train.epochs passes of `per_epoch` steps each, capped by train.steps."""
    return max(1, min(tc.steps, int(math.ceil(tc.epochs * per_epoch))))


def batch_ids(train_seqs: Sequence[int], tc: TrainConfig, step: int) -> list[int]:
    """The training sequences of one step: train.batch of them, from the permutation of the step's
    epoch (seeded by train.seed and the epoch)."""
    per_epoch = epoch_steps(len(train_seqs), tc.batch)
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(tc.seed * 7919 + epoch)
    perm = torch.randperm(len(train_seqs), generator=g).tolist()
    return [train_seqs[i] for i in perm[k * tc.batch:(k + 1) * tc.batch]] or list(train_seqs[:tc.batch])


def lr_at(tc: TrainConfig, step: int, total: int, scale: float = 1.0) -> float:
    """The learning rate of `step` of `total`: linear warm-up to train.lr * scale, then cosine decay
    to 10% of it."""
    peak = tc.lr * scale
    if step < tc.warmup:
        return peak * (step + 1) / tc.warmup
    p = (step - tc.warmup) / max(1, total - tc.warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


class EarlyStop:
    """Validation every train.eval_every steps (and at the last step); keeps the best weights and
    says stop after train.patience validations without improvement (0: never).

    Its state is a plain dict (`val`: [(step, loss)], `best`: the best weights, `best_val`, `bad`)
    that a trainer may keep inside its checkpoint and hand back to resume.
    """

    def __init__(self, tc: TrainConfig, state: dict[str, Any] | None = None) -> None:
        self.every, self.patience = tc.eval_every, tc.patience
        self.state = state if state is not None else {}
        for k, v in (("val", []), ("best", None), ("best_val", float("inf")), ("bad", 0)):
            self.state.setdefault(k, v)
        self.last: float | None = None  # the loss validated at the latest check (None: none was due)

    @property
    def history(self) -> list[tuple[int, float]]:
        """(step, validation loss rounded to 5 digits) of every validation so far."""
        return self.state["val"]

    @property
    def best(self) -> float:
        return self.state["best_val"]

    def check(self, step: int, last: bool, model: torch.nn.Module, val: Callable[[], float]) -> bool:
        """After training step `step` (1-based; `last`: the run's final one): validate with `val()`
        when due, keep `model`'s weights when they are the best so far; True when training should stop."""
        self.last = None
        if step % self.every == 0 or last:
            v = self.last = val()
            self.state["val"].append((step, round(v, 5)))
            if v < self.state["best_val"] - MIN_GAIN:
                self.state.update(best_val=v, bad=0,
                                  best={k: t.detach().clone() for k, t in model.state_dict().items()})
            else:
                self.state["bad"] += 1
        return bool(self.patience) and self.state["bad"] >= self.patience

    def restore(self, model: torch.nn.Module) -> None:
        """Load the best weights validated into `model` (nothing when none was validated)."""
        if self.state["best"] is not None:
            model.load_state_dict(self.state["best"])


def train_precision(tc: TrainConfig, device: torch.device | str = "cpu") -> str:
    """What train.precision means on `device`: "bf16" or "fp32" (auto: bf16 where it is native)."""
    if tc.precision != "auto":
        return tc.precision
    if torch.device(device).type == "cuda":
        return "bf16"
    from engine.models.machine import cpu_signature

    flags = cpu_signature().split("|")[-2].split(",")  # "model|flags|threads"
    return "bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else "fp32"


def step_precision(tc: TrainConfig, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """The context a training step's forward runs in: bf16 autocast, or nothing (fp32)."""
    if train_precision(tc, device) == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
