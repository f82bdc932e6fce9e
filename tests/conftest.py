"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs two workers) each worker gets one intra-op thread: two
    workers of two threads each would put four busy threads on two cores, the oversubscription that
    `one_torch_thread` below avoids for small tensor ops. Subprocesses keep torch's default."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


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
