"""A study on the user's own traffic: a mix of a packaged workload and a file part end to end (tau and
speedup per part in best.yaml and the report), no request text anywhere in the run directory, the
`tuner workload inspect` command, and a request the engine refuses counted and skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engine.measure.runner import Measurement
from engine.measure.workloads import gsm_prompts, mtbench_prompts
from tuner.cli import main
from tuner.run.session import optimize
from tuner.schema.compose import load_config
from tuner.schema.config import BestResult

SECRET = "ZEBRA-7731-do-not-log"  # planted in every request of the file


def _chat_file(path: Path) -> Path:
    """MT-bench questions and GSM problems as OpenAI chat bodies, half greedy, half T=0.7, each with the secret."""
    chat, math = [p.text for p in mtbench_prompts()[:20]], [p.text for p in gsm_prompts(20, 0)]
    with path.open("w") as f:
        for i, text in enumerate(chat + math):
            body = {"model": "m", "messages": [{"role": "user", "content": f"{SECRET} {text}"}], "max_tokens": 6 + i % 5}
            if i % 2:
                body.update(temperature=0.7, seed=i)
            f.write(json.dumps(body) + "\n")
    return path


SMALL = ["model=tiny-random", "search=quick", "workload.max_new_tokens=10", "engine.builtin.threads=1",
         "search.methods=[ngram]", "search.depth.max=2", "search.n_trials=3", "report.figures=false"]  # no PNG checked here


@pytest.fixture(scope="module")
def engine():
    from tuner.study.measurer import open_engine

    return open_engine(load_config(["model=tiny-random", "engine.builtin.threads=1"]))


def test_a_mix_with_a_file_part_reports_each_part_and_keeps_no_text(tmp_path: Path, engine) -> None:
    path = _chat_file(tmp_path / "chat.jsonl")
    mix = f"workload.mix=[{{workload:code,weight:0.5}},{{path:'{path}',weight:0.5}}]"
    run = optimize([*SMALL, "+workload=mix", mix, "workload.num_prompts=4", "workload.num_heldout=2",
                    f"run_dir={tmp_path / 'runs'}", "search.study_name=m"], engine=engine, quiet=True)
    best = BestResult.model_validate(yaml.safe_load((run / "best.yaml").read_text()))
    assert [p.name for p in best.parts] == ["code", "chat.jsonl"]
    for p in best.parts:
        assert p.requests == 1 and p.split == "heldout"
        assert p.tau is not None and p.tau >= 1.0 and p.speedup is not None and p.speedup > 0
        assert p.output_tokens_per_s and p.baseline_tokens_per_s
    html = (run / "report.html").read_text()
    assert "Per part of the mix" in html and "chat.jsonl" in html
    # the user's traffic: the planted text appears in no file of the run directory, binary ones included
    leaks = [str(f) for f in run.rglob("*") if f.is_file() and SECRET.encode() in f.read_bytes()]
    assert leaks == [], f"request text in {leaks}"


def test_inspect_prints_the_shape_and_a_broken_file_exits_2(tmp_path: Path, capsys) -> None:
    path = _chat_file(tmp_path / "chat.jsonl")
    assert main(["workload", "inspect", "+workload=file", f"workload.path={path}", "model=tiny-random"]) == 0
    out = capsys.readouterr().out
    assert "format openai (detected from the first record)" in out and "requests: 40" in out
    assert "sampled (temperature > 0): 50.0%" in out and SECRET not in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text() + '{"model": "m", "max_tokens": 3}\n')
    assert main(["workload", "inspect", "+workload=file", f"workload.path={bad}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {bad}:41: no prompt: an openai record needs 'messages' (chat) or 'prompt' "
                   "(completions) (format openai)"]


def _measurement(errors: list[str], n_ok: int) -> Measurement:
    return Measurement(output_tokens_per_s=10.0, request_throughput=1.0, ttft_p50_ms=1, ttft_p90_ms=1, ttft_p99_ms=1,
                       tpot_p50_ms=1, tpot_p90_ms=1, tpot_p99_ms=1, itl_p50_ms=1, itl_p90_ms=1, itl_p99_ms=1,
                       tau=1.0, accepted_per_pos=[], n_requests=n_ok, output_tokens=10 * n_ok, wall_s=1.0,
                       concurrency=1, texts=[], errors=errors)


@pytest.mark.parametrize("workload, errors, survives", [
    ("file", ["file:3: HTTP 400: the prompt is too long"], True),
    ("file", ["file:3: HTTP 500: boom"], False),  # the configuration broke it: no candidate
    ("file", ["file:3: HTTP 400: x", "file:4: HTTP 400: y", "file:5: HTTP 400: z"], False),  # nothing finished
    ("code", ["HumanEval/1: HTTP 400: x"], False),  # a packaged set has no bad records
])
def test_a_request_the_engine_refuses_is_counted_and_skipped(tmp_path: Path, workload: str, errors: list[str],
                                                             survives: bool, capsys) -> None:
    from tuner.schema.config import SpecConfig
    from tuner.study.measurer import Measurer

    path = _chat_file(tmp_path / "c.jsonl")
    cfg = load_config(["model=tiny-random", f"+workload={workload}", f"workload.path={path}"]
                      if workload == "file" else ["model=tiny-random", "+workload=code"])
    n_ok = 3 - len(errors)

    class Target:
        def run(self, prompts, params, concurrency):
            return _measurement(errors, n_ok)

    m = Measurer(lambda spec: Target(), cfg, {"tune": ["p"] * 3})
    m._draft_mb[(SpecConfig(method="off").model_dump_json(), "tune")] = None
    if survives:
        for _ in range(2):
            assert m(SpecConfig(method="off"), "tune", 1).tok_s == 10.0
        assert m.skipped == {"file:3"}
        assert capsys.readouterr().err.count("refused 1 request(s)") == 1, "said once"
    else:
        with pytest.raises(RuntimeError, match="requests failed"):
            m(SpecConfig(method="off"), "tune", 1)
