"""Online acceptance estimates for adaptive speculation (`spec.adaptive`): per request, the
probability that the draft node at each index (1 = the root's first child; a chain's index is its
depth) lies on the accepted path, given that it was drafted and verified. Every verify step
updates them; the controller (engine.decode.control) reads them as the expected tokens each
further drafted node adds.

Each request starts from the batch's estimate over all requests, which itself starts from a fixed
prior. An index a request does not verify in a step (it drafted fewer nodes, or none) drifts back
towards the batch's estimate, and the batch's towards the prior: without that, a request whose
drafts stopped paying would never draft again to find out that they pay now."""

from __future__ import annotations

# a conditional acceptance of 0.7 per level before anything is observed: optimistic enough that a
# fresh request tries its drafts, and what the drift returns an unverified index to
PRIOR = 0.7
REQUEST_RATE = 0.3  # a request's own estimate follows its last few verify steps (acceptance comes in runs)
BATCH_RATE = 0.05  # the batch's estimate averages over many requests' steps
DRIFT = 1 / 32  # per step, an unverified index moves this share of the way back


class Acceptance:
    """p[r-1]: the estimated probability that draft node r (tree order: parents first) is accepted."""

    def __init__(self, nodes: int, start: list[float] | None = None, rate: float = REQUEST_RATE) -> None:
        self.p = list(start) if start is not None else [PRIOR ** r for r in range(1, nodes + 1)]
        self.rate = rate

    def fork(self) -> "Acceptance":
        """A new request's estimate: this (the batch's) estimate, followed at the request's rate."""
        return Acceptance(len(self.p), self.p, REQUEST_RATE)

    def update(self, drafted: int, path: list[int]) -> None:
        """One verify step: nodes 1..`drafted` were verified and `path` (node indices, root first)
        was accepted."""
        on_path = set(path)
        for r in range(1, min(drafted, len(self.p)) + 1):
            self.p[r - 1] += self.rate * ((1.0 if r in on_path else 0.0) - self.p[r - 1])

    def drift(self, past: int, toward: list[float] | None = None) -> None:
        """The indices past `past` were not verified this step: each moves DRIFT of the way back
        towards `toward` (None: the prior)."""
        for r in range(past + 1, len(self.p) + 1):
            target = toward[r - 1] if toward is not None else PRIOR ** r
            self.p[r - 1] += DRIFT * (target - self.p[r - 1])

    def gains(self, nodes: int) -> list[float]:
        """Expected accepted tokens added by each of the first `nodes` draft nodes, made
        non-increasing (a running minimum) so that the best n nodes are always the first n."""
        out: list[float] = []
        low = 1.0
        for v in self.p[:nodes]:
            low = min(low, max(v, 0.0))
            out.append(low)
        return out
