"""Stage 5 of the head pipeline: offline T=0 acceptance of a trained head on unseen answers.

At T=0 a chain draft is accepted token by token while it equals the target's greedy continuation,
which the data holds. At every answer position the head drafts `depth` tokens on its own features
(as it would inside the engine); acceptance at depth d = P(the first d drafts all match).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.heads.data import IGNORE, DistillData
from engine.heads.trainer import _shift, make_batch, unrolled

EVAL_DEPTH = 5


@torch.no_grad()
def chain_acceptance(net, embed: torch.Tensor, draft_ids: torch.Tensor | None,
                     data: DistillData, seqs: Sequence[int], seq_len: int, depth: int = EVAL_DEPTH) -> dict:
    """Acceptance per depth and tau = 1 + sum of them, over the answer positions of `seqs`.
    `net` is the trainer's Eagle1Net / Eagle3Net; `draft_ids` maps its logits' columns to target ids."""
    if not seqs:
        return {}
    net.head.eval()
    hits = torch.zeros(depth)
    count = 0
    for a in range(0, len(seqs), 8):
        b = make_batch(data, seqs[a:a + 8], seq_len, embed.device)
        outs = unrolled(net, embed, b["tokens"], net.first(b, 0.0, None), depth)
        idx = torch.arange(b["tokens"].shape[1], device=embed.device)[None]
        # position t drafts tokens t+2, t+3, ...: count it when token t+2 is an answer token
        run = (_shift(b["labels"], 1) != IGNORE) & (idx < b["lens"][:, None] - 2)
        v0 = run.clone()
        for j, out in enumerate(outs):
            ids = net.logits(out).argmax(-1)
            if draft_ids is not None:
                ids = draft_ids.to(ids.device)[ids]
            lab = _shift(b["labels"], 1 + j)
            run = run & (lab != IGNORE) & (ids == lab)
            hits[j] += run[v0].sum().cpu()
        count += int(v0.sum())
    acc = (hits / max(count, 1)).tolist()
    return {"acceptance_per_depth": [round(x, 4) for x in acc], "tau_chain_offline": round(1 + sum(acc), 4),
            "eval_positions": count}
