"""The built-in server's queue and its one engine thread: requests wait in a bounded queue (a full
queue answers 429) and the thread steps the engine's scheduler (engine.decode.batch) on them,
sending tokens, errors and results back to each request's event loop. Up to
engine.builtin.max_batch requests decode together, joining and leaving between steps (max_batch 1:
one at a time, first come, first served).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from engine.api import SamplingParams, TextEngine
from engine.serving.metrics import Metrics
from engine.serving.requests import APIError


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    outbox: "Outbox | None" = None  # set while a batched step runs: the event waits for the step's end

    def emit(self, kind: str, payload: Any) -> None:
        if self.outbox is not None:
            self.outbox.items.append((self, kind, payload))
            return
        _deliver(self.loop, [(self, kind, payload)])


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[Job, str, Any]]) -> None:
    def put() -> None:
        for job, kind, payload in items:
            job.events.put_nowait((kind, payload))

    try:
        loop.call_soon_threadsafe(put)
    except RuntimeError:  # the event loop is gone (server shutting down)
        for job, _, _ in items:
            job.cancelled = True


@dataclass
class Outbox:
    """The events of one batched step, handed to the event loop in ONE call after the step: each
    call_soon_threadsafe writes to the loop's wake-up pipe, and a write per request and step showed
    in the engine thread's profile (docs/results.md)."""

    items: list[tuple[Job, str, Any]] = field(default_factory=list)

    def flush(self) -> None:
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}
        for item in self.items:
            by_loop.setdefault(id(item[0].loop), (item[0].loop, []))[1].append(item)
        self.items = []
        for loop, items in by_loop.values():
            _deliver(loop, items)


class Worker:
    """Steps the engine's scheduler (`engine.batcher()`) on queued jobs; in a thread of its own
    (`start`) or in the caller's (`run`, what `tuner serve` does from the main thread).

    Why the main thread for serving: libgomp keeps one OpenMP team per thread that ran a parallel
    region, and once its threads outnumber the CPUs every team stops spinning between regions and
    sleeps on a futex instead. The engine was loaded and warmed up in the main thread, so an engine
    thread beside it made two teams on a 2-core machine, and a batched step was markedly slower there
    than in the main thread (hundreds of regions a step, each paying a wake-up; docs/results.md,
    "Figures behind the code").
    """

    def __init__(self, engine: TextEngine, metrics: Metrics, queue_size: int) -> None:
        self.engine, self.metrics = engine, metrics
        self.queue_size = queue_size
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.batch = engine.batcher()
        metrics.scheduler(self.batch)
        self.thread = threading.Thread(target=self.run, name="spectune-engine", daemon=True)
        self.running_in: threading.Thread | None = None  # the thread running the loop, while it runs

    def _waiting(self) -> int:
        return self.jobs.qsize() + self.batch.queued

    def submit(self, job: Job) -> None:
        if self._waiting() >= self.queue_size:
            raise APIError(429, f"the server's queue is full ({self.queue_size} requests waiting); retry later",
                           code="queue_full", type_="rate_limit_error")
        self.jobs.put_nowait(job)
        self.metrics.waiting.labels(self.metrics.model).set(self._waiting())

    def alive(self) -> bool:
        return self.running_in is not None and self.running_in.is_alive()

    def start(self) -> None:
        """Run the loop in a thread of its own."""
        self.thread.start()

    def run(self) -> None:
        """Run the loop in the calling thread until `stop_soon` (or `stop`)."""
        self.running_in = threading.current_thread()
        try:
            self._loop()
        finally:
            self.running_in = None

    def stop_soon(self) -> None:
        """Ask the loop to end after the step in flight (safe from a signal handler)."""
        self.jobs.put_nowait(None)

    def stop(self) -> None:
        self.jobs.put(None)
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    def _loop(self) -> None:
        m, be = self.metrics, self.batch
        jobs: list[tuple[Job, Any]] = []
        outbox = Outbox()
        while True:
            idle = not be.active and not be.waiting
            try:
                job = self.jobs.get() if idle else self.jobs.get_nowait()
            except queue.Empty:
                job = ...
            while job is not ...:
                if job is None:
                    outbox.flush()
                    return
                if not job.cancelled:
                    job.outbox = outbox
                    jobs.append((job, self._submit(job)))
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    job = ...
            for job, req in jobs:
                if job.cancelled and req is not None:
                    be.cancel(req)  # its slot is free before the next step
            jobs = [(j, r) for j, r in jobs if r is not None and not r.finished]
            try:
                be.step()
            except Exception as exc:  # noqa: BLE001 - the running requests fail, the server goes on
                failed = {id(r) for r in be.abort(f"{type(exc).__name__}: {exc}")}
                for job, req in jobs:  # the running ones fail; queued ones still get their turn
                    if id(req) in failed:
                        job.emit("error", req.error)
                jobs = [(j, r) for j, r in jobs if id(r) not in failed]
            outbox.flush()
            m.running.labels(m.model).set(be.running)
            m.waiting.labels(m.model).set(self._waiting())
            if (pc := be.engine.prefix_cache) is not None:
                m.prefix_cache(pc.queries, pc.hits)

    def _submit(self, job: Job) -> Any:
        first: list[float] = []

        def on_tokens(toks: list[int]) -> None:
            if not first:
                first.append(time.perf_counter())
            job.emit("tokens", list(toks))

        def on_done(req: Any) -> None:
            if req.error is not None:
                if not job.cancelled:
                    job.emit("error", req.error)
                return
            end = time.perf_counter()
            self.metrics.record(req.result, len(job.prompt_ids), (first[0] if first else end) - job.arrival,
                                end - job.arrival)
            job.emit("done", req.result)

        try:
            return self.batch.submit(job.prompt_ids, job.params, on_tokens, on_done)
        except Exception as exc:  # noqa: BLE001 - a request that cannot run fails alone
            job.emit("error", f"{type(exc).__name__}: {exc}")
            return None
