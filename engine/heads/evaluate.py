"""Stage 5 of the head pipeline: offline T=0 acceptance of a trained head on unseen answers.

At T=0 a chain draft is accepted token by token while it equals the target's greedy continuation,
which the data holds. At every answer position the head drafts `depth` tokens on its own features
(as it would inside the engine); acceptance at depth d = P(the first d drafts all match).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from engine.heads.data import IGNORE, DistillData
from engine.heads.trainer import _shift, make_batch, unrolled

EVAL_DEPTH = 5


@torch.no_grad()
def chain_acceptance(net, embed: torch.Tensor, draft_ids: torch.Tensor | None,
                     data: DistillData, seqs: Sequence[int], seq_len: int, depth: int = EVAL_DEPTH,
                     topk: int = 1, max_nodes: int = 64) -> dict:
    """Acceptance per depth and tau = 1 + sum of them, over the answer positions of `seqs`.
    `net` is the trainer's Eagle1Net / Eagle3Net; `draft_ids` maps its logits' columns to target ids.
    With `topk` > 1 also `acceptance_topk_per_depth`: P(each of the first d target tokens is among
    the head's `topk` best at its level), the most a tree of that top-k can accept (its node on the
    target's path exists only then; the head is unrolled on the target's tokens, as on that path),
    and `tree_nodes`: [depth, count] of the `max_nodes` most often accepted nodes of the head's
    top-k tree (a node: the ranks of the target's tokens among the head's best, level by level),
    most often first: a tree of n nodes accepts at most the n largest of their shares a step."""
    if not seqs:
        return {}
    net.head.eval()
    hits, tree_hits = torch.zeros(depth), torch.zeros(depth)
    nodes: Counter[tuple[int, ...]] = Counter()
    count = 0
    for a in range(0, len(seqs), 8):
        b = make_batch(data, seqs[a:a + 8], seq_len, embed.device)
        outs = unrolled(net, embed, b["tokens"], net.first(b, 0.0, None), depth)
        idx = torch.arange(b["tokens"].shape[1], device=embed.device)[None]
        # position t drafts tokens t+2, t+3, ...: count it when token t+2 is an answer token
        run = (_shift(b["labels"], 1) != IGNORE) & (idx < b["lens"][:, None] - 2)
        v0 = run.clone()
        tree = run.clone()
        ranks = []
        for j, out in enumerate(outs):
            best = net.logits(out).topk(topk, dim=-1).indices
            if draft_ids is not None:
                best = draft_ids.to(best.device)[best]
            lab = _shift(b["labels"], 1 + j)
            run = run & (lab != IGNORE) & (best[..., 0] == lab)
            hits[j] += run[v0].sum().cpu()
            found = best == lab[..., None]
            tree = tree & (lab != IGNORE) & found.any(-1)
            tree_hits[j] += tree[v0].sum().cpu()
            ranks.append(torch.where(tree, found.int().argmax(-1), -1))
        count += int(v0.sum())
        if topk > 1:
            for row in torch.stack(ranks, -1)[v0].tolist():
                for j in range(depth):
                    if row[j] < 0:
                        break
                    nodes[tuple(row[:j + 1])] += 1
    acc = (hits / max(count, 1)).tolist()
    out = {"acceptance_per_depth": [round(x, 4) for x in acc], "tau_chain_offline": round(1 + sum(acc), 4),
           "eval_positions": count}
    if topk > 1:
        out["acceptance_topk_per_depth"] = [round(x, 4) for x in (tree_hits / max(count, 1)).tolist()]
        top = sorted(nodes.items(), key=lambda kv: (-kv[1], len(kv[0])))[:max_nodes]
        out["tree_nodes"] = [[len(k), c] for k, c in top]
    return out
