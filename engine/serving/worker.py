"""The built-in server's queue and its one worker thread: requests wait in a bounded queue (a full
queue answers 429) and the thread runs the engine on them one at a time, first come, first served,
sending tokens, errors and results back to each request's event loop.
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


class _Cancelled(Exception):
    """Raised from the token callback to stop generating for a client that went away."""


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    def emit(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancelled = True


class Worker:
    """One thread that runs the engine on queued jobs, first come, first served."""

    def __init__(self, engine: TextEngine, metrics: Metrics, queue_size: int) -> None:
        self.engine, self.metrics = engine, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.thread = threading.Thread(target=self._loop, name="spectune-engine", daemon=True)

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"the server's queue is full ({self.jobs.maxsize} requests waiting); retry later",
                           code="queue_full", type_="rate_limit_error") from None
        self.metrics.waiting.labels(self.metrics.model).set(self.jobs.qsize())

    def alive(self) -> bool:
        return self.thread.is_alive()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        m = self.metrics
        while (job := self.jobs.get()) is not None:
            m.waiting.labels(m.model).set(self.jobs.qsize())
            if job.cancelled:
                continue
            m.running.labels(m.model).set(1)
            first: list[float] = []

            def on_tokens(toks: list[int], job: Job = job, first: list[float] = first) -> None:
                if job.cancelled:
                    raise _Cancelled()
                if not first:
                    first.append(time.perf_counter())
                job.emit("tokens", list(toks))

            try:
                res = self.engine.generate(job.prompt_ids, job.params, on_tokens=on_tokens)
            except _Cancelled:
                pass
            except Exception as exc:  # the request fails, the server goes on
                job.emit("error", f"{type(exc).__name__}: {exc}")
            else:
                end = time.perf_counter()
                m.record(res, len(job.prompt_ids), (first[0] if first else end) - job.arrival, end - job.arrival)
                job.emit("done", res)
            finally:
                m.running.labels(m.model).set(0)
