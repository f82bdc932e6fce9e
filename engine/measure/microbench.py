"""The cost model's microbenchmark: what one verification forward of the built-in engine costs on
this machine, against tokens verified, context length and batch size (tuner.projection.costmodel
caches the table per machine and engine setting and projects from it)."""

from __future__ import annotations

import time

import torch

from engine.models.cache import crop_to, new_cache
from engine.models.forward import lean_forward
from engine.models.target import Target
from tuner.schema.config import BuiltinEngineConfig, UserError

TOKENS = (1, 2, 4, 8, 16, 32, 64)  # tokens verified in one forward (a tree's budget)
CONTEXTS = (128, 512)  # tokens already in the KV cache


def measure_forward(target: Target, tokens: tuple[int, ...] = TOKENS, contexts: tuple[int, ...] = CONTEXTS,
                    repeats: int = 3, builtin: BuiltinEngineConfig | None = None,
                    cache_dir: str | None = None, batch: int = 1) -> dict[str, float]:
    """Median seconds of one target forward over `tokens` new tokens (a chain) after `context`
    cached tokens, for every pair: what a verification costs on this machine, through the forward
    the engine verifies with (`builtin.forward`: the lean forward, compiled or not, or transformers').
    `batch` > 1: one batched step of that many sequences, each verifying `tokens` after its own
    `context` (slots of one KV pool, as continuous batching runs them; the lean forward only)."""
    out: dict[str, float] = {}
    if batch > 1:
        if builtin is None or builtin.forward != "lean":
            raise UserError(f"concurrency {batch}: only engine.builtin.forward=lean decodes requests together, "
                            "so only its batched step has a cost here")
        return _measure_batched(target, tokens, contexts, repeats, builtin, cache_dir, batch)
    if builtin is not None and builtin.forward == "lean":
        lean = lean_forward(target, builtin.compile, cache_dir, builtin.linear_plan, builtin.native_step)
        if builtin.compile:
            lean.warm_up()
        with torch.inference_mode():
            for c in contexts:
                cache = lean.new_cache(c + max(tokens))
                ids = torch.randint(100, 1000, (c + max(tokens),), generator=torch.Generator().manual_seed(0)).tolist()
                lean.step(cache, ids[:c], last_only=True)
                for n in tokens:
                    times = []
                    for _ in range(repeats):
                        t = time.perf_counter()
                        lean.step(cache, ids[c:c + n])  # logits of every row, as a verification
                        times.append(time.perf_counter() - t)
                        cache.crop(c)
                    out[f"{n},{c}"] = sorted(times)[len(times) // 2]
        return out

    model, dev = target.model, target.device
    with torch.inference_mode():
        for c in contexts:
            cache = new_cache(model.config)
            ids = torch.randint(100, 1000, (1, c), generator=torch.Generator().manual_seed(0)).to(dev)
            model.model(input_ids=ids, position_ids=torch.arange(c, device=dev)[None], cache=cache, use_cache=True)
            for n in tokens:
                times = []
                for _ in range(repeats):
                    new = ids[:, :n] if n <= c else torch.randint(100, 1000, (1, n)).to(dev)
                    pos = torch.arange(c, c + n, device=dev)[None]
                    t = time.perf_counter()
                    h = model.model(input_ids=new, position_ids=pos, cache=cache, use_cache=True).last_hidden_state
                    model.lm_head(h[0])
                    times.append(time.perf_counter() - t)
                    crop_to(cache, c)
                out[f"{n},{c}"] = sorted(times)[len(times) // 2]
    return out


def _measure_batched(target: Target, tokens: tuple[int, ...], contexts: tuple[int, ...], repeats: int,
                     builtin: BuiltinEngineConfig, cache_dir: str | None, batch: int) -> dict[str, float]:
    """`measure_forward` for `batch` sequences in one step (`LeanForward.step_batch`)."""
    lean = lean_forward(target, builtin.compile, cache_dir, builtin.linear_plan, builtin.native_step)
    if builtin.compile:
        lean.warm_up()
    out: dict[str, float] = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for c in contexts:
            pool = lean.pool(batch, c + max(tokens))
            caches = [pool.acquire(c + max(tokens)) for _ in range(batch)]
            ids = [torch.randint(100, 1000, (c + max(tokens),), generator=gen).tolist() for _ in range(batch)]
            for cache, seq in zip(caches, ids):  # every sequence its own prompt, as requests are
                lean.step(cache, seq[:c], last_only=True)
            for n in tokens:
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    lean.step_batch(caches, [seq[c:c + n] for seq in ids], [None] * batch, [None] * batch,
                                    [False] * batch)
                    times.append(time.perf_counter() - t)
                    for cache in caches:
                        cache.crop(c)
                out[f"{n},{c}"] = sorted(times)[len(times) // 2]
    return out
