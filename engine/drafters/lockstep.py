"""Drafting in lockstep: the EAGLE drafts of several requests advance together, each step's head
forward run once over all their rows (continuous batching, engine.decode.batch).

A draft is a sequence of steps (`ModelDrafter.drafting`): the catch-up over the newly committed
positions, then one tree level at a time. At each step every draft still growing contributes its
rows; the head's linears (fc, q/k/v, o, the MLP) and the logits matmul over the draft lm_head rows
run once over their concatenation, while each draft attends over its own cache with its own mask
(`LeanHead.step_batch`). A tree of smaller depth drops out after its last level. Each draft samples
with its own generator in its own order, so the trees are those each request drafts alone, up to
the float rounding of a matmul over more rows.

Drafters share a forward when their `lockstep_key`s are equal: the same LeanHead (one head module,
so EAGLE-1 and EAGLE-3 heads never mix) and the same logits rows. Any other drafter (n-gram, suffix,
a draft model, Medusa, a head the lean layer does not carry) drafts alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.api import SamplingParams
from engine.drafters.base import CatchUp, DraftSteps, Drafter
from engine.drafters.eagle import EagleDrafter
from engine.trees.tree import Tree


def lockstep_groups(drafters: Sequence[Drafter | None]) -> list[list[int]]:
    """Indices of the drafters that draft together, one list per shared head forward (two or more
    drafters each; a lone one gains nothing and drafts as usual)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, d in enumerate(drafters):
        key = d.lockstep_key() if isinstance(d, EagleDrafter) else None
        if key is not None:
            groups.setdefault(key, []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def draft_together(drafters: Sequence[EagleDrafter], ids: Sequence[list[int]], params: Sequence[SamplingParams],
                   generators: Sequence[torch.Generator | None]) -> list[Tree | Exception]:
    """`drafters[i].draft(ids[i], params[i], generators[i])` for every i, with ONE head forward per
    step over the rows of all drafts still growing. The drafters must share a `lockstep_key`.
    Returns each draft's tree, or the exception that ended it: an error in one draft's own step
    fails that draft only, an error in the shared forward every draft in it."""
    lean = drafters[0].lean
    assert lean is not None and all(d.lockstep_key() == drafters[0].lockstep_key() for d in drafters), \
        "draft_together: the drafters do not share a head forward"
    out: list[Tree | Exception | None] = [None] * len(drafters)
    steps: dict[int, DraftSteps] = {i: d.drafting(x, p, g) for i, (d, x, p, g) in
                                    enumerate(zip(drafters, ids, params, generators))}

    def fail(i: int, exc: Exception) -> None:
        out[i] = exc
        steps.pop(i).close()  # runs the draft's rollback now

    replies: dict[int, torch.Tensor | None] = dict.fromkeys(steps)
    try:
        with torch.inference_mode():
            while replies:
                asks = {}
                for i, reply in replies.items():
                    try:
                        asks[i] = steps[i].send(reply)
                    except StopIteration as done:
                        out[i] = done.value
                        del steps[i]
                    except Exception as exc:  # noqa: BLE001 - one draft's failure
                        out[i] = exc
                        del steps[i]
                rows = {}
                for i, ask in asks.items():
                    try:
                        rows[i] = drafters[i]._rows(ask)
                    except Exception as exc:  # noqa: BLE001
                        fail(i, exc)
                if not rows:
                    break
                try:
                    feats = lean.step_batch(list(rows.values()))
                    kept = [drafters[i]._keep(f, isinstance(asks[i], CatchUp)) for i, f in zip(rows, feats)]
                    logits = drafters[0]._logits(torch.cat(kept)).split([k.shape[0] for k in kept])
                except Exception as exc:  # noqa: BLE001 - the shared forward fails everyone in it
                    for i in rows:
                        fail(i, exc)
                    break
                replies = {i: lg[0] if isinstance(asks[i], CatchUp) else lg for i, lg in zip(rows, logits)}
    finally:
        for s in steps.values():  # only after an interrupt: every finished or failed draft left `steps`
            s.close()
    return out  # type: ignore[return-value]  # every entry is set once the loop ends
