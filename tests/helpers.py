"""Helpers shared by the tests: a free port, the fake vLLM / SGLang executable, a fake measurement,
the built-in engine and its server.

Imported as `helpers` (pytest puts tests/ on sys.path, as for tests/pg.py).
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tuner.study.objective import Sample
from tuner.schema.config import SpecConfig

FAKE_SERVER = Path(__file__).with_name("fake_engine_server.py")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
