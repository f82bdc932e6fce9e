"""The user's own requests from a file: three shapes, read as a stream, split and sampled by hash.

Shapes (`workload.format`):
- openai: one OpenAI request body per line (JSONL), chat (`messages`) or completions (`prompt`),
  with its own max_tokens / max_completion_tokens, temperature, top_p, stop and seed.
- sharegpt: `conversations` of `from` / `value` turns, one per JSONL line or a JSON array. The
  conversation up to its first `gpt` turn is the prompt; that turn's length is the output budget.
- prompts: `{"prompt": ...}` lines, or plain text with one prompt a line.
`auto` looks at the first record: `messages`, or `prompt` with other request fields, is openai;
`conversations` is sharegpt; `prompt` alone or a line of plain text is prompts.

The file is never held whole: each record is parsed, hashed and dropped unless it is among the
few sampled so far. The split is by a hash of the request itself (held out when the hash falls
below num_heldout / (num_prompts + num_heldout)), so a request keeps its split when the file
grows; within a split the requests with the smallest seeded hashes are played (bottom-k
sampling: the same on every run, and memory bounded by k). Shape statistics are counted exactly
or from a seeded reservoir of lengths.

A record the file cannot give (malformed JSON, no prompt, a bad field) is a UserError naming the
file and line.
"""

from __future__ import annotations

import codecs
import hashlib
import heapq
import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from tuner.schema.config import UserError

FORMATS = ("openai", "sharegpt", "prompts")
RESERVOIR = 10_000  # lengths kept for the percentiles of `inspect`
ROLES = {"system": "system", "user": "user", "assistant": "assistant",
         "human": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant"}
OPENAI_FIELDS = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "stream",
                 "n", "user", "logprobs", "presence_penalty", "frequency_penalty")


class RecordError(ValueError):
    """What is wrong with one record (the caller adds the file and line)."""


@dataclass
class Record:
    """One request as the file gives it. `messages` is the conversation up to the reply ((role,
    text) pairs, the last a user turn); `chat` False for an openai completions request."""

    line: int
    messages: tuple[tuple[str, str], ...]
    chat: bool | None  # None: the workload's chat_template decides
    max_tokens: int | None = None  # the budget the request states
    reply: str | None = None  # sharegpt: the answer whose length is the budget
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    turns: int = 1  # turns of the whole conversation (sharegpt: all, not only the prompt's)
    # when the request arrived, in seconds (a record's optional "timestamp", as a gateway logs it):
    # workload.arrival=trace replays these gaps; not part of the request's identity
    arrival_s: float | None = None

    def key(self) -> bytes:
        """The request's identity: its text and parameters, not its line (stable when the file grows)."""
        return json.dumps([self.messages, self.chat, self.max_tokens, self.reply, self.temperature, self.top_p,
                           self.stop, self.seed], ensure_ascii=False).encode()


# ---------------------------------------------------------------------------------------------
# one record of each shape


def _text(x: Any, what: str) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in x):
        return "".join(p["text"] for p in x)
    raise RecordError(f"{what} is not text (a string or a list of {{type: text, text: ...}} parts)")


def _number(obj: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise RecordError(f"{key}={v!r}: allowed is a number in {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def _arrival(obj: dict) -> float | None:
    """A record's arrival time: its optional "timestamp", seconds (since the epoch or any origin)."""
    return _number(obj, "timestamp", 0.0, 1e13)


def _int(obj: dict, key: str, lo: int) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise RecordError(f"{key}={v!r}: allowed is an integer >= {lo}")
    return v


def _conversation(turns: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    if not any(r == "user" and t.strip() for r, t in turns):
        raise RecordError("no prompt: the conversation has no user turn with text")
    if turns[-1][0] != "user":
        raise RecordError(f"the last message before the reply has role '{turns[-1][0]}', not 'user'")
    return tuple(turns)


def parse_openai(obj: Any, line: int) -> Record:
    """An OpenAI chat or completions request body."""
    if not isinstance(obj, dict):
        raise RecordError("not a JSON object (an OpenAI request body)")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise RecordError("messages is not a non-empty list")
        turns = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise RecordError(f"messages[{i}] needs a role of system, user or assistant")
            turns.append((m["role"], _text(m.get("content"), f"messages[{i}].content")))
        messages, chat = _conversation(turns), True
    elif "prompt" in obj:
        p = obj["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if not isinstance(p, str):
            raise RecordError("prompt is not a string (token-id and batched prompts are not played)")
        if not p.strip():
            raise RecordError("no prompt: prompt is empty")
        messages, chat = (("user", p),), False
    else:
        raise RecordError("no prompt: an openai record needs 'messages' (chat) or 'prompt' (completions)")
    stop = obj.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise RecordError("stop is not a non-empty string or a list of them")
    budget = _int(obj, "max_completion_tokens", 1) or _int(obj, "max_tokens", 1)
    return Record(line, messages, chat, max_tokens=budget, temperature=_number(obj, "temperature", 0.0, 2.0),
                  top_p=_number(obj, "top_p", 0.0, 1.0, lo_open=True), stop=tuple(stop or ()),
                  seed=_int(obj, "seed", -(2**63)), turns=len(messages), arrival_s=_arrival(obj))


def parse_sharegpt(obj: Any, line: int) -> Record:
    """A ShareGPT conversation: the turns up to its first gpt turn are the prompt, that turn the reply."""
    conv = obj.get("conversations") if isinstance(obj, dict) else None
    if not isinstance(conv, list) or not conv:
        raise RecordError("no prompt: a sharegpt record needs a non-empty 'conversations' list")
    turns = []
    for i, t in enumerate(conv):
        if not isinstance(t, dict) or ROLES.get(str(t.get("from", "")).lower()) is None:
            raise RecordError(f"conversations[{i}] needs 'from' (human, gpt, system) and 'value'")
        turns.append((ROLES[str(t["from"]).lower()], _text(t.get("value"), f"conversations[{i}].value")))
    first = next((i for i, (r, _) in enumerate(turns) if r == "assistant"), None)
    prompt, reply = (turns, None) if first is None else (turns[:first], turns[first][1])
    if not prompt:
        raise RecordError("no prompt: the conversation starts with a gpt turn")
    return Record(line, _conversation(prompt), None, reply=reply, turns=len(turns), arrival_s=_arrival(obj))


def parse_prompt(obj: Any, line: int) -> Record:
    """A `{"prompt": ...}` record or a line of plain text."""
    arrival = None
    if isinstance(obj, dict):
        if not isinstance(obj.get("prompt"), str):
            raise RecordError("no prompt: a prompts record is {\"prompt\": \"...\"} or a line of plain text")
        arrival = _arrival(obj)
        obj = obj["prompt"]
    if not isinstance(obj, str) or not obj.strip():
        raise RecordError("no prompt: the line is empty")
    return Record(line, (("user", obj),), None, arrival_s=arrival)


PARSERS = {"openai": parse_openai, "sharegpt": parse_sharegpt, "prompts": parse_prompt}


def detect(obj: Any) -> str | None:
    """The shape of a first record, or None when it fits none."""
    if isinstance(obj, str):
        return "prompts"
    if not isinstance(obj, dict):
        return None
    if "conversations" in obj:
        return "sharegpt"
    if "messages" in obj or ("prompt" in obj and any(k in obj for k in OPENAI_FIELDS)):
        return "openai"
    return "prompts" if "prompt" in obj else None


# ---------------------------------------------------------------------------------------------
# reading a file as a stream of (line, value)


def _json_array(f: Any, path: Path) -> Iterator[tuple[int, Any]]:
    """The elements of a JSON array file, one at a time (the array itself is never held)."""
    dec = json.JSONDecoder()
    buf, pos, line, eof = f.read(1 << 20), 0, 1, False
    pos = buf.index("[") + 1
    line += buf.count("\n", 0, pos)
    while True:
        while True:  # skip blanks and one comma
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                line += buf[pos] == "\n"
                pos += 1
            if pos < len(buf) or eof:
                break
            more = f.read(1 << 20)
            eof = not more
            buf, pos = buf[pos:] + more, 0
        if pos >= len(buf):
            raise UserError(f"{path}:{line}: the JSON array is not closed with ']'")
        if buf[pos] == "]":
            return
        while True:
            try:
                value, end = dec.raw_decode(buf, pos)
                break
            except json.JSONDecodeError as exc:
                more = "" if eof else f.read(1 << 20)
                if not more:
                    raise UserError(f"{path}:{line}: not valid JSON ({exc.msg})") from None
                buf, pos = buf[pos:] + more, 0
        yield line, value
        line += buf.count("\n", pos, end)
        pos = end
        if pos > (1 << 20):  # drop what was read, keep the buffer small
            buf, pos = buf[pos:], 0


def _lines(f: BinaryIO, path: Path, plain_ok: bool) -> Iterator[tuple[int, Any]]:
    for n, data in enumerate(f, 1):
        try:
            raw = data.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{path}:{n}: not UTF-8 text") from None
        s = raw.strip()
        if not s:
            continue
        if plain_ok and not s.startswith("{"):
            yield n, raw.rstrip("\r\n")
            continue
        try:
            yield n, json.loads(s)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not valid JSON ({exc.msg}, column {exc.colno})") from None


def records(path: str | Path, fmt: str = "auto") -> tuple[str, Iterator[Record]]:
    """(the shape, an iterator of the file's records). Errors name the file and line (UserError)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"workload.path={path}: no such file")
    if not p.is_file():
        raise UserError(f"workload.path={path}: not a file")
    try:
        f = p.open("rb")
        first = b""
        while not first:  # the first character that is not blank
            chunk = f.read(1 << 16)
            if not chunk:
                break
            first = chunk.lstrip()[:1]
    except OSError as exc:
        raise UserError(f"workload.path={path}: cannot be read ({type(exc).__name__}: {exc})") from None
    if not first:
        f.close()
        raise UserError(f"{p}: the file is empty: no requests")
    f.seek(0)
    array = first == b"["
    plain = not array and first != b"{"

    def stream() -> Iterator[tuple[int, Any]]:
        if not array:
            return _lines(f, p, fmt == "prompts")
        # a codecs reader, unlike a TextIOWrapper, does not close the file when it is dropped
        return _json_array(codecs.getreader("utf-8")(f), p)

    if fmt == "auto":
        if plain:
            fmt = "prompts"
        else:
            fmt = "openai"  # lines are read as JSON while detecting
            try:
                n, obj = next(stream())
            except StopIteration:
                f.close()
                raise UserError(f"{p}: the file is empty: no requests") from None
            except UnicodeDecodeError:
                f.close()
                raise UserError(f"{p}: not UTF-8 text") from None
            found = detect(obj)
            if found is None:
                f.close()
                raise UserError(f"{p}:{n}: cannot tell the format: the first record has none of 'messages' or "
                                "'prompt' with request fields (openai), 'conversations' (sharegpt), 'prompt' alone "
                                "(prompts); set workload.format")
            fmt = found
            f.seek(0)
    parse = PARSERS[fmt]

    def gen() -> Iterator[Record]:
        with f:
            n = 0
            try:
                for n, obj in stream():
                    try:
                        yield parse(obj, n)
                    except RecordError as exc:
                        raise UserError(f"{p}:{n}: {exc} (format {fmt})") from None
            except UnicodeDecodeError:  # inside a JSON array: the line after the last record read
                raise UserError(f"{p}:{n + 1}: not UTF-8 text") from None

    return fmt, gen()


# ---------------------------------------------------------------------------------------------
# split and sample


def _u64(data: bytes, salt: bytes = b"") -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=salt).digest(), "big")


def heldout_of(key: bytes, share: float) -> bool:
    """Whether a request is held out: by the hash of the request alone."""
    return _u64(key) < share * 2**64


@dataclass
class Shape:
    """A file's shape: exact counts, length percentiles from a seeded reservoir."""

    format: str
    detected: bool
    requests: int = 0
    tune: int = 0
    heldout: int = 0
    sampled: int = 0  # temperature > 0 (a request's own, else the workload's)
    stated_budget: int = 0  # requests that state max_tokens
    replies: int = 0  # sharegpt requests with a reply
    turns: Counter = field(default_factory=Counter)  # turns of a conversation -> requests
    prompt_chars: list[int] = field(default_factory=list)  # reservoir
    output_budget: list[int] = field(default_factory=list)  # reservoir: max_tokens where stated
    reply_chars: list[int] = field(default_factory=list)  # reservoir: sharegpt reply lengths


@dataclass
class Sampled:
    """What a study plays from a file: the sampled records of each split, and the file's shape."""

    shape: Shape
    tune: list[Record]
    heldout: list[Record]


def _keep(res: list[int], seen: int, value: int, rng: random.Random) -> None:
    """Algorithm R: a uniform sample of RESERVOIR values from a stream."""
    if len(res) < RESERVOIR:
        res.append(value)
    else:
        j = rng.randrange(seen)
        if j < RESERVOIR:
            res[j] = value


def sample_file(path: str | Path, fmt: str, n_tune: int, n_heldout: int, seed: int,
                default_temperature: float) -> Sampled:
    """Stream the file once: every record checked, split by its hash, the `n_tune` / `n_heldout`
    requests with the smallest seeded hashes of each split kept, the shape counted."""
    found, recs = records(path, fmt)
    shape = Shape(found, detected=fmt == "auto")
    share = n_heldout / (n_tune + n_heldout) if n_tune + n_heldout else 0.0
    salt = str(seed).encode()[:64]
    heaps: dict[bool, list[tuple[int, int, Record]]] = {False: [], True: []}
    want = {False: n_tune, True: n_heldout}
    rng = random.Random(seed)
    for rec in recs:
        shape.requests += 1
        key = rec.key()
        held = share > 0 and heldout_of(key, share)
        if held:
            shape.heldout += 1
        else:
            shape.tune += 1
        temp = rec.temperature if rec.temperature is not None else default_temperature
        shape.sampled += temp > 0
        shape.turns[rec.turns] += 1
        _keep(shape.prompt_chars, shape.requests, sum(len(t) for _, t in rec.messages), rng)
        if rec.max_tokens is not None:
            shape.stated_budget += 1
            _keep(shape.output_budget, shape.stated_budget, rec.max_tokens, rng)
        if rec.reply is not None:
            shape.replies += 1
            _keep(shape.reply_chars, shape.replies, len(rec.reply), rng)
        heap = heaps[held]
        rank = -_u64(key, salt)  # a max-heap of the smallest ranks
        if len(heap) < want[held]:
            heapq.heappush(heap, (rank, -rec.line, rec))
        elif heap and (rank, -rec.line) > heap[0][:2]:
            heapq.heapreplace(heap, (rank, -rec.line, rec))
    if shape.requests == 0:
        raise UserError(f"{path}: the file holds no requests")

    def ordered(heap: list[tuple[int, int, Record]]) -> list[Record]:
        return [r for _, _, r in sorted(heap, key=lambda x: (-x[0], -x[1]))]

    return Sampled(shape, ordered(heaps[False]), ordered(heaps[True]))
