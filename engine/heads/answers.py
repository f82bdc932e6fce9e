"""Stage 2 of the head pipeline: the target answers the training prompts, batched, greedily.

The head must predict what *this* target says next, so its data is the target's own greedy answers
(on-policy). Generation is the cost that bounds how much data a head sees, so it is batched: left-
padded prompts share one forward per step, the KV cache grows in place, and rows that finished leave
the batch (the cache keeps only the live rows), so a batch costs what its longest answer costs only
while that answer is the one still running. Everything training needs is captured on the way, so no
second pass over the text is needed: the target's final normed hidden state at every position (the
EAGLE feature) and, at answer positions, the target's top-k next-token probabilities (soft labels).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from engine.models.cache import new_cache
from engine.models.eagle3_head import aux_features
from engine.heads.data import FIXED_TEXT, DistillData

Progress = Callable[[int, int, int, float], None]  # (prompts done, total, tokens generated, seconds)


def _batch_select(cache, rows: torch.Tensor) -> None:
    """Keep only `rows` (batch indices) in every layer of the cache."""
    for layer in cache.layers:
        layer.batch_keep(rows)


@torch.inference_mode()
def answer_batch(model, prompts: Sequence[Sequence[int]], max_new: int, eos: set[int], pad: int,
                 topk: int = 8, aux_layers: Sequence[int] | None = None) -> list[dict]:
    """Greedy answers to `prompts`, one forward per step for the whole batch.

    Returns per prompt: `answer` (token ids, EOS included when reached), `features` float16
    [len(prompt)+len(answer)-1, h] for positions 0..n-2 (the last token's feature predicts nothing we
    keep), `topk_ids` / `topk_probs` [len(answer), k]: the target's distribution for each answer token,
    and with `aux_layers` (EAGLE-3) `aux` float16 [same positions as features, len(aux_layers)*h]: the
    inputs of those target layers (residual stream).
    """
    dev = next(model.parameters()).device
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), pad, dtype=torch.long, device=dev)
    valid = torch.zeros(b, width, dtype=torch.bool, device=dev)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), device=dev)
        valid[i, width - len(p):] = True
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    dtype = next(model.parameters()).dtype
    neg = torch.finfo(dtype).min
    causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
    allowed = causal[None] & valid[:, None, :]
    # a padding query row sees nothing; give it itself so softmax stays finite (its output is unused)
    allowed |= torch.eye(width, dtype=torch.bool, device=dev)[None]
    mask = torch.zeros(b, 1, width, width, dtype=dtype, device=dev).masked_fill_(~allowed[:, None], neg)
    cache = new_cache(model.config)
    want_aux = bool(aux_layers)

    def forward(**kw):
        out = model.model(**kw, cache=cache, use_cache=True, output_hidden_states=want_aux)
        aux = aux_features(out.hidden_states, aux_layers)
        return out.last_hidden_state, aux

    hidden, aux = forward(input_ids=ids, position_ids=pos, attention_mask=mask)
    feats = [[hidden[i, width - len(p):].to(torch.float16)] for i, p in enumerate(prompts)]
    auxs = [[aux[i, width - len(p):].to(torch.float16)] for i, p in enumerate(prompts)] if want_aux else None
    last = hidden[:, -1]
    answers: list[list[int]] = [[] for _ in range(b)]
    tk_ids: list[list[torch.Tensor]] = [[] for _ in range(b)]
    tk_p: list[list[torch.Tensor]] = [[] for _ in range(b)]
    live = torch.arange(b, device=dev)  # original row of each cache row
    key_valid = valid
    lengths = valid.sum(1)
    for step in range(max_new):
        logits = model.lm_head(last).float()
        probs, top = torch.softmax(logits, -1).topk(topk, dim=-1)
        nxt = top[:, 0]
        done_rows = []
        for r, i in enumerate(live.tolist()):
            t = int(nxt[r])
            answers[i].append(t)
            tk_ids[i].append(top[r])
            tk_p[i].append(probs[r])
            if t in eos or step == max_new - 1:
                done_rows.append(r)
        if len(done_rows) == len(live):
            break
        if done_rows:
            keep = torch.tensor([r for r in range(len(live)) if r not in set(done_rows)], device=dev)
            _batch_select(cache, keep)
            live, nxt, key_valid, lengths = live[keep], nxt[keep], key_valid[keep], lengths[keep]
        key_valid = torch.cat([key_valid, torch.ones(len(live), 1, dtype=torch.bool, device=dev)], 1)
        step_mask = torch.zeros(len(live), 1, 1, key_valid.shape[1], dtype=dtype, device=dev)
        step_mask.masked_fill_(~key_valid[:, None, None], neg)
        out, aux = forward(input_ids=nxt[:, None], position_ids=lengths[:, None], attention_mask=step_mask)
        lengths = lengths + 1
        last = out[:, 0]
        for r, i in enumerate(live.tolist()):
            feats[i].append(out[r].to(torch.float16))
            if want_aux:
                auxs[i].append(aux[r].to(torch.float16))
    res = []
    for i in range(b):
        n = len(prompts[i]) + len(answers[i]) - 1
        r = {"answer": answers[i], "features": torch.cat(feats[i])[:n].cpu(),
             "topk_ids": torch.stack(tk_ids[i]).cpu(), "topk_probs": torch.stack(tk_p[i]).to(torch.float16).cpu()}
        if want_aux:
            r["aux"] = torch.cat(auxs[i])[:n].cpu()
        res.append(r)
    return res


def generate_answers(model, prompts: Sequence[Sequence[int]], max_new: int, eos: set[int], pad: int,
                     batch: int = 32, topk: int = 8, aux_layers: Sequence[int] | None = None,
                     prompt_idx: Sequence[int] | None = None,
                     on_progress: Progress | None = None, meta: dict | None = None) -> DistillData:
    """Answer every prompt (batches of similar prompt length) and lay the results out as DistillData."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[dict | None] = [None] * len(prompts)
    t0 = time.perf_counter()
    done = tokens = 0
    for a in range(0, len(order), batch):
        idx = order[a:a + batch]
        for i, r in zip(idx, answer_batch(model, [prompts[i] for i in idx], max_new, eos, pad, topk, aux_layers)):
            results[i] = r
            tokens += len(r["answer"])
        done += len(idx)
        if on_progress:
            on_progress(done, len(prompts), tokens, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    info = dict(meta or {})
    info.update(prompts=len(prompts), answer_tokens=tokens, aux_layers=list(aux_layers or []), generate_seconds=round(seconds, 1),
                generate_tok_s=round(tokens / max(seconds, 1e-9), 1), gen_batch=batch)
    return DistillData.from_answers(prompts, results, prompt_idx or list(range(len(prompts))), info)


@torch.inference_mode()
def teacher_force(model, seqs: Sequence[tuple[Sequence[int], Sequence[int]]], topk: int = 8, batch: int = 8,
                  aux_layers: Sequence[int] | None = None, prompt_idx: Sequence[int] | None = None,
                  on_progress: Progress | None = None, meta: dict | None = None) -> DistillData:
    """Fixed (prompt, reply) token sequences through the target in one forward each (prefill, batched):
    the features it would have there and, at reply positions, its own top-k distribution and greedy
    choice as labels. Only the contexts are not the target's own text (the supplement of stage 2).
    Right padding needs no mask: a causal row never sees the padding after it."""
    dev = next(model.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
    results: list[dict | None] = [None] * len(seqs)
    want_aux = bool(aux_layers)
    t0 = time.perf_counter()
    done = tokens = 0
    for a in range(0, len(order), batch):
        idx = order[a:a + batch]
        rows = [list(seqs[i][0]) + list(seqs[i][1]) for i in idx]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
        for j, r in enumerate(rows):
            ids[j, :len(r)] = torch.tensor(r, device=dev)
        out = model.model(input_ids=ids, output_hidden_states=want_aux)
        hidden = out.last_hidden_state
        for j, i in enumerate(idx):
            p, reply = seqs[i]
            n, s = len(rows[j]), len(p) - 1
            probs, top = torch.softmax(model.lm_head(hidden[j, s:n - 1]).float(), -1).topk(topk, dim=-1)
            r = {"answer": list(reply), "features": hidden[j, :n - 1].to(torch.float16).cpu(),
                 "topk_ids": top.cpu(), "topk_probs": probs.to(torch.float16).cpu(), "labels": top[:, 0].cpu()}
            if want_aux:
                r["aux"] = aux_features(out.hidden_states, aux_layers, (j, slice(None, n - 1))).to(torch.float16).cpu()
            results[i] = r
            tokens += len(reply)
        done += len(idx)
        if on_progress:
            on_progress(done, len(seqs), tokens, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    info = dict(meta or {})
    info.update(fixed_sequences=len(seqs), fixed_tokens=tokens, fixed_seconds=round(seconds, 1),
                fixed_tok_s=round(tokens / max(seconds, 1e-9), 1))
    data = DistillData.from_answers([s[0] for s in seqs], results, prompt_idx or list(range(len(seqs))), info)
    data.sampled[:] = FIXED_TEXT
    return data
