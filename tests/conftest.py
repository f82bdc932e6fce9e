"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs two workers) each worker gets one intra-op thread: two
    workers of two threads each would put four busy threads on two cores, the oversubscription that
    `one_torch_thread` below avoids for small tensor ops. The processes its tests start (tuner
    commands, the built-in server, vLLM's engine core and its n-gram proposer's numba pool) inherit
    one thread too: with two OpenMP threads, while the other worker holds a core, every parallel op
    waits for the preempted thread (docs/results.md, the test-suite rows)."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"  # read by each subprocess's torch (and OpenMP) at start
        os.environ["NUMBA_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    elif getattr(config.option, "numprocesses", None):
        _build_first_use_caches()


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding a `slow` test (vLLM start-ups, the real model, PostgreSQL) run first, each file
    kept whole and in order: under `make test`'s two workers (--no-loadscope-reorder hands files out
    in this order) the long ones then overlap the many short ones instead of ending the run side
    by side on both cores."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: collection order otherwise


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
