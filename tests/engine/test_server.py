"""The built-in OpenAI-compatible server, started for real (uvicorn on 127.0.0.1) over the
tiny-random model: OpenAI shapes, streaming, usage, /metrics, the bounded queue, and a catalogue
of bad requests each answered 4xx in the OpenAI error shape while /health stays 200."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from helpers import TINY_SERVER, free_port, server_fixtures, wait_healthy
from engine.measure.promparse import spec_counters
from engine.serving.server import TextStream, serve_in_thread
from tuner.schema.compose import load_config

cfg, engine, server = server_fixtures(TINY_SERVER)


def _sse(r: httpx.Response) -> list[dict]:
    events = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    assert r.text.rstrip().endswith("data: [DONE]")
    return events


def test_health_and_models(server, cfg) -> None:
    assert httpx.get(f"{server}/health").status_code == 200
    m = httpx.get(f"{server}/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == cfg.model.name


def test_chat_completion_matches_the_engine(server, cfg, engine) -> None:
    from engine.api import SamplingParams

    r = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": cfg.model.name, "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant"
    direct = engine.generate(engine.encode_prompt("Say hello.", True), SamplingParams(max_new_tokens=12))
    assert msg["content"] == direct.text, "greedy output over HTTP equals the engine's own"
    u = body["usage"]
    assert u["completion_tokens"] == direct.stats.new_tokens
    assert u["prompt_tokens"] == len(engine.encode_prompt("Say hello.", True))
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_streaming_chat_deltas_concatenate_to_the_full_text(server, cfg) -> None:
    req = {"model": cfg.model.name, "messages": [{"role": "user", "content": "Count to five."}],
           "max_tokens": 16, "temperature": 0}
    full = httpx.post(f"{server}/v1/chat/completions", json=req, timeout=60).json()
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                   json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert text == full["choices"][0]["message"]["content"]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == \
        [full["choices"][0]["finish_reason"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]


def test_completions_stream_and_not(server, cfg) -> None:
    req = {"model": cfg.model.name, "prompt": "def fib(n):", "max_tokens": 10, "temperature": 0}
    full = httpx.post(f"{server}/v1/completions", json=req, timeout=60).json()
    assert full["object"] == "text_completion" and full["usage"]["completion_tokens"] >= 1
    events = _sse(httpx.post(f"{server}/v1/completions", json={**req, "stream": True}, timeout=60))
    assert "".join(c["text"] for e in events for c in e["choices"]) == full["choices"][0]["text"]
    assert not any("usage" in e for e in events), "usage only when stream_options.include_usage"
    ids = httpx.post(f"{server}/v1/completions", timeout=60,
                     json={**req, "prompt": [1, 2, 3, 4]}).json()
    assert ids["usage"]["prompt_tokens"] == 4


def test_metrics_count_what_was_generated(server, cfg) -> None:
    before = httpx.get(f"{server}/metrics").text
    r = httpx.post(f"{server}/v1/completions", timeout=60, json={
        "model": cfg.model.name, "prompt": "a b a b a b a b a b", "max_tokens": 20, "temperature": 0})
    n = r.json()["usage"]["completion_tokens"]
    after = httpx.get(f"{server}/metrics").text
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:e2e_request_latency_seconds",
                 "vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds",
                 "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens"):
        assert name in after
    d = spec_counters(after) - spec_counters(before)
    assert d.present and d.num_draft_tokens >= d.num_accepted_tokens >= 0
    assert sum(d.accepted_per_pos.values()) == d.num_accepted_tokens
    gen = [ln for ln in after.splitlines() if ln.startswith("vllm:generation_tokens_total")]
    gen0 = [ln for ln in before.splitlines() if ln.startswith("vllm:generation_tokens_total")]
    assert float(gen[0].split()[-1]) - float(gen0[0].split()[-1]) == n


def _counter(text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "_total"))


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, cfg) -> None:
    """vLLM's prefix-cache counters: the second send of a prompt finds all of it but its last token."""
    prompt = [(7 * i) % 200 + 3 for i in range(40)]
    req = {"model": cfg.model.name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    texts, hits, queries = [], [], []
    for _ in range(2):
        before = httpx.get(f"{server}/metrics").text
        texts.append(httpx.post(f"{server}/v1/completions", json=req, timeout=60).json()["choices"][0]["text"])
        after = httpx.get(f"{server}/metrics").text
        hits.append(_counter(after, "vllm:prefix_cache_hits") - _counter(before, "vllm:prefix_cache_hits"))
        queries.append(_counter(after, "vllm:prefix_cache_queries") - _counter(before, "vllm:prefix_cache_queries"))
    assert queries == [40, 40] and hits == [0, 39] and texts[0] == texts[1]


BAD_REQUESTS = [
    # (name, path, raw body or JSON, expected status, substring of the error message)
    ("bad json", "/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("json array", "/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("empty body", "/v1/completions", b"", 400, "not valid JSON"),
    ("missing messages", "/v1/chat/completions", {"model": "tiny-random"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("content not text", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("last message not user", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, 400, "last message"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 10**9]}, 400, "token ids"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
    ("max_tokens over the limit", "/v1/completions", {"prompt": "x", "max_tokens": 65}, 400, "limit of 64"),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens not a number", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("temperature negative", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n > 1", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("empty stop string", "/v1/completions", {"prompt": "x", "stop": [""], "max_tokens": 2}, 400, "stop"),
    ("prompt over the context", "/v1/completions", {"prompt": "word " * 3000, "max_tokens": 4}, 400, "context"),
    ("prompt ids over the context", "/v1/completions", {"prompt": [5] * 2047, "max_tokens": 8}, 400, "context"),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, "no route"),
    # text that is not Unicode / not UTF-8 (JSON escapes can carry lone surrogates the tokenizer cannot take)
    ("lone surrogate in chat content", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\udcff"}]}', 400, "messages[0].content"),
    ("lone surrogate in a text part", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', 400, "Unicode"),
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt": "\\udcff"}', 400, "prompt"),
    ("lone surrogate in stop", "/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"]}', 400, "stop[0]"),
    ("lone surrogate in a key", "/v1/completions", b'{"prompt": "x", "\\udcff": 1}', 400, "Unicode"),
    ("lone surrogate in model", "/v1/completions", b'{"prompt": "x", "model": "\\udcff"}', 400, "model"),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "not valid JSON"),
    ("invalid UTF-8 in chat", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3"}]}', 400,
     "not valid JSON"),
    ("NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "NaN"),
    ("Infinity", "/v1/completions", b'{"prompt": "x", "top_p": Infinity}', 400, "Infinity"),
    ("nested too deeply", "/v1/completions", b"[" * 20_000 + b"]" * 20_000, 400, "JSON"),
    ("seed out of range", "/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    # oversized bodies: announced by Content-Length, or a JSON string past the limit
    ("oversized body", "/v1/completions", b'{"prompt": "' + b"a" * 1_100_000 + b'"}', 413, "1048576 bytes"),
    ("oversized chat body", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "word " * 220_000}]}, 413, "2048-token context"),
]

# Every request field with values of the wrong type (or out of range): always 400, never 5xx.
WRONG_TYPES = {
    "model": [5, ["tiny-random"], {}],
    "max_tokens": ["many", [1], {}, 1.5, 2**70],
    "max_completion_tokens": ["many", [4], -3],
    "temperature": ["hot", [1], {}, 3],
    "top_p": ["x", [0.5], 2],
    "top_k": ["x", 1.5, [1], -2],
    "stop": [5, [1], {}, [None], [["a"]]],
    "seed": ["x", 1.5, [1]],
    "n": ["x", 2, [1]],
    "stream": ["maybe", [1], {}],
    "stream_options": ["x", [1], 5],
}
CHAT_WRONG = [["hi"], [1], [None], [{"role": "user"}], [{"content": "x"}], [{"role": 1, "content": "x"}],
              [{"role": "user", "content": {"text": "x"}}], [{"role": "user", "content": [{"type": "text"}]}],
              [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
              [{"role": "user", "content": [5]}], "hi", {}]
PROMPT_WRONG = [5, {}, [1.5], [[1]], [None], [-1], True, ["a", 1]]
WRONG_CASES = ([(f"{f}={v!r}", "/v1/completions", {"prompt": "x", "max_tokens": 2, f: v}, f)
                for f, vs in WRONG_TYPES.items() for v in vs]
               + [(f"{f}={v!r} (chat)", "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, f: v}, f)
                  for f, vs in WRONG_TYPES.items() for v in vs[:1]]
               + [(f"messages={v!r}", "/v1/chat/completions", {"messages": v}, "messages") for v in CHAT_WRONG]
               + [(f"prompt={v!r}", "/v1/completions", {"prompt": v}, "prompt") for v in PROMPT_WRONG])


@pytest.mark.parametrize("name,path,body,field", WRONG_CASES, ids=[c[0] for c in WRONG_CASES])
def test_every_field_of_the_wrong_type_is_400(server, name, path, body, field) -> None:
    r = httpx.post(f"{server}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and field in err["message"], err


def test_a_streamed_oversized_body_is_413(server) -> None:
    """No Content-Length (chunked upload): the limit holds while reading."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(f"{server}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server}/health").status_code == 200


def test_tiny_temperature_and_top_p_are_greedy_not_nan(server, engine) -> None:
    from engine.api import SamplingParams

    greedy = engine.generate(engine.encode_prompt("Say hi.", True), SamplingParams(max_new_tokens=6)).text
    for extra in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300}):
        r = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == greedy, extra


@pytest.mark.parametrize("name,path,body,status,needle", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_4xx_in_openai_shape_and_server_stays_healthy(server, name, path, body, status,
                                                                      needle) -> None:
    if isinstance(body, bytes):
        r = httpx.post(f"{server}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(f"{server}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and needle in err["message"]
    assert httpx.get(f"{server}/health").status_code == 200
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_wrong_method_is_405(server) -> None:
    r = httpx.get(f"{server}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_full_queue_answers_429_and_recovers(engine, monkeypatch) -> None:
    """queue_size=1, request 1 held inside the engine's step, request 2 waiting: request 3 gets 429."""
    from engine.decode.batch import BatchEngine
    from engine.serving.worker import Worker

    gate, started = threading.Event(), threading.Event()
    real = BatchEngine._forward

    def held(self, reqs, spec):
        started.set()
        # the test opens the gate itself after request 3; the timeout only keeps a broken run from
        # hanging. At 10 s a suite whose other worker ran vLLM on both cores let request 1 go before
        # request 3 was sent (the queue then had room: 200, not 429)
        gate.wait(120)
        return real(self, reqs, spec)

    monkeypatch.setattr(BatchEngine, "_forward", held)
    # requests 1 and 2 both submitted before request 3 is sent: the waiting gauge alone read 1 from
    # request 1's own submission (it is set again only after a step), so on a loaded suite request 3
    # could reach the queue before request 2 did, be accepted, and wait on the held step
    submitted = threading.Semaphore(0)
    real_submit = Worker.submit

    def counted(self, job) -> None:
        real_submit(self, job)
        submitted.release()

    monkeypatch.setattr(Worker, "submit", counted)
    small = load_config(TINY_SERVER + ["serve.queue_size=1"])
    url, stop = serve_in_thread(engine, small.model, small.serve)
    try:
        results: list[int] = []
        req = {"prompt": "x", "max_tokens": 1}
        t1 = threading.Thread(target=lambda: results.append(httpx.post(f"{url}/v1/completions", json=req,
                                                                       timeout=30).status_code))
        t1.start()
        assert started.wait(10)  # the worker holds request 1
        t2 = threading.Thread(target=lambda: results.append(httpx.post(f"{url}/v1/completions", json=req,
                                                                       timeout=30).status_code))
        t2.start()
        assert submitted.acquire(timeout=30) and submitted.acquire(timeout=30), "request 2 never reached the queue"
        assert 'vllm:num_requests_waiting{model_name="tiny-random"} 1.0' in httpx.get(f"{url}/metrics").text
        r3 = httpx.post(f"{url}/v1/completions", json=req, timeout=30)
        assert r3.status_code == 429 and r3.json()["error"]["code"] == "queue_full"
        assert httpx.get(f"{url}/health").status_code == 200
        gate.set()
        t1.join(30)
        t2.join(30)
        assert sorted(results) == [200, 200]
    finally:
        gate.set()
        stop()


def test_text_stream_holds_back_stop_strings_and_partial_characters() -> None:
    pieces = {1: "ab", 2: "c\n", 3: "\nde", 4: "\ufffd"}
    ts = TextStream(lambda ids: "".join(pieces[i] for i in ids), stops=["\n\n"])
    out = ts.push([1]) + ts.push([2])
    assert "\n" not in out, "a possible stop-string start is held back"
    assert ts.push([3]) == "", "a stop string inside the text: wait for the final text"
    assert out + ts.finish("abc") == "abc"
    ts2 = TextStream(lambda ids: "".join(pieces[i] for i in ids), stops=[])
    assert ts2.push([1]) == "ab" and ts2.push([4]) == "", "a partial UTF-8 character is held back"



def test_tuner_serve_command_serves_until_terminated() -> None:
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", "serve", "model=tiny-random",
                             f"serve.port={port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 120)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert f"on http://127.0.0.1:{port}/v1" in out


def test_serve_decodes_in_the_main_thread_and_stops_on_sigterm(cfg, engine, monkeypatch) -> None:
    """`serve` (what `tuner serve` runs) steps the engine in the thread that loaded it, with uvicorn
    beside it, and a SIGTERM ends both."""
    import os
    import signal
    import time

    from engine.decode.batch import BatchEngine
    from engine.serving.server import serve

    stepped_in: set[str] = set()
    real = BatchEngine.step

    def step(self) -> None:
        stepped_in.add(threading.current_thread().name)
        real(self)

    monkeypatch.setattr(BatchEngine, "step", step)
    settings = cfg.serve.model_copy(update={"host": "127.0.0.1", "port": free_port()})
    got: dict = {}

    def client() -> None:
        url = f"http://127.0.0.1:{settings.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                got["r"] = httpx.post(f"{url}/v1/completions", timeout=30, json={
                    "model": cfg.model.name, "prompt": "a b a b", "max_tokens": 5, "temperature": 0}).json()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=client, daemon=True).start()
    t = time.monotonic()
    serve(engine, cfg.model, settings)  # returns on the SIGTERM
    assert time.monotonic() - t < 30 and got["r"]["usage"]["completion_tokens"] >= 1
    assert stepped_in == {threading.main_thread().name}
    assert signal.getsignal(signal.SIGTERM) == before  # the old handler is back


def test_tuner_serve_on_a_busy_port_is_a_user_error(capsys) -> None:
    import socket

    from tuner.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["serve", "model=tiny-random", f"serve.port={s.getsockname()[1]}"]) == 2
    assert "cannot listen" in capsys.readouterr().err


def test_client_that_leaves_mid_stream_does_not_hurt_the_server(server, cfg) -> None:
    req = {"model": cfg.model.name, "prompt": "Once upon a time", "max_tokens": 60, "temperature": 0,
           "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{server}/v1/completions", json=req) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk
    assert httpx.get(f"{server}/health").status_code == 200
    ok = httpx.post(f"{server}/v1/completions", timeout=60, json={**req, "stream": False, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_the_role_chunk_goes_out_with_the_first_token(cfg, engine, monkeypatch) -> None:
    """A stream's first chunk (the role) is sent only once the engine has a token, as vLLM's server
    does: benchmark clients time TTFT from the first chunk, so a request still queued must not
    look answered."""
    import time

    from engine.decode.batch import BatchEngine

    gate, first_at = threading.Event(), []
    real = BatchEngine._forward

    def slow(self, reqs, spec):
        gate.wait(10)
        first_at.append(time.monotonic())  # before the step's forward: its tokens come after this
        return real(self, reqs, spec)

    monkeypatch.setattr(BatchEngine, "_forward", slow)
    url, stop = serve_in_thread(engine, cfg.model, cfg.serve)
    try:
        threading.Timer(0.5, gate.set).start()
        body = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
            lines = (ln for ln in r.iter_lines() if ln.startswith("data: "))
            first = json.loads(next(lines)[6:])
            got_at = time.monotonic()
            rest = [ln for ln in lines]
        assert first["choices"][0]["delta"]["role"] == "assistant"
        assert first_at and got_at >= first_at[0]  # not before the engine produced the token
        assert rest[-1] == "data: [DONE]"
    finally:
        gate.set()
        stop()


def test_a_step_that_raises_fails_the_running_requests_and_the_queued_ones_still_run(engine) -> None:
    """The engine thread's guard: a step that raises fails the requests running in it, and a request
    still waiting for a place in the batch runs afterwards instead of getting that error."""
    import asyncio

    from engine.api import SamplingParams
    from engine.serving.metrics import Metrics
    from engine.serving.worker import Job, Worker

    async def main() -> tuple:
        w = Worker(engine, Metrics("m"), 16)
        be = w.batch
        be.max_batch = 1  # the second request waits while the first runs
        real, calls = be.step, []

        def step() -> None:
            calls.append(1)
            real()
            if len(calls) == 1:
                raise RuntimeError("kernel")

        be.step = step
        loop = asyncio.get_running_loop()
        ids = engine.encode_prompt("def f(x):", False)
        a, b = Job(ids, SamplingParams(max_new_tokens=4), loop), Job(ids, SamplingParams(max_new_tokens=4), loop)
        w.submit(a)
        w.submit(b)
        w.start()

        async def last(job: Job) -> tuple:
            while True:
                kind, payload = await asyncio.wait_for(job.events.get(), 60)
                if kind in ("error", "done"):
                    return kind, payload

        try:
            return await last(a), await last(b), be
        finally:
            await asyncio.to_thread(w.stop)

    ra, rb, be = asyncio.run(main())
    assert ra == ("error", "RuntimeError: kernel")
    assert rb[0] == "done" and rb[1].tokens and not be.pool.views  # every slot given back


def test_a_batched_steps_events_reach_the_event_loop_in_one_wake_up(engine) -> None:
    """The batched loop hands each step's tokens of every request to the event loop in one
    call_soon_threadsafe (each call writes to the loop's wake-up pipe), in order per request."""
    import asyncio

    from engine.api import SamplingParams
    from engine.serving.metrics import Metrics
    from engine.serving.worker import Job, Worker

    async def main() -> tuple[list[list[tuple]], list[int], int]:
        loop = asyncio.get_running_loop()
        wakes, real = [], loop.call_soon_threadsafe

        def counted(cb, *args):
            if "_deliver" in cb.__qualname__:  # the worker's, not asyncio's own thread hand-offs
                wakes.append(1)
            return real(cb, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        w = Worker(engine, Metrics("m"), 16)
        be, steps, real_step = w.batch, [], w.batch.step
        be.step = lambda: (steps.append(1), real_step())[1]
        ids = engine.encode_prompt("def f(x):", False)
        jobs = [Job(ids, SamplingParams(max_new_tokens=6), loop) for _ in range(3)]
        for j in jobs:
            w.submit(j)
        w.start()
        got: list[list[tuple]] = [[] for _ in jobs]
        try:
            for i, j in enumerate(jobs):
                while not got[i] or got[i][-1][0] != "done":
                    got[i].append(await asyncio.wait_for(j.events.get(), 60))
        finally:
            await asyncio.to_thread(w.stop)
        return got, wakes, len(steps)

    got, wakes, steps = asyncio.run(main())
    for events in got:
        assert [k for k, _ in events[:-1]] == ["tokens"] * (len(events) - 1) and events[-1][0] == "done"
        assert sum((p for _, p in events[:-1]), []) == events[-1][1].tokens  # every token once, in order
    # one wake-up per step that produced events (3 requests, 6 tokens each: 3 x 7 events otherwise)
    assert 1 <= len(wakes) <= steps < sum(len(e) for e in got)
