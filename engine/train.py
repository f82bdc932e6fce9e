"""Training EAGLE-1 draft heads on the target's own outputs (self-distillation, engine.distill).

Loss at input position t (token t+1, feature t): SmoothL1(predicted feature, feature t+1) +
ce_weight * CE(frozen lm_head(predicted feature), target's greedy token t+2), on response positions.
Input features get Gaussian noise (the head must tolerate its own imperfect features at depth).

Training-time test (EAGLE-3): step j>0 feeds the head its own step j-1 output as the feature, with
the query at index t seeing the real-feature keys of positions <= t plus its own keys of the earlier
steps at t, which is exactly what a tree node at depth j+1 sees while drafting. Step j's loss is
weighted decay**j.

Draft vocabulary (EAGLE-3's d2t idea): the CE and drafting use only the `draft_vocab` most frequent
target tokens of the data, a row slice of the frozen lm_head; on CPU the full lm_head is most of the
cost of a draft step.

Training is deterministic given the seed (batch order and noise derive from (seed, step)), saves a
resumable checkpoint every `checkpoint_every` steps and continues from it after an interruption.
Heads are cached per (target, workload) under `<cache>/heads/`; `ensure_head` trains only when none
is there or on request.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.distill import DistillData, collect_prompts, data_key, generate_data
from engine.eagle import EagleHead, head_config, save_head
from tuner.schema import Config, SpecConfig, TrainConfig, UserError, WorkloadConfig

META = "spectune_meta.json"
CKPT = "checkpoint.pt"
EVAL_DEPTH = 5  # chain depth of the offline acceptance estimate

# report(phase, done, total, info): phase "generate" (prompts answered) or "train" (steps, info has loss)
Report = Callable[[str, int, int, dict], None]


# --------------------------------------------------------------------------- data -> batches

def draft_vocab(data: DistillData, n: int, vocab_size: int, eos: Sequence[int] = ()) -> torch.Tensor | None:
    """Target ids of the draft vocabulary: EOS plus the most frequent labels of the training
    responses, sorted by id (None: draft over the full vocabulary)."""
    if n <= 0 or n >= vocab_size:
        return None
    counts = torch.bincount(data.response_labels(), minlength=vocab_size).float()
    for e in eos:
        counts[e] = float("inf")
    return torch.sort(torch.topk(counts, n).indices).values


def split_prompts(data: DistillData, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training sequences, evaluation sequences): whole prompts are held out of training, and only
    their greedy answers are evaluated (at T=0 the accepted drafts are the greedy continuation)."""
    prompts = sorted(set(data.prompt_idx.tolist()))
    g = torch.Generator().manual_seed(seed)
    perm = [prompts[i] for i in torch.randperm(len(prompts), generator=g).tolist()]
    n_eval = int(round(fraction * len(prompts))) if len(prompts) > 1 else 0
    ev = set(perm[:n_eval])
    pidx, sampled = data.prompt_idx.tolist(), data.sampled.tolist()
    train = [i for i in range(data.num_sequences) if pidx[i] not in ev]
    evals = [i for i in range(data.num_sequences) if pidx[i] in ev and sampled[i] == 0]
    return train, evals


def make_batch(data: DistillData, seqs: Sequence[int], seq_len: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (tokens [B,n], features [B,n,h], labels [B,n], loss mask [B,n], lengths [B]).
    A sequence longer than seq_len keeps its last seq_len tokens (the response); RoPE is relative,
    so dropping the start of a long prompt only shortens the context the head attends to."""
    rows = []
    for i in seqs:
        tok, feat, lab, start = data.sequence(i)
        cut = max(0, len(tok) - seq_len)
        rows.append((tok[cut:], feat[cut:], lab[cut:], max(start - 1 - cut, 0)))
    n = max(len(r[0]) for r in rows)
    b, h = len(rows), data.features.shape[1]
    toks = torch.zeros(b, n, dtype=torch.long)
    feats = torch.zeros(b, n, h)
    labels = torch.zeros(b, n, dtype=torch.long)
    mask = torch.zeros(b, n, dtype=torch.bool)
    lens = torch.zeros(b, dtype=torch.long)
    for k, (t, f, lb, s) in enumerate(rows):
        m = len(t)
        toks[k, :m], feats[k, :m], labels[k, :m], lens[k] = t, f, lb, m
        mask[k, s:m] = True
    return toks, feats, labels, mask, lens


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t+k] at index t, zero-padded at the end."""
    if k == 0:
        return x
    pad = torch.zeros_like(x[:, :k])
    return torch.cat([x[:, k:], pad], dim=1)


def _ttt_mask(n: int, step: int, device: torch.device) -> torch.Tensor:
    """[1, 1, n, (step+1)*n] bool: causal over the real-feature keys, then the query's own keys of
    the earlier unrolled steps (one diagonal per step), as a depth-(step+1) tree node sees."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)[None, None]


def unrolled(head: EagleHead, embed: torch.Tensor, toks: torch.Tensor, feats: torch.Tensor,
             steps: int) -> list[torch.Tensor]:
    """The head's predicted features for `steps` unrolled steps; out[j][:, t] predicts feature t+1+j."""
    b, n, _ = feats.shape
    pos = torch.arange(n, device=feats.device)[None].expand(b, n)
    x, past, outs = feats, None, []
    for j in range(steps):
        e = F.embedding(_shift(toks, 1 + j), embed)
        mask = None if j == 0 else _ttt_mask(n, j, feats.device)
        x, past = head(e, x, pos + j, mask, past)
        outs.append(x)
    return outs


def _valid(mask: torch.Tensor, lens: torch.Tensor, j: int) -> torch.Tensor:
    """Positions with a real input token and target at unrolled step j (t + 1 + j < length)."""
    idx = torch.arange(mask.shape[1], device=mask.device)[None]
    return mask & (idx < (lens[:, None] - 1 - j))


# --------------------------------------------------------------------------- training

def _lr(tc: TrainConfig, step: int) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    p = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


def _batch_ids(train_seqs: list[int], tc: TrainConfig, step: int) -> list[int]:
    """Sequences of one step: epoch-wise permutations seeded by (seed, epoch), so any step's batch is
    known without replaying the ones before (resume is exact)."""
    per_epoch = max(1, len(train_seqs) // tc.batch)
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(tc.seed * 7919 + epoch)
    perm = torch.randperm(len(train_seqs), generator=g).tolist()
    return [train_seqs[i] for i in perm[k * tc.batch:(k + 1) * tc.batch]] or train_seqs[:tc.batch]


def step_loss(head: EagleHead, embed: torch.Tensor, lm_w: torch.Tensor, t2d: torch.Tensor | None,
              batch: tuple, tc: TrainConfig, noise_std: float, gen: torch.Generator | None
              ) -> tuple[torch.Tensor, dict]:
    """The training loss of one batch, and its parts (step 0 feature loss, CE, top-1 accuracy)."""
    toks, feats, labels, mask, lens = batch
    x = feats
    if noise_std > 0:
        x = feats + noise_std * torch.randn(feats.shape, generator=gen)
    outs = unrolled(head, embed, toks, x, tc.unroll)
    total = torch.zeros(())
    parts: dict = {}
    wsum = 0.0
    for j, out in enumerate(outs):
        v = _valid(mask, lens, j)
        if not bool(v.any()):
            continue
        pred = out[v]
        tgt = _shift(feats, 1 + j)[v]
        lab = _shift(labels, 1 + j)[v]
        if t2d is not None:
            lab = t2d[lab]  # -100 where the target token is outside the draft vocabulary
        l_feat = F.smooth_l1_loss(pred, tgt)
        logits = pred @ lm_w.T
        l_ce = F.cross_entropy(logits, lab, ignore_index=-100)
        w = tc.unroll_decay ** j
        total = total + w * (l_feat + tc.ce_weight * l_ce)
        wsum += w
        if j == 0:
            with torch.no_grad():
                parts = {"feat": float(l_feat), "ce": float(l_ce), "acc": float((logits.argmax(-1) == lab).float().mean())}
    return total / max(wsum, 1e-9), parts


@torch.no_grad()
def evaluate(head: EagleHead, embed: torch.Tensor, lm_w: torch.Tensor, d2t_ids: torch.Tensor | None,
             data: DistillData, seqs: Sequence[int], seq_len: int, depth: int = EVAL_DEPTH) -> dict:
    """Offline T=0 chain acceptance on greedy answers: at each response position the head drafts
    `depth` tokens on its own features; accepted = the leading drafts equal to the target's greedy
    tokens. Returns acceptance per depth (P(first d accepted)) and tau = 1 + mean accepted length."""
    if not seqs:
        return {}
    was = head.training
    head.eval()
    hits = torch.zeros(depth)
    count = 0
    accepted = 0.0
    for a in range(0, len(seqs), 8):
        toks, feats, labels, mask, lens = make_batch(data, seqs[a:a + 8], seq_len)
        outs = unrolled(head, embed, toks, feats, depth)
        run = _valid(mask, lens, 0)
        v0 = run.clone()
        for j, out in enumerate(outs):
            ids = (out @ lm_w.T).argmax(-1)
            if d2t_ids is not None:
                ids = d2t_ids[ids]
            run = run & _valid(mask, lens, j) & (ids == _shift(labels, 1 + j))
            hits[j] += run[v0].sum()
        count += int(v0.sum())
        accepted += float(hits.sum())
    head.train(was)
    acc = (hits / max(count, 1)).tolist()
    return {"acceptance_per_depth": [round(x, 4) for x in acc], "tau_chain_offline": round(1 + sum(acc), 4),
            "eval_positions": count}


def init_head(target_config, seed: int) -> EagleHead:
    """A fresh trainable head (fp32) with PyTorch's default init, seeded. (engine.eagle.random_head
    uses the target's initializer_range, far too large for a stable start on some targets.)"""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = EagleHead(head_config(target_config)).float()
    return head.train().requires_grad_(True)


def _save_ckpt(path: Path, head: EagleHead, opt: torch.optim.Optimizer, step: int, fingerprint: str,
               history: list) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".ckpt.")
    os.close(fd)
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "fingerprint": fingerprint,
                "history": history}, tmp)
    os.replace(tmp, path)


def train_head(data: DistillData, target: torch.nn.Module, tc: TrainConfig, work: Path,
               report: Report | None = None, eos: Sequence[int] = ()) -> tuple[EagleHead, dict]:
    """Train a head on `data` for tc.steps steps, resuming from `work/checkpoint.pt` when it was
    written by the same data and settings. Returns (head in eval mode, summary)."""
    work.mkdir(parents=True, exist_ok=True)
    embed = target.get_input_embeddings().weight.detach().float()
    lm_full = target.get_output_embeddings().weight.detach().float()
    vocab_size = lm_full.shape[0]
    ids = draft_vocab(data, tc.draft_vocab, vocab_size, eos)
    lm_w = lm_full if ids is None else lm_full[ids].contiguous()
    t2d = None
    if ids is not None:
        t2d = torch.full((vocab_size,), -100, dtype=torch.long)
        t2d[ids] = torch.arange(len(ids))
    train_seqs, eval_seqs = split_prompts(data, tc.eval_fraction, tc.seed)
    if not train_seqs:
        raise UserError("train-draft: no training sequences (raise train.prompts or lower train.eval_fraction)")
    resp = data.response_labels()
    coverage = 1.0 if t2d is None else float((t2d[resp] >= 0).float().mean()) if len(resp) else 0.0
    rms = float(data.features.pow(2).mean().sqrt())
    fingerprint = hashlib.sha256(json.dumps([data.meta.get("key"), tc.model_dump(exclude={"checkpoint_every"})],
                                            sort_keys=True).encode()).hexdigest()[:16]

    head = init_head(target.config, tc.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, history = 0, []
    ckpt = work / CKPT
    if ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        if state.get("fingerprint") == fingerprint:
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            start, history = int(state["step"]), list(state["history"])
    t0 = time.perf_counter()
    for step in range(start, tc.steps):
        for g in opt.param_groups:
            g["lr"] = _lr(tc, step)
        batch = make_batch(data, _batch_ids(train_seqs, tc, step), tc.seq_len)
        gen = torch.Generator().manual_seed(tc.seed * 1_000_003 + step)
        loss, parts = step_loss(head, embed, lm_w, t2d, batch, tc, tc.noise * rms, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        history.append(round(float(loss.detach()), 5))
        done = step + 1
        if done % tc.checkpoint_every == 0 or done == tc.steps:
            _save_ckpt(ckpt, head, opt, done, fingerprint, history)
        if report:
            report("train", done, tc.steps, {"loss": float(loss.detach()), **parts})
    head.eval().requires_grad_(False)
    head.draft_ids = ids
    summary = {"steps": tc.steps, "resumed_from": start, "train_seconds": round(time.perf_counter() - t0, 1),
               "loss_first": history[0] if history else None, "loss_last": history[-1] if history else None,
               "draft_vocab": 0 if ids is None else len(ids), "draft_vocab_coverage": round(coverage, 4),
               "train_sequences": len(train_seqs), "eval_sequences": len(eval_seqs)}
    summary.update(evaluate(head, embed, lm_w, ids, data, eval_seqs, tc.seq_len))
    return head, summary


# --------------------------------------------------------------------------- cache

def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def target_hash(cfg: Config) -> str:
    """Identity of the target's weights (and of the precision its features are computed in)."""
    from engine.model import cache_root, file_digest, gguf_path

    m, root = cfg.model, cache_root(cfg.cache_dir)
    if m.random_init:
        basis = f"random:{m.model_dump_json()}:{cfg.seed}"
    elif m.local_path:
        p = Path(m.local_path).expanduser()
        weights = sorted(p.glob("*.safetensors")) or sorted(p.glob("*.bin"))
        basis = "local:" + ",".join(file_digest(w, root) for w in weights) if weights else f"local:{p.resolve()}"
    elif m.gguf is not None:
        basis = "gguf:" + file_digest(gguf_path(m.gguf.package, m.gguf.file), root)
    else:
        basis = f"hub:{m.hf_id}"
    return _short(f"{basis}:fp8={cfg.engine.builtin.fp8_weights}")


def head_dir(cfg: Config) -> Path:
    """Where the head for (target, workload) lives: <cache>/heads/<model>-<target hash>/<workload>-<hash>."""
    from engine.model import cache_root

    if cfg.workload is None:
        raise UserError("train-draft needs a workload: add +workload=NAME")
    w = cfg.workload
    return cache_root(cfg.cache_dir) / "heads" / f"{cfg.model.name}-{target_hash(cfg)}" / f"{w.name}-{_short(w.model_dump_json())}"


def cached_head(cfg: Config) -> Path | None:
    """The finished head for cfg's target and workload, if one was trained."""
    out = head_dir(cfg)
    return out if (out / META).is_file() else None


def ensure_head(cfg: Config, engine=None, retrain: bool = False, workloads: Sequence[WorkloadConfig] = (),
                report: Report | None = None) -> Path:
    """The head directory for cfg's target and workload: the cached one, or a newly trained one
    (retrain=True trains again from scratch, reusing generated data). `workloads` are the other
    packaged workloads: their prompts add diversity and their held-out prompts are excluded too."""
    if cfg.workload is None:
        raise UserError("train-draft needs a workload: add +workload=NAME")
    out = head_dir(cfg)
    work = out.parent / f".{out.name}.work"  # checkpoints of a run in progress
    if not retrain and (out / META).is_file():
        return out
    if retrain:
        # forget the old head and checkpoints now: an interrupted retrain then resumes on the next call
        (out / META).unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    if engine is None:
        from engine.loop import Engine

        engine = Engine.from_config(cfg.model_copy(update={"spec": SpecConfig()}))
    tc = cfg.train
    from engine.model import cache_root

    thash = target_hash(cfg)
    prompts = collect_prompts(cfg.workload, workloads, tc.prompts, tc.seed)
    chat = cfg.workload.chat_template
    key = data_key(thash, prompts, chat, tc)
    data_path = cache_root(cfg.cache_dir) / "distill" / key
    t0 = time.perf_counter()
    if (data_path / "data.safetensors").is_file():
        data = DistillData.load(data_path)
    else:
        def progress(done: int, total: int) -> None:
            if report:
                report("generate", done, total, {})

        data = generate_data(engine.model, engine.tokenizer, lambda text: engine.encode_prompt(text, chat), prompts,
                             tc, engine.eos, progress,
                             meta={"key": key, "target": thash, "workloads": [cfg.workload.name, *[w.name for w in workloads]]})
        data.meta["generate_seconds"] = round(time.perf_counter() - t0, 1)
        data.save(data_path)
    head, summary = train_head(data, engine.model, tc, work, report, eos=sorted(engine.eos))
    if out.exists():
        shutil.rmtree(out)
    save_head(head, out)
    meta = {"target": cfg.model.name, "target_hash": thash, "workload": cfg.workload.name,
            "method": "eagle", "data": {k: v for k, v in data.meta.items()}, "data_dir": str(data_path),
            "train": tc.model_dump(), "seed": tc.seed, **summary,
            "total_seconds": round(time.perf_counter() - t0, 1)}
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return out


def read_meta(path: str | Path) -> dict:
    """The spectune metadata of a trained head directory."""
    p = Path(path) / META
    if not p.is_file():
        raise UserError(f"{path}: no {META} (not a head trained by tuner train-draft)")
    return json.loads(p.read_text())
