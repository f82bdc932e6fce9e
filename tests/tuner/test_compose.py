"""tuner.schema.compose: a composition is made once per process and each caller gets its own copy."""

from __future__ import annotations

import hydra

from tuner.schema.compose import compose, conf_dir, load_config


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
    over = ["model=tiny-random", "+workload=code", "search.n_trials=4321"]  # composed nowhere else
    first = compose(over)
    first["search"]["n_trials"] = 1
    assert load_config(over).search.n_trials == 4321 and compose(over)["search"]["n_trials"] == 4321
    assert len(calls) == 1
