"""The one load generator: plays prompts against an engine and measures it, the same way for all.

Two ways in, one set of figures (`Measurement`):
- `run_inprocess`: the built-in engine in this process. Concurrency N is a closed loop of N
  clients in front of one engine that serves requests first come, first served (the engine runs
  one request at a time, as the built-in server does): request i arrives at t0 for i < N, else when
  request i-N finishes. TTFT, TPOT and end-to-end latency are measured from arrival, so queueing
  counts, exactly as it would over HTTP. No threads: timings are not disturbed by the GIL.
- `run_http`: any OpenAI-compatible endpoint (the built-in server, vLLM, SGLang) with N concurrent
  streaming requests (httpx, asyncio). Token counts come from `usage` (stream_options.include_usage);
  tau and acceptance per position from the delta of the `vllm:spec_decode_*` counters on /metrics.

Per request: TTFT = first streamed token(s) - arrival; TPOT = (e2e - TTFT) / (tokens - 1) (not ITL:
under speculation one chunk can carry several tokens); ITL = gaps between streamed chunks.
`measure` adds warm-up and repeats and reports medians with a 95% confidence interval; an
in-process target starts each of them from the suffix cache its first pass found (a suffix spec's
global tree would otherwise hand a repeated prompt its own earlier answer).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx
import numpy as np

from engine.api import SamplingParams, TextEngine
from engine.measure.promparse import SpecCounters, spec_counters, tau_from_delta
from engine.measure.stats import log_interval, tight
from engine.measure.workloads import Prompt, encode, params_of
from tuner.schema.config import Figures


@dataclass
class RequestRecord:
    """What one request measured (seconds, from its arrival)."""

    prompt_id: str
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.error or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Measurement:
    """Figures of one pass over a prompt set at one concurrency. Latencies in ms; None if no data."""

    output_tokens_per_s: float
    request_throughput: float  # finished requests per second
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    tpot_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    tau: float | None  # tokens per target forward over all steps; None when the endpoint has no counters
    accepted_per_pos: list[float]  # [i]: share of draft steps whose position i+1 was accepted
    n_requests: int  # requests that finished without error
    output_tokens: int
    wall_s: float
    concurrency: int
    texts: list[str]  # in prompt order ("" for failed requests)
    errors: list[str]
    draft_s: float | None = None  # in-process only: time spent drafting / verifying
    verify_s: float | None = None
    # (TTFT ms, TPOT ms or None) of each finished request, in prompt order: what goodput counts
    latencies: list[tuple[float | None, float | None]] = field(default_factory=list)

    def to_dict(self, texts: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not texts:
            d.pop("texts")
        d.pop("latencies")
        return d

    def goodput(self, ttft_ms: float | None, tpot_ms: float | None) -> float:
        """Finished requests per second whose TTFT and TPOT meet the SLOs (None: no limit), DistServe's
        goodput; a one-token request has no TPOT and meets that SLO."""
        good = sum(1 for ft, pt in self.latencies
                   if ft is not None and (ttft_ms is None or ft <= ttft_ms) and (tpot_ms is None or pt is None or pt <= tpot_ms))
        return good / self.wall_s if self.wall_s > 0 else 0.0


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else None


def _measurement(records: list[RequestRecord], wall_s: float, concurrency: int, tau: float | None,
                 accepted_per_pos: list[float], **extra: Any) -> Measurement:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    itl = [g for r in ok for g in r.itl_s]
    out_tokens = sum(r.output_tokens for r in ok)
    return Measurement(
        output_tokens_per_s=out_tokens / wall_s if wall_s > 0 else 0.0,
        request_throughput=len(ok) / wall_s if wall_s > 0 else 0.0,
        ttft_p50_ms=_pct(ttft, 50), ttft_p90_ms=_pct(ttft, 90), ttft_p99_ms=_pct(ttft, 99),
        tpot_p50_ms=_pct(tpot, 50), tpot_p90_ms=_pct(tpot, 90), tpot_p99_ms=_pct(tpot, 99),
        itl_p50_ms=_pct(itl, 50), itl_p90_ms=_pct(itl, 90), itl_p99_ms=_pct(itl, 99),
        tau=tau, accepted_per_pos=accepted_per_pos, n_requests=len(ok), output_tokens=out_tokens,
        wall_s=wall_s, concurrency=concurrency, texts=[r.text for r in records],
        errors=[f"{r.prompt_id}: {r.error}" for r in records if r.error is not None],
        latencies=[(None if r.ttft_s is None else r.ttft_s * 1e3, None if (t := r.tpot_s) is None else t * 1e3) for r in ok],
        **extra)


# ---------------------------------------------------------------------------------------------
# in-process


def run_inprocess(engine: TextEngine, prompts: Sequence[Prompt], params: SamplingParams,
                  concurrency: int = 1, chat_template: bool = True) -> Measurement:
    """Play the prompts against an in-process engine: a closed loop of `concurrency` clients, each
    sending its next prompt when its last one finished. A built-in engine that batches
    (engine.builtin.max_batch > 1) decodes the clients' requests together; any other runs them one at a time."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    encoded = [encode(engine, p, chat_template) for p in prompts]  # tokenising is the client's work
    own = [params_of(p, params) for p in prompts]  # a request's own sampling and budget (a file's)
    records = [RequestRecord(prompt_id=p.id) for p in prompts]
    results: list[Any] = [None] * len(prompts)
    stamps: list[list[float]] = [[] for _ in prompts]
    arrivals = [0.0] * len(prompts)
    ends: list[float] = [0.0] * len(prompts)
    # torch: only for in-process runs; imported before the clock starts (a first import takes seconds)
    from engine.decode.batch import batcher_for

    t0 = time.perf_counter()
    batch = batcher_for(engine) if concurrency > 1 else None
    if batch is not None:
        def on_tokens(i: int, _toks: list[int]) -> None:
            stamps[i].append(time.perf_counter())

        def on_done(i: int, req: Any) -> None:
            ends[i] = time.perf_counter()
            arrivals[i] = req.arrival
            results[i] = req.result
            if req.error is not None:
                records[i].error = req.error

        batch.closed_loop(encoded, own, concurrency, on_tokens, on_done)
    else:
        for i, ids in enumerate(encoded):
            arrivals[i] = t0 if i < concurrency else ends[i - concurrency]
            try:
                results[i] = engine.generate(ids, own[i], on_tokens=lambda _toks, i=i: stamps[i].append(time.perf_counter()))
            except Exception as exc:  # one failed request is recorded, the run goes on
                records[i].error = f"{type(exc).__name__}: {exc}"
            ends[i] = time.perf_counter()
    new_tokens = forwards = draft_steps = 0
    acc: list[int] = []
    draft_s = verify_s = 0.0
    for i, (rec, res) in enumerate(zip(records, results)):
        if res is None:
            continue
        st = res.stats
        rec.output_tokens = st.new_tokens
        rec.text = res.text
        rec.e2e_s = ends[i] - arrivals[i]
        rec.ttft_s = (stamps[i][0] if stamps[i] else ends[i]) - arrivals[i]
        rec.itl_s = [b - a for a, b in zip(stamps[i], stamps[i][1:])]
        new_tokens += st.new_tokens
        forwards += st.target_forwards
        draft_steps += st.draft_steps
        draft_s += st.draft_s
        verify_s += st.verify_s
        for j, n in enumerate(st.accepted_per_pos):
            if j >= len(acc):
                acc.append(0)
            acc[j] += n
    wall = (max(ends) - t0) if ends else 0.0
    tau = new_tokens / forwards if forwards else None
    per_pos = [a / draft_steps for a in acc] if draft_steps else []
    return _measurement(records, wall, concurrency, tau, per_pos, draft_s=draft_s, verify_s=verify_s)


# ---------------------------------------------------------------------------------------------
# HTTP (OpenAI-compatible, streaming)


def request_body(model: str, prompt: Prompt, params: SamplingParams, chat_template: bool) -> tuple[str, dict]:
    """(path, JSON body) of one streaming request: chat completions with the template, else
    completions (a request from a file says which itself, and carries its own sampling)."""
    params = params_of(prompt, params)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.top_k > 0:
        body["top_k"] = params.top_k  # vLLM / SGLang extension
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed
    if chat_template if prompt.chat is None else prompt.chat:
        body["messages"] = prompt.messages()
        return "/v1/chat/completions", body
    body["prompt"] = "\n\n".join(m["content"] for m in prompt.messages())  # as engine.measure.workloads.encode
    return "/v1/completions", body


async def _scrape(client: httpx.AsyncClient) -> SpecCounters | None:
    try:
        r = await client.get("/metrics")
        return spec_counters(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def _one_request(client: httpx.AsyncClient, path: str, body: dict, rec: RequestRecord, arrival: float) -> None:
    stamps: list[float] = []
    pieces: list[str] = []
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {raw[:300]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return
                for ch in chunk.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
                    if piece:
                        stamps.append(time.perf_counter())
                        pieces.append(piece)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return
    end = time.perf_counter()
    rec.text = "".join(pieces)
    # usage counts tokens exactly; without it (an endpoint ignoring include_usage) count chunks.
    rec.output_tokens = usage_tokens if usage_tokens is not None else len(pieces)
    rec.e2e_s = end - arrival
    rec.ttft_s = (stamps[0] if stamps else end) - arrival
    rec.itl_s = [b - a for a, b in zip(stamps, stamps[1:])]


async def run_http_async(base_url: str, model: str, prompts: Sequence[Prompt], params: SamplingParams,
                         concurrency: int = 1, chat_template: bool = True, timeout_s: float = 600.0) -> Measurement:
    """`run_http` for callers already inside an event loop."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    records = [RequestRecord(prompt_id=p.id) for p in prompts]
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, limits=limits) as client:
        before = await _scrape(client)
        next_idx = 0
        ends: list[float] = []

        async def client_loop() -> None:  # one of N closed-loop clients
            nonlocal next_idx
            while next_idx < len(prompts):
                i = next_idx
                next_idx += 1
                path, body = request_body(model, prompts[i], params, chat_template)
                await _one_request(client, path, body, records[i], time.perf_counter())
                ends.append(time.perf_counter())

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(min(concurrency, max(1, len(prompts))))))
        wall = (max(ends) - t0) if ends else 0.0
        after = await _scrape(client)
    tau, per_pos = None, []
    if before is not None and after is not None:
        delta = after - before
        out_tokens = sum(r.output_tokens for r in records if r.error is None)
        tau = tau_from_delta(out_tokens, delta)
        per_pos = delta.acceptance_per_pos()
    return _measurement(records, wall, concurrency, tau, per_pos)


def run_http(base_url: str, model: str, prompts: Sequence[Prompt], params: SamplingParams,
             concurrency: int = 1, chat_template: bool = True, timeout_s: float = 600.0) -> Measurement:
    """Play the prompts against an OpenAI-compatible endpoint with `concurrency` streaming clients."""
    return asyncio.run(run_http_async(base_url, model, prompts, params, concurrency, chat_template, timeout_s))


# ---------------------------------------------------------------------------------------------
# targets, repeats, summary


class LoadTarget(Protocol):
    """Something `measure` can play prompts against (not engine.models.target.Target, the loaded model).
    It may also have `start_pass()`, which `measure` calls before every pass (warm-up and each repeat)."""

    def run(self, prompts: Sequence[Prompt], params: SamplingParams, concurrency: int) -> Measurement: ...


@dataclass
class InProcessTarget:
    engine: TextEngine
    chat_template: bool = True
    # the engine's global suffix caches as this target's first pass found them (engine.drafters.suffix)
    _suffix_start: dict[int, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def run(self, prompts: Sequence[Prompt], params: SamplingParams, concurrency: int) -> Measurement:
        return run_inprocess(self.engine, prompts, params, concurrency, self.chat_template)

    def start_pass(self) -> None:
        """With a spec that remembers earlier requests (suffix), put the engine's suffix caches back
        to the state this target's first pass found: every pass played through it (a bench's
        warm-up, repeats and levels) meets the same cache, never its own earlier answers."""
        spec = getattr(self.engine, "spec", None)
        if spec is None or not spec.remembers_requests:  # no drafter that keeps anything across requests
            return
        from engine.drafters.suffix import restore_caches, snapshot_caches

        target = self.engine.target  # type: ignore[attr-defined]  # the built-in engine's loaded model
        if self._suffix_start is None:
            self._suffix_start = snapshot_caches(target)
        else:
            restore_caches(target, self._suffix_start)


@dataclass
class HttpTarget:
    base_url: str
    model: str
    chat_template: bool = True
    timeout_s: float = 600.0

    def run(self, prompts: Sequence[Prompt], params: SamplingParams, concurrency: int) -> Measurement:
        return run_http(self.base_url, self.model, prompts, params, concurrency, self.chat_template, self.timeout_s)


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(statistics.median(vals)) if vals else None


def _mean_lists(lists: list[list[float]]) -> list[float]:
    lists = [x for x in lists if x]
    if not lists:
        return []
    n = max(len(x) for x in lists)
    return [statistics.fmean(x[i] if i < len(x) else 0.0 for x in lists) for i in range(n)]


@dataclass
class Summary:
    """Repeated measurements of one configuration: medians over repeats, and a 95% t-interval of
    the mean output tokens/s (None with a single repeat)."""

    runs: list[Measurement]
    output_tokens_per_s: float
    ci_low: float | None
    ci_high: float | None
    tau: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    request_throughput: float
    accepted_per_pos: list[float]  # mean over repeats
    errors: list[str]
    itl_p50_ms: float | None = None  # gaps between streamed chunks (a spec step's tokens may share one)
    itl_p99_ms: float | None = None

    @classmethod
    def of(cls, runs: list[Measurement]) -> "Summary":
        tps = [m.output_tokens_per_s for m in runs]
        _, lo, hi, _, _ = log_interval(tps)  # on logs: a rate's interval is never negative
        return cls(
            runs=runs, output_tokens_per_s=float(statistics.median(tps)), ci_low=lo, ci_high=hi,
            tau=_median([m.tau for m in runs]),
            ttft_p50_ms=_median([m.ttft_p50_ms for m in runs]), ttft_p99_ms=_median([m.ttft_p99_ms for m in runs]),
            tpot_p50_ms=_median([m.tpot_p50_ms for m in runs]), tpot_p99_ms=_median([m.tpot_p99_ms for m in runs]),
            request_throughput=float(statistics.median(m.request_throughput for m in runs)),
            accepted_per_pos=[float(x) for x in _mean_lists([m.accepted_per_pos for m in runs])],
            errors=[e for m in runs for e in m.errors],
            itl_p50_ms=_median([m.itl_p50_ms for m in runs]), itl_p99_ms=_median([m.itl_p99_ms for m in runs]),
        )

    @property
    def rel_ci_half_width(self) -> float | None:
        """CI half-width over the median tokens/s: the noise of this figure."""
        if self.ci_low is None or self.ci_high is None or self.output_tokens_per_s <= 0:
            return None
        return (self.ci_high - self.ci_low) / 2 / self.output_tokens_per_s

    def figures(self) -> Figures:
        """The schema's Figures (what best.yaml records)."""
        return Figures(output_tokens_per_s=self.output_tokens_per_s, ci_low=self.ci_low, ci_high=self.ci_high,
                       tau=self.tau, ttft_p99_ms=self.ttft_p99_ms, tpot_p99_ms=self.tpot_p99_ms,
                       itl_p50_ms=self.itl_p50_ms, itl_p99_ms=self.itl_p99_ms)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "runs"}
        d["runs"] = [m.to_dict() for m in self.runs]
        return d


def measure(target: LoadTarget, prompts: Sequence[Prompt], params: SamplingParams, concurrency: int = 1,
            warmup: int = 1, repeats: int = 3, repeats_min: int | None = None,
            ci_rel_width: float | None = None) -> Summary:
    """Warm up with `warmup` requests (not measured), then play all prompts `repeats` times.

    With `ci_rel_width`, stop early once at least `repeats_min` (default 2) repeats ran and the
    CI half-width is below that share of the median tokens/s.
    """
    if not prompts:
        raise ValueError("measure needs at least one prompt")
    start = getattr(target, "start_pass", None)

    def play(ps: Sequence[Prompt], c: int) -> Measurement:
        if start is not None:  # the state a pass leaves (the suffix cache) is not the next one's start
            start()
        return target.run(ps, params, c)

    if warmup > 0:
        play([prompts[i % len(prompts)] for i in range(warmup)], 1)
    runs: list[Measurement] = []
    for _ in range(repeats):
        runs.append(play(prompts, concurrency))
        if ci_rel_width is not None and tight([m.output_tokens_per_s for m in runs], ci_rel_width, repeats_min or 2):
            break
    return Summary.of(runs)
