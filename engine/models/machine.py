"""Facts measured about this machine once and cached: where the caches live, which CPU this is, and a JSON file of
measurements keyed by it (copy bandwidth, the lean forward's linear plan)."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.models.cpuload import busy_mark, others_share  # timed_once's; tests plant them here


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


def measured_once(path: Path, key: str, measure: Callable[[Any], Any], remeasure: bool = False,
                  keep: Callable[[Any], bool] | None = None) -> Any:
    """The value stored under `key` in the JSON file `path`. When it is missing (or `remeasure`),
    `measure(old value or None)` gives it and the file is rewritten whole (workers may measure at
    once: the last complete write wins, never a torn file), unless `keep(value)` says the fresh
    value must not outlive this call (a timing taken while the machine was busy with others)."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    old = known.get(key)
    new = measure(old) if remeasure or old is None else old
    if new is not old and (keep is None or keep(new)):
        known[key] = new
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    return new


LOADED = 0.05  # a timing taken while others kept more of the CPUs busy is not cached (a tenth of a core on two)
# timings this process took under load, by (file, key): used again here instead of timed again (a
# process that opens several engines would otherwise pay the timing at each), never written
_LOADED_HERE: dict[tuple[str, str], Any] = {}


def quiet_enough(got: dict[str, Any]) -> bool:
    """Whether a timing may be cached: other processes kept at most LOADED of the CPUs busy while it was
    taken (or that could not be told). A timing under load is slow throughout and unevenly so; cached,
    every later run on the machine, quiet ones too, would be planned or priced by it."""
    return got.get("others") is None or got["others"] <= LOADED


def loaded_here(path: Path, key: str) -> Any:
    """The timing this process took under load for `key` in `path` (timed_once), or None: a reader
    that must not time (a finaliser reading back a choice) sees what this process measured."""
    return _LOADED_HERE.get((str(path), key))


def timed_once(path: Path, key: str, measure: Callable[[Any], dict[str, Any]], what: str,
               remeasure: bool = False) -> dict[str, Any]:
    """`measured_once` for a timing of this machine (`what` names it in the warning): the share of the CPUs
    other processes kept busy meanwhile is stored with it (`others`), and a timing taken while that was
    over LOADED is used by this process (timed once here) but not cached, so the next quiet run times its own."""
    here = (str(path), key)

    def timed(old: Any) -> dict[str, Any]:
        mine = _LOADED_HERE.get(here)
        if mine is not None and not remeasure:
            return mine
        mark = busy_mark()
        got = measure(mine if mine is not None else old)
        share = others_share(mark)
        # what a timing under load left in `mine` stays in the value: the value is loaded too
        got["others"] = share if mine is None or share is None else max(share, mine["others"])
        if not quiet_enough(got):
            _LOADED_HERE[here] = got
            print(f"spectune: {what} was timed while other processes kept {got['others']:.0%} of the CPUs busy "
                  f"(at most {LOADED:.0%} is cached): this process uses it, the cache keeps none", file=sys.stderr)
        return got

    return measured_once(path, key, timed, remeasure, keep=quiet_enough)
