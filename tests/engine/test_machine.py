"""engine/models/machine.py: per-machine measurements are measured once, kept under their key, and
measured again only when asked (with the old value at hand)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.models.machine import cpu_signature, measured_once


def test_a_measurement_is_taken_once_per_key_and_again_only_on_request(tmp_path) -> None:
    path = tmp_path / "sub" / "facts.json"
    calls = []

    def measure(old):
        calls.append(old)
        return {"n": len(calls)}

    assert measured_once(path, "a", measure) == {"n": 1}
    assert measured_once(path, "a", lambda old: pytest.fail("measured a cached key again")) == {"n": 1}
    assert measured_once(path, "b", measure) == {"n": 2}
    assert measured_once(path, "a", measure, remeasure=True) == {"n": 3} and calls[-1] == {"n": 1}
    assert json.loads(path.read_text()) == {"a": {"n": 3}, "b": {"n": 2}}
    assert [p.name for p in path.parent.iterdir()] == ["facts.json"]  # no temporary file left behind


def test_a_torn_cache_file_is_measured_again(tmp_path) -> None:
    path = tmp_path / "facts.json"
    path.write_text('{"a": ')
    assert measured_once(path, "a", lambda old: 7) == 7 and json.loads(path.read_text()) == {"a": 7}


def test_the_cpu_signature_names_the_thread_count(monkeypatch) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_signature()
        torch.set_num_threads(2)
        assert one.endswith("|1t") and cpu_signature().endswith("|2t") and one != cpu_signature()
    finally:
        torch.set_num_threads(before)
