"""vLLM's peer-client fields on the built-in server (uvicorn on 127.0.0.1, tiny-random, n-gram
speculation on): `ignore_eos`, `min_tokens` and `max_completion_tokens` are honoured by the engine
itself, and a field the server cannot honour is a 400 that names it, never dropped in silence.

The tiny model never ends a text by itself, so each test plants an end-of-sequence: the token
the model greedily emits fourth becomes the engine's EOS for the test."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from helpers import engine_for, serving
from engine.api import SamplingParams
from tuner.schema.compose import load_config

PROMPT = "Write a long story about the sea."
N = 12


@pytest.fixture(scope="module")
def cfg():
    return load_config(["model=tiny-random", "spec.method=ngram", "spec.depth=3", "spec.budget=4",
                        "serve.max_tokens_limit=64"])


@pytest.fixture(scope="module")
def engine(cfg):
    return engine_for(cfg)


@pytest.fixture(scope="module")
def server(cfg, engine):
    with serving(cfg, engine) as url:
        yield url


@pytest.fixture
def planted(engine) -> Iterator[list[int]]:
    """The greedy tokens of PROMPT (N of them), with the fourth one planted as the engine's EOS."""
    ids = engine.encode_prompt(PROMPT, True)
    res = engine.generate(ids, SamplingParams(max_new_tokens=N))
    toks = engine.tokenizer.encode(res.text, add_special_tokens=False)
    assert len(toks) >= 4
    old = engine.eos
    engine.eos = set(old) | {toks[3]}
    try:
        yield toks
    finally:
        engine.eos = old


def _chat(server: str, **fields) -> dict:
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_engine_stops_at_eos_unless_told_otherwise(engine, planted) -> None:
    ids = engine.encode_prompt(PROMPT, True)
    first = planted.index(planted[3])  # the planted token may occur before position 3 as well
    plain = engine.generate(ids, SamplingParams(max_new_tokens=N))
    assert plain.finish_reason == "stop" and plain.stats.new_tokens == first
    full = engine.generate(ids, SamplingParams(max_new_tokens=N, ignore_eos=True))
    assert full.finish_reason == "length" and full.stats.new_tokens == N
    later = engine.generate(ids, SamplingParams(max_new_tokens=N, min_tokens=first + 1))
    assert later.stats.new_tokens > first  # the early EOS is passed over, the request goes on


def test_ignore_eos_and_max_completion_tokens_over_http(server, planted) -> None:
    stopped = _chat(server, max_completion_tokens=N)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < N
    fixed = _chat(server, max_completion_tokens=N, ignore_eos=True)
    assert fixed["choices"][0]["finish_reason"] == "length"
    assert fixed["usage"]["completion_tokens"] == N  # max_completion_tokens is the budget
    short = _chat(server, max_completion_tokens=5, ignore_eos=True)
    assert short["usage"]["completion_tokens"] == 5


def test_min_tokens_over_http_and_its_bound(server, planted) -> None:
    stopped = _chat(server, max_tokens=N)["usage"]["completion_tokens"]
    longer = _chat(server, max_tokens=N, min_tokens=stopped + 1)
    assert longer["usage"]["completion_tokens"] > stopped
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 4, "min_tokens": 5}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_the_streamed_peer_client_gets_fixed_lengths(server, planted) -> None:
    """What `vllm bench serve --dataset-name random` asks: streamed, usage included, ignore_eos."""
    r = httpx.post(f"{server}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": N, "ignore_eos": True, "temperature": 0, "repetition_penalty": 1.0,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    assert f'"completion_tokens": {N}' in r.text


@pytest.mark.parametrize("field,value", [("frequency_penalty", 0.5), ("presence_penalty", 1.0),
                                         ("repetition_penalty", 1.2), ("logprobs", True), ("best_of", 2),
                                         ("response_format", {"type": "json_object"}), ("min_p", 0.1),
                                         ("guided_json", {"type": "object"}), ("no_such_field", 1)])
def test_a_field_it_cannot_honour_is_400_naming_it(server, field, value) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["code"] == "unsupported_field"


def test_neutral_values_and_metadata_pass(server) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "frequency_penalty": 0,
        "presence_penalty": 0.0, "repetition_penalty": 1.0, "logprobs": False, "user": "u-1",
        "response_format": {"type": "text"}, "stop_token_ids": []})
    assert r.status_code == 200, r.text
