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
  validation) or fp32. `train.precision=auto`: bf16 on a GPU; on a CPU the faster of the two by a
  short timed training step (`timed_train_precision`: once per machine, cached), not by CPU flags,
  the rule engine.builtin.weights=auto follows (tuner.schema.precision.timed_choice). Not the
  engine's weights either: decoding is bound by reading the weights, so bf16 weights decode faster
  even where bf16 arithmetic is emulated, while a training step's matmuls are bound by that arithmetic
  (on the 2-core AVX2 EPYC bf16 autocast made them 9-30x slower, docs/results.md, issue 40).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.heads.data import FIXED_TEXT, DistillData
from tuner.schema.config import TrainConfig
from tuner.schema.precision import timed_choice

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


# the timed training step: a decoder MLP's two matmuls (SmolLM2's widths), forward and backward, over
# TIMED_ROWS tokens (a training batch holds thousands; fewer keep an emulated bf16 step under a second here)
TIMED_ROWS, TIMED_WIDTHS = 128, (576, 1536)
TIMED_ROUNDS = 3  # steps of each precision, alternating; the fastest counts (another process only adds time)
TIMED_VERSION = 2  # in the cache key: a change of what is timed (or of the entry's layout) measures again
_CHOSEN: dict[str, tuple[str, str]] = {}  # this process's resolved choices by cache key


def time_train_steps(rounds: int = TIMED_ROUNDS) -> dict[str, dict[str, float]]:
    """Milliseconds of the timed training step per precision ({"fp32": {"128 rows": ms}, "bf16": ...}):
    the fastest of `rounds`, the precisions alternating after a warm-up of each. A precision whose step
    took over 3x the other's fastest stops early (only a step 3x faster than its others could change the
    choice). Runs with autograd on wherever it is called from."""
    with torch.inference_mode(False), torch.enable_grad():
        return _time_train_steps(rounds)


def _time_train_steps(rounds: int) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(0)
    h, f = TIMED_WIDTHS
    w1 = (torch.randn(f, h, generator=g) * h ** -0.5).requires_grad_()
    w2 = (torch.randn(h, f, generator=g) * f ** -0.5).requires_grad_()
    x = torch.randn(TIMED_ROWS, h, generator=g)

    def step(precision: str) -> float:
        t = time.perf_counter()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        with ctx:
            y = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, w1)), w2)
        y.float().square().mean().backward()
        w1.grad = w2.grad = None
        return (time.perf_counter() - t) * 1e3

    best = {p: step(p) for p in ("fp32", "bf16")}  # warm-up; counts only where it stops early below
    done: set[str] = set()
    for _ in range(rounds):
        for p, other in (("fp32", "bf16"), ("bf16", "fp32")):
            if p not in done:
                best[p] = min(best[p], step(p))
                if best[p] > 3 * best[other]:
                    done.add(p)
    return {p: {f"{TIMED_ROWS} rows": round(ms, 3)} for p, ms in best.items()}


def timed_train_precision(cache_dir: str | os.PathLike | None = None,
                          measure: Callable[[], dict[str, dict[str, float]]] = time_train_steps) -> tuple[str, str]:
    """(precision, reason in one line) that train.precision=auto takes on this CPU: the faster of fp32
    and bf16 autocast by `measure` (a timed training step), fp32 unless bf16 is at least AUTO_MARGIN
    faster (tuner.schema.precision.timed_choice). Timed once per machine (CPU, threads, torch) and kept
    in <cache>/train_precision.json (a head's key holds the choice: it must not move between runs),
    unless timed while other processes kept the CPUs busy (machine.timed_once: then this process's
    alone); without a writable cache, once per process."""
    from engine.models.machine import cache_root, cpu_signature, timed_once

    key = "|".join([cpu_signature(), f"torch {torch.__version__}", f"v{TIMED_VERSION}"])
    path = cache_root(cache_dir) / "train_precision.json"
    memo = f"{path}|{key}"
    if memo not in _CHOSEN:
        try:
            ms = timed_once(path, key, lambda _old: {"ms": measure()}, "the training step's timing")["ms"]
        except OSError:
            ms = measure()
        _CHOSEN[memo] = timed_choice(ms, "training step")
    return _CHOSEN[memo]


def train_precision(tc: TrainConfig, device: torch.device | str = "cpu") -> str:
    """What train.precision means on `device`: "bf16" or "fp32" (auto: bf16 on a GPU, on a CPU the
    faster by a timed training step, `timed_train_precision`)."""
    if tc.precision != "auto":
        return tc.precision
    if torch.device(device).type == "cuda":
        return "bf16"
    return timed_train_precision()[0]


def step_precision(tc: TrainConfig, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """The context a training step's forward runs in: bf16 autocast, or nothing (fp32)."""
    if train_precision(tc, device) == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
