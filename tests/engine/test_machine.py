"""engine/models/machine.py: per-machine measurements are measured once, kept under their key, and
measured again only when asked (with the old value at hand); engine/models/native.py: a built C++
library is kept and the next process loads it without compiling."""

from __future__ import annotations

import ctypes
import json
import subprocess

import pytest
import torch

from engine.models import native
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


def test_a_built_library_is_kept_and_the_next_process_loads_it_without_compiling(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # the default cache root follows the home directory
    source = 'extern "C" int answer() { return 42; }'

    def bind(lib: ctypes.CDLL) -> None:
        lib.answer.restype = ctypes.c_int

    first = native.Native("probe", source, [], bind)
    if first.library() is None:
        pytest.skip(f"no C++ compiler: {first.error}")
    assert first.library().answer() == 42
    kept = sorted(p.name for p in (tmp_path / ".cache" / "spectune" / "native").iterdir())
    assert len(kept) == 1 and kept[0].startswith(f"probe-{first.tag}-") and kept[0].endswith(".so")  # no .tmp left

    def no_compiler(*a, **k):
        raise FileNotFoundError("g++")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    again = native.Native("probe", source, [], bind)  # what a new process holds
    assert again.library() is not None and again.library().answer() == 42
    other = native.Native("probe", source, ["-DOTHER=1"], bind)  # other flags: another library, not the kept one
    assert other.library() is None and "g++" in (other.error or "")
