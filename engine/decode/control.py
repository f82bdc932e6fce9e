"""The adaptive speculation controller (`spec.adaptive`): each step, how many draft nodes each
request verifies, to maximise the expected tokens per second of the whole batch.

A step over the batch yields one token per sequence plus, for each verified draft node, the
probability that it is accepted (engine.decode.acceptance: non-increasing along a request's
nodes), and costs the target forward over all its rows (engine.decode.stepcost) plus the drafting
of the nodes. The forward's cost depends only on how many rows the step has, so for each total of
n draft nodes the best choice is the n nodes of highest gain across the batch; the controller
tries every n from 0 (no speculation: always a candidate) to all of them and keeps the best
ratio. Every cost beyond the step without drafts is priced MARGIN above its estimate, so that
the errors of the estimates (acceptance, step cost) favour drafting less: a draft must be expected to
pay by that margin, and at a batch size where rows cost about what they yield, off wins.
Verification is untouched: any subset of a draft is verified losslessly, and the choice
depends on past steps and draft sizes, never on the drafted tokens' values."""

from __future__ import annotations

from collections.abc import Callable, Sequence

MARGIN = 0.15  # the engine's pessimism on the cost of drafts (forward rows and drafting)


def choose(gains: Sequence[Sequence[float]], tokens: float, step_s: Callable[[int], float],
           draft_s: float = 0.0, margin: float = 0.0) -> list[int]:
    """Draft nodes per request. `gains[i]`: request i's expected accepted tokens per further node
    (non-increasing, as long as its draft may be); `tokens`: the tokens the step yields without
    drafts; `step_s(n)`: seconds of the forward with n draft rows besides its own (a row per
    sequence, a prompt's rows); `draft_s`: seconds per drafted node; `margin`: what the drafts'
    costs are priced above their estimates (the engine passes MARGIN). Ties go to fewer nodes."""
    ranked = sorted(((g, i) for i, gs in enumerate(gains) for g in gs), key=lambda gi: -gi[0])
    base = step_s(0)
    best_n, best_rate = 0, tokens / base
    got = tokens
    for n, (g, _) in enumerate(ranked, start=1):
        if g <= 0:
            break
        got += g
        rate = got / (base + (1 + margin) * (step_s(n) - base + draft_s * n))
        if rate > best_rate * (1 + 1e-9):
            best_n, best_rate = n, rate
    out = [0] * len(gains)
    for _, i in ranked[:best_n]:
        out[i] += 1
    return out
