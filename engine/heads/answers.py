"""Stage 2 of the head pipeline: the target answers the training prompts, batched, greedily (and, for
more data per prompt, with answers sampled from the target: train.answers_per_prompt).

The head must predict what *this* target says next, so its data is the target's own greedy answers
(on-policy). Generation is the cost that bounds how much data a head sees, so it is batched through
the engine's own forward: the prompts are prefilled in one step, then every step decodes one token
for each running row in one call (on CPU the native step), and rows that finished leave the batch,
so a batch costs what its longest answer costs only while that answer is the one still running. Everything training needs is captured on the way, so no
second pass over the text is needed: the target's final normed hidden state at every position (the
EAGLE feature) and, at answer positions, the target's top-k next-token probabilities (soft labels).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from engine.models.eagle3_head import aux_features
from engine.heads.data import FIXED_TEXT, DistillData

Progress = Callable[[int, int, int, float], None]  # (prompts done, total, tokens generated, seconds)


@torch.inference_mode()
def answer_batch(forward, prompts: Sequence[Sequence[int]], max_new: int, eos: set[int],
                 topk: int = 8, aux_layers: Sequence[int] | None = None,
                 temperatures: Sequence[float] | None = None, seed: int = 0) -> list[dict]:
    """Greedy (or sampled, see below) answers to `prompts` through the engine's own forward (`Engine.forward`: the lean or
    native step, or transformers behind the same interface), the live rows of a step in one call.

    The prompts are prefilled together, then each step decodes one token for every row still
    running; a row that finished releases its cache. Returns per prompt: `answer` (token ids, EOS
    included when reached), `features` float16 [len(prompt)+len(answer)-1, h] for positions 0..n-2
    (the last token's feature predicts nothing we keep), `topk_ids` / `topk_probs` [len(answer), k]:
    the target's distribution for each answer token, and with `aux_layers` (EAGLE-3) `aux` float16
    [same positions as features, len(aux_layers)*h]: the inputs of those target layers.

    `temperatures` (one per prompt, 0: greedy) samples a row's answer from the target's distribution
    at that temperature (seeded by `seed`): more answers per prompt. A sampled row also returns
    `labels`, the target's greedy choice at each position (what a draft must hit at T=0), while its
    top-k stays the target's own distribution, as for greedy rows. The labels and top-k of all live
    rows are computed in one call per step, and the step's tokens read back once.
    """
    aux_t = tuple(aux_layers) if aux_layers else None
    b = len(prompts)
    pool = forward.pool(b, max(len(p) for p in prompts) + max_new + 1)
    caches = [pool.acquire(len(p) + max_new + 1) for p in prompts]
    feats: list[list[torch.Tensor]] = [[] for _ in range(b)]
    auxs: list[list[torch.Tensor]] = [[] for _ in range(b)]
    answers: list[list[int]] = [[] for _ in range(b)]
    tk_ids: list[list[torch.Tensor]] = [[] for _ in range(b)]
    tk_p: list[list[torch.Tensor]] = [[] for _ in range(b)]
    live = list(range(b))
    temps = [0.0] * b if temperatures is None else [float(t) for t in temperatures]
    sampling = any(t > 0 for t in temps)
    gen: torch.Generator | None = None
    outs = forward.step_batch(caches, [list(p) for p in prompts], [None] * b, [None] * b, [True] * b, aux_t)
    for step in range(max_new):
        last = torch.stack([logits[-1] for _, logits, _ in outs]).float()  # [live, vocab]
        probs, top = torch.softmax(last, -1).topk(topk, dim=-1)
        nxt = top[:, 0]
        if sampling:
            if gen is None:
                gen = torch.Generator(device=last.device).manual_seed(seed)
            t = torch.tensor([temps[i] for i in live], device=last.device)
            drawn = torch.multinomial(torch.softmax(last / t.clamp_min(1e-6)[:, None], -1), 1, generator=gen)[:, 0]
            nxt = torch.where(t > 0, drawn, nxt)
        # the outputs may be views of buffers the next step reuses: copied here, in one call each
        hid = torch.cat([hidden for hidden, _, _ in outs]).to(torch.float16).split([len(o[0]) for o in outs])
        ax = torch.cat([aux for _, _, aux in outs]).to(torch.float16).split([len(o[2]) for o in outs]) if aux_t else None
        for j, (i, tok) in enumerate(zip(live, nxt.tolist())):
            feats[i].append(hid[j])
            if ax is not None:
                auxs[i].append(ax[j])
            answers[i].append(int(tok))
            tk_ids[i].append(top[j])
            tk_p[i].append(probs[j])
        still = [i for i in live if answers[i][-1] not in eos and step < max_new - 1]
        for i in set(live) - set(still):
            pool.release(caches[i])
        live = still
        if not live:
            break
        outs = forward.step_batch([caches[i] for i in live], [[answers[i][-1]] for i in live], [None] * len(live),
                                  [None] * len(live), [True] * len(live), aux_t)
    res = []
    for i in range(b):
        r = {"answer": answers[i], "features": torch.cat(feats[i]).cpu(),
             "topk_ids": torch.stack(tk_ids[i]).cpu(), "topk_probs": torch.stack(tk_p[i]).to(torch.float16).cpu()}
        if temps[i] > 0:
            r["labels"] = r["topk_ids"][:, 0].clone()
        if aux_t:
            r["aux"] = torch.cat(auxs[i]).cpu()
        res.append(r)
    return res


def generate_answers(forward, prompts: Sequence[Sequence[int]], max_new: int, eos: set[int],
                     batch: int = 32, topk: int = 8, aux_layers: Sequence[int] | None = None,
                     prompt_idx: Sequence[int] | None = None,
                     on_progress: Progress | None = None, meta: dict | None = None,
                     temperatures: Sequence[float] | None = None, seed: int = 0) -> DistillData:
    """Answer every prompt through the engine's forward (batches of similar prompt length) and lay the
    results out as DistillData. `temperatures` (one per prompt, 0: greedy) samples those answers
    (answer_batch, seeded by `seed` and the batch); their sequences are marked `sampled`."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[dict | None] = [None] * len(prompts)
    t0 = time.perf_counter()
    done = tokens = 0
    for a in range(0, len(order), batch):
        idx = order[a:a + batch]
        temps = None if temperatures is None else [temperatures[i] for i in idx]
        for i, r in zip(idx, answer_batch(forward, [prompts[i] for i in idx], max_new, eos, topk, aux_layers,
                                          temps, seed * 1_000_003 + a)):
            results[i] = r
            tokens += len(r["answer"])
        done += len(idx)
        if on_progress:
            on_progress(done, len(prompts), tokens, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    info = dict(meta or {})
    info.update(prompts=len(prompts), answer_tokens=tokens, aux_layers=list(aux_layers or []), generate_seconds=round(seconds, 1),
                generate_tok_s=round(tokens / max(seconds, 1e-9), 1), gen_batch=batch)
    data = DistillData.from_answers(prompts, results, prompt_idx or list(range(len(prompts))), info)
    if temperatures is not None:
        data.sampled[:] = (torch.tensor([float(t) for t in temperatures]) > 0).long()
    return data


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
