"""The built-in server's Prometheus metrics under vLLM's names, so one load generator and one
dashboard serve every engine (a registry per app, so tests can run several servers in one process).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.api import GenResult

if TYPE_CHECKING:  # the type only: a scrape reads the scheduler's state, the server owns it
    from engine.decode.batch import BatchEngine


class Metrics:
    """The server's Prometheus metrics, under vLLM's names."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.model = model_name
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps that carried drafted tokens", lab, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens offered for verification",
                                    lab, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted", lab, registry=r)
        self.accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted drafted tokens per draft position", lab + ["position"], registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting in the queue", lab, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests being generated", lab, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lab, registry=r)
        # automatic prefix caching, in prompt tokens looked up and found (engine.decode.prefix)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", lab,
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", lab, registry=r)
        self._prefix_seen = (0, 0)
        self.success = Counter("vllm:request_success", "Finished requests", lab + ["finished_reason"], registry=r)
        lat = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", lab,
                             buckets=lat, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (queueing included)", lab,
                              buckets=lat, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Per-request time per output token", lab,
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        for m in (self.drafts, self.draft_tokens, self.accepted, self.waiting, self.running, self.prompt_tokens,
                  self.generation_tokens, self.prefix_queries, self.prefix_hits):
            m.labels(model_name=model_name)  # expose zeros before the first request

    def scheduler(self, batch: BatchEngine) -> None:
        """Expose the scheduler `batch`'s state at each scrape: its steps by the sequences they ran
        (spectune:steps), and adaptive control's state (`spec.adaptive`, spectune:adaptive_*)."""
        self.registry.register(_Steps(self.model, batch))
        self.registry.register(_Controller(self.model, batch))

    def prefix_cache(self, queries: int, hits: int) -> None:
        """Bring the prefix-cache counters up to the cache's running totals."""
        q0, h0 = self._prefix_seen
        self.prefix_queries.labels(self.model).inc(queries - q0)
        self.prefix_hits.labels(self.model).inc(hits - h0)
        self._prefix_seen = (queries, hits)

    def record(self, res: GenResult, prompt_len: int, ttft_s: float, e2e_s: float) -> None:
        m, st = self.model, res.stats
        self.drafts.labels(m).inc(st.draft_steps)
        self.draft_tokens.labels(m).inc(st.drafted_tokens)
        self.accepted.labels(m).inc(st.accepted_tokens)
        for pos, n in enumerate(st.accepted_per_pos):
            self.accepted_pos.labels(m, str(pos)).inc(n)
        self.prompt_tokens.labels(m).inc(prompt_len)
        self.generation_tokens.labels(m).inc(st.new_tokens)
        self.success.labels(m, res.finish_reason).inc()
        self.e2e.labels(m).observe(e2e_s)
        self.ttft.labels(m).observe(ttft_s)
        if st.new_tokens > 1:
            self.tpot.labels(m).observe((e2e_s - ttft_s) / (st.new_tokens - 1))


class _Steps:
    """spectune:steps_total{sequences}: the engine's steps by how many sequences their forwards ran,
    read when /metrics is scraped. How full the batch was kept: under N clients that each send
    their next request when the last one ends, a step below N means a place stood empty (a request
    ended and its client's next had not joined yet)."""

    def __init__(self, model: str, batch: BatchEngine) -> None:
        self.model, self.batch = model, batch

    def collect(self) -> Iterator[CounterMetricFamily]:
        c = CounterMetricFamily("spectune:steps", "Engine steps by the sequences their forwards ran",
                                labels=["model_name", "sequences"])
        for n, steps in enumerate(list(self.batch.occupancy)):
            if steps:
                c.add_metric([self.model, str(n)], steps)
        yield c


ROWS_SHOWN = (0, 1, 2, 4, 8, 16)  # the draft-row counts whose prices a scrape shows


class _Controller:
    """Adaptive control's state, read when /metrics is scraped (nothing per step), under
    spectune:adaptive_*: per batch size the engine has stepped at, the price of a step with 0-16
    draft rows (the step-cost curve as timed, the controller's price with the live figures and the
    step's overhead, and the forward's live mean per count of rows that ran, with how many steps
    ran it), a priced step's overhead with and without draft rows, the controller's own pricing
    and what drafting at all adds to a step there; the live level over the curve, the
    drafting's seconds per node and the batch's acceptance estimate at draft positions 1-3. What
    tells a mispriced row from a misestimated
    node in a served run (benchmarks/adaptive.py reads it per cell)."""

    def __init__(self, model: str, batch: BatchEngine) -> None:
        self.model, self.batch = model, batch

    def collect(self) -> Iterator[GaugeMetricFamily]:
        cost = self.batch.cost
        if cost is None:  # no adaptive band
            return
        m = self.model
        g = {name: GaugeMetricFamily(f"spectune:adaptive_{name}", doc, labels=labels) for name, doc, labels in (
            ("level", "Live steps' seconds less the curve's draft rows, over the curve's step without them",
             ["model_name"]),
            ("draft_seconds_per_node", "Drafting seconds per drafted node", ["model_name"]),
            ("overhead_seconds", "A step's seconds outside the forward and drafting", ["model_name", "batch"]),
            ("setup_seconds", "What a step that ran draft rows spent outside the forward and drafting beyond "
             "one without rows", ["model_name", "batch"]),
            ("kind_overhead_seconds", "A priced step's seconds outside the forward and drafting: plain (no draft "
             "rows), drafting", ["model_name", "batch", "kind"]),
            ("kind_work_seconds", "A priced step's own seconds verifying, committing, learning and cutting drafts, "
             "timed in the engine's thread: plain (no draft rows), drafting", ["model_name", "batch", "kind"]),
            ("pricing_seconds", "The controller's own seconds pricing a step in full", ["model_name", "batch"]),
            ("curve_seconds", "The timed curve's forward seconds with this many draft rows", ["model_name", "batch", "rows"]),
            ("price_seconds", "The controller's price of a step with this many draft rows", ["model_name", "batch", "rows"]),
            ("forward_seconds", "Live forwards' mean seconds with this many draft rows", ["model_name", "batch", "rows"]),
            ("forward_steps", "Live forwards run with this many draft rows", ["model_name", "batch", "rows"]),
            ("acceptance", "The batch's acceptance estimate at a draft position", ["model_name", "spec", "position"]))}
        g["level"].add_metric([m], cost.level)
        g["draft_seconds_per_node"].add_metric([m], cost.draft_s)
        for b in sorted(set(cost.live) | set(cost.overhead)):  # (read while the engine thread steps: copies)
            g["overhead_seconds"].add_metric([m, str(b)], cost.overhead_s(b))
            g["setup_seconds"].add_metric([m, str(b)], cost.setup_s(b))
            for kind, figures in (("plain", cost.plain), ("drafting", cost.drafting)):
                if b in figures:
                    g["kind_overhead_seconds"].add_metric([m, str(b), kind], figures[b])
            for kind, figures in (("plain", cost.work[False]), ("drafting", cost.work[True])):
                if b in figures:
                    g["kind_work_seconds"].add_metric([m, str(b), kind], figures[b])
            if b in cost.pricing:
                g["pricing_seconds"].add_metric([m, str(b)], cost.pricing[b])
            price = cost.table(b, 0, ROWS_SHOWN[-1])
            live = cost.rows.get(b)
            for n in ROWS_SHOWN:
                g["curve_seconds"].add_metric([m, str(b), str(n)], cost.curve_s(b, n))
                g["price_seconds"].add_metric([m, str(b), str(n)], price[n])
                if live is not None and live.n[n]:
                    g["forward_seconds"].add_metric([m, str(b), str(n)], live.t[n])
                    g["forward_steps"].add_metric([m, str(b), str(n)], live.n[n])
        for key, est in list(self.batch.accept.items()):
            for r, p in enumerate(est.p[:3], start=1):
                g["acceptance"].add_metric([m, key, str(r)], p)
        yield from g.values()
