"""Training Medusa-1 heads (engine.models.medusa_head) on the target's own outputs, and the cache of trained
drafts (`ensure_trained`, shared with the draft-model trainer).

The target stays frozen and every head reads only the target's final normed hidden state, so the
self-distillation data (features + the target's greedy next tokens) is all training needs: no
target forward runs here. Head k at answer position t learns the target's greedy token t+2+k
(cross-entropy over the draft vocabulary, weight decay**k as in Medusa-1). Whole prompts are kept
out of training to measure the validation loss and the offline acceptance.

`training_data` is the one adapter to the distillation pipeline (it reads the fields tokens,
features, labels, offsets, starts, prompt_idx, sampled only); the draft-model trainer uses it too.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.medusa_head import MedusaHeads, new_heads, save_heads
from tuner.schema.config import Config, SpecConfig, TrainConfig, UserError, WorkloadConfig

META = "spectune_meta.json"
LOSS_DECAY = 0.8  # Medusa-1: head k's loss weight decay**k

# report(phase, done, total, info): phase "generate" (prompts answered) or "train" (steps, info has loss)
Report = Callable[[str, int, int, dict], None]


# --------------------------------------------------------------------------- adapter to the data pipeline

def training_data(cfg: Config, engine, workloads: Sequence[WorkloadConfig] = (), report: Report | None = None):
    """The self-distillation data of cfg's target and prompts (generated once, cached, shared with
    the EAGLE heads of the same data settings)."""
    from engine.heads.pipeline import build_data

    return build_data(cfg, engine, workloads, report)


def draft_dir(cfg: Config, method: str) -> Path:
    """Where a trained draft of `method` for cfg's target, workload and training settings lives
    (beside the EAGLE heads: <cache>/heads/<model>-<target>/<method>-<workload>-<key>)."""
    from engine.heads.pipeline import head_dir

    return head_dir(cfg, method)


def target_hash(cfg: Config) -> str:
    """Identity of the target's weights (the head cache's)."""
    from engine.heads.pipeline import target_hash as th

    return th(cfg)


# --------------------------------------------------------------------------- data -> examples

def split_prompts(data, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training sequences, validation sequences): whole prompts go to validation, and only their
    greedy answers (what T=0 acceptance is about)."""
    prompts = sorted(set(data.prompt_idx.tolist()))
    g = torch.Generator().manual_seed(seed)
    perm = [prompts[i] for i in torch.randperm(len(prompts), generator=g).tolist()]
    n_val = max(1, int(round(fraction * len(prompts)))) if len(prompts) > 1 and fraction > 0 else 0
    val = set(perm[:n_val])
    pidx, sampled = data.prompt_idx.tolist(), data.sampled.tolist()
    return ([i for i in range(len(pidx)) if pidx[i] not in val],
            [i for i in range(len(pidx)) if pidx[i] in val and sampled[i] == 0])


def answer_positions(data, seqs: Sequence[int], ahead: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions t [M], labels [M, ahead]): t runs over answer positions from the last prompt token
    on; labels[:, k] is the target's greedy token t+2+k (-100 past the sequence's end or unknown)."""
    pos, labs = [], []
    n_all = len(data.labels)
    for i in seqs:
        a, b = int(data.offsets[i]), int(data.offsets[i + 1])
        t = torch.arange(a + max(int(data.starts[i]) - 1, 0), b - 1)
        if len(t) == 0:
            continue
        idx = t[:, None] + 1 + torch.arange(ahead)[None]  # label j = greedy token j+1
        lab = data.labels[idx.clamp(max=n_all - 1)].clone()
        lab[idx > b - 2] = -100  # the last token's label is after the sequence: not part of it
        pos.append(t)
        labs.append(lab)
    if not pos:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, ahead, dtype=torch.long)
    return torch.cat(pos), torch.cat(labs)


def token_map(labels: torch.Tensor, n: int, vocab_size: int, eos: Sequence[int] = ()) -> torch.Tensor | None:
    """Sorted target ids of the draft vocabulary: EOS plus the n most frequent labels (None: full)."""
    if n <= 0 or n >= vocab_size:
        return None
    lab = labels[labels >= 0]
    counts = torch.bincount(lab, minlength=vocab_size).float()
    for e in eos:
        counts[e] = float("inf")
    return torch.sort(torch.topk(counts, n).indices).values


def _to_draft(labels: torch.Tensor, t2d: torch.Tensor | None) -> torch.Tensor:
    if t2d is None:
        return labels
    out = torch.full_like(labels, -100)
    ok = labels >= 0
    out[ok] = t2d[labels[ok]]
    return out


# --------------------------------------------------------------------------- loss, evaluation, training

def medusa_loss(heads: MedusaHeads, feats: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Weighted CE over heads (labels in draft ids, -100 ignored) and each head's top-1 accuracy."""
    logits = heads(feats)  # [K, M, V']
    total, wsum, acc = torch.zeros(()), 0.0, []
    for k in range(heads.num_heads):
        lab = labels[:, k]
        ok = lab >= 0
        if not bool(ok.any()):
            acc.append(0.0)
            continue
        w = LOSS_DECAY ** k
        total = total + w * F.cross_entropy(logits[k][ok], lab[ok])
        wsum += w
        acc.append(float((logits[k][ok].argmax(-1) == lab[ok]).float().mean()))
    return total / max(wsum, 1e-9), acc


@torch.no_grad()
def evaluate(heads: MedusaHeads, feats: torch.Tensor, labels: torch.Tensor) -> dict:
    """Validation loss, per-head accuracy and offline T=0 chain acceptance (P(heads 1..d all right))."""
    if len(feats) == 0:
        return {}
    was = heads.training
    heads.eval()
    loss, acc = medusa_loss(heads, feats, labels)
    pred = heads(feats).argmax(-1).T  # [M, K]
    right = (pred == labels) & (labels >= 0)
    run = torch.cumprod(right.long(), dim=1).float().mean(0)
    heads.train(was)
    return {"val_loss": round(float(loss), 5), "head_accuracy": [round(a, 4) for a in acc],
            "acceptance_per_depth": [round(float(x), 4) for x in run], "tau_chain_offline": round(1 + float(run.sum()), 4),
            "eval_positions": len(feats)}


def lr_at(tc: TrainConfig, step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to 10% of train.lr."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    p = (step - tc.warmup) / max(1, total - tc.warmup)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


def total_steps(tc: TrainConfig, n_examples: int, per_step: int) -> int:
    """train.epochs passes over the training examples, capped by train.steps."""
    return max(1, min(tc.steps, int(math.ceil(tc.epochs * n_examples / max(per_step, 1)))))


class EarlyStop:
    """Validation every train.eval_every steps; keeps the best weights, stops after train.patience
    evaluations without improvement."""

    def __init__(self, tc: TrainConfig) -> None:
        self.every, self.patience = tc.eval_every, tc.patience
        self.best, self.best_state, self.bad, self.history = float("inf"), None, 0, []

    def check(self, step: int, last: bool, model: torch.nn.Module, val: Callable[[], float]) -> bool:
        """Evaluate when due; True when training should stop."""
        if not (step % self.every == 0 or last):
            return False
        v = val()
        self.history.append((step, round(v, 5)))
        if v < self.best - 1e-4:
            self.best, self.bad = v, 0
            self.best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
        else:
            self.bad += 1
        return bool(self.patience) and self.bad >= self.patience

    def restore(self, model: torch.nn.Module) -> None:
        if self.best_state is not None:
            model.load_state_dict(self.best_state)


def train_medusa(data, target: torch.nn.Module, name: str, tc: TrainConfig, report: Report | None = None,
                 eos: Sequence[int] = ()) -> tuple[MedusaHeads, dict]:
    """Train `tc.medusa_heads` heads on batches of tc.batch * tc.seq_len answer positions for
    train.epochs (capped by train.steps), early-stopped on the validation loss. Deterministic given
    tc.seed. Returns (best heads in eval mode, summary with the validation loss before and after)."""
    K = tc.medusa_heads
    train_seqs, val_seqs = split_prompts(data, tc.eval_fraction, tc.seed)
    tpos, tlab = answer_positions(data, train_seqs, K)
    if len(tpos) == 0:
        raise UserError("train-draft: no training positions (raise train.prompts or lower train.eval_fraction)")
    vpos, vlab = answer_positions(data, val_seqs, K)
    vocab = target.config.vocab_size
    tmap = token_map(tlab[:, 0], tc.draft_vocab, vocab, eos)
    t2d = None
    if tmap is not None:
        t2d = torch.full((vocab,), -100, dtype=torch.long)
        t2d[tmap] = torch.arange(len(tmap))
    tlab, vlab = _to_draft(tlab, t2d), _to_draft(vlab, t2d)
    feats = data.features
    with torch.random.fork_rng():
        torch.manual_seed(tc.seed)
        heads = new_heads(target, name, K, 1, tmap).float().train()
    vfeat = feats[vpos].float()
    before = evaluate(heads, vfeat, vlab)
    opt = torch.optim.AdamW(heads.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=0.0)
    per_step = min(tc.batch * tc.seq_len, len(tpos))
    steps = total_steps(tc, len(tpos), per_step)
    g = torch.Generator().manual_seed(tc.seed)
    stop = EarlyStop(tc)
    history: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(tc, step, steps)
        idx = torch.randint(len(tpos), (per_step,), generator=g)
        loss, acc = medusa_loss(heads, feats[tpos[idx]].float(), tlab[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        history.append(round(float(loss.detach()), 5))
        if report:
            report("train", step + 1, steps, {"loss": float(loss.detach()), "acc": acc[0]})
        if len(vpos) and stop.check(step + 1, step + 1 == steps, heads, lambda: evaluate(heads, vfeat, vlab)["val_loss"]):
            break
    stop.restore(heads)
    heads.eval().requires_grad_(False)
    after = evaluate(heads, vfeat, vlab)
    summary = {"method": "medusa", "heads": K, "steps": len(history), "max_steps": steps,
               "train_seconds": round(time.perf_counter() - t0, 1),
               "loss_first": history[0] if history else None, "loss_last": history[-1] if history else None,
               "val_loss_before": before.get("val_loss"), "val_history": stop.history,
               "draft_vocab": 0 if tmap is None else len(tmap), "train_positions": len(tpos), **after}
    return heads, summary


# --------------------------------------------------------------------------- cache

def cached(cfg: Config, method: str) -> Path | None:
    """The finished draft of `method` for cfg's target, workload and settings, if trained."""
    out = draft_dir(cfg, method)
    return out if (out / META).is_file() else None


def _engine(cfg: Config, engine):
    if engine is not None:
        return engine
    from engine.decode.loop import Engine

    return Engine.from_config(cfg.model_copy(update={"spec": SpecConfig()}))


def ensure_trained(cfg: Config, method: str, train: Callable[[Any, Any], tuple[Callable[[Path], Any], dict]],
                   engine=None, retrain: bool = False, workloads: Sequence[WorkloadConfig] = (),
                   report: Report | None = None) -> Path:
    """The draft directory of `method` for cfg's target, workload and settings: cached, or trained
    now. `train(engine, data)` trains on the self-distillation data and returns (save, summary):
    save(out) writes the draft into `out`, summary goes into its meta. The meta is written last, so
    a directory without one (an interrupted save) is never taken for a finished draft."""
    out = draft_dir(cfg, method)
    if not retrain and (out / META).is_file():
        return out
    engine = _engine(cfg, engine)
    t0 = time.perf_counter()
    data = training_data(cfg, engine, workloads, report)
    save, summary = train(engine, data)
    if out.exists():
        shutil.rmtree(out)
    save(out)
    meta = {"target": cfg.model.name, "target_hash": target_hash(cfg), "workload": cfg.workload.name,
            "data": dict(data.meta), "train": cfg.train.model_dump(mode="json"), "seed": cfg.train.seed, **summary,
            "total_seconds": round(time.perf_counter() - t0, 1)}
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def ensure_medusa(cfg: Config, engine=None, retrain: bool = False, workloads: Sequence[WorkloadConfig] = (),
                  report: Report | None = None) -> Path:
    """The Medusa head directory for cfg's target and workload: cached, or trained now."""
    def train(engine, data):
        heads, summary = train_medusa(data, engine.model, cfg.model.name, cfg.train, report, eos=sorted(engine.eos))
        return (lambda out: save_heads(heads, out)), summary

    return ensure_trained(cfg, "medusa", train, engine, retrain, workloads, report)
