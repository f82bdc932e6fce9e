"""Training Medusa-1 heads (engine.models.medusa_head) on the target's own outputs.

The target stays frozen and every head reads only the target's final normed hidden state, so the
self-distillation data (features + the target's greedy next tokens) is all training needs: no
target forward runs here. Head k at answer position t learns the target's greedy token t+2+k
(cross-entropy over the draft vocabulary, weight decay**k as in Medusa-1). Whole prompts are kept
out of training to measure the validation loss and the offline acceptance (the split, schedule
and early stop are engine.heads.schedule's; the data and the cache engine.heads.pipeline's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.heads.pipeline import TrainJob, ensure_trained
from engine.heads.schedule import EarlyStop, Report, lr_at, split_prompts, step_precision, total_steps
from engine.heads.vocab import label_index, token_map
from engine.models.medusa_head import MedusaHeads, new_heads, save_heads
from tuner.schema.config import TrainConfig, UserError, WorkloadConfig

LOSS_DECAY = 0.8  # Medusa-1: head k's loss weight decay**k


# --------------------------------------------------------------------------- data -> examples

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
    t2d = label_index(tmap, vocab)
    tlab, vlab = _to_draft(tlab, t2d), _to_draft(vlab, t2d)
    feats = data.features
    with torch.random.fork_rng():
        torch.manual_seed(tc.seed)
        heads = new_heads(target, name, K, 1, tmap).float().train()
    vfeat = feats[vpos].float()
    before = evaluate(heads, vfeat, vlab)
    opt = torch.optim.AdamW(heads.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=0.0)
    per_step = min(tc.batch * tc.seq_len, len(tpos))
    steps = total_steps(tc, len(tpos) / per_step)
    g = torch.Generator().manual_seed(tc.seed)
    stop = EarlyStop(tc)
    history: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(tc, step, steps)
        idx = torch.randint(len(tpos), (per_step,), generator=g)
        with step_precision(tc, feats.device):
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

def ensure_medusa(job: TrainJob, engine=None, retrain: bool = False, workloads: Sequence[WorkloadConfig] = (),
                  report: Report | None = None) -> Path:
    """The Medusa head directory for the job's target and workload: cached, or trained now."""
    def train(engine, data):
        heads, summary = train_medusa(data, engine.model, job.model.name, job.train, report, eos=sorted(engine.eos))
        return (lambda out: save_heads(heads, out)), summary

    return ensure_trained(job, "medusa", train, engine, retrain, workloads, report)
