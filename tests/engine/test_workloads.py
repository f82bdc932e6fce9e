"""Every workload loads real prompts from the packaged sets: counts, determinism, disjoint splits."""

from __future__ import annotations

import json

import pytest

from engine.measure.workloads import (
    CODE_PREFIX,
    humaneval_prompts,
    load_prompts,
    mtbench_categories,
    mtbench_prompts,
    sampling_params,
)
from tuner.schema.compose import available, load_config, packaged_names
from tuner.schema.config import UserError

WORKLOADS = packaged_names()  # file and mix have no prompts of their own (tests/engine/test_traffic.py)


def _wl(name: str, *overrides: str):
    return load_config(["model=tiny-random", f"+workload={name}", *overrides]).workload


def test_every_conf_workload_is_covered() -> None:
    assert set(WORKLOADS) >= {"code", "chat", "math", "json", "creative"}


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_loads_counts_determinism_disjoint(name: str) -> None:
    wl = _wl(name)
    tune, held = load_prompts(wl, "tune"), load_prompts(wl, "heldout")
    assert len(tune) == wl.num_prompts and len(held) == wl.num_heldout
    assert all(p.text.strip() for p in tune + held)
    ids = [p.id for p in tune + held]
    assert len(set(ids)) == len(ids), "ids are unique"
    assert not {p.id for p in tune} & {p.id for p in held}, "tune and held-out splits overlap"
    assert not {p.text for p in tune} & {p.text for p in held}, "tune and held-out texts overlap"
    assert load_prompts(wl, "tune") == tune and load_prompts(wl, "heldout") == held, "not deterministic"


@pytest.mark.parametrize("name", ["code", "chat", "math", "json"])
def test_seed_changes_the_selection(name: str) -> None:
    a = load_prompts(_wl(name, "workload.seed=0"), "tune")
    b = load_prompts(_wl(name, "workload.seed=1"), "tune")
    assert [p.text for p in a] != [p.text for p in b]


def test_sources_are_the_real_sets() -> None:
    he = humaneval_prompts()
    assert len(he) == 164 and he[0].id == "HumanEval/0"
    assert he[0].text.startswith(CODE_PREFIX) and "def has_close_elements" in he[0].text
    mt = mtbench_prompts()
    assert len(mt) == 80
    assert mtbench_categories() == sorted(["writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                           "stem", "humanities"])


def test_code_prompts_are_humaneval() -> None:
    for p in load_prompts(_wl("code"), "tune"):
        assert p.source == "humaneval" and p.id.startswith("HumanEval/") and p.text.startswith(CODE_PREFIX)


def test_mtbench_categories_filter() -> None:
    wl = _wl("creative")
    for p in load_prompts(wl, "tune") + load_prompts(wl, "heldout"):
        assert p.source in ("mtbench/writing", "mtbench/roleplay")


def test_json_prompts_carry_a_parseable_schema_and_a_real_text() -> None:
    real = {p.text[len(CODE_PREFIX):] for p in humaneval_prompts()} | {p.text for p in mtbench_prompts()}
    for p in load_prompts(_wl("json"), "tune"):
        schema_part, text_part = p.text.split("\n\nSchema:\n", 1)[1].split("\n\nText:\n", 1)
        schema = json.loads(schema_part)
        assert schema["type"] == "object" and schema["required"]
        assert text_part in real


def test_math_prompts_are_generated_word_problems() -> None:
    tune = load_prompts(_wl("math"), "tune")
    assert all(p.source == "gsm" and any(c.isdigit() for c in p.text) for p in tune)


def test_too_many_prompts_is_a_user_error() -> None:
    wl = _wl("creative", "workload.num_prompts=20", "workload.num_heldout=5")  # writing+roleplay: 20 questions
    with pytest.raises(UserError, match="exceeds the 20 prompts"):
        load_prompts(wl, "tune")


def test_unknown_category_is_a_user_error() -> None:
    wl = _wl("chat", "workload.categories=[writing,poetry]")
    with pytest.raises(UserError, match="poetry.*allowed"):
        load_prompts(wl, "tune")


def test_bad_split_is_a_user_error() -> None:
    with pytest.raises(UserError, match="split"):
        load_prompts(_wl("code"), "test")  # type: ignore[arg-type]


def test_sampling_params_follow_the_workload() -> None:
    sp = sampling_params(_wl("creative", "workload.max_new_tokens=7"))
    assert (sp.max_new_tokens, sp.temperature, sp.top_p) == (7, 1.0, 0.95)


def test_mtbench_questions_are_read_from_the_venv_data_dir(tmp_path, monkeypatch) -> None:
    """scripts/setup.sh copies question.jsonl out of the wheel to $VENV/share/spectune/mt_bench/
    (the wheel itself is never installed): mtbench_path() looks there first."""
    import sys

    from engine.measure import workloads

    data = tmp_path / "share" / "spectune" / "mt_bench" / "question.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "More."]}) + "\n")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert workloads.mtbench_path() == data


def test_missing_mtbench_questions_are_a_one_line_user_error(tmp_path, monkeypatch, capsys) -> None:
    import sys

    from engine.measure import workloads
    from tuner.cli import main

    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # no share/spectune/mt_bench here
    monkeypatch.setattr(workloads.importlib.util, "find_spec", lambda name, *a: None)  # nor the old package
    with pytest.raises(UserError) as err:
        workloads.mtbench_path()
    msg = str(err.value)
    assert "\n" not in msg and "make setup" in msg and str(tmp_path / "share/spectune/mt_bench/question.jsonl") in msg
    # through the CLI: exit 2, that one line, no traceback (prompts load before any engine)
    workloads.mtbench_prompts.cache_clear()
    try:
        assert main(["bench", "model=tiny-random", "+workload=chat", "workload.num_prompts=1"]) == 2
    finally:
        workloads.mtbench_prompts.cache_clear()
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err_lines) == 1 and "MT-bench questions not installed" in err_lines[0]
    assert "Traceback" not in err_lines[0]
