"""Facts measured about this machine once and cached: where the caches live, which CPU this is, and a JSON file of
measurements keyed by it (copy bandwidth, the lean forward's linear plan)."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """`cache_dir`, or ~/.cache/spectune: where every measured or built artifact of spectune lives."""
    return Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "spectune"


def cpu_signature() -> str:
    """This CPU as far as kernel speed goes: model name, the SIMD flags torch dispatches on, and the
    thread count (the model name alone is generic on cloud VMs: 'Intel(R) Xeon(R) Processor' is
    an AVX2 machine on one host and an AVX-512/AMX one on another)."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), name)
        have = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
        flags = ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in have)
    except OSError:
        pass
    return f"{name}|{flags}|{torch.get_num_threads()}t"


def measured_once(path: Path, key: str, measure: Callable[[Any], Any], remeasure: bool = False) -> Any:
    """The value stored under `key` in the JSON file `path`. When it is missing (or `remeasure`),
    `measure(old value or None)` gives it and the file is rewritten whole (workers may measure at
    once: the last complete write wins, never a torn file)."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    old = known.get(key)
    new = measure(old) if remeasure or old is None else old
    if new is not old:
        known[key] = new
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    return new
