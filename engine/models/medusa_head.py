"""Medusa-1 heads on a frozen target: architecture, target signature, save/load in vLLM's layout.

Head k (k = 0..K-1) maps the target's final hidden state at position t (after its final norm, the
same feature EAGLE uses) to logits for token t+2+k: `num_layers` residual blocks x + SiLU(W x + b)
(W zero-initialised, so an untrained head starts as the identity) and its own lm_head, initialised
from the rows of the target's lm_head. The target's own lm_head already predicts token t+1.

Draft vocabulary: the lm_heads score only the `draft_vocab` most frequent target tokens of the
training data (`token_map`, sorted target ids); on CPU a full 49k-row lm_head per head would cost
more than the rest of a draft step.

Layout (what vLLM's `"method":"medusa"` loads): config.json with model_type "medusa",
architectures ["MedusaModel"], hidden_size, vocab_size, num_heads, num_hidden_layers,
truncated_vocab_size, medusa_fc_bias; model.safetensors with `blocks.{k}.layers.{j}.weight|bias`,
`lm_heads.{k}.weight` [truncated_vocab, h] and `token_map` int64 (only when the vocabulary is
truncated). config.json also carries `spectune_target`: the target's name, dimensions and a few
embedding values, so a head trained for another target is refused with one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tuner.schema.config import UserError

WEIGHTS = "model.safetensors"
_PROBE = (4, 32)  # embedding rows x columns kept as the target's signature


def target_signature(target: nn.Module, name: str) -> dict:
    """What identifies a target for a draft trained on it: dimensions plus a few embedding values
    (the embedding is never FP8-rounded, and a 2% tolerance absorbs bf16 vs fp32)."""
    cfg = target.config
    emb = target.get_input_embeddings().weight
    r, c = _PROBE
    return {"name": name, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "probe": [round(float(x), 6) for x in emb[:r, :c].detach().float().flatten()]}


def signature_mismatch(saved: dict | None, target: nn.Module, name: str) -> str | None:
    """Why a draft trained for `saved` does not fit this target (None: it fits)."""
    if not saved:
        return "it names no target (spectune_target missing)"
    now = target_signature(target, name)
    for k in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if saved.get(k) != now[k]:
            return f"it was trained for {saved.get('name')} ({k} {saved.get(k)}), the target is {name} ({k} {now[k]})"
    a, b = torch.tensor(saved.get("probe", [])), torch.tensor(now["probe"])
    if a.shape != b.shape or not torch.allclose(a, b, rtol=2e-2, atol=1e-3):
        return f"it was trained for {saved.get('name')} with other weights than the target {name}"
    return None


class ResBlock(nn.Module):
    """x + SiLU(W x + b)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads. forward(features [.., h]) -> logits [K, .., V'] over the draft vocabulary
    (`token_map`, None for the full vocabulary)."""

    def __init__(self, hidden: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 token_map: torch.Tensor | None = None, target: dict | None = None) -> None:
        super().__init__()
        self.hidden, self.vocab_size = hidden, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.target = target or {}
        rows = vocab_size if token_map is None else len(token_map)
        self.blocks = nn.ModuleList(nn.ModuleList(ResBlock(hidden) for _ in range(num_layers)) for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, rows, bias=False) for _ in range(num_heads))
        self.register_buffer("token_map", None if token_map is None else token_map.long(), persistent=False)
        for blocks in self.blocks:
            for b in blocks:
                nn.init.zeros_(b.linear.weight)
                nn.init.zeros_(b.linear.bias)

    def init_from_target(self, lm_head_weight: torch.Tensor) -> None:
        """Every head's lm_head starts as the target's (its draft-vocabulary rows)."""
        w = lm_head_weight.detach().float()
        if self.token_map is not None:
            w = w[self.token_map]
        with torch.no_grad():
            for lm in self.lm_heads:
                lm.weight.copy_(w)

    def hidden_states(self, features: torch.Tensor) -> list[torch.Tensor]:
        """Each head's transformed feature (before its lm_head)."""
        out = []
        for blocks in self.blocks:
            x = features
            for b in blocks:
                x = b(x)
            out.append(x)
        return out

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.stack([lm(x) for lm, x in zip(self.lm_heads, self.hidden_states(features))])

    def full_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[K, .., vocab_size]: tokens outside the draft vocabulary get -inf (never drafted)."""
        logits = self(features)
        if self.token_map is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.token_map] = logits
        return full

    def config_dict(self) -> dict:
        rows = self.vocab_size if self.token_map is None else len(self.token_map)
        return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": self.hidden,
                "vocab_size": self.vocab_size, "num_heads": self.num_heads, "num_hidden_layers": self.num_layers,
                "truncated_vocab_size": rows, "medusa_fc_bias": True, "spectune_target": self.target}


def new_heads(target: nn.Module, name: str, num_heads: int, num_layers: int = 1,
              token_map: torch.Tensor | None = None) -> MedusaHeads:
    """Fresh fp32 heads for `target`: identity residual blocks, lm_heads copied from the target's."""
    cfg = target.config
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, num_heads, num_layers, token_map,
                        target_signature(target, name))
    heads.init_from_target(target.get_output_embeddings().weight)
    return heads


def save_heads(heads: MedusaHeads, path: str | Path) -> Path:
    """Write config.json + model.safetensors (vLLM's Medusa layout, see the module docstring)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(heads.config_dict(), indent=2) + "\n")
    state = {}
    for k, blocks in enumerate(heads.blocks):
        for j, b in enumerate(blocks):
            state[f"blocks.{k}.layers.{j}.weight"] = b.linear.weight
            state[f"blocks.{k}.layers.{j}.bias"] = b.linear.bias
        state[f"lm_heads.{k}.weight"] = heads.lm_heads[k].weight
    if heads.token_map is not None:
        state["token_map"] = heads.token_map
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(out / WEIGHTS),
              metadata={"format": "pt"})
    return out


def load_heads(path: str | Path, target: nn.Module | None = None, name: str = "the target") -> MedusaHeads:
    """Load heads saved by `save_heads`; with `target`, refuse heads trained for another target."""
    from safetensors.torch import load_file

    p = Path(path).expanduser()
    if not (p / "config.json").is_file() or not (p / WEIGHTS).is_file():
        raise UserError(f"spec.head_path={path}: not a Medusa head directory (needs config.json and {WEIGHTS}); "
                        "train one with `tuner train-draft spec.method=medusa`")
    cfg = json.loads((p / "config.json").read_text())
    if cfg.get("model_type") != "medusa":
        raise UserError(f"spec.head_path={path}: config.json has model_type {cfg.get('model_type')!r}, "
                        "a Medusa head has 'medusa' (spec.method=medusa needs Medusa heads)")
    if target is not None:
        why = signature_mismatch(cfg.get("spectune_target"), target, name)
        if why:
            raise UserError(f"spec.head_path={path}: a Medusa head for another target: {why}")
    state = load_file(str(p / WEIGHTS))
    token_map = state.pop("token_map", None)
    heads = MedusaHeads(int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_heads"]),
                        int(cfg.get("num_hidden_layers", 1)), token_map, cfg.get("spectune_target"))
    ours = {}
    for k, blocks in enumerate(heads.blocks):
        for j in range(len(blocks)):
            ours[f"blocks.{k}.layers.{j}.weight"] = f"blocks.{k}.{j}.linear.weight"
            ours[f"blocks.{k}.layers.{j}.bias"] = f"blocks.{k}.{j}.linear.bias"
        ours[f"lm_heads.{k}.weight"] = f"lm_heads.{k}.weight"
    if set(state) != set(ours):
        raise UserError(f"spec.head_path={path}: weights do not match the config (missing "
                        f"{sorted(set(ours) - set(state))[:3]}, unexpected {sorted(set(state) - set(ours))[:3]})")
    try:
        heads.load_state_dict({ours[k]: v for k, v in state.items()})
    except RuntimeError as exc:
        raise UserError(f"spec.head_path={path}: tensor shapes do not match the config ({str(exc).splitlines()[-1].strip()})") from None
    return heads
