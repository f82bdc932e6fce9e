"""engine/models/machine.py: per-machine measurements are measured once, kept under their key, and
measured again only when asked (with the old value at hand)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.models.machine import busy_mark, cpu_signature, measured_once


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


def test_a_measurement_keep_refuses_is_returned_but_not_stored(tmp_path) -> None:
    path = tmp_path / "facts.json"
    assert measured_once(path, "a", lambda old: {"busy": 0.5}, keep=lambda v: v["busy"] < 0.1) == {"busy": 0.5}
    assert not path.exists()
    assert measured_once(path, "a", lambda old: {"busy": 0.0}, keep=lambda v: v["busy"] < 0.1) == {"busy": 0.0}
    assert json.loads(path.read_text()) == {"a": {"busy": 0.0}}


def test_the_others_share_is_the_machines_busy_time_less_this_processs(monkeypatch) -> None:
    """Over 2 s on 4 CPUs the machine was busy 5 CPU-seconds, this process 2 of them: others 3 / 8 of
    the machine, 1.5 cores (what the held-out check reads)."""
    from engine.models import cpuload, machine

    real = busy_mark()
    assert real is not None and real[1] > 0 and real[2] > 0  # this is Linux: /proc/stat and our times
    monkeypatch.undo()  # the suite's quiet machine for the check (tests/conftest.py)
    monkeypatch.setattr(cpuload, "cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(cpuload, "busy_mark", lambda: (10.0, 105.0, 52.0))
    assert machine.others_share((8.0, 100.0, 50.0)) == pytest.approx(3 / 8)
    assert cpuload.others_cores((8.0, 100.0, 50.0)) == pytest.approx(1.5)
    assert machine.others_share((8.0, 104.0, 50.0)) == 0.0  # this process's time is never the others'
    assert machine.others_share(None) is None and machine.others_share((10.0, 100.0, 50.0)) is None


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
