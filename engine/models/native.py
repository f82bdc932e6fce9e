"""C++ kernels built at first use with the system compiler (the one inductor needs anyway), for this
CPU (-march=native), loaded through ctypes: the few-row linear (engine.models.smallm), the decode
attention (engine.models.attention) and the decode step (engine.models.decode_step).

A built library is kept in `~/.cache/spectune/native/` under a key of its source, flags, compiler
and CPU (`build_key`), so a later process loads it instead of compiling again (without a writable
home it is built into a temporary directory for the process); `prebuild` starts a build in the
background while the caller loads weights.

Each library links torch's own OpenMP runtime (the process has already loaded libgomp), so torch's
thread count is the kernel's. A machine without g++, or a failed compile, leaves the library None
with the reason in `Native.error`: the callers then keep torch's kernels (the linear plan times
only the forms it has; batched attention takes pooled SDPA), and scripts/image_check.sh asserts
that both build in the image.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

# The vector types every kernel source starts with (VW: fp32 lanes, defined by the kernel's flags).
VECTORS = r"""
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int vi __attribute__((vector_size(VW * 4)));
"""

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def avx512() -> bool:
    """Whether this CPU has AVX-512F (16-lane fp32 vectors)."""
    return " avx512f " in f" {cpu_id()} "


@functools.cache
def compiler_id() -> str:
    """The compiler as far as its output goes: `g++ --version`'s first line (empty without g++: the
    build then fails and says so)."""
    try:
        out = subprocess.run(["g++", "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.splitlines()[0] if out else ""


@functools.cache
def cpu_id() -> str:
    """What -march=native compiles for: the CPU's model name and flags (a home directory may be
    shared by machines of different CPUs)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return "|".join(next((ln for ln in info if ln.startswith(k)), "") for k in ("model name", "flags"))


def build_key(source: str, flags: list[str], compiler: str, cpu: str) -> str:
    """The identity of a built library: a change to any part builds a new one."""
    return hashlib.sha256("\0".join([source, " ".join(flags), compiler, cpu]).encode()).hexdigest()[:20]


def build_dir() -> Path:
    """Where built libraries are kept, per user (not per study cache_dir: the library depends on
    the machine only)."""
    from engine.models.machine import cache_root

    return cache_root(None) / "native"


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

    def path(self) -> Path:
        """The cached library's file."""
        return build_dir() / f"{self.name}-{build_key(self.source, self.flags, compiler_id(), cpu_id())}.so"

    def _build(self) -> ctypes.CDLL:
        out = self.path()
        if not out.is_file():
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                kept = os.access(out.parent, os.W_OK)
            except OSError:
                kept = False
            if not kept:  # no writable home (a container user without one): built for this process only
                out = Path(tempfile.mkdtemp(prefix=f"spectune-{self.name}-")) / out.name
            # private names until the rename: processes building at once never load a torn file
            tmp = f".{out.stem}.{os.getpid()}.{threading.get_ident()}"
            src, so = out.with_name(tmp + ".cpp"), out.with_name(tmp + ".so")
            src.write_text(self.source)
            try:
                subprocess.run(["g++", *self.flags, str(src), "-o", str(so)], check=True, capture_output=True,
                               text=True, timeout=120)
                os.replace(so, out)
            finally:
                src.unlink(missing_ok=True)
                so.unlink(missing_ok=True)
        lib = ctypes.CDLL(str(out))
        self.bind(lib)
        return lib

    def prebuild(self) -> None:
        """Build (or load) the library on a background thread; `library()` then waits for it."""
        threading.Thread(target=self.library, name=f"build-{self.name}", daemon=True).start()

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
