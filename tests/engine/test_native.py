"""The C++ kernels' build cache (engine.models.native): a library is compiled once per source, flags,
compiler and CPU, kept per user, and loaded by later processes without compiling again."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest

from engine.models import native

SOURCE = 'extern "C" int twice(int x) { return X * x; }\n'


def _bind(lib: ctypes.CDLL) -> None:
    lib.twice.argtypes, lib.twice.restype = [ctypes.c_int], ctypes.c_int


def test_the_key_changes_with_source_flags_compiler_and_cpu() -> None:
    base = native.build_key(SOURCE, ["-O3", "-DX=2"], "g++ 12.2", "avx512f")
    assert base == native.build_key(SOURCE, ["-O3", "-DX=2"], "g++ 12.2", "avx512f")  # stable
    others = {native.build_key(SOURCE + " ", ["-O3", "-DX=2"], "g++ 12.2", "avx512f"),
              native.build_key(SOURCE, ["-O3", "-DX=3"], "g++ 12.2", "avx512f"),
              native.build_key(SOURCE, ["-O3", "-DX=2"], "g++ 13.1", "avx512f"),
              native.build_key(SOURCE, ["-O3", "-DX=2"], "g++ 12.2", "avx2")}
    assert base not in others and len(others) == 4


def test_a_library_is_built_once_then_loaded_from_the_per_user_cache(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if not native.compiler_id():
        pytest.skip("no g++ on this machine")
    monkeypatch.setenv("HOME", str(tmp_path))
    first = native.Native("twice", SOURCE, ["-DX=2"], _bind)
    assert first.library() is not None, first.error
    assert first.library().twice(21) == 42
    built = sorted((tmp_path / ".cache" / "spectune" / "native").iterdir())
    assert built == [first.path()]  # the library alone: no source or temporary file left behind

    real = subprocess.run

    def no_compiler(cmd, *a, **k):
        if cmd[0] == "g++":
            raise AssertionError("compiled again although the library is cached")
        return real(cmd, *a, **k)

    monkeypatch.setattr(native.subprocess, "run", no_compiler)
    again = native.Native("twice", SOURCE, ["-DX=2"], _bind)  # a later process: same key
    again.prebuild()
    assert again.library() is not None and again.library().twice(5) == 10
    monkeypatch.setattr(native.subprocess, "run", real)
    other = native.Native("twice", SOURCE, ["-DX=3"], _bind)  # other flags: another library
    assert other.library().twice(5) == 15 and other.path() != first.path()
    assert len(list(built[0].parent.iterdir())) == 2


def test_without_a_writable_home_the_library_is_built_for_the_process(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if not native.compiler_id():
        pytest.skip("no g++ on this machine")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(native.os, "access", lambda path, mode: False)  # as for a container user without a home
    lib = native.Native("twice", SOURCE, ["-DX=4"], _bind)
    assert lib.library() is not None and lib.library().twice(2) == 8, lib.error
    assert not any((tmp_path / ".cache" / "spectune" / "native").iterdir())  # nothing kept
