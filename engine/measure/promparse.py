"""Prometheus `/metrics` text -> speculative-decoding counters, and their delta over a run.

vLLM (and the built-in server, which uses vLLM's names) count drafts, drafted tokens, accepted
tokens and accepted tokens per draft position. Over HTTP these counters are the only way to learn
tau: every target forward yields 1 + its accepted tokens, so over a run
forwards = output_tokens - delta_accepted and tau = output_tokens / forwards.

SGLang (python/sglang/srt/metrics/collector.py) has no such counters, only the gauges
`sglang:spec_accept_length` ("the average acceptance length of speculative decoding") and
`sglang:spec_accept_rate` (accepted / drafted tokens). The scheduler sets the length, at every
decode log interval, to spec_num_total_accepted_tokens / spec_num_total_forward_ct, where each
verify step adds accepted drafts + 1 (the bonus token) per request to the numerator and 1 per
request to the denominator, then resets both: it is tokens per target forward, i.e. tau itself,
over the latest interval (a gauge, not a counter, so it is read as of the end of a run, not as a
delta). It is 0 until a speculative decode step has been logged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm:spec_decode_"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"


def parse_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """All samples of a Prometheus text exposition: {(name, sorted labels): value}.

    Counter sample names are normalised without the `_total` suffix (exporters differ on it).
    """
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name[: -len("_total")] if s.name.endswith("_total") else s.name
            if name.endswith("_created"):  # creation timestamps, not counts
                continue
            out[(name, tuple(sorted(s.labels.items())))] = s.value
    return out


@dataclass
class SpecCounters:
    """The spec_decode counters summed over every label except `position`."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    present: bool = False  # the endpoint exposes spec_decode counters (or SGLang's gauges) at all
    # SGLang gauges (mean over ranks/label sets; None when the page has none): tokens per target
    # forward and accepted/drafted over the scheduler's latest log interval.
    accept_length: float | None = None
    accept_rate: float | None = None

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        positions = set(self.accepted_per_pos) | set(before.accepted_per_pos)
        return SpecCounters(
            num_drafts=self.num_drafts - before.num_drafts,
            num_draft_tokens=self.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - before.num_accepted_tokens,
            accepted_per_pos={p: self.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)
                              for p in sorted(positions)},
            present=self.present and before.present,
            # gauges are levels, not counts: the later page's value is the run's
            accept_length=self.accept_length,
            accept_rate=self.accept_rate,
        )

    def acceptance_per_pos(self) -> list[float]:
        """Share of drafts whose token at position i (0-based) was accepted."""
        if self.num_drafts <= 0 or not self.accepted_per_pos:
            return []
        n = max(self.accepted_per_pos) + 1
        return [self.accepted_per_pos.get(i, 0.0) / self.num_drafts for i in range(n)]


def spec_counters(text: str) -> SpecCounters:
    """Sum vLLM's spec_decode counters (over model/engine labels) from a /metrics text, and read
    SGLang's speculative gauges (averaged over label sets, e.g. tp/dp ranks)."""
    c = SpecCounters()
    gauges: dict[str, list[float]] = {SGLANG_ACCEPT_LENGTH: [], SGLANG_ACCEPT_RATE: []}
    for (name, labels), value in parse_samples(text).items():
        if name in gauges:
            c.present = True
            gauges[name].append(value)
            continue
        if not name.startswith(PREFIX):
            continue
        what = name[len(PREFIX):]
        c.present = True
        if what == "num_drafts":
            c.num_drafts += value
        elif what == "num_draft_tokens":
            c.num_draft_tokens += value
        elif what == "num_accepted_tokens":
            c.num_accepted_tokens += value
        elif what == "num_accepted_tokens_per_pos":
            pos = int(dict(labels)["position"])
            c.accepted_per_pos[pos] = c.accepted_per_pos.get(pos, 0.0) + value
    for name, values in gauges.items():
        # ranks that logged no speculative step yet sit at 0: leave them out of the mean
        live = [v for v in values if v > 0]
        mean = sum(live) / len(live) if live else (0.0 if values else None)
        if name == SGLANG_ACCEPT_LENGTH:
            c.accept_length = mean
        else:
            c.accept_rate = mean
    return c


def tau_from_delta(output_tokens: int, delta: SpecCounters) -> float | None:
    """Tokens per target forward over the run, from the accepted-token delta; None without counters.

    Without vLLM counters but with SGLang's gauge, tau is the gauge itself (already tokens per
    forward, bonus token included); a gauge at 0 (no speculative step logged) gives None.
    """
    if not delta.present or output_tokens <= 0:
        return None
    if delta.num_drafts == 0 and delta.num_accepted_tokens == 0 and delta.accept_length is not None:
        return delta.accept_length if delta.accept_length >= 1.0 else None
    forwards = output_tokens - delta.num_accepted_tokens
    return output_tokens / forwards if forwards > 0 else None
