"""The built-in engine as an OpenAI-compatible server (FastAPI + uvicorn).

Endpoints: /v1/completions, /v1/chat/completions (streaming and not, with `usage`), /v1/models,
/health, /metrics (Prometheus, vLLM's metric names so one load generator and one dashboard serve
every engine). Requests wait in a bounded queue (serve.queue_size) and one engine thread runs them,
batched when the engine batches (engine.builtin.max_batch > 1); a full queue answers 429. Every bad request gets a 4xx in the
OpenAI error shape and the server stays healthy.

This module holds the app (routes, parsing into sampling parameters, responses and streams) and
running it; the request bodies and errors are in engine.serving.requests, the metrics in
engine.serving.metrics, the queue and worker thread in engine.serving.worker (re-exported here).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from engine.api import GenResult, SamplingParams, TextEngine
from engine.serving.metrics import Metrics
from engine.serving.requests import (APIError, Body, ChatRequest, CompletionRequest, error_response, not_unicode,
                                    reject_constant, validation_error)
from engine.serving.worker import Job, Worker
from tuner.schema.config import ModelConfig, ServeConfig

__all__ = ["APIError", "ChatRequest", "CompletionRequest", "Job", "Metrics", "TextStream", "Worker", "create_app",
           "serve", "serve_in_thread"]


class TextStream:
    """Incremental detokenisation: emits only text that can no longer change.

    Holds back a trailing partial UTF-8 character and, with stop strings, enough characters to
    hide a stop string that is still being generated (the engine never emits stop strings).
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, toks: list[int]) -> str:
        self.tokens.extend(toks)
        text = self.decode(self.tokens)
        if any(s in text for s in self.stops):
            return ""  # the final text (cut at the stop string) comes with finish()
        safe = text[: len(text) - self.hold] if self.hold else text
        safe = safe.rstrip("\ufffd")
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, final_text: str) -> str:
        delta = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
        self.sent = final_text
        return delta


def _tokenizer(engine: TextEngine) -> Any:
    tok = getattr(engine, "tokenizer", None)
    if tok is None:
        raise RuntimeError("the engine exposes no tokenizer (needed to stream text)")
    return tok

# ---------------------------------------------------------------------------------------------
# the app


def create_app(engine: TextEngine, model_cfg: ModelConfig, settings: ServeConfig, *,
               engine_thread: bool = True) -> FastAPI:
    """The FastAPI app serving `engine` (already set to its spec) as the model `model_cfg` under `settings`.
    `engine_thread`: its lifespan runs the engine in a thread of its own; False leaves running
    `app.state.worker.run()` to the caller (`serve` does, in the main thread)."""
    metrics = Metrics(model_cfg.name)
    worker = Worker(engine, metrics, settings.queue_size)
    names = {model_cfg.name, model_cfg.hf_id}
    tok = _tokenizer(engine)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if engine_thread:
            worker.start()
        yield
        if engine_thread:
            worker.stop()

    app = FastAPI(title="spectune built-in engine", lifespan=lifespan)
    app.state.metrics = metrics
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(404)
    async def _not_found(req: Request, _exc: Exception) -> JSONResponse:
        return error_response(APIError(404, f"no route {req.method} {req.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def _bad_method(req: Request, _exc: Exception) -> JSONResponse:
        return error_response(APIError(405, f"method {req.method} not allowed on {req.url.path}"))

    @app.get("/health")
    async def health() -> Response:
        if not worker.alive():
            return JSONResponse({"status": "engine worker stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_cfg.name, "object": "model", "created": 0,
                                            "owned_by": "spectune", "root": model_cfg.hf_id,
                                            "max_model_len": model_cfg.max_context}]}

    # No request needs more than the context's worth of text: 32 bytes a token covers JSON-escaped
    # text in any script (a \\u escape with its four hex digits is 6 bytes; a token is rarely over 4
    # characters).
    body_limit = max(2**20, 32 * model_cfg.max_context)

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 past body_limit (announced by Content-Length or streamed)."""
        limit = body_limit
        too_big = APIError(413, f"request body exceeds this server's limit of {limit} bytes "
                                f"(32 bytes per token of the model's {model_cfg.max_context}-token context)",
                           code="request_too_large")
        announced = request.headers.get("content-length", "")
        if announced.isdigit() and int(announced) > limit:
            raise too_big
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(request: Request, model: type[Body]) -> Any:
        try:
            raw = json.loads(await read_body(request), parse_constant=reject_constant)
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise APIError(400, f"request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise APIError(400, "request body is not valid JSON: nested too deeply") from None
        if not isinstance(raw, dict):
            raise APIError(400, "request body must be a JSON object")
        bad = not_unicode(raw)
        if bad:
            raise APIError(400, f"{bad}: not valid Unicode text (a lone UTF-16 surrogate); send UTF-8 text",
                           param=bad)
        try:
            body = model.model_validate(raw)
        except ValidationError as err:
            raise validation_error(err) from None
        refused = body.unsupported()
        if refused is not None:
            raise refused
        if body.model is not None and body.model not in names:
            raise APIError(404, f"the model '{body.model}' does not exist (served: {model_cfg.name})",
                           param="model", code="model_not_found")
        return body

    def sampling(body: Body, prompt_len: int) -> SamplingParams:
        ctx, limit = model_cfg.max_context, settings.max_tokens_limit
        if prompt_len >= ctx:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the model's context is {ctx} tokens",
                           param="messages" if isinstance(body, ChatRequest) else "prompt", code="context_length_exceeded")
        requested = body.max_completion_tokens or body.max_tokens
        if requested is not None and requested > limit:
            raise APIError(400, f"max_tokens={requested} exceeds this server's limit of {limit}", param="max_tokens")
        max_new = requested if requested is not None else min(limit, ctx - prompt_len)
        if prompt_len + max_new > ctx:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_new}) exceeds the model's context "
                                f"of {ctx} tokens", param="max_tokens", code="context_length_exceeded")
        if body.min_tokens > max_new:
            raise APIError(400, f"min_tokens={body.min_tokens} exceeds max_tokens={max_new}", param="min_tokens")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        # A temperature this small divides logits into overflow; it means greedy, as in other servers.
        temperature = body.temperature if body.temperature >= 1e-5 else 0.0
        return SamplingParams(max_new_tokens=max_new, temperature=temperature, top_p=body.top_p,
                              top_k=max(0, body.top_k), stop=stops, seed=body.seed,
                              ignore_eos=body.ignore_eos, min_tokens=body.min_tokens)

    def chat_ids(body: ChatRequest) -> list[int]:
        msgs = body.messages
        if len(msgs) == 1 and msgs[0].role == "user":
            return engine.encode_prompt(msgs[0].text(), True)  # exactly what the in-process runner sends
        if msgs[-1].role != "user":
            raise APIError(400, "the last message must have role 'user'", param="messages")
        return engine.encode_messages([{"role": m.role, "content": m.text()} for m in msgs])

    def completion_ids(body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, list):
            vocab = model_cfg.vocab_size
            if any(t < 0 or t >= vocab for t in body.prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            return list(body.prompt)
        return engine.encode_prompt(body.prompt, False)

    async def run(body: Body, prompt_ids: list[int], chat: bool) -> Response:
        params = sampling(body, len(prompt_ids))
        job = Job(prompt_ids=prompt_ids, params=params, loop=asyncio.get_running_loop())
        worker.submit(job)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        usage_wanted = bool((body.stream_options or {}).get("include_usage"))
        obj = "chat.completion" if chat else "text_completion"
        if body.stream:
            gen = _stream(job, rid, created, chat, usage_wanted, TextStream(decode, params.stop))
            return StreamingResponse(gen, media_type="text/event-stream")
        try:
            while True:
                kind, payload = await job.events.get()
                if kind == "error":
                    raise APIError(500, f"generation failed: {payload}", type_="server_error")
                if kind == "done":
                    break
        finally:
            job.cancelled = True  # a client that went away stops the generation
        res: GenResult = payload
        choice: dict[str, Any] = {"index": 0, "finish_reason": res.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": res.text}
        else:
            choice["text"] = res.text
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_cfg.name,
                             "choices": [choice], "usage": _usage(len(prompt_ids), res)})

    async def _stream(job: Job, rid: str, created: int, chat: bool, usage_wanted: bool,
                      text: TextStream) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece: str | None, finish: str | None = None, first: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                    {"content": piece} if piece else {})
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_cfg.name,
                                          "choices": [choice]}) + "\n\n"

        try:
            started = False
            while True:
                kind, payload = await job.events.get()
                if chat and not started and kind != "error":
                    # the role chunk goes out with the first token, as vLLM's server does: clients time
                    # TTFT from the first chunk
                    started = True
                    yield chunk(None, first=True)
                if kind == "tokens":
                    piece = text.push(payload)
                    if piece:
                        yield chunk(piece)
                elif kind == "error":
                    err = APIError(500, f"generation failed: {payload}", type_="server_error")
                    yield "data: " + json.dumps(err.body()) + "\n\n"
                    break
                else:
                    res: GenResult = payload
                    tail = text.finish(res.text)
                    if tail:
                        yield chunk(tail)
                    yield chunk(None, finish=res.finish_reason)
                    if usage_wanted:
                        yield "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                                     "model": model_cfg.name, "choices": [],
                                                     "usage": _usage(len(job.prompt_ids), res)}) + "\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled = True

    def tokenized(make: Callable[[Any], list[int]], body: Body, param: str) -> list[int]:
        try:
            return make(body)
        except APIError:
            raise
        except Exception as exc:  # the tokenizer / chat template rejected what the client sent
            raise APIError(400, f"the {param} could not be tokenized: {type(exc).__name__}: {exc}",
                           param=param) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse(request, ChatRequest)
        return await run(body, tokenized(chat_ids, body, "messages"), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return await run(body, tokenized(completion_ids, body, "prompt"), chat=False)

    return app


def _usage(prompt_len: int, res: GenResult) -> dict[str, int]:
    n = res.stats.new_tokens
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
# ---------------------------------------------------------------------------------------------
# running it


def serve(engine: TextEngine, model_cfg: ModelConfig, settings: ServeConfig) -> None:
    """Serve on settings.host:settings.port until SIGINT or SIGTERM. The engine runs in this (the
    main) thread, where it was loaded, and uvicorn in a thread beside it (engine.serving.worker says
    why); vLLM likewise keeps its engine core apart from its HTTP front end."""
    import signal

    import uvicorn

    app = create_app(engine, model_cfg, settings, engine_thread=False)
    worker: Worker = app.state.worker
    # requests still streaming when the engine stops get 5 s to finish, then the server goes
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                                           timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, name="spectune-http", daemon=True)

    def on_signal(_sig: int, _frame: Any) -> None:
        # from another thread: the handler may interrupt this thread inside the queue's own lock
        threading.Thread(target=worker.stop_soon, daemon=True).start()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        watch = threading.Thread(target=lambda: (http.join(), worker.stop_soon()), daemon=True)
        watch.start()  # a server that fails to start (or stops) ends the engine loop too
        worker.run()
    finally:
        server.should_exit = True
        http.join(timeout=30)
        for s, h in old.items():
            signal.signal(s, h)
    if not server.started:
        raise RuntimeError(f"the HTTP server did not start on {settings.host}:{settings.port} (see the log above)")


def serve_in_thread(engine: TextEngine, model_cfg: ModelConfig, settings: ServeConfig, host: str = "127.0.0.1",
                    startup_timeout_s: float = 30.0) -> tuple[str, Callable[[], None]]:
    """Start a real uvicorn server on a free port of `host` in a thread: (base_url, stop)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))  # bound before uvicorn starts: no race for the port
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model_cfg, settings), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="spectune-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the built-in server did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()

    return f"http://{host}:{port}", stop
