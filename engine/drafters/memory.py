"""Draft memory: what a drafter adds to the target's memory, in MB (parameters + KV cache).

Parameters are measured on the drafter's own tensors (its modules' parameters and buffers and any
tensor it keeps, such as a draft-vocabulary slice of an lm_head), each storage counted once; tensors
it shares with the target (EAGLE's embedding and lm_head) are not counted. The KV cache is the
drafter's own attention cache (K and V of every layer of its model) at `context_tokens` positions:
the longest request of a run. n-gram lookup and Medusa heads have no parameters resp. no cache.
"""

from __future__ import annotations

from typing import Any

import torch

MB = 1e6


def _storages(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, torch.Tensor):
        return [obj]
    return []


def _kv_bytes_per_token(modules: list[torch.nn.Module]) -> int:
    """K and V bytes per position of the first drafter module with a decoder config (0 without one)."""
    for m in modules:
        cfg = getattr(m, "config", None)
        layers = getattr(cfg, "num_hidden_layers", None)
        if not layers or not getattr(cfg, "num_attention_heads", None):
            continue
        kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        elt = next((p.element_size() for p in m.parameters()), 4)
        return 2 * layers * kv * hd * elt
    return 0


def draft_memory(drafter: Any, target: torch.nn.Module, context_tokens: int) -> dict[str, float]:
    """{params_mb, kv_mb, total_mb, target_params_mb, share_of_target} for a drafter of `target`
    (None: speculation off). `share_of_target` is the draft's total against the target's parameters."""
    shared = {t.untyped_storage().data_ptr() for t in _storages(target)}
    target_bytes = sum(t.numel() * t.element_size() for t in _storages(target))
    seen: set[int] = set()
    own = 0
    modules = []
    for value in (vars(drafter).values() if drafter is not None else ()):
        if isinstance(value, torch.nn.Module):
            mine = [t for t in _storages(value) if t.untyped_storage().data_ptr() not in shared]
            if mine:
                modules.append(value)
        for t in _storages(value):
            ptr = t.untyped_storage().data_ptr()
            if ptr in shared or ptr in seen:
                continue
            seen.add(ptr)
            own += t.untyped_storage().nbytes()
    kv = _kv_bytes_per_token(modules) * context_tokens
    total = own + kv
    return {"params_mb": round(own / MB, 3), "kv_mb": round(kv / MB, 3), "total_mb": round(total / MB, 3),
            "kv_tokens": context_tokens, "target_params_mb": round(target_bytes / MB, 1),
            "share_of_target": round(total / target_bytes, 4) if target_bytes else None}


def context_tokens(engine: Any, prompts: list[Any], max_new_tokens: int, chat_template: bool) -> int:
    """The longest context a run can reach: the longest encoded prompt plus max_new_tokens (capped
    by the model's context)."""
    longest = max((len(engine.encode_prompt(p.text, chat_template)) for p in prompts), default=0)
    return min(longest + max_new_tokens, engine.max_context)


def target_draft_memory(target: Any, prompts: list[Any], max_new_tokens: int, chat_template: bool
                        ) -> dict[str, float] | None:
    """Draft memory of a load-generator target that runs the built-in engine in this process (its
    current drafter), None for anything else (an HTTP endpoint)."""
    engine = getattr(target, "engine", None)
    if engine is None or not hasattr(engine, "drafter"):
        return None
    return draft_memory(engine.drafter, engine.model, context_tokens(engine, prompts, max_new_tokens, chat_template))
