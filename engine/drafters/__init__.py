"""Drafters behind one interface (engine.drafters.base.Drafter) and the factory the engine uses."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from engine.drafters.base import Drafter, ModelDrafter
from engine.drafters.draft_model import DraftModelDrafter, read_draft_vocab
from engine.drafters.eagle import EagleDrafter
from engine.drafters.eagle3 import Eagle3Drafter
from engine.drafters.medusa import MedusaDrafter
from engine.drafters.ngram import NgramDrafter, NgramTrieDrafter
from engine.drafters.recycle import RecycleDrafter
from engine.drafters.suffix import SuffixDrafter, suffix_cache
from tuner.schema.config import SpecConfig, UserError
from tuner.schema.methods import engine_methods

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "NgramTrieDrafter", "SuffixDrafter", "RecycleDrafter", "DraftModelDrafter", "EagleDrafter", "Eagle3Drafter",
           "MedusaDrafter", "make_drafter", "load_draft_model", "untrained_drafter"]

_LOCK = threading.Lock()
_MODELS: dict[tuple, torch.nn.Module] = {}
_HEADS: dict[tuple, torch.nn.Module] = {}


def _vocab_signature(tok) -> tuple:
    return (len(tok), tok.eos_token_id, tuple(sorted(tok.get_vocab().items())))


def load_draft_model(path: str, target, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A local HF causal LM with exactly the target's tokenizer, loaded once per process."""
    key = (str(Path(path).expanduser().resolve()), str(dtype), str(device), id(target.tokenizer))
    with _LOCK:
        if key in _MODELS:
            return _MODELS[key]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise UserError(f"spec.draft_model={path}: not a local HF checkpoint directory (no config.json); hub ids are not downloaded")
    try:
        dtok = AutoTokenizer.from_pretrained(str(p))
    except Exception as exc:  # noqa: BLE001 - any load failure means: no usable tokenizer there
        raise UserError(f"spec.draft_model={path}: no tokenizer in the directory ({type(exc).__name__}); "
                        "a draft model must ship the target's tokenizer") from None
    if _vocab_signature(dtok) != _vocab_signature(target.tokenizer):
        raise UserError(f"spec.draft_model={path}: its tokenizer differs from the target's "
                        f"({len(dtok)} vs {len(target.tokenizer)} tokens); a draft must share the target's tokenizer")
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype, attn_implementation="sdpa").to(device).eval()
    model.requires_grad_(False)
    if device.type == "cpu" and dtype == torch.float32:  # the target's fast CPU linears (engine.models.kernels)
        from engine.models.kernels import use_onednn_linears

        use_onednn_linears(model)
    with _LOCK:
        return _MODELS.setdefault(key, model)


def _at_target_weights(head: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """The head frozen and rounded to the format it is served in beside the target's weights
    (engine.models.fp8.head_weights: bf16 beside bf16 and fp8 targets), so the drafts it proposes are
    those of the served head and its linears read 2 bytes a weight (engine.drafters.lean_head)."""
    from engine.models.fp8 import apply_weights, head_weights

    head.requires_grad_(False)
    apply_weights(head, head_weights(getattr(model, "spectune_weights", "fp32")))
    return head


def load_eagle_head(spec: SpecConfig, target, seed: int = 0) -> torch.nn.Module:
    """The EAGLE-1 head of `spec.head_path`, or a seeded random head when no path is given (cached)."""
    from engine.models.eagle_head import load_head, random_head

    model = target.model
    key = (spec.head_path and str(Path(spec.head_path).expanduser().resolve()), id(model), seed)
    with _LOCK:
        if key in _HEADS:
            return _HEADS[key]
    head = load_head(spec.head_path, model.config) if spec.head_path else random_head(model.config, seed)
    head = _at_target_weights(head.to(device=target.device, dtype=target.dtype).eval(), model)
    with _LOCK:
        return _HEADS.setdefault(key, head)


def load_medusa_heads(spec: SpecConfig, target) -> torch.nn.Module:
    """The Medusa heads of `spec.head_path`, checked against the target (cached per process)."""
    from engine.models.medusa_head import load_heads

    if not spec.head_path:
        raise UserError("spec.head_path is required for spec.method=medusa (train heads with "
                        "`tuner train-draft spec.method=medusa +workload=NAME`)")
    key = ("medusa", str(Path(spec.head_path).expanduser().resolve()), id(target.model), str(target.dtype))
    with _LOCK:
        if key in _HEADS:
            return _HEADS[key]
    heads = load_heads(spec.head_path, target.model, target.name).to(device=target.device, dtype=target.dtype).eval()
    heads.requires_grad_(False)
    with _LOCK:
        return _HEADS.setdefault(key, heads)


def load_eagle3_head(spec: SpecConfig, target, seed: int = 0) -> torch.nn.Module:
    """The EAGLE-3 head of `spec.head_path`, or a seeded random head over the full vocabulary when
    no path is given (cached per process)."""
    from engine.models.eagle3_head import load_eagle3, random_eagle3

    model = target.model
    key = ("eagle3", spec.head_path and str(Path(spec.head_path).expanduser().resolve()), id(model), seed)
    with _LOCK:
        if key in _HEADS:
            return _HEADS[key]
    head = load_eagle3(spec.head_path, model.config) if spec.head_path else random_eagle3(model, seed)
    head = _at_target_weights(head.to(device=target.device, dtype=target.dtype).eval(), model)
    with _LOCK:
        return _HEADS.setdefault(key, head)


def make_drafter(spec: SpecConfig, target, seed: int = 0) -> Drafter | None:
    """The drafter for a SpecConfig (None for method 'off'); models and heads are loaded once per process."""
    supported = engine_methods("builtin")
    if spec.method not in supported:
        raise UserError(f"spec.method={spec.method}: the built-in engine supports {', '.join(supported)}")
    if spec.method == "off":
        return None
    if spec.method == "ngram":
        return NgramDrafter(spec) if spec.topk == 1 else NgramTrieDrafter(spec)
    if spec.method == "suffix":
        return SuffixDrafter(spec, suffix_cache(target, spec.suffix_tree_depth))
    if spec.method == "recycle":
        return RecycleDrafter(spec, target.model.config.vocab_size)
    if spec.method == "draft_model":
        model = load_draft_model(spec.draft_model, target, target.dtype, target.device)
        return DraftModelDrafter(spec, model, read_draft_vocab(spec.draft_model, model.config.vocab_size))
    if spec.method == "medusa":
        return MedusaDrafter(spec, load_medusa_heads(spec, target))
    if spec.method == "eagle3":
        return Eagle3Drafter(spec, load_eagle3_head(spec, target, seed), target.model)
    return EagleDrafter(spec, load_eagle_head(spec, target, seed), target.model)


def untrained_drafter(spec: SpecConfig, target, draft_vocab: int, seed: int = 0) -> Drafter:
    """A drafter of `spec` (eagle or eagle3) with a seeded random head of the shape training gives
    it: a draft vocabulary of `draft_vocab` target tokens (train.draft_vocab; 0: the whole vocabulary),
    in the format it is served in. A draft step costs what the trained head's costs, and its drafts
    are rejected, so it times a head's steps before any head is trained; verification keeps the
    output exact. Never cached: nothing else drafts with it."""
    from engine.models.eagle3_head import init_eagle3
    from engine.models.eagle_head import random_head

    model = target.model
    vocab = model.config.vocab_size
    ids = torch.arange(min(draft_vocab, vocab) if draft_vocab > 0 else vocab)
    if spec.method == "eagle3":
        head = _at_target_weights(init_eagle3(model, ids, None, seed).to(device=target.device, dtype=target.dtype).eval(),
                                  model)
        return Eagle3Drafter(spec, head, model)
    if spec.method != "eagle":
        raise UserError(f"spec.method={spec.method}: an untrained head is built for eagle and eagle3 only")
    head = random_head(model.config, seed)
    head.draft_ids = ids if draft_vocab > 0 else None
    return EagleDrafter(spec, _at_target_weights(head.to(device=target.device, dtype=target.dtype).eval(), model), model)
