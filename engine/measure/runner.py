"""The one load generator: plays prompts against an engine and measures it, the same way for all.

Two ways in, one set of figures (`Measurement`):
- `run_inprocess`: the built-in engine in this process. Concurrency N is a closed loop of N
  clients in front of the engine's scheduler, the one the built-in server steps (up to
  engine.builtin.max_batch requests decode together, the rest wait first come, first served):
  request i arrives at t0 for i < N, else when request i-N finishes. TTFT, TPOT and end-to-end latency are measured from arrival, so queueing
  counts, exactly as it would over HTTP. No threads: timings are not disturbed by the GIL.
- `run_http`: any OpenAI-compatible endpoint (the built-in server, vLLM, SGLang) with N concurrent
  streaming requests (httpx, asyncio). Token counts come from `usage` (stream_options.include_usage);
  tau and acceptance per position from the delta of the `vllm:spec_decode_*` counters on /metrics.

Open loop (`arrivals`, seconds from the start, `arrival_times`): request i arrives at its time
whatever the engine is doing, as production traffic does (a request rate instead of N clients).
In process it is queued at that moment (the batch scheduler admits it when a slot frees; an engine
that runs one request at a time takes it when the last one ends), over HTTP it is sent then. The
queueing delay (arrival to admission, in process), the requests waiting and the batch sizes the
engine actually ran (each step's active requests in process; the server's
`vllm:num_requests_running` gauge sampled over HTTP) are recorded per run.

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
from itertools import accumulate
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx
import numpy as np

from engine.api import SamplingParams, TextEngine
from engine.measure.promparse import SpecCounters, parse_samples, spec_counters, tau_from_delta
from engine.measure.stats import log_interval, tight
from engine.measure.workloads import Prompt, encode, params_of
from tuner.schema.config import Figures, UserError


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
    queue_s: float | None = None  # arrival to admission (in process)
    sent_s: float | None = None  # arrival, seconds from the pass's start
    forwards: int | None = None  # target forwards of this request (in process; a server counts none per request)

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
    rate: float | None = None  # open loop: the request rate (requests/s) the arrivals were drawn at
    queue_p50_ms: float | None = None  # arrival to admission (in process)
    queue_p99_ms: float | None = None
    waiting_mean: float | None = None  # requests waiting for a slot, averaged over steps (or scrapes)
    batch_sizes: dict[int, int] = field(default_factory=dict)  # requests in a step -> steps (or scrapes)
    # (output tokens, end-to-end seconds) of each request in prompt order, (0, 0.0) for a failed one:
    # what a per-prompt figure (the held-out check's interval over prompts) is drawn from
    requests: list[tuple[int, float]] = field(default_factory=list)
    # target forwards of each request in prompt order (0 for a failed one), in process only (a server's
    # counters sum over every request): a part of a pass's own tau (the held-out check's sides)
    request_forwards: list[int] = field(default_factory=list)
    # (sent at, output tokens, each streamed chunk's time) of each finished request, seconds from the
    # pass's start: how many were in flight when, and what they delivered meanwhile
    timeline: list[tuple[float, int, list[float]]] = field(default_factory=list)

    def to_dict(self, texts: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not texts:
            d.pop("texts")
        d.pop("latencies")
        d.pop("requests")
        d.pop("request_forwards")
        d.pop("timeline")
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
    queue = [r.queue_s for r in ok if r.queue_s is not None]
    if queue:
        extra.setdefault("queue_p50_ms", _pct(queue, 50))
        extra.setdefault("queue_p99_ms", _pct(queue, 99))
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
        requests=[(r.output_tokens, r.e2e_s or 0.0) if r.error is None else (0, 0.0) for r in records],
        request_forwards=([r.forwards or 0 if r.error is None else 0 for r in records]
                          if any(r.forwards is not None for r in records) else []),
        timeline=[(r.sent_s, r.output_tokens, list(accumulate([r.sent_s + r.ttft_s, *r.itl_s])))
                  for r in ok if r.sent_s is not None and r.ttft_s is not None],
        **extra)


def arrival_times(n: int, rate: float, kind: str = "poisson", seed: int = 0,
                  stamps: Sequence[float | None] | None = None) -> list[float]:
    """Arrival offsets (seconds from the start, the first at 0) of n requests at `rate` per second:
    poisson (exponential gaps drawn with `seed`, so a configuration and its baseline meet the same
    arrivals), constant (1 / rate apart), or trace (the requests' own timestamps `stamps`, their
    gaps scaled so that the mean rate is `rate`)."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if n <= 0:
        return []
    if kind == "constant":
        return [i / rate for i in range(n)]
    if kind == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, n - 1)
        return [0.0, *np.cumsum(gaps).tolist()]
    if kind != "trace":
        raise ValueError(f"arrival={kind!r}: allowed poisson, constant, trace")
    if stamps is None or len(stamps) < n or any(t is None for t in stamps[:n]):
        raise UserError("workload.arrival=trace: every request needs its arrival timestamp (Prompt.arrival_s); "
                        "these prompts carry none (use arrival=poisson or constant)")
    ts = sorted(float(t) for t in stamps[:n])  # type: ignore[arg-type]
    span = ts[-1] - ts[0]
    if n == 1 or span <= 0:
        return [i / rate for i in range(n)]  # all at one instant: no gaps to scale, play them evenly
    scale = (n - 1) / rate / span  # the trace's mean gap becomes 1 / rate
    return [(t - ts[0]) * scale for t in ts]


# ---------------------------------------------------------------------------------------------
# in-process


def run_inprocess(engine: TextEngine, prompts: Sequence[Prompt], params: SamplingParams,
                  concurrency: int = 1, chat_template: bool = True, arrivals_s: Sequence[float] | None = None,
                  rate: float | None = None) -> Measurement:
    """Play the prompts against an in-process engine through its scheduler (`engine.batcher()`,
    engine.decode.batch: up to engine.builtin.max_batch requests decode together, the rest wait for
    a place): a closed loop of `concurrency` clients, each sending its next prompt when its last one
    finished, or, with `arrivals_s` (offsets from the start, ascending; `rate` labels them), an open
    loop: request i arrives at its offset whatever is in flight."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    open_loop = arrivals_s is not None
    if open_loop and len(arrivals_s) != len(prompts):
        raise ValueError("arrivals_s needs one offset per prompt")
    encoded = [encode(engine, p, chat_template) for p in prompts]  # tokenising is the client's work
    own = [params_of(p, params) for p in prompts]  # a request's own sampling and budget (a file's)
    records = [RequestRecord(prompt_id=p.id) for p in prompts]
    results: list[Any] = [None] * len(prompts)
    stamps: list[list[float]] = [[] for _ in prompts]
    arrivals = [0.0] * len(prompts)
    ends: list[float] = [0.0] * len(prompts)
    steps: dict[int, int] = {}
    waiting: list[int] = []
    batch = engine.batcher()  # before the clock starts: it may build drafters

    def on_tokens(i: int, _toks: list[int]) -> None:
        stamps[i].append(time.perf_counter())

    def on_done(i: int, req: Any) -> None:
        ends[i] = time.perf_counter()
        arrivals[i] = req.arrival
        results[i] = req.result
        if req.error is not None:  # one failed request is recorded, the run goes on
            records[i].error = req.error

    t0 = time.perf_counter()
    if open_loop:
        at = [t0 + a for a in arrivals_s]
        arrivals = list(at)  # a request the scheduler refuses keeps its arrival
        _open_loop(batch, encoded, own, at, records, on_tokens, on_done, steps, waiting)
    else:
        batch.closed_loop(encoded, own, concurrency, on_tokens, on_done)
    new_tokens = forwards = draft_steps = 0
    acc: list[int] = []
    draft_s = verify_s = 0.0
    for i, (rec, res) in enumerate(zip(records, results)):
        if res is None:
            continue
        st = res.stats
        rec.output_tokens = st.new_tokens
        rec.forwards = st.target_forwards
        rec.text = res.text
        rec.e2e_s = ends[i] - arrivals[i]
        rec.ttft_s = (stamps[i][0] if stamps[i] else ends[i]) - arrivals[i]
        rec.itl_s = [b - a for a, b in zip(stamps[i], stamps[i][1:])]
        rec.sent_s = arrivals[i] - t0
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
    extra: dict[str, Any] = {}
    if open_loop:
        extra = dict(rate=rate, batch_sizes=dict(sorted(steps.items())),
                     waiting_mean=statistics.fmean(waiting) if waiting else None)
    return _measurement(records, wall, concurrency, tau, per_pos, draft_s=draft_s, verify_s=verify_s, **extra)


def _open_loop(batch: Any, encoded: list[list[int]], params: list[SamplingParams], at: list[float],
               records: list[RequestRecord], on_tokens: Any, on_done: Any, steps: dict[int, int],
               waiting: list[int]) -> None:
    """Drive a batch scheduler (engine.decode.batch.BatchEngine) with requests that arrive at the
    times `at` (perf_counter): each is submitted at its time, joins the batch when a slot frees, and
    the engine steps while any request is active or waiting. Records each request's queueing delay
    (arrival to the start of the step that admitted it), each step's batch size and the requests
    left waiting after each step."""
    pending: dict[int, tuple[int, Any]] = {}  # id(request) -> (index, request), submitted, not yet admitted
    nxt = 0
    n = len(encoded)
    while nxt < n or batch.waiting or batch.active:
        now = time.perf_counter()
        while nxt < n and at[nxt] <= now:
            i = nxt
            nxt += 1
            try:
                req = batch.submit(encoded[i], params[i], lambda toks, i=i: on_tokens(i, toks),
                                   lambda r, i=i: on_done(i, r))
            except Exception as exc:  # noqa: BLE001 - a request the scheduler refuses fails alone
                records[i].error = f"{type(exc).__name__}: {exc}"
                continue
            req.arrival = at[i]
            pending[id(req)] = (i, req)
        if not batch.waiting and not batch.active:
            if nxt < n:
                time.sleep(max(0.0, at[nxt] - time.perf_counter()))  # idle until the next arrival
            continue
        before = len(batch.active)
        t_step = time.perf_counter()
        batch.step()
        queued = {id(r) for r in batch.waiting}
        admitted = [k for k in pending if k not in queued]
        for k in admitted:
            i, _req = pending.pop(k)
            records[i].queue_s = max(0.0, t_step - at[i])
        size = before + len(admitted)
        if size:
            steps[size] = steps.get(size, 0) + 1
        waiting.append(len(batch.waiting))


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
    if params.ignore_eos:
        body["ignore_eos"] = True  # vLLM / SGLang extension, honoured by the built-in server too
    if params.min_tokens:
        body["min_tokens"] = params.min_tokens
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


# the gauges of requests running and waiting: vLLM's names (the built-in server's too), SGLang's
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
GAUGE_PERIOD_S = 0.1


async def _gauges(client: httpx.AsyncClient, sizes: dict[int, int], waiting: list[float],
                  stop: asyncio.Event) -> None:
    """Sample the server's running / waiting gauges every GAUGE_PERIOD_S until `stop`: the batch
    sizes the server ran (samples with at least one request running) and its queue."""
    while not stop.is_set():
        try:
            r = await client.get("/metrics")
            vals = parse_samples(r.text) if r.status_code == 200 else {}
        except httpx.HTTPError:
            vals = {}
        run = [v for (name, _), v in vals.items() if name in RUNNING]
        wait = [v for (name, _), v in vals.items() if name in WAITING]
        if run and sum(run) >= 1:
            n = int(round(sum(run)))
            sizes[n] = sizes.get(n, 0) + 1
            if wait:
                waiting.append(sum(wait))
        try:
            await asyncio.wait_for(stop.wait(), GAUGE_PERIOD_S)
        except asyncio.TimeoutError:
            pass


async def run_http_async(base_url: str, model: str, prompts: Sequence[Prompt], params: SamplingParams,
                         concurrency: int = 1, chat_template: bool = True, timeout_s: float = 600.0,
                         arrivals_s: Sequence[float] | None = None, rate: float | None = None) -> Measurement:
    """`run_http` for callers already inside an event loop."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if arrivals_s is not None:
        return await _open_loop_http(base_url, model, prompts, params, chat_template, timeout_s, arrivals_s, rate)
    records = [RequestRecord(prompt_id=p.id) for p in prompts]
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, limits=limits) as client:
        before = await _scrape(client)
        next_idx = 0
        ends: list[float] = []
        sent = [0.0] * len(prompts)

        async def client_loop() -> None:  # one of N closed-loop clients
            nonlocal next_idx
            while next_idx < len(prompts):
                i = next_idx
                next_idx += 1
                path, body = request_body(model, prompts[i], params, chat_template)
                sent[i] = time.perf_counter()
                await _one_request(client, path, body, records[i], sent[i])
                ends.append(time.perf_counter())

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(min(concurrency, max(1, len(prompts))))))
        wall = (max(ends) - t0) if ends else 0.0
        for rec, at in zip(records, sent):
            rec.sent_s = at - t0
        after = await _scrape(client)
    tau, per_pos = None, []
    if before is not None and after is not None:
        delta = after - before
        out_tokens = sum(r.output_tokens for r in records if r.error is None)
        tau = tau_from_delta(out_tokens, delta)
        per_pos = delta.acceptance_per_pos()
    return _measurement(records, wall, concurrency, tau, per_pos)


async def _open_loop_http(base_url: str, model: str, prompts: Sequence[Prompt], params: SamplingParams,
                          chat_template: bool, timeout_s: float, arrivals_s: Sequence[float],
                          rate: float | None) -> Measurement:
    """Send request i at its offset arrivals_s[i] whatever is in flight (an open loop)."""
    if len(arrivals_s) != len(prompts):
        raise ValueError("arrivals_s needs one offset per prompt")
    records = [RequestRecord(prompt_id=p.id) for p in prompts]
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    n = len(prompts) + 2  # every request may be in flight at once: a connection each, never a client-side queue
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    sizes: dict[int, int] = {}
    waiting: list[float] = []
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, limits=limits) as client, \
            httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout) as scraper:
        before = await _scrape(client)
        ends: list[float] = []
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            at = t0 + arrivals_s[i]
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            path, body = request_body(model, prompts[i], params, chat_template)
            records[i].sent_s = arrivals_s[i]
            await _one_request(client, path, body, records[i], at)
            ends.append(time.perf_counter())

        stop = asyncio.Event()
        sampler = asyncio.create_task(_gauges(scraper, sizes, waiting, stop))
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = (max(ends) - t0) if ends else 0.0
        stop.set()
        await sampler
        after = await _scrape(client)
    tau, per_pos = None, []
    if before is not None and after is not None:
        delta = after - before
        tau = tau_from_delta(sum(r.output_tokens for r in records if r.error is None), delta)
        per_pos = delta.acceptance_per_pos()
    return _measurement(records, wall, 1, tau, per_pos, rate=rate, batch_sizes=dict(sorted(sizes.items())),
                        waiting_mean=statistics.fmean(waiting) if waiting else None)


def run_http(base_url: str, model: str, prompts: Sequence[Prompt], params: SamplingParams,
             concurrency: int = 1, chat_template: bool = True, timeout_s: float = 600.0,
             arrivals_s: Sequence[float] | None = None, rate: float | None = None) -> Measurement:
    """Play the prompts against an OpenAI-compatible endpoint with `concurrency` streaming clients,
    or with `arrivals_s` (offsets from the start) each request sent at its time (an open loop)."""
    return asyncio.run(run_http_async(base_url, model, prompts, params, concurrency, chat_template, timeout_s,
                                      arrivals_s, rate))


# ---------------------------------------------------------------------------------------------
# targets, repeats, summary


class LoadTarget(Protocol):
    """Something `measure` can play prompts against (not engine.models.target.Target, the loaded model).
    It may also have `start_pass()`, which `measure` calls before every pass (warm-up and each repeat)."""

    def run(self, prompts: Sequence[Prompt], params: SamplingParams, concurrency: int,
            arrivals_s: Sequence[float] | None = None, rate: float | None = None) -> Measurement: ...


@dataclass
class InProcessTarget:
    engine: TextEngine
    chat_template: bool = True
    # the engine's global suffix caches as this target's first pass found them (engine.drafters.suffix)
    _suffix_start: dict[int, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def run(self, prompts: Sequence[Prompt], params: SamplingParams, concurrency: int,
            arrivals_s: Sequence[float] | None = None, rate: float | None = None) -> Measurement:
        return run_inprocess(self.engine, prompts, params, concurrency, self.chat_template, arrivals_s, rate)

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

    def run(self, prompts: Sequence[Prompt], params: SamplingParams, concurrency: int,
            arrivals_s: Sequence[float] | None = None, rate: float | None = None) -> Measurement:
        return run_http(self.base_url, self.model, prompts, params, concurrency, self.chat_template, self.timeout_s,
                        arrivals_s, rate)


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
            ci_rel_width: float | None = None, arrivals_s: Sequence[float] | None = None,
            rate: float | None = None) -> Summary:
    """Warm up with `warmup` requests (not measured), then play all prompts `repeats` times, with
    `arrivals_s` (one offset per prompt, `rate` labels them) as an open loop.

    With `ci_rel_width`, stop early once at least `repeats_min` (default 2) repeats ran and the
    CI half-width is below that share of the median tokens/s.
    """
    if not prompts:
        raise ValueError("measure needs at least one prompt")
    start = getattr(target, "start_pass", None)

    def play(ps: Sequence[Prompt], c: int, at: Sequence[float] | None = None) -> Measurement:
        if start is not None:  # the state a pass leaves (the suffix cache) is not the next one's start
            start()
        return target.run(ps, params, c) if at is None else target.run(ps, params, c, arrivals_s=at, rate=rate)

    if warmup > 0:
        play([prompts[i % len(prompts)] for i in range(warmup)], 1)
    runs: list[Measurement] = []
    for _ in range(repeats):
        runs.append(play(prompts, concurrency, arrivals_s))
        if ci_rel_width is not None and tight([m.output_tokens_per_s for m in runs], ci_rel_width, repeats_min or 2):
            break
    return Summary.of(runs)
