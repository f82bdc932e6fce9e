"""How `engine.builtin.weights: auto` is timed where no rule decides it (tuner.schema.precision): a
short decode step of each candidate format through the native step, at one sequence and at the
engine's max_batch sequences, on this machine, once per machine and model shape, cached in
<cache>/weights_auto.json (engine.models.machine.timed_once), like the linear plan: a timing taken
while other processes kept the CPUs busy is used by the process that took it, never cached.

Only the shapes matter to a step's time, not the values: each format is timed on a copy of the
loaded fp32 model rounded to it (engine.models.fp8.apply_weights), one format at a time (one copy in
memory beside the model), the fastest of ROUNDS steps counting (another process's burst only adds time).
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable

import torch

from engine.models import decode_step
from engine.models.fp8 import apply_weights
from engine.models.kvpool import KVPool
from engine.models.llama import LeanLlama
from engine.models.machine import cache_root, cpu_signature, loaded_here, timed_once

CONTEXT = 256  # committed positions of each timed sequence (as the step-cost curve's)
ROUNDS = 12  # timed steps per point; the fastest counts
VERSION = 2  # in the cache key: a change of what is timed (or of the entry's layout) measures again


def points(max_batch: int) -> list[int]:
    """The sequences (one decode row each) a step is timed with: 1 and max_batch."""
    return sorted({1, max_batch})


def time_format(hf_model: torch.nn.Module, weights: str, max_batch: int) -> dict[str, float]:
    """Milliseconds of one native decode step of `hf_model` (fp32, CPU) rounded to `weights`, per
    point ("1 seq", "8 seqs"): the fastest of ROUNDS after a warm-up step."""
    model = copy.deepcopy(hf_model)  # the loaded model keeps its values
    apply_weights(model, weights)
    lean = LeanLlama(model)
    step = decode_step.NativeStep.of(lean)
    if step is None:
        raise RuntimeError(f"auto weights: the native step cannot run {weights} weights here")
    pool = KVPool(lean, max_batch, CONTEXT + 2)
    caches = [pool.acquire(CONTEXT + 2) for _ in range(max_batch)]
    out = {}
    with torch.inference_mode():
        for n in points(max_batch):
            best = float("inf")
            for i in range(ROUNDS + 1):
                for c in caches[:n]:
                    c.length = CONTEXT  # a zeroed pool: attention over zeros costs what it would
                t = time.perf_counter()
                step(caches[:n], [[1]] * n, [None] * n, [None] * n, [True] * n, None)
                if i:
                    best = min(best, time.perf_counter() - t)
            out[f"{n} seq" + ("s" if n > 1 else "")] = round(best * 1e3, 3)
    return out


def timed_formats(load: Callable[[], torch.nn.Module] | None, shape: str, formats: tuple[str, ...], max_batch: int,
                  cache_dir: str | os.PathLike | None = None, remeasure: bool = False
                  ) -> dict[str, dict[str, float]] | None:
    """{format: {point: ms}} for each of `formats`, timed once per (CPU, threads, torch, the step's
    build, the model's `shape`, max_batch) and cached unless timed under load; `load()` gives the fp32
    model, called only when timing. `load` None: the figures this process or the cache holds (None
    when none were timed here)."""
    key = "|".join([cpu_signature(), f"torch {torch.__version__}", f"step {decode_step.TAG}", shape,
                    f"b{max_batch}", ",".join(formats), f"v{VERSION}"])
    path = cache_root(cache_dir) / "weights_auto.json"
    if load is None:  # this process's own timing under load first: the cache never kept it
        got = loaded_here(path, key)
        if got is None:
            try:
                got = json.loads(path.read_text()).get(key)
            except (OSError, ValueError):
                return None
        return None if got is None else got["ms"]

    def measure(_old: object) -> dict[str, dict[str, dict[str, float]]]:
        model = load()
        return {"ms": {f: time_format(model, f, max_batch) for f in formats}}

    # a step timed under load is slow unevenly (a loaded run once cached bf16 several times slower than
    # fp32; docs/results.md): cached, it would choose the format for every later run on the machine
    return timed_once(path, key, measure, "the weights' decode-step timing", remeasure)["ms"]
