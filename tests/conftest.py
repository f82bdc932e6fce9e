"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
