"""C++ kernels built at first use with the system compiler (the one inductor needs anyway), for this
CPU (-march=native), loaded through ctypes: the few-row linear (engine.models.smallm) and the decode
attention (engine.models.attention).

A built library is kept under ~/.cache/spectune/native/, named by its source, flags and this CPU,
so later processes (every worker, every `tuner serve`) load it instead of compiling again (seconds
of g++ each); where that directory cannot be written, each process builds its own copy.

Each library links torch's own OpenMP runtime (the process has already loaded libgomp), so torch's
thread count is the kernel's. A machine without g++, or a failed compile, leaves the library None
with the reason in `Native.error`: the callers then keep torch's kernels (the linear plan times
only the forms it has; batched attention takes pooled SDPA), and scripts/image_check.sh asserts
that both build in the image.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from engine.models.machine import cache_root

# The vector types every kernel source starts with (VW: fp32 lanes, defined by the kernel's flags).
VECTORS = r"""
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int vi __attribute__((vector_size(VW * 4)));
"""

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def avx512() -> bool:
    """Whether this CPU has AVX-512F (16-lane fp32 vectors)."""
    try:
        return " avx512f " in f" {Path('/proc/cpuinfo').read_text()} "
    except OSError:
        return False


def build_dir() -> Path:
    """Where built libraries are kept: native/ under the default cache root (~/.cache/spectune)."""
    return cache_root(None) / "native"


def cpu_key() -> str:
    """This CPU as -march=native sees it (model name and every flag), hashed: a home directory shared
    by machines of different CPUs never loads a library built for another."""
    try:
        info = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(("model name", "flags"))]
    except OSError:
        info = []
    return hashlib.sha256("\n".join(sorted(set(info))).encode()).hexdigest()[:12]


class Native:
    """One C++ source compiled with FLAGS plus `defines` into a shared library, once per process."""

    def __init__(self, name: str, source: str, defines: list[str], bind: Callable[[ctypes.CDLL], None]) -> None:
        self.name, self.source, self.bind = name, source, bind
        self.flags = [*FLAGS, *defines]
        # the kernel's version: plans timed with it name it, so a changed kernel is timed again
        self.tag = hashlib.sha256((source + " ".join(self.flags)).encode()).hexdigest()[:16]
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def _build(self) -> ctypes.CDLL:
        cached = build_dir() / f"{self.name}-{self.tag}-{cpu_key()}.so"
        try:
            lib = ctypes.CDLL(str(cached))
        except OSError:  # not built yet on this machine (or unreadable): build it
            lib = ctypes.CDLL(str(self._compile(cached)))
        self.bind(lib)
        return lib

    def _compile(self, cached: Path) -> Path:
        """Compile into `cached` (written whole: workers may build at once), or into a temporary
        directory where the cache cannot be written; the library's path."""
        work = Path(tempfile.mkdtemp(prefix=f"spectune-{self.name}-"))
        src, out = work / f"{self.name}-{self.tag}.cpp", work / f"{self.name}-{self.tag}.so"
        src.write_text(self.source)
        try:
            subprocess.run(["g++", *self.flags, str(src), "-o", str(out)], check=True, capture_output=True, text=True,
                           timeout=120)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
            tmp.write_bytes(out.read_bytes())
            os.replace(tmp, cached)
        except OSError:
            return out
        shutil.rmtree(work, ignore_errors=True)
        return cached

    def library(self) -> ctypes.CDLL | None:
        """The built library, or None when this machine cannot build it (`error` says why)."""
        if self.lib is not None:
            return self.lib
        with self._lock:
            if self.lib is None and self.error is None:
                try:
                    self.lib = self._build()
                except (OSError, subprocess.SubprocessError) as exc:
                    detail = (getattr(exc, "stderr", "") or str(exc)).strip()
                    self.error = f"{type(exc).__name__}: {detail.splitlines()[-1] if detail else exc}"
            return self.lib
