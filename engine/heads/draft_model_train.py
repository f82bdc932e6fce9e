"""A draft model for a target that has none: a few-layer Llama cut from the target and distilled on
the target's own answers.

Initialisation: the target's config with `train.draft_layers` decoder layers; its embedding, first
layers, final norm and lm_head copied from the target (so it shares the target's tokenizer and
starts as a shallow version of it). Training: the embedding and lm_head stay frozen (tied weights
stay tied, and vLLM loads the result as a plain LlamaForCausalLM); the layers and final norm learn
at every answer position t (from the last prompt token on) the target's greedy token t+1
(cross-entropy over the draft vocabulary) plus the target's final normed hidden state at t
(smooth L1): through the shared lm_head, matching the feature matches the target's whole
distribution, not only its argmax.

Output: an HF checkpoint directory (config.json, model.safetensors, the target's tokenizer files)
plus `draft_vocab.json` (the target ids the drafter scores; vLLM ignores it and drafts over the full
vocabulary) and `spectune_meta.json`, cached beside the heads (engine.heads.pipeline.head_dir).
The split, schedule and early stop are engine.heads.schedule's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from engine.drafters.draft_model import DRAFT_VOCAB
from engine.heads.pipeline import TrainJob, ensure_trained
from engine.heads.schedule import (EarlyStop, Report, batch_ids, epoch_steps, lr_at, split_prompts, step_precision,
                                   total_steps)
from engine.heads.vocab import label_index, token_map
from tuner.schema.config import TrainConfig, UserError, WorkloadConfig

FEATURE_WEIGHT = 1.0  # loss = CE + FEATURE_WEIGHT * SmoothL1(hidden, target feature)
# Copied layers are already trained: a smaller step than a fresh head's keeps what they know.
LR_SCALE = 0.25


def init_draft_model(target: torch.nn.Module, layers: int) -> LlamaForCausalLM:
    """A `layers`-layer Llama with the target's embedding, first layers, final norm and lm_head (fp32)."""
    tc = target.config
    if layers > tc.num_hidden_layers:
        raise UserError(f"train.draft_layers={layers}: the target has only {tc.num_hidden_layers} layers")
    d = tc.to_dict()
    for k in ("quantization_config", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        d.pop(k, None)
    d.update(num_hidden_layers=layers, architectures=["LlamaForCausalLM"])
    cfg = LlamaConfig.from_dict(d)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).float()
    src = {k: v.detach().float().cpu() for k, v in target.state_dict().items()}
    keep = {k: v for k, v in src.items() if not k.startswith("model.layers.")
            or int(k.split(".")[2]) < layers}
    missing, unexpected = model.load_state_dict(keep, strict=False)
    missing = [k for k in missing if "rotary" not in k and not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(f"train-draft spec.method=draft_model: target {type(target).__name__} is not a Llama-like "
                        f"model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.config.use_cache = True
    return model


def make_batch(data, seqs: Sequence[int], seq_len: int) -> dict:
    """Right-padded tokens [B, n], target features [B, n, h], labels [B, n] (-100 outside answer
    positions), lengths [B]. Longer sequences keep their last seq_len tokens (RoPE is relative)."""
    rows = []
    for i in seqs:
        a, b = int(data.offsets[i]), int(data.offsets[i + 1])
        cut = max(0, (b - a) - seq_len)
        start = max(int(data.starts[i]) - 1 - cut, 0)
        lab = data.labels[a + cut:b].clone()
        lab[:start] = -100
        lab[-1:] = -100  # the last token's successor is not in the sequence
        rows.append((data.tokens[a + cut:b], data.features[a + cut:b], lab))
    n = max(len(r[0]) for r in rows)
    h = data.features.shape[1]
    toks = torch.zeros(len(rows), n, dtype=torch.long)
    feats = torch.zeros(len(rows), n, h)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    lens = torch.zeros(len(rows), dtype=torch.long)
    for k, (t, f, lb) in enumerate(rows):
        m = len(t)
        toks[k, :m], feats[k, :m], labels[k, :m], lens[k] = t, f.float(), lb, m
    return {"tokens": toks, "features": feats, "labels": labels, "lens": lens}


def draft_loss(model: LlamaForCausalLM, lm_w: torch.Tensor, t2d: torch.Tensor | None, batch: dict
               ) -> tuple[torch.Tensor, dict]:
    """CE over the draft vocabulary + FEATURE_WEIGHT * smooth L1 to the target's features, at
    answer positions. Right padding needs no mask: causal attention never looks right."""
    hidden = model.model(input_ids=batch["tokens"]).last_hidden_state
    lab = batch["labels"]
    ok = lab >= 0
    h, f = hidden[ok], batch["features"][ok]
    dl = lab[ok] if t2d is None else t2d[lab[ok]]
    logits = h @ lm_w.T
    ce = F.cross_entropy(logits, dl, ignore_index=-100)
    feat = F.smooth_l1_loss(h, f)
    with torch.no_grad():
        known = dl >= 0
        acc = float((logits[known].argmax(-1) == dl[known]).float().mean()) if bool(known.any()) else 0.0
    return ce + FEATURE_WEIGHT * feat, {"ce": float(ce.detach()), "feat": float(feat.detach()), "acc": acc}


@torch.no_grad()
def validate(model: LlamaForCausalLM, lm_w: torch.Tensor, t2d: torch.Tensor | None, data, seqs: Sequence[int],
             tc: TrainConfig) -> dict:
    """Mean validation loss and top-1 agreement with the target's greedy tokens."""
    was = model.training
    model.eval()
    losses, accs = [], []
    for a in range(0, len(seqs), tc.batch):
        loss, parts = draft_loss(model, lm_w, t2d, make_batch(data, seqs[a:a + tc.batch], tc.seq_len))
        losses.append(float(loss))
        accs.append(parts["acc"])
    model.train(was)
    n = max(len(losses), 1)
    return {"val_loss": round(sum(losses) / n, 5), "val_top1": round(sum(accs) / n, 4)}


def train_draft_model(data, target: torch.nn.Module, tc: TrainConfig, report: Report | None = None,
                      eos: Sequence[int] = ()) -> tuple[LlamaForCausalLM, torch.Tensor | None, dict]:
    """Distil a `tc.draft_layers`-layer draft from `target` on `data` (train.epochs over the training
    sequences, capped by train.steps, early-stopped on the validation loss). Returns (model in eval
    mode, draft vocabulary ids or None, summary with the validation loss before and after)."""
    train_seqs, val_seqs = split_prompts(data, tc.eval_fraction, tc.seed)
    if not train_seqs:
        raise UserError("train-draft: no training sequences (raise train.prompts or lower train.eval_fraction)")
    with torch.random.fork_rng():
        torch.manual_seed(tc.seed)
        model = init_draft_model(target, tc.draft_layers).train()
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_output_embeddings().weight.requires_grad_(False)
    vocab = model.config.vocab_size
    lab_all = data.labels[data.labels >= 0]
    tmap = token_map(lab_all, tc.draft_vocab, vocab, eos)
    lm_full = model.get_output_embeddings().weight.detach()
    lm_w, t2d = lm_full, None
    if tmap is not None:
        lm_w, t2d = lm_full[tmap].contiguous(), label_index(tmap, vocab)
    before = validate(model, lm_w, t2d, data, val_seqs, tc) if val_seqs else {}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr * LR_SCALE, betas=(0.9, 0.95), weight_decay=0.0)
    steps = total_steps(tc, epoch_steps(len(train_seqs), tc.batch))
    stop = EarlyStop(tc)
    history: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        for grp in opt.param_groups:
            grp["lr"] = lr_at(tc, step, steps, LR_SCALE)
        with step_precision(tc, lm_w.device):
            loss, parts = draft_loss(model, lm_w, t2d, make_batch(data, batch_ids(train_seqs, tc, step), tc.seq_len))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.append(round(float(loss.detach()), 5))
        if report:
            report("train", step + 1, steps, {"loss": float(loss.detach()), **parts})
        if val_seqs and stop.check(step + 1, step + 1 == steps, model,
                                   lambda: validate(model, lm_w, t2d, data, val_seqs, tc)["val_loss"]):
            break
    stop.restore(model)
    model.eval().requires_grad_(False)
    after = validate(model, lm_w, t2d, data, val_seqs, tc) if val_seqs else {}
    summary = {"method": "draft_model", "layers": tc.draft_layers, "steps": len(history), "max_steps": steps,
               "train_seconds": round(time.perf_counter() - t0, 1),
               "loss_first": history[0] if history else None, "loss_last": history[-1] if history else None,
               "val_loss_before": before.get("val_loss"), "val_top1_before": before.get("val_top1"),
               "val_history": stop.history, "draft_vocab": 0 if tmap is None else len(tmap),
               "train_sequences": len(train_seqs), "val_sequences": len(val_seqs), **after}
    return model, tmap, summary


def save_draft_model(model: LlamaForCausalLM, tokenizer, path: str | Path, draft_ids: torch.Tensor | None = None) -> Path:
    """An HF checkpoint directory with the target's tokenizer (what vLLM's draft_model loads) plus
    the draft vocabulary the built-in drafter scores."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    if draft_ids is not None:
        (out / DRAFT_VOCAB).write_text(json.dumps({"target_ids": draft_ids.tolist()}) + "\n")
    return out


def ensure_draft_model(job: TrainJob, engine=None, retrain: bool = False, workloads: Sequence[WorkloadConfig] = (),
                       report: Report | None = None) -> Path:
    """The draft-model directory for the job's target, workload and settings: cached, or trained now."""
    def train(engine, data):
        model, tmap, summary = train_draft_model(data, engine.model, job.train, report, eos=sorted(engine.eos))
        return (lambda out: save_draft_model(model, engine.tokenizer, out, tmap)), summary

    return ensure_trained(job, "draft_model", train, engine, retrain, workloads, report)
