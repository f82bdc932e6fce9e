"""The EAGLE-1 draft head: architecture and load/save in the public layout that vLLM serves.

Input at position t is (token t+1, feature t), feature = the target's final hidden state after its
final norm. `fc` (2h -> h, embedding FIRST in the concatenation) mixes them, then one Llama decoder
layer WITHOUT input_layernorm and without a final norm (output = mlp_out + residual); the output
is a predicted feature, turned into logits by the target's frozen lm_head.

Checkpoint layout (docs/design.md): config.json = the target's config with num_hidden_layers 1 and
architectures ["LlamaForCausalLM"]; safetensors with `fc.weight`,
`layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight`. `fc.bias` is loaded when present (some public heads have
one) but never created for new heads: vLLM silently drops it.

Optional draft vocabulary (heads trained by engine.heads): `draft_vocab.json` beside the weights
lists the target token ids the head drafts over (a row slice of the lm_head, EAGLE-3's d2t idea).
It is a JSON file, not a tensor, because vLLM loads every *.safetensors in the directory and
refuses unknown tensor names; vLLM ignores it and drafts over the full vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from engine.models.cache import KVBuffer
from tuner.schema.config import UserError

WEIGHTS = "model.safetensors"


def hf_llama() -> ModuleType:
    """transformers' Llama modeling module, imported on first use: it is a heavy import, and most
    processes that import the heads' modules (the native step reads `aux_features`) never build a head."""
    from transformers.models.llama import modeling_llama
    return modeling_llama


# SGLang loads an EAGLE-1 draft only as architecture LlamaForCausalLMEagle, whose fc has a bias, while
# vLLM maps "LlamaForCausalLM" to its EAGLE model and would not know that name: the head keeps vLLM's
# config.json and gets an SGLang view beside it (same weights, a zero fc.bias, SGLang's architecture).
SGLANG_DIR = "sglang"
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle"
DRAFT_VOCAB = "draft_vocab.json"
_IGNORED = ("embed_tokens.weight", "lm_head.weight")  # shared from the target


class EagleAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                past: "KVBuffer | tuple[torch.Tensor, torch.Tensor] | None") -> tuple[torch.Tensor, object]:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = hf_llama().apply_rotary_pos_emb(q, k, cos, sin)
        if isinstance(past, KVBuffer):  # drafting: the cache grows in place
            k, v = past.append(k, v)
        elif past is not None:  # training-time-test unrolling: a tuple, concatenated (autograd)
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        rep = self.n_heads // self.n_kv
        kk = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        vv = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        if mask is None:  # no cache: plain causal attention (training, a first catch-up)
            out = F.scaled_dot_product_attention(q, kk, vv, is_causal=t > 1)
        else:
            out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), past if isinstance(past, KVBuffer) else (k, v)


class EagleLayer(nn.Module):
    """A Llama decoder layer without input_layernorm (the fc output goes straight into attention)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = EagleAttention(cfg)
        self.mlp = hf_llama().LlamaMLP(cfg)
        self.post_attention_layernorm = hf_llama().LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class EagleHead(nn.Module):
    """EAGLE-1 head. forward(token_embeds, features, position_ids) -> predicted next features."""

    def __init__(self, cfg: LlamaConfig, fc_bias: bool = False) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList([EagleLayer(cfg)])
        self.rotary_emb = hf_llama().LlamaRotaryEmbedding(cfg)
        # target ids of the draft vocabulary (None: the full vocabulary); not a weight of the layout
        self.register_buffer("draft_ids", None, persistent=False)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None = None, past: "KVBuffer | tuple[torch.Tensor, torch.Tensor] | None" = None
                ) -> tuple[torch.Tensor, object]:
        """token_embeds, features [B, T, h]; position_ids [B, T]; mask bool [B|1, 1, T, S+T] over
        (cached + new) keys, None for causal attention without a cache. Returns (out [B, T, h], new kv)."""
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        cos, sin = self.rotary_emb(x, position_ids)
        layer = self.layers[0]
        attn, kv = layer.self_attn(x, cos, sin, mask, past)
        x = x + attn
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, kv


def head_config(target_config: LlamaConfig) -> LlamaConfig:
    """The head's config: the target's, one layer, served by vLLM as architecture LlamaForCausalLM."""
    d = target_config.to_dict()
    d.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    for k in ("quantization_config", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        d.pop(k, None)
    return LlamaConfig.from_dict(d)


def random_head(target_config: LlamaConfig, seed: int = 0) -> EagleHead:
    """A seeded random head (drafts are poor but verification keeps the output exact)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = EagleHead(head_config(target_config))
        std = getattr(target_config, "initializer_range", 0.02)
        for mod in head.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)
    return head


def save_sglang_view(out: Path, cfg: dict, hidden: int) -> Path:
    """out/sglang: the head as SGLang loads an EAGLE-1 draft (tuner.schema.engine_command points
    --speculative-draft-model-path there): config.json with SGLang's architecture, the weights
    (a link to the head's own) and a zero fc.bias (SGLang's fc has a bias; the head is trained without)."""
    from safetensors.torch import save_file

    view = out / SGLANG_DIR
    view.mkdir(exist_ok=True)
    (view / "config.json").write_text(json.dumps({**cfg, "architectures": [SGLANG_ARCHITECTURE]}, indent=2,
                                                 default=str) + "\n")
    link = view / WEIGHTS
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path("..") / WEIGHTS)
    save_file({"fc.bias": torch.zeros(hidden)}, str(view / "fc_bias.safetensors"), metadata={"format": "pt"})
    return view


def save_head(head: EagleHead, path: str | Path) -> Path:
    """Write config.json + model.safetensors in the public EAGLE-1 layout."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_dict()
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    cfg.pop("transformers_version", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
    # clone: a head that drafted has fused weights (engine.drafters.lean_head) whose rows are views
    state = {k: v.detach().cpu().clone() for k, v in head.state_dict().items() if not k.startswith("rotary_emb")}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    save_sglang_view(out, cfg, state["fc.weight"].shape[0])
    if head.draft_ids is not None:
        (out / DRAFT_VOCAB).write_text(json.dumps({"target_ids": head.draft_ids.tolist()}) + "\n")
    return out


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / WEIGHTS).is_file():
        from safetensors.torch import load_file

        return load_file(str(path / WEIGHTS))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(str(path / "pytorch_model.bin"), map_location="cpu", weights_only=True)
    raise UserError(f"spec.head_path={path}: no {WEIGHTS} or pytorch_model.bin (an EAGLE-1 head in the public layout)")


def load_head(path: str | Path, target_config: LlamaConfig | None = None) -> EagleHead:
    """Load a head saved in the public EAGLE-1 layout (config.json + weights with the same names)."""
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise UserError(f"spec.head_path={path}: not a local EAGLE head directory (no config.json); hub ids are not downloaded")
    cfg = LlamaConfig.from_pretrained(str(p))
    if target_config is not None and cfg.hidden_size != target_config.hidden_size:
        raise UserError(f"spec.head_path={path}: hidden_size {cfg.hidden_size} does not match the target's {target_config.hidden_size}")
    state = {k.removeprefix("model."): v for k, v in _read_weights(p).items()}
    state = {k: v for k, v in state.items() if k not in _IGNORED}
    if "layers.0.input_layernorm.weight" in state:
        raise UserError(f"spec.head_path={path}: has layers.0.input_layernorm.weight; an EAGLE-1 head has none")
    head = EagleHead(cfg, fc_bias="fc.bias" in state)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb")]
    if missing or unexpected:
        raise UserError(f"spec.head_path={path}: not an EAGLE-1 head (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if (p / DRAFT_VOCAB).is_file():
        ids = json.loads((p / DRAFT_VOCAB).read_text())["target_ids"]
        if ids and (min(ids) < 0 or max(ids) >= cfg.vocab_size):
            raise UserError(f"spec.head_path={path}: {DRAFT_VOCAB} has token ids outside the vocabulary")
        head.draft_ids = torch.tensor(ids, dtype=torch.long)
    return head
