"""tuner.schema.compose: a composition is made once per process and each caller gets its own copy; the
group choices are composed once and key overrides applied on a copy, with the result of one compose."""

from __future__ import annotations

import hydra

import pytest

from tuner.schema import compose as C
from tuner.schema.compose import compose, conf_dir, load_config
from tuner.schema.config import UserError


def test_the_same_overrides_are_composed_once_and_each_caller_edits_its_own_copy(monkeypatch) -> None:
    """Hydra re-reads the whole tree per composition (~0.1 s), and one process repeats the same ones
    (every packaged workload whenever draft data is assembled): each is composed once. That is sound
    only while the tree holds no interpolation (an environment variable, the clock), so this checks
    that too; the defaults list may name group choices (`${engine}`), which the overrides fix."""
    import re

    choice = re.compile(r"^\s*- optional \w+: (\$\{\w+\}_?)+$", re.M)
    assert not [p.name for p in conf_dir().rglob("*.yaml") if "${" in choice.sub("", p.read_text())]
    calls: list[list[str]] = []
    real = hydra.compose
    monkeypatch.setattr(hydra, "compose", lambda *a, **k: calls.append(k["overrides"]) or real(*a, **k))
    C._hydra_composed.cache_clear()
    C._hydra_groups.cache_clear()
    over = ["model=tiny-random", "+workload=code", "search.n_trials=4321"]
    first = compose(over)
    first["search"]["n_trials"] = 1
    assert load_config(over).search.n_trials == 4321 and compose(over)["search"]["n_trials"] == 4321
    # other key overrides on the same group choices: applied to a copy, the choices not composed again
    again = compose(["model=tiny-random", "+workload=code", "search.n_trials=7", "spec.depth=2"])
    assert again["search"]["n_trials"] == 7 and again["spec"]["depth"] == 2
    assert compose(["model=tiny-random", "+workload=code"])["search"]["n_trials"] != 7  # the cached tree untouched
    assert calls == [["model=tiny-random", "+workload=code"]]


# Override sets whose two-stage composition (group choices once, key overrides on a copy) must equal
# Hydra's one compose of them: each kind of key override (set, add, force-add, delete, a mapping, a
# list, an empty or quoted value, a key of the chosen option), and the errors of each stage.
TWO_STAGES = [
    ["engine=vllm", "engine.vllm.port=9", "spec.depth=3", "deploy.name=", "deploy.name='a: b'"],
    ["+workload=code", "workload.concurrency=[1,4]", "+bogus=1", "~spec.depth", "++engine.builtin.threads=2"],
    ["++engine.vllm.env={A:b}", "engine=vllm", "+workload=code", "+workload.mix=[{workload: chat, weight: 1}]"],
    ["spec.foo=1"], ["workload.concurrency=[1,4]"], ["engine=vllm", "engine.vllm.env={A:b}"], ["+spec.method=ngram"],
    ["engine.vllm.port=1"], ["model=foo", "spec.depth=3"], ["workload=code"],
]


@pytest.mark.parametrize("overrides", TWO_STAGES, ids=" ".join)
def test_two_stages_compose_what_one_compose_does(overrides: list[str]) -> None:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    def one(over: list[str]) -> tuple[str, object]:
        try:
            with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
                cfg = hydra_compose(config_name="config", overrides=over)
        except Exception as exc:  # the message the one-line error is made of
            return "error", C._hydra_error_line(exc, over)
        return "ok", OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)

    try:
        two: tuple[str, object] = "ok", C._hydra_composed(str(conf_dir()), tuple(overrides))
    except UserError as exc:
        two = "error", str(exc)
    assert two == one(overrides)
