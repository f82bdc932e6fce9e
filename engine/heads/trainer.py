"""Stage 4 of the head pipeline: training an EAGLE head on the target's own answers.

Loss at input position t (token t+1, feature t), over `unroll` training-time-test steps j:
SmoothL1(predicted feature, feature t+1+j) + ce_weight * soft CE against the target's top-k
distribution for token t+2+j, restricted to the draft vocabulary and renormalised there. Step j > 0
feeds the head its own step j-1 output as the feature, with the attention a depth-(j+1) tree node has
(real-feature keys of positions <= t plus its own earlier steps at t); step j's loss weighs
decay**j. Input features get Gaussian noise, as in EAGLE, so the head tolerates its own errors.

The validation split (whole prompts that share nothing with any held-out set), the batches, the
learning-rate schedule and early stopping are engine.heads.schedule's, as for every draft trainer.
Deterministic given the seed (batch order and noise derive from (seed, step)); a resumable
checkpoint every `checkpoint_every` steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models.eagle_head import EagleHead, head_config
from engine.heads.data import IGNORE, DistillData
from engine.heads.schedule import (EarlyStop, Report, batch_ids, epoch_steps, lr_at, split_prompts, step_precision,
                                   total_steps, train_precision)
from engine.heads.vocab import DraftVocab
from tuner.schema.config import TrainConfig, UserError

CKPT = "checkpoint.pt"


def make_batch(data: DistillData, seqs: Sequence[int], seq_len: int, device: torch.device | str = "cpu") -> dict:
    """Right-padded tensors of the sequences (a sequence longer than seq_len keeps its last seq_len
    tokens: RoPE is relative, so cutting the start of a long prompt only shortens the context)."""
    rows = []
    for i in seqs:
        a, b = int(data.offsets[i]), int(data.offsets[i + 1])
        a = max(a, b - seq_len)
        rows.append((a, b))
    n = max(b - a for a, b in rows)
    bsz, h, k = len(rows), data.features.shape[1], data.topk_ids.shape[1]
    out = {"tokens": torch.zeros(bsz, n, dtype=torch.long), "features": torch.zeros(bsz, n, h),
           "labels": torch.full((bsz, n), IGNORE, dtype=torch.long), "topk_ids": torch.zeros(bsz, n, k, dtype=torch.long),
           "topk_probs": torch.zeros(bsz, n, k), "lens": torch.zeros(bsz, dtype=torch.long)}
    if data.aux is not None:
        out["aux"] = torch.zeros(bsz, n, data.aux.shape[1])
    for r, (a, b) in enumerate(rows):
        m = b - a
        if data.aux is not None:
            out["aux"][r, :m] = data.aux[a:b].float()
        out["tokens"][r, :m] = data.tokens[a:b]
        out["features"][r, :m] = data.features[a:b].float()
        out["labels"][r, :m] = data.labels[a:b]
        out["topk_ids"][r, :m] = data.topk_ids[a:b]
        out["topk_probs"][r, :m] = data.topk_probs[a:b].float()
        out["lens"][r] = m
    return {k: v.to(device) for k, v in out.items()}


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t+k] at index t, zero-padded at the end."""
    if k == 0:
        return x
    return torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], dim=1)


def _ttt_mask(n: int, step: int, device: torch.device) -> torch.Tensor:
    """[1, 1, n, (step+1)*n] bool: causal over the real-feature keys, then the query's own keys of
    the earlier unrolled steps (one diagonal per step), as a depth-(step+1) tree node sees."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)[None, None]


class Eagle1Net:
    """EAGLE-1 for training: features in, predicted next features out, scored by the target's frozen
    lm_head rows of the draft vocabulary; trained with feature regression plus CE."""

    regress = True

    def __init__(self, head: EagleHead, lm_w: torch.Tensor) -> None:
        self.head, self.lm_w = head, lm_w

    def first(self, batch: dict, noise_std: float, gen: torch.Generator | None) -> torch.Tensor:
        f = batch["features"]
        return f if noise_std <= 0 else f + noise_std * torch.randn(f.shape, generator=gen).to(f.device)

    def step(self, e: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, mask, past):
        return self.head(e, x, pos, mask, past)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.lm_w.T


class Eagle3Net:
    """EAGLE-3 for training: the fused low/mid/high target states in, its own hidden out, scored by
    its own lm_head over the draft vocabulary; trained with CE only (no feature regression)."""

    regress = False

    def __init__(self, head) -> None:
        self.head = head

    def first(self, batch: dict, noise_std: float, gen: torch.Generator | None) -> torch.Tensor:
        a = batch["aux"]
        if noise_std > 0:
            a = a + noise_std * torch.randn(a.shape, generator=gen).to(a.device)
        return self.head.fuse(a)

    def step(self, e: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, mask, past):
        from engine.models.cache import KVBuffer

        past = past if past is not None else KVBuffer()
        return self.head(e, x, pos, mask, past), past

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head.logits(x)


def unrolled(net, embed: torch.Tensor, toks: torch.Tensor, first: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs for `steps` unrolled steps; out[j][:, t] predicts token t+2+j (and, for
    EAGLE-1, feature t+1+j). `net` is an Eagle1Net / Eagle3Net (an EagleHead is wrapped)."""
    if isinstance(net, EagleHead):
        net = Eagle1Net(net, embed.new_zeros(1, embed.shape[1]))
    b, n, _ = first.shape
    pos = torch.arange(n, device=first.device)[None].expand(b, n)
    x, past, outs = first, None, []
    for j in range(steps):
        e = F.embedding(_shift(toks, 1 + j), embed)
        mask = None if j == 0 else _ttt_mask(n, j, first.device)
        x, past = net.step(e, x, pos + j, mask, past)
        outs.append(x)
    return outs


def soft_targets(topk_ids: torch.Tensor, topk_probs: torch.Tensor, t2d: torch.Tensor | None,
                 draft_size: int) -> torch.Tensor:
    """[M, draft_size] target distribution from top-k (ids, probs), renormalised over the draft
    vocabulary (rows whose top-k all fall outside it are all zero)."""
    ids = topk_ids if t2d is None else t2d[topk_ids]
    probs = topk_probs * (ids >= 0)
    out = torch.zeros(ids.shape[0], draft_size, device=ids.device)
    out.scatter_add_(1, ids.clamp(min=0), probs)
    return out / out.sum(-1, keepdim=True).clamp(min=1e-9)


def step_loss(net, embed: torch.Tensor, t2d: torch.Tensor | None, batch: dict, tc: TrainConfig,
              noise_std: float, gen: torch.Generator | None) -> tuple[torch.Tensor, dict]:
    """The training loss of one batch and its parts at step 0 (feature loss, CE, top-1 accuracy)."""
    toks, feats, lens = batch["tokens"], batch["features"], batch["lens"]
    outs = unrolled(net, embed, toks, net.first(batch, noise_std, gen), tc.unroll)
    idx = torch.arange(toks.shape[1], device=toks.device)[None]
    total, wsum, parts = feats.new_zeros(()), 0.0, {}
    for j, out in enumerate(outs):
        # the feature of token t+1+j exists for t+1+j <= len-2 (the last token has none)
        v_feat = idx < (lens[:, None] - 2 - j)
        lab = _shift(batch["labels"], 1 + j)
        v_ce = (lab != IGNORE) & (idx < (lens[:, None] - 1 - j))
        if not bool(v_ce.any()):
            continue
        l_feat = feats.new_zeros(())
        if net.regress and bool(v_feat.any()):
            l_feat = F.smooth_l1_loss(out[v_feat], _shift(feats, 1 + j)[v_feat])
        logits = net.logits(out[v_ce])
        tgt = soft_targets(_shift(batch["topk_ids"], 1 + j)[v_ce], _shift(batch["topk_probs"], 1 + j)[v_ce], t2d,
                           logits.shape[-1])
        l_ce = -(tgt * F.log_softmax(logits, -1)).sum(-1).mean()
        w = tc.unroll_decay ** j
        total = total + w * (l_feat + (tc.ce_weight if net.regress else 1.0) * l_ce)
        wsum += w
        if j == 0:
            with torch.no_grad():
                hard = lab[v_ce] if t2d is None else t2d[lab[v_ce]]
                parts = {"feat": float(l_feat), "ce": float(l_ce),
                         "acc": float((logits.argmax(-1) == hard).float().mean())}
    return total / max(wsum, 1e-9), parts


def init_head(target_config, seed: int) -> EagleHead:
    """A fresh trainable EAGLE-1 head (fp32, PyTorch's default init), seeded."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = EagleHead(head_config(target_config)).float()
    return head.train().requires_grad_(True)


def init_net(method: str, target: torch.nn.Module, vocab: DraftVocab | None, seed: int):
    """(trainable head, its training net, lm rows or None) for `method` (eagle | eagle3)."""
    device = next(target.parameters()).device
    if method == "eagle3":
        from engine.models.eagle3_head import init_eagle3

        ids = torch.arange(target.config.vocab_size) if vocab is None else vocab.ids
        head = init_eagle3(target, ids, seed=seed).float().to(device).train().requires_grad_(True)
        head.d2t.requires_grad_(False)
        return head, Eagle3Net(head)
    if method != "eagle":
        raise UserError(f"spec.method={method}: the head trainer trains eagle and eagle3 heads")
    lm_full = target.get_output_embeddings().weight.detach().float()
    lm_w = lm_full if vocab is None else lm_full[vocab.ids.to(device)].contiguous()
    head = init_head(target.config, seed).to(device)
    return head, Eagle1Net(head, lm_w)


@torch.no_grad()
def validation_loss(net, embed: torch.Tensor, t2d: torch.Tensor | None,
                    data: DistillData, seqs: Sequence[int], tc: TrainConfig, device) -> float:
    """Mean loss (no noise) over the validation sequences."""
    was = net.head.training
    net.head.eval()
    losses = []
    for a in range(0, len(seqs), tc.batch):
        batch = make_batch(data, seqs[a:a + tc.batch], tc.seq_len, device)
        losses.append(float(step_loss(net, embed, t2d, batch, tc, 0.0, None)[0]))
    net.head.train(was)
    return sum(losses) / max(len(losses), 1)


def train_head(data: DistillData, target: torch.nn.Module, tc: TrainConfig, vocab: DraftVocab | None, work: Path,
               report: Report | None = None, method: str = "eagle") -> tuple[torch.nn.Module, dict]:
    """Train a head on `data` (early stopping on a validation split), resuming from
    work/checkpoint.pt when it was written by the same data and settings. Returns (head in eval
    mode with the best validation weights, summary)."""
    work.mkdir(parents=True, exist_ok=True)
    device = next(target.parameters()).device
    embed = target.get_input_embeddings().weight.detach().float()
    t2d = None if vocab is None else vocab.t2d.to(device)
    if method == "eagle3" and data.aux is None:
        raise UserError("train-draft spec.method=eagle3: the data has no target layer states (built for eagle)")
    train_seqs, val_seqs = split_prompts(data, tc.eval_fraction, tc.seed)
    if not train_seqs:
        raise UserError("train-draft: no training sequences (raise train.prompts or lower train.eval_fraction)")
    steps = total_steps(tc, epoch_steps(len(train_seqs), tc.batch))
    src = data.aux if method == "eagle3" else data.features
    rms = float(src[: min(len(src), 100_000)].float().pow(2).mean().sqrt())
    fingerprint = hashlib.sha256(json.dumps([data.meta.get("key"), tc.model_dump(exclude={"checkpoint_every"}), method,
                                             None if vocab is None else len(vocab.ids)], sort_keys=True).encode()).hexdigest()[:16]
    head, net = init_net(method, target, vocab, tc.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state: dict = {"step": 0, "history": []}  # the early stop's state lives in it too (the checkpoint has both)
    ckpt = work / CKPT
    if ckpt.is_file():
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)
        if saved.get("fingerprint") == fingerprint:
            head.load_state_dict(saved["head"])
            opt.load_state_dict(saved["opt"])
            state = saved["state"]
    stop = EarlyStop(tc, state)
    start = state["step"]
    t0 = time.perf_counter()
    tokens = 0
    stopped_early = False
    for step in range(start, steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(tc, step, steps)
        batch = make_batch(data, batch_ids(train_seqs, tc, step), tc.seq_len, device)
        tokens += int(batch["lens"].sum())
        gen = torch.Generator().manual_seed(tc.seed * 1_000_003 + step)
        with step_precision(tc, device):
            loss, parts = step_loss(net, embed, t2d, batch, tc, tc.noise * rms, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        state["history"].append(round(float(loss.detach()), 5))
        done = step + 1
        info = {"loss": float(loss.detach()), **parts, "tok_s": tokens / max(time.perf_counter() - t0, 1e-9)}
        stopping = bool(val_seqs) and stop.check(
            done, done == steps, head, lambda: validation_loss(net, embed, t2d, data, val_seqs, tc, device))
        if stop.last is not None:
            info["val"] = stop.last
        state["step"] = done
        if done % tc.checkpoint_every == 0 or done == steps:
            _save_ckpt(ckpt, head, opt, fingerprint, state)
        if report:
            report("train", done, steps, info)
        if stopping:
            stopped_early = True
            break
    stop.restore(head)
    head.eval().requires_grad_(False)
    if method == "eagle":
        head.draft_ids = None if vocab is None else vocab.ids
    summary = {"steps": state["step"], "max_steps": steps, "stopped_early": stopped_early, "resumed_from": start,
               "train_seconds": round(time.perf_counter() - t0, 1),
               "train_tok_s": round(tokens / max(time.perf_counter() - t0, 1e-9), 1),
               "loss_first": state["history"][0] if state["history"] else None,
               "loss_last": state["history"][-1] if state["history"] else None,
               "val_loss": state["val"], "best_val_loss": None if not state["val"] else round(state["best_val"], 5),
               "train_sequences": len(train_seqs), "val_sequences": len(val_seqs),
               "precision": train_precision(tc, device)}
    return head, summary


def _save_ckpt(path: Path, head: EagleHead, opt: torch.optim.Optimizer, fingerprint: str, state: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ckpt.")
    os.close(fd)
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "fingerprint": fingerprint, "state": state}, tmp)
    os.replace(tmp, path)
