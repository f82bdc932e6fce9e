"""Online acceptance estimates for adaptive speculation (`spec.adaptive`): per request, the
probability that the draft node at each index (1 = the root's first child; a chain's index is its
depth) lies on the accepted path, given that it was drafted and verified. Every verify step
updates them; the controller (engine.decode.control) reads them as the expected tokens each
further drafted node adds.

Each request starts from the batch's estimate over all requests, which itself starts from a fixed
prior. An index a request does not verify in a step (it drafted fewer nodes, or none) drifts back
towards the batch's estimate: without that, a request whose drafts stopped paying would never
draft again to find out that they pay now. On a step where nobody drafted, that target held, so
the step is only counted, once for the whole batch (the scheduler's count, which an estimate
catches up with as `idle` when it is next read: `catch_up`), and the drift of a run of such steps
applied at once when the estimate is next read in full or the batch's estimate is about to move
(`settle`): most steps at a batch size where nothing pays touch no estimate. The batch's estimate holds while nobody drafts (the
engine's probes, engine.decode.batch, keep measuring it); on a step where someone drafted, the
indices deeper than anyone verified drift towards the deepest verified one's estimate times the
prior's ratio per level, so what the probes learn at shallow indices carries to the deeper ones.

Besides acceptance, each estimate follows its drafter's fill: the nodes a draft call yields over
the nodes it was allowed. A lookup drafter (n-gram, suffix) finds nothing on most steps of some
prompts; the controller counts a request's allowed nodes as that share of a row each before
drafting, and prices the real drafts after.

A drafter that states a confidence in its draft (`Tree.conf`: an n-gram or suffix lookup's share
of the matched context's occurrences that its first token followed) is calibrated online: per
confidence band, the batch's acceptance of the drafts in that band (`Calibration`). A draft's
expected gains are then its request's estimate times its band's acceptance over the batch's: a
continuation seen every time the context occurred counts for more than one seen once in five.
A band nothing was observed in yet starts from the batch's estimate (a factor of 1).

Each index also carries its estimate's variance in units of p (1 - p) (`v`: one over the samples it is
worth): 1 for the prior (one sample's worth), shrinking with every verify step by the rate's
exponential weights, to rate / (2 - rate) at most samples' worth (about 6 for a request's estimate, 39
for the batch's). A fresh request takes the batch's. The controller (`spread`) doubts a draft's
expected tokens by as many standard errors as engine.decode.control.DOUBT: a gain its estimate
cannot tell from a loss is not drafted."""

from __future__ import annotations

# a conditional acceptance of 0.7 per level before anything is observed: optimistic enough that a
# fresh request tries its drafts, and the ratio per level that unverified deeper indices drift to
PRIOR = 0.7
REQUEST_RATE = 0.3  # a request's own estimate follows its last few verify steps (acceptance comes in runs)
BATCH_RATE = 0.05  # the batch's estimate averages over many requests' steps
DRIFT = 1 / 32  # per step, an unverified index moves this share of the way back
LOW_FILL = 0.05  # a drafter's fill is taken as at least this (a request's allowed nodes are never free)
BANDS = (0.5, 0.8, 1.0)  # confidence bands: below 0.5, below 0.8, below 1, exactly 1 (always followed)


class Acceptance:
    """p[r-1]: the estimated probability that draft node r (tree order: parents first) is accepted;
    v[r-1]: its variance over p (1 - p), one over the samples it is worth; age[r-1]: the steps since
    index r was last verified; fill: the drafter's nodes per node allowed."""

    def __init__(self, nodes: int, start: list[float] | None = None, rate: float = REQUEST_RATE,
                 fill: float = 1.0, var: list[float] | None = None) -> None:
        self.p = list(start) if start is not None else [PRIOR ** r for r in range(1, nodes + 1)]
        self.v = list(var) if var is not None else [1.0] * len(self.p)  # a prior is worth one sample
        self.rate = rate
        self.age = [0] * len(self.p)
        self.fill = fill  # 1 before anything is observed: every allowed node is a row
        self.idle = 0  # steps not yet applied in which nothing was verified and the drift's target held
        # the scheduler's count of steps in which nobody drafted, when `idle` last caught up with it
        # (`catch_up`): such a step touches no request's estimate (engine.decode.batch)
        self.mark = 0

    def fork(self) -> "Acceptance":
        """A new request's estimate: this (the batch's) estimate, followed at the request's rate."""
        return Acceptance(len(self.p), self.p, REQUEST_RATE, self.fill, self.v)

    def update(self, drafted: int, path: list[int]) -> None:
        """One verify step: nodes 1..`drafted` were verified and `path` (node indices, root first)
        was accepted."""
        on_path = set(path)
        keep = (1 - self.rate) ** 2
        for r in range(1, min(drafted, len(self.p)) + 1):
            self.p[r - 1] += self.rate * ((1.0 if r in on_path else 0.0) - self.p[r - 1])
            self.v[r - 1] = keep * self.v[r - 1] + self.rate ** 2  # the new sample's weight squared
            self.age[r - 1] = 0

    def drift(self, past: int, toward: list[float] | None = None) -> None:
        """The indices past `past` were not verified this step: each moves DRIFT of the way back
        towards `toward` (None: the estimate at `past` times PRIOR per level beyond it, the
        batch's way; nothing moves when `past` is 0, nothing having been verified)."""
        if toward is None and past == 0:
            return
        for r in range(past + 1, len(self.p) + 1):
            target = toward[r - 1] if toward is not None else self.p[past - 1] * PRIOR ** (r - past)
            self.p[r - 1] += DRIFT * (target - self.p[r - 1])
            self.age[r - 1] += 1

    def catch_up(self, quiet: int) -> "Acceptance":
        """Count the steps in which nobody drafted since the last call (`quiet`: the scheduler's
        count of them so far) as `idle`; returns itself."""
        self.idle += quiet - self.mark
        self.mark = quiet
        return self

    def settle(self, toward: list[float]) -> None:
        """Apply the `idle` steps' drift at once: each was `drift(0, toward)` with the same target,
        which over k steps leaves each index (1 - DRIFT)^k of its way from the target."""
        k = self.idle
        if not k:
            return
        keep = (1 - DRIFT) ** k
        self.p = [t + (v - t) * keep for v, t in zip(self.p, toward)]
        self.age = [a + k for a in self.age]
        self.idle = 0

    def first(self, toward: float) -> float:
        """The estimate at index 1 as `settle` would leave it (`toward`: the target's index 1), without
        settling: what the controller's screen reads every step."""
        return self.p[0] if not self.idle else toward + (self.p[0] - toward) * (1 - DRIFT) ** self.idle

    def observe_fill(self, allowed: int, drafted: int) -> None:
        """A draft call allowed `allowed` nodes and yielded `drafted`."""
        if allowed > 0:
            self.fill += self.rate * (min(drafted / allowed, 1.0) - self.fill)

    def spread(self, gains: list[float]) -> list[float]:
        """The variance of each of `gains` (this estimate's expected tokens per node, `gains` or a
        band's): g (1 - g) over the samples its index is worth."""
        return [g * (1 - g) * v for g, v in zip(gains, self.v)]

    @property
    def rows(self) -> float:
        """The rows each allowed node is expected to add (the fill, at least LOW_FILL)."""
        return max(self.fill, LOW_FILL)

    def gains(self, nodes: int) -> list[float]:
        """Expected accepted tokens added by each of the first `nodes` draft nodes, made
        non-increasing (a running minimum) so that the best n nodes are always the first n."""
        out: list[float] = []
        low = 1.0
        for v in self.p[:nodes]:  # min(low, max(v, 0)) without the calls
            if v < low:
                low = v if v > 0.0 else 0.0
            out.append(low)
        return out


class Calibration:
    """The batch's acceptance per confidence band (BANDS), each started from the batch's estimate
    when first seen and followed at the batch's rate."""

    def __init__(self) -> None:
        self.bands: dict[int, Acceptance] = {}

    @staticmethod
    def band(conf: float) -> int:
        return sum(conf >= b for b in BANDS)

    def gains(self, est: Acceptance, batch: Acceptance, conf: float | None, nodes: int) -> list[float]:
        """A draft's expected gains per node: `est`'s times its band's acceptance over `batch`'s
        (`est`'s own where `conf` is None or the band is new), non-increasing, at most 1."""
        cal = self.bands.get(self.band(conf)) if conf is not None else None
        if cal is None:
            return est.gains(nodes)
        out: list[float] = []
        low = 1.0
        for p, c, b in zip(est.p[:nodes], cal.p, batch.p):
            low = min(low, max(min(p * c / max(b, 1e-3), 1.0), 0.0))
            out.append(low)
        return out

    def first_ratio(self, batch: Acceptance) -> float:
        """`upper`'s ratio at index 1: its most accepted band's over the batch's (at least 1)."""
        if not self.bands:
            return 1.0
        return max(1.0, *(b.p[0] / max(batch.p[0], 1e-3) for b in self.bands.values()))

    def upper(self, ests: list[Acceptance], batch: Acceptance, nodes: int) -> list[list[float]]:
        """Each estimate's expected gains per node were each index at its most accepted band's ratio
        to the batch (1 where no band is above the batch, or none was observed): at least what any
        band's draft would be worth, before the draft's confidence is known. One ratio per index
        for all the requests (the controller calls it every step)."""
        if not self.bands:
            return [e.gains(nodes) for e in ests]
        ratio = [max(1.0, *(b.p[r] / max(batch.p[r], 1e-3) for b in self.bands.values())) for r in range(nodes)]
        out = []
        for e in ests:
            gains, low = [], 1.0
            for p, f in zip(e.p[:nodes], ratio):  # min(low, max(min(p f, 1), 0)) without the calls (low <= 1)
                v = p * f
                if v < low:
                    low = v if v > 0.0 else 0.0
                gains.append(low)
            out.append(gains)
        return out

    def update(self, batch: Acceptance, conf: float | None, drafted: int, path: list[int]) -> None:
        """A verified draft of confidence `conf` (nothing learnt without one)."""
        if conf is None or drafted <= 0:
            return
        band = self.band(conf)
        cal = self.bands.get(band)
        if cal is None:
            cal = self.bands[band] = Acceptance(len(batch.p), batch.p, batch.rate, var=batch.v)
        cal.update(drafted, path)
        cal.drift(drafted)
