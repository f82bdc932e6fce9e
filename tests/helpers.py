"""Helpers shared by the tests: a free port, the fake vLLM / SGLang executable, a fake measurement,
the built-in engine and its server.

Imported as `helpers` (pytest puts tests/ on sys.path, as for tests/pg.py).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.decode.stepcost import StepCost
from tuner.study.objective import Sample
from tuner.schema.config import SpecConfig

FAKE_SERVER = Path(__file__).with_name("fake_engine_server.py")


class PlantedCost(StepCost):
    """A step cost that stays as planted: no live step, drafting time, step overhead or the
    controller's own pricing time moves it, so adaptive control chooses from the planted prices and
    the drafts it verifies alone, the same choices under any load (a test's power must not depend
    on how busy the machine is)."""

    def observe_step(self, batch: int, extra: int, seconds: float) -> None:
        pass

    def observe_draft(self, seconds: float, nodes: int) -> None:
        pass

    def observe_overhead(self, batch: int, seconds: float, drafted: bool | None = None) -> None:
        pass

    def observe_pricing(self, batch: int, seconds: float) -> None:
        pass

    def observe_work(self, batch: int, seconds: float, drafted: bool) -> None:
        pass


class PlantedClock:
    """The clock of the batch scheduler (engine.decode.batch) as planted: each target forward takes
    `forward(batch, extra)` seconds (its sequences and the rows beyond one each), `advance` adds
    what a test says a step spends elsewhere, and nothing else takes any time. What the engine
    learns from its steps' timings is then the same under any load. `plant` installs it."""

    def __init__(self, forward: Callable[[int, int], float]) -> None:
        self.now, self.forward = 0.0, forward

    def perf_counter(self) -> float:
        return self.now

    def thread_time(self) -> float:  # the scheduler's own CPU seconds: as planted, all of its time
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def plant(self, monkeypatch, engine) -> None:
        """Time `engine`'s batch scheduler by this clock (monkeypatch undoes it)."""
        from engine.decode import batch

        monkeypatch.setattr(batch, "time", self)
        real = engine.forward.step_batch

        def step_batch(caches, rows, *args, **kwargs):
            out = real(caches, rows, *args, **kwargs)
            self.now += self.forward(len(caches), sum(len(r) - 1 for r in rows))
            return out

        monkeypatch.setattr(engine.forward, "step_batch", step_batch)


class PlantedLoad:
    """engine.models.cpuload.others_cores planted: its i-th reading (a check's i-th pair) is `others[i]`
    cores kept busy by other processes (the last repeats; None: a machine that cannot be read)."""

    def __init__(self, others: list[float | None]) -> None:
        self.others, self.calls = list(others), 0

    def __call__(self, mark: object) -> float | None:
        self.calls += 1
        return self.others[min(self.calls - 1, len(self.others) - 1)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sglang_wheel(cache: Path, version: str) -> Path:
    """SGLang's wheel of `version` (pip download --no-deps, no install), kept in `cache` for the run.
    Downloaded into a private directory and renamed into place: pytest-xdist workers that ask at
    the same time never open a partly written file."""
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={version}", "-d",
                        str(private)], check=True, timeout=300)
        (wheel,) = private.glob(f"sglang-{version}-*.whl")
        os.replace(wheel, cache / wheel.name)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return cache / wheel.name


def wait_healthy(proc, url: str, timeout_s: float) -> None:
    """Wait until the server process `proc` answers 200 on `url`/health; fail with its output if it exits."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "tuner serve did not become healthy"
        time.sleep(0.25)


def fake_engine_exe(directory: Path, name: str = "vllm") -> str:
    """An executable file `directory/bin/name` that runs tests/fake_engine_server.py (a stand-in for
    `vllm` or SGLang's python); its path."""
    path = directory / "bin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\nimport runpy\nrunpy.run_path({str(FAKE_SERVER)!r}, run_name='__main__')\n")
    path.chmod(0o755)
    return str(path)


def fake_measure(delay_s: float = 0.02):
    """A MeasureFn without an engine: speculation 'helps' a little with depth; each call sleeps
    delay_s (a trial makes two)."""

    def measure(spec: SpecConfig, split: str, concurrency: int) -> Sample:
        time.sleep(delay_s)
        if spec.method == "off":
            return Sample(100.0, 1.0, 10.0, 10.0)
        return Sample(100.0 + 20 * spec.depth, 1.0 + 0.3 * spec.depth, 10.0, 9.0)

    return measure


def engine_for(cfg):
    """The built-in engine of cfg (its model loaded once per process), set to cfg.spec."""
    from tuner.study.measurer import open_engine

    return open_engine(cfg)


@contextmanager
def serving(cfg, engine) -> Iterator[str]:
    """The built-in OpenAI-compatible server over `engine` on 127.0.0.1, for the block; its URL."""
    from engine.serving.server import serve_in_thread

    url, stop = serve_in_thread(engine, cfg.model, cfg.serve)
    try:
        yield url
    finally:
        stop()


# The built-in server the server tests share: tiny-random with n-gram speculation, small replies.
TINY_SERVER = ["model=tiny-random", "spec.method=ngram", "spec.depth=3", "spec.budget=4", "serve.max_tokens_limit=64"]


def server_fixtures(overrides: list[str]) -> tuple[Callable, Callable, Callable]:
    """Module-scoped pytest fixtures (cfg, engine, server) for a test module to bind by those names
    (`cfg, engine, server = server_fixtures(TINY_SERVER)`): the config of `overrides`, its built-in
    engine, and that engine's server on 127.0.0.1 (the fixture's value is its URL)."""
    import pytest

    from tuner.schema.compose import load_config

    @pytest.fixture(scope="module")
    def cfg():
        return load_config(overrides)

    @pytest.fixture(scope="module")
    def engine(cfg):
        return engine_for(cfg)

    @pytest.fixture(scope="module")
    def server(cfg, engine):
        with serving(cfg, engine) as url:
            yield url

    return cfg, engine, server


# The largest top-2 logit margin a change of blocking (rows per forward, batch layout) can flip, by
# engine.builtin.weights. fp32: two blockings differ by summation order, ~1e-5 on these logits. bf16 /
# fp8: the linears round their input to bf16, so where two blockings sum in different orders (CPUs
# without AVX-512 BF16: the fp32 route) a 1e-7 difference can flip an activation's bf16 rounding, one
# bf16 step (2^-8 of it): up to ~3e-2 on these logits (measured between the torch and native forms).
TIE_MARGIN = {"fp32": 1e-3, "bf16": 3e-2, "fp8": 3e-2}


def assert_same_or_near_tie(engine, prompt: list[int], a: list[int], b: list[int], weights: str) -> int | None:
    """Two greedy continuations of `prompt` by `engine` under different blockings are the same, or
    at their first difference the engine's top-2 logits (over prompt + the common part) are exactly
    the two tokens chosen and lie within TIE_MARGIN[weights]: a tie the rounding may break either
    way. Returns the index of that difference (None: identical)."""
    import torch

    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        assert len(a) == len(b), f"one output stops early: {len(a)} vs {len(b)} tokens"
        return None
    with torch.inference_mode():
        cache = engine.lean.new_cache(len(prompt) + i + 1)
        _, logits, _ = engine.lean.step(cache, prompt + a[:i], last_only=True)
    top = torch.topk(logits[-1].float(), 2)
    margin = float(top.values[0] - top.values[1])
    assert {a[i], b[i]} == set(top.indices.tolist()) and margin <= TIE_MARGIN[weights], (
        f"outputs differ at token {i} ({a[i]} vs {b[i]}): top-2 {top.indices.tolist()} margin {margin:.2e}, "
        f"not a {weights} rounding tie (<= {TIE_MARGIN[weights]:g})")
    return i
