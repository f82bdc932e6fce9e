"""Shared fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# `--timeline PATH`: each test's worker, wall and CPU seconds, and each worker's share (tests/timeline.py)
pytest_plugins = ("timeline",)

_CONVERTER = pytest.StashKey["subprocess.Popen | None"]()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs two workers) each worker gets one intra-op thread: two
    workers of two threads each would put four busy threads on two cores, the oversubscription that
    `one_torch_thread` below avoids for small tensor ops. The processes its tests start (tuner
    commands, the built-in server, vLLM's engine core and its n-gram proposer's numba pool) inherit
    one thread too: with two OpenMP threads, while the other worker holds a core, every parallel op
    waits for the preempted thread (docs/results.md, the test-suite rows)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"  # read by each subprocess's torch (and OpenMP) at start
        os.environ["NUMBA_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    elif getattr(config.option, "numprocesses", None):
        _build_first_use_caches()
        config.stash[_CONVERTER] = _convert_smollm2_in_background()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller waits for its background conversion (a short selection of tests may end first):
    killed mid-way, it would leave its half-built copy in the cache."""
    converter = config.stash.get(_CONVERTER, None)
    if converter is not None:
        converter.wait()


def _build_first_use_caches() -> None:
    """What the engine builds at first use and keeps in ~/.cache/spectune (the SmolLM2 tokenizer
    extracted from the GGUF, ~12 s of CPU; the three C++ kernels, ~13 s), built once by the xdist
    controller before its workers start, through the engine's own functions. On an empty cache
    (CI, a fresh clone) both workers and the subprocesses their first tests start would each build
    them at once (the loser of each race discards its copy). The tests of the building itself
    (tests/engine/test_native.py, test_engine_model.py) use their own cache directories."""
    from engine.models import attention, decode_step, smallm
    from engine.models.forward import prebuild_kernels
    from engine.models.target import smollm2_tokenizer_dir

    prebuild_kernels()  # g++ on background threads while the tokenizer is extracted here, as the engine does
    smollm2_tokenizer_dir()
    for mod in (smallm, attention, decode_step):
        mod._NATIVE.library()  # waits for its build (None without a compiler: the engine reports that itself)


def _convert_smollm2_in_background() -> subprocess.Popen | None:
    """On an empty cache, the controller starts the SmolLM2 GGUF -> fp32 checkpoint conversion (the
    engine's own hf_checkpoint_dir, the slowest first-use build) in a process of its own while the workers
    run their first files. Built by the first worker test that needs it, the other worker's first such
    test waited on the cache's lock with one core idle; now a worker that waits leaves both cores to
    the conversion and the other worker. A failed conversion is reported by the tests themselves:
    each builds the checkpoint again through the same function."""
    from engine.models.target import SMOLLM2_GGUF, cache_root, file_digest, gguf_path

    root = cache_root(None)
    if (root / "models" / file_digest(gguf_path(*SMOLLM2_GGUF), root) / ".complete").is_file():
        return None  # hf_checkpoint_dir's layout: converted by an earlier run
    code = "from tuner.schema.compose import load_config; from engine.models.target import hf_checkpoint_dir; " \
           "hf_checkpoint_dir(load_config([]).model)"
    return subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding a `slow` test (vLLM start-ups, the real model, PostgreSQL) run first, each file
    kept whole and in order: under `make test`'s two workers (--no-loadscope-reorder hands files out
    in this order) the long ones then overlap the many short ones instead of ending the run side
    by side on both cores."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: collection order otherwise


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The held-out check's load signal (engine.models.cpuload.others_cores) reads a quiet machine in
    every test: how many pairs a check measures must not follow what else the suite's machine runs.
    Tests of the signal plant their own (helpers.PlantedLoad) or undo this."""
    from engine.models import cpuload

    monkeypatch.setattr(cpuload, "others_cores", lambda mark: 0.0)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for modules of tiny tensor ops: on a shared 2-core machine thread
    hand-offs cost more than they save (measured ~5x slower with 2 threads under load)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY = ["model=tiny-random", "spec.method=off"]  # the tiny random Llama every fast engine test runs


@pytest.fixture(scope="module")
def engine():
    """The built-in engine over the tiny random Llama, speculation off (a module sets its spec)."""
    from tuner.schema.compose import load_config
    from tuner.study.measurer import open_engine

    return open_engine(load_config(TINY))
