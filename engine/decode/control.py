"""The adaptive speculation controller (`spec.adaptive`): each step, how many draft nodes each
request verifies, to maximise the expected tokens per second of the whole batch.

A step over the batch yields one token per sequence plus, for each verified draft node, the
probability that it is accepted (engine.decode.acceptance: non-increasing along a request's
nodes), and costs the target forward over all its rows (engine.decode.stepcost) plus the drafting
of the nodes. The forward's cost depends only on how many rows the step has, so for each total of
n draft nodes the best choice is the n nodes of highest gain across the batch; the controller
tries every n from 0 (no speculation: always a candidate) to all of them and keeps the best
ratio. Before drafting, a request's node counts as the rows its drafter is expected to yield per
node allowed (a lookup drafter that finds nothing adds no row), so the nodes allowed are an upper
bound that the real drafts are then cut to. A step's price with n >= 1 rows holds what drafting at
all adds to it besides the rows (engine.decode.stepcost.setup_s: the cut, the trees' verification,
the estimates' updates), so a few rows that yield about what they cost leave the step off's. Every
cost beyond the step without drafts is priced MARGIN above its estimate, so that the errors of the
estimates (acceptance, step cost) favour drafting less: a draft must be expected to pay by that
margin, and at a batch size where rows cost about what they yield, off wins. The drafts' expected tokens are doubted too, by what their
estimates do not know (`spread`: engine.decode.acceptance's variance of each node's gain): a total
of nodes is weighed at its expected tokens less DOUBT standard errors of their sum, so a gain of a
few percent that an estimate of a few samples cannot tell from a loss leaves the step off's (or the
shallower draft's), while many nodes across a batch, whose errors average out, are doubted less each.

Estimates learn only from what is drafted, so every PROBE_EVERY steps requests draft one node
each beyond the choice (`probe`): those whose next index went unverified longest, weighed by how
often their drafters yield a node (a probe that drafts nothing verifies nothing), and only where
those nodes would pay if they were certainly accepted (where a row costs what a token yields,
nothing is probed and off's steps stay off's). The probes bound what a stale estimate costs: a
batch whose prior acceptance was too low to draft learns that its drafts pay. A probe has a price:
the seconds its rows and drafting add to the step less what its expected tokens are worth, at the
prices the choice weighs (the margin on the rows, the doubt on the tokens: `probe_loss`), paid
from a budget that grows by PROBE_SHARE of every step's seconds (`ProbeBudget`); a probe step
runs the run of the stalest requests' nodes with the most nodes per second lost, once the budget
pays for it (`ProbeBudget.afford`). Where a
row is nearly free probes cost nothing and run every PROBE_EVERY steps; where a row costs about
what a token yields, probes run only as often as that share of the time pays for, so exploring
costs less than the noise of any measurement of the engine. Where a row costs a fraction of a
token's worth, one node a probe step paid for the whole of what drafting at all adds to a step
and was doubted by its own estimate alone: a batch of 16 that started from the prior learnt one
sample per probe step, too few to outweigh the prior's doubt before its requests ended. Several
nodes share that cost and their sum is doubted less, so the same budget buys a sample per request.

A probe that found nothing backs off (`backoff`): a probe step at a batch size whose full choice
drafts nothing, after a probe there that found nothing (its accepted nodes fewer than its rows'
price in tokens at the choice's prices, or no node that would pay even if accepted), doubles the
steps to that batch size's next probe step, up to PROBE_BACKOFF times PROBE_EVERY; a probe whose
accepted nodes paid for its rows keeps the pace, and so does one whose drafters drafted nothing
(it found no evidence either way), and a choice that drafts brings it back to PROBE_EVERY. A probe
step whose probes the budget cannot pay for yet puts the next one where it will have earned
them (`ProbeBudget.wait`), so no step is priced in full for a probe it cannot run. Where
nothing pays, probing then follows the evidence down to a small share of its budget and its
steps' pricing to a small share of the steps.

Most steps at a batch size where drafts do not pay draft nothing, and pricing every total of rows
to find that out costs more than anything else the controller does. So each full choice also
yields the least gain per row at which any total of rows could pay (`pay_floor`: no node gains
more than its request's first, so below it `choose` drafts nothing); for the next steps at that
batch size, until the next probe step prices everything again, a batch whose best first node is
below that floor (less SLACK, for what the prices move meanwhile) drafts nothing without pricing,
and so does one whose last full choice drafted nothing (a fixed cost of drafting at all, the
pricing's own included, spreads over every node the batch could draft in the floor, which then
screens little; the estimates move only by what is verified, so the next choice would be the
same). Joining prompts that add more than SLACK of the step's seconds price everything.

Verification is untouched: any subset of a draft is verified losslessly, and the choice
depends on past steps and draft sizes, never on the drafted tokens' values."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from operator import itemgetter

MARGIN = 0.15  # the engine's pessimism on the cost of drafts (forward rows and drafting)
DOUBT = 1.0  # standard errors of the drafts' expected tokens that a total of nodes must still pay after
PROBE_EVERY = 4  # a probe at most every this many steps: at most a quarter of a row per step
PROBE_BACKOFF = 16  # where nothing pays, a batch size's probe steps grow at most this many times further apart
PROBE_SHARE = 0.005  # the share of the steps' seconds that the probes may be expected to lose
SLACK = 0.1  # a batch is screened out below this much less than the last pay floor (prices move between steps)


def _rate(got: float, rows: float, base: float, step_s: Callable[[float], float], draft_s: float,
          margin: float) -> float:
    return got / (base + (1 + margin) * (step_s(rows) - base + draft_s * rows))


def choose(gains: Sequence[Sequence[float]], tokens: float, step_s: Callable[[float], float],
           draft_s: float = 0.0, margin: float = 0.0, rows: Sequence[float] | None = None,
           spread: Sequence[Sequence[float]] | None = None, doubt: float = 0.0) -> list[int]:
    """Draft nodes per request. `gains[i]`: request i's expected accepted tokens per further node
    (non-increasing, as long as its draft may be); `tokens`: the tokens the step yields without
    drafts; `step_s(n)`: seconds of the forward with n draft rows besides its own (a row per
    sequence, a prompt's rows); `draft_s`: seconds per drafted node; `margin`: what the drafts'
    costs are priced above their estimates (the engine passes MARGIN); `rows[i]`: the rows each of
    request i's nodes is expected to add (its drafter's fill; 1 each by default), its gains the
    expected tokens of a node it does draft; `spread[i][r]`: the variance of `gains[i][r]`
    (Acceptance.spread), each total's expected tokens taken `doubt` standard errors of their sum
    lower (the engine passes DOUBT). Ties go to fewer nodes."""
    # highest gain first, ties in request order (a stable sort, reversed stably)
    ranked = sorted(((g, i, r) for i, gs in enumerate(gains) for r, g in enumerate(gs) if g > 0), key=itemgetter(0),
                    reverse=True)
    base = step_s(0)
    best_n, best_rate = 0, tokens / base
    got, n_rows, var = tokens, 0, 0.0  # whole rows stay ints: a table's index
    k, per_row = 1 + margin, (1 + margin) * draft_s
    doubted = spread is not None and doubt > 0
    for n, (g, i, r) in enumerate(ranked, start=1):  # _rate inlined: this loop runs a few hundred times a step
        w = 1 if rows is None else rows[i]
        got += g * w
        n_rows += w
        sure = got
        if doubted:
            var += spread[i][r] * w * w
            sure -= doubt * math.sqrt(var)
        rate = sure / (base + k * (step_s(n_rows) - base) + per_row * n_rows)
        if rate > best_rate * (1 + 1e-9):
            best_n, best_rate = n, rate
    out = [0] * len(gains)
    for _, i, _ in ranked[:best_n]:
        out[i] += 1
    return out


def pay_floor(tokens: float, table: Sequence[float], draft_s: float = 0.0, margin: float = 0.0) -> float:
    """The least gain per row at which some total of draft rows priced by `table` (a step's seconds
    with n = 0, 1, ... rows, linear between) raises the step's tokens per second on `choose`'s
    terms: with every gain at most g per row, n rows yield at most g n tokens more, which pays only
    if g exceeds tokens / table[0] times the least cost per row over the totals (on each segment
    between whole totals the cost per row is monotone, so the whole totals bound it)."""
    base = table[0]
    k, per_row = 1 + margin, (1 + margin) * draft_s
    cheapest = min(((k * (t - base) + per_row * n) / n for n, t in enumerate(table) if n), default=math.inf)
    return tokens / base * cheapest


def probe(chosen: Sequence[int], gains: Sequence[Sequence[float]], ages: Sequence[Sequence[int]], tokens: float,
          step_s: Callable[[float], float], draft_s: float = 0.0, margin: float = 0.0,
          rows: Sequence[float] | None = None) -> list[int]:
    """The requests that may each draft one node beyond `chosen` (their nodes from `choose` on the
    same arguments) this step, stalest first: among the requests that may draft deeper, ordered by
    how long their next index is expected to have gone unverified when verified (`ages[i][r]`:
    steps since request i's index r + 1 was verified, times `rows[i]`, the share of its draft calls
    that yield a node: a lookup drafter that finds nothing verifies nothing, and its index stays as
    stale), the longest run of them whose nodes would pay together were they certainly accepted
    (none: where a row costs what a token yields). By age alone, a batch whose requests all drafted
    nothing (their ages equal) probed its first request every time, and where that one's drafter
    found nothing, nothing was ever verified. `probe_loss` prices each run's first nodes, and the
    budget (`ProbeBudget.afford`) decides how many of them run: several where a row is cheap
    against a token's worth, so that a probe step verifies several samples."""
    w = [1] * len(gains) if rows is None else list(rows)
    n_rows = sum(k * wi for k, wi in zip(chosen, w))
    got = tokens + sum(sum(g[:k]) * wi for g, k, wi in zip(gains, chosen, w))
    base = step_s(0)
    now = _rate(got, n_rows, base, step_s, draft_s, margin)
    order = sorted((i for i, (k, g) in enumerate(zip(chosen, gains)) if k < len(g)),
                   key=lambda i: ages[i][chosen[i]] * w[i], reverse=True)  # stable: ties in request order
    best, more = 0, 0
    for n, i in enumerate(order, start=1):
        more += w[i]
        if _rate(got + more, n_rows + more, base, step_s, draft_s, margin) > now:
            best = n
    return order[:best]


def rows_price(step_s: Callable[[float], float], n_rows: float, more: float, draft_s: float = 0.0,
               margin: float = 0.0) -> float:
    """The seconds that `more` draft rows beyond `n_rows` add to a step, their drafting included,
    priced `margin` above the estimates (what a probe's rows cost, as the choice weighs them)."""
    return (1 + margin) * (step_s(n_rows + more) - step_s(n_rows) + draft_s * more)


def probe_loss(chosen: Sequence[int], gains: Sequence[Sequence[float]], tokens: float, step_s: Callable[[float], float],
               probed: Sequence[int], draft_s: float = 0.0, rows: Sequence[float] | None = None, margin: float = 0.0,
               spread: Sequence[Sequence[float]] | None = None, doubt: float = 0.0) -> list[float]:
    """The seconds that probing the first 1, 2, ... of `probed` (requests, each one node beyond
    `chosen`) is expected to lose at the prices the choice weighed: what their rows and drafting
    add to the step (`margin` above `step_s`), less their expected accepted tokens (`doubt` standard
    errors of their sum lower, `spread` as in `choose`) at the step's seconds per token; 0 where
    they are expected to pay even so. Priced without the margin and the doubt, a probe at a batch
    size where a node yields about what its row costs lost nothing and ran every PROBE_EVERY
    steps: a quarter of the steps drafted where off was faster. Several nodes share what drafting
    at all adds to a step and their sum is doubted less than each alone (as `choose` weighs them)."""
    w = [1] * len(gains) if rows is None else list(rows)
    n_rows = sum(k * wi for k, wi in zip(chosen, w))
    got = tokens + sum(sum(g[:k]) * wi for g, k, wi in zip(gains, chosen, w))
    now = step_s(n_rows) + draft_s * n_rows
    doubted = spread is not None and doubt > 0
    out, more, gain, var = [], 0, 0.0, 0.0
    for i in probed:
        more += w[i]
        gain += gains[i][chosen[i]] * w[i]
        if doubted:
            var += spread[i][chosen[i]] * w[i] * w[i]
        extra = rows_price(step_s, n_rows, more, draft_s, margin)
        sure = gain - doubt * math.sqrt(var) if doubted else gain
        out.append(max(extra - sure * now / got, 0.0))
    return out


def backoff(every: int, first: int, drafted: bool, missed: bool) -> int:
    """The steps from a batch size's probe step to its next, after a full choice there: `first`
    (PROBE_EVERY) once the choice drafts; else twice `every`, up to `first` x PROBE_BACKOFF, when
    `missed`: a probe step whose choice drafts nothing after a probe that found nothing (its
    accepted nodes fewer than its rows' price in tokens, or no node that would pay even if
    accepted); else `every` unchanged (a probe whose accepted nodes paid for its rows keeps the
    pace: its evidence may make a draft pay). Where
    nothing pays, probe steps (each priced in full) and their probes then come as rarely as every
    PROBE_EVERY x PROBE_BACKOFF steps; where a probe's evidence makes a
    draft pay, the next choice drafts and the probes are PROBE_EVERY apart again."""
    if drafted:
        return first
    return min(2 * every, first * PROBE_BACKOFF) if missed else every


class ProbeBudget:
    """The seconds the probes may still lose: PROBE_SHARE of every step's seconds, banked up to one
    step's worth (a stretch without probes does not buy a burst of them)."""

    def __init__(self) -> None:
        self.credit = 0.0

    def earn(self, step_s: float) -> None:
        """A step of `step_s` seconds ran."""
        self.credit = min(self.credit + PROBE_SHARE * step_s, step_s)

    def wait(self, loss: float, step_s: float) -> int:
        """The steps of `step_s` seconds until a probe expected to lose `loss` is paid for (at most
        PROBE_EVERY x PROBE_BACKOFF: the credit is capped at one step's seconds)."""
        short = loss - self.credit
        if short <= 0:
            return 0
        if loss > step_s:  # never
            return PROBE_EVERY * PROBE_BACKOFF
        return min(math.ceil(short / (PROBE_SHARE * step_s)), PROBE_EVERY * PROBE_BACKOFF)

    def afford(self, losses: Sequence[float], step_s: float) -> tuple[int, float]:
        """The run of probes to buy (`losses[k - 1]`: what its first k are expected to lose), among
        those the credit can ever hold (a loss of at most `step_s`, one step's seconds): the k with
        the least loss per probe (the longest that loses nothing, if any does; ties to the longer
        run), and its loss; paid if the credit holds it (else 0 probes: `wait` for the loss). What
        drafting at all adds to a step is paid once per run and a run's doubt grows as the square
        root of its nodes, so where a row costs about what its node yields the whole run loses
        less per node than a part of it bought at every probe step."""
        k, each = 0, math.inf
        for n, loss in enumerate(losses, start=1):  # ties (to rounding) to the longer run
            if loss <= step_s and loss / n <= each * (1 + 1e-9):
                k, each = n, loss / n
        if not k:
            return 0, math.inf
        loss = losses[k - 1]
        if loss > self.credit:
            return 0, loss
        self.credit -= loss
        return k, loss
