"""The EAGLE-3 draft head for Llama targets: architecture, the target's aux features, and
load/save in the checkpoint layout vLLM's `eagle3` method serves. Its KV cache is an
engine.models.cache.KVBuffer (grows in place; rollback is a length change).

Features. The target's hidden states entering decoder layers `aux_layers` (default low 2, mid L//2,
high L-3: each the residual stream before that layer, i.e. HF's `hidden_states[k]`, vLLM's
`eagle_aux_hidden_state_layer_ids`) are concatenated [.., 3h] and projected by `fc` (3h -> h) into
the first draft step's feature. Later steps feed the head's own pre-norm output back as the feature.

One decoder "midlayer": input_layernorm on the token embedding, hidden_norm on the feature, q/k/v
over cat(embed_norm, feature_norm) (2h wide), o_proj, residual = the feature (un-normed), then
post_attention_layernorm + MLP with a residual. The pre-norm output is the next step's feature; the
final `norm` and the head's OWN lm_head score a reduced draft vocabulary, mapped back to target ids
by `d2t` (target id = draft id + d2t[draft id]); `t2d` marks the target ids in the draft vocabulary.

Input at position t is (token t+1, feature t) with rotary position t, as for EAGLE-1.

Checkpoint layout: config.json = the target's config with architectures ["LlamaForCausalLMEagle3"],
num_hidden_layers 1, draft_vocab_size, eagle_aux_hidden_state_layer_ids, tie_word_embeddings false;
model.safetensors with exactly `fc.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight`, `norm.weight`, `lm_head.weight`, `d2t` (int64), `t2d` (bool).
No embedding: the target's is shared (a checkpoint that ships `embed_tokens.weight` is loaded with it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from engine.models.cache import KVBuffer
from engine.models.eagle_head import hf_llama
from tuner.schema.config import UserError

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
AUX_KEY = "eagle_aux_hidden_state_layer_ids"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default (2, L//2, L-3), clamped into 1..L-1 so that tiny test models get valid ids
    (layer 0's input is the bare embedding, which vLLM cannot capture)."""
    hi = max(num_layers - 1, 0)
    return tuple(min(max(k, 1), hi) for k in (2, num_layers // 2, num_layers - 3))  # type: ignore[return-value]


def aux_features(states, layers: Sequence[int] | None, rows=slice(None)) -> torch.Tensor | None:
    """What an EAGLE-3 drafter reads of the target: the states of `layers` (low, mid, high; a
    layer may repeat), each indexed by `rows`, side by side along the hidden dimension; None without
    layers. `states` is indexed by layer id: transformers' hidden_states (entry k: layer k's input)
    or the lean forward's {layer id: input}."""
    if not layers:
        return None
    return torch.cat([states[k][rows] for k in layers], dim=-1)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2h-wide cat(embed_norm, feature_norm)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(2 * h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVBuffer | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = hf_llama().apply_rotary_pos_emb(q, k, cos, sin)
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.append(k, v)
        causal = False
        if mask is None and t > 1:
            if past == 0:
                causal = True
            else:  # SDPA's is_causal aligns top-left; after a prefix the diagonal is offset
                mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)[None, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Eagle3Layer(nn.Module):
    """The midlayer: its parameter names are the checkpoint's `midlayer.*`."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = hf_llama().LlamaMLP(cfg)
        self.input_layernorm = hf_llama().LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = hf_llama().LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = hf_llama().LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class Eagle3Head(nn.Module):
    """EAGLE-3 head. `fuse` turns target aux states into first-step features, `forward` runs one draft
    step (returns the pre-norm output = the next step's feature), `logits` scores the draft vocabulary
    and `to_target_ids` maps draft ids to target ids. `aux_layers` are the target layers it reads."""

    def __init__(self, cfg: LlamaConfig, aux_layers: Sequence[int], draft_vocab_size: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.aux_layers = tuple(int(k) for k in aux_layers)
        if len(self.aux_layers) != 3:
            raise ValueError(f"EAGLE-3 reads 3 target layers, got {self.aux_layers}")
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = hf_llama().LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.rotary_emb = hf_llama().LlamaRotaryEmbedding(cfg)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < draft_vocab_size)  # the first ids until set
        self.embed_tokens: nn.Embedding | None = None  # only when a checkpoint ships its own

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.out_features

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft over `target_ids` (sorted, unique, one per lm_head row): fills d2t and t2d."""
        ids = target_ids.to(device=self.d2t.device, dtype=torch.long)
        if ids.numel() != self.draft_vocab_size or (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all())):
            raise ValueError(f"draft vocabulary: {self.draft_vocab_size} sorted unique target ids expected")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids (any shape)."""
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """Target id of every draft id, [draft_vocab]."""
        return self.to_target_ids(torch.arange(self.draft_vocab_size, device=self.d2t.device))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [B, T, 3h] (low, mid, high concatenated) -> first-step features [B, T, h]."""
        return self.fc(aux)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None = None, cache: KVBuffer | None = None) -> torch.Tensor:
        """token_embeds, features [B, T, h]; position_ids [B, T]; mask bool [B|1, 1, T, S+T] over the
        cache's S keys plus the T new ones (None: causal). Appends the T keys/values to `cache`.
        Returns the pre-norm hidden [B, T, h], which is the next step's feature."""
        layer = self.midlayer
        e = layer.input_layernorm(token_embeds)
        f = layer.hidden_norm(features)
        residual = f if self.norm_before_residual else features
        cos, sin = self.rotary_emb(features, position_ids)
        x = residual + layer.self_attn(torch.cat([e, f], dim=-1), cos, sin, mask, cache)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [.., h] -> logits over the draft vocabulary [.., draft_vocab]."""
        return self.lm_head(self.norm(hidden))


def head_config(target_config: LlamaConfig, aux_layers: Sequence[int], draft_vocab_size: int) -> LlamaConfig:
    """The head's config: the target's, one layer, with the EAGLE-3 keys vLLM reads."""
    d = target_config.to_dict()
    for k in ("quantization_config", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        d.pop(k, None)
    d.update(architectures=[ARCHITECTURE], num_hidden_layers=1, draft_vocab_size=int(draft_vocab_size),
             tie_word_embeddings=False, **{AUX_KEY: [int(k) for k in aux_layers]})
    return LlamaConfig.from_dict(d)


def init_eagle3(target: nn.Module, draft_ids: torch.Tensor, aux_layers: Sequence[int] | None = None,
                seed: int = 0) -> Eagle3Head:
    """A fresh head for the HF causal LM `target` drafting over `draft_ids` (target token ids; sorted
    and deduplicated here). Linear weights ~ N(0, initializer_range), norms 1, and the lm_head rows
    copied from the target's output embedding (the tied embedding) at the draft ids."""
    tcfg = target.config
    aux = tuple(aux_layers) if aux_layers is not None else default_aux_layers(tcfg.num_hidden_layers)
    if any(not 1 <= k < tcfg.num_hidden_layers for k in aux):  # layer 0's input is the embedding: vLLM has none
        raise UserError(f"eagle3 aux layers {list(aux)}: each must be in 1..{tcfg.num_hidden_layers - 1} "
                        "(the input of that target layer)")
    ids = torch.unique(draft_ids.detach().long().cpu())  # sorted
    if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= tcfg.vocab_size:
        raise UserError(f"eagle3 draft vocabulary: ids must be in 0..{tcfg.vocab_size - 1} (got {ids.numel()} ids)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3Head(head_config(tcfg, aux, ids.numel()), aux, ids.numel())
        std = getattr(tcfg, "initializer_range", 0.02)
        for mod in head.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=std)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight.detach()[ids.to(target.device)].float().cpu())
    head.set_draft_vocab(ids)
    return head


def save_eagle3(head: Eagle3Head, path: str | Path) -> Path:
    """Write config.json + model.safetensors in the layout vLLM's eagle3 method loads."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_dict()
    cfg.update(architectures=[ARCHITECTURE], num_hidden_layers=1, draft_vocab_size=head.draft_vocab_size,
               tie_word_embeddings=False, **{AUX_KEY: list(head.aux_layers)})
    # SGLang reads the layers from eagle_config and captures the input of layer id + 1 (vLLM: of layer
    # id, and its top-level key wins over eagle_config): the same target states, ids one lower.
    cfg["eagle_config"] = {AUX_KEY: [k - 1 for k in head.aux_layers], "use_aux_hidden_state": True}
    cfg.pop("transformers_version", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
    # clone: a head that drafted has fused weights (engine.drafters.lean_head) whose rows are views
    state = {k: v.detach().cpu().clone() for k, v in head.state_dict().items() if not k.startswith("rotary_emb")}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


def _read_weights(p: Path, where: str) -> dict[str, torch.Tensor]:
    if (p / WEIGHTS).is_file():
        from safetensors.torch import load_file

        return load_file(str(p / WEIGHTS))
    if (p / "pytorch_model.bin").is_file():
        return torch.load(str(p / "pytorch_model.bin"), map_location="cpu", weights_only=True)
    raise UserError(f"{where}: no {WEIGHTS} or pytorch_model.bin (an EAGLE-3 head in vLLM's layout)")


def load_eagle3(path: str | Path, target_config: LlamaConfig | None = None, key: str = "spec.head_path") -> Eagle3Head:
    """Load a head saved in vLLM's EAGLE-3 layout; with `target_config`, check it fits that target.
    Anything else is refused with a one-line UserError naming `key`."""
    p = Path(path).expanduser()
    where = f"{key}={path}"
    if not (p / "config.json").is_file():
        raise UserError(f"{where}: not a local EAGLE-3 head directory (no config.json); hub ids are not downloaded")
    try:
        raw = json.loads((p / "config.json").read_text())
    except ValueError:
        raise UserError(f"{where}: config.json is not valid JSON") from None
    archs = raw.get("architectures") or []
    if not any("Eagle3" in a for a in archs):
        raise UserError(f"{where}: architectures {archs} is not an EAGLE-3 head (expected [\"{ARCHITECTURE}\"])")
    if (raw.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise UserError(f"{where}: a head without aux hidden states (eagle_config.use_aux_hidden_state false) is not supported")
    cfg = LlamaConfig.from_dict({k: v for k, v in raw.items() if k != "transformers_version"})
    if target_config is not None:
        for name in ("hidden_size", "vocab_size"):
            if getattr(cfg, name) != getattr(target_config, name):
                raise UserError(f"{where}: {name} {getattr(cfg, name)} does not match the target's {getattr(target_config, name)}")
    aux = raw.get(AUX_KEY)
    if aux is None:
        if target_config is None:
            raise UserError(f"{where}: config.json has no {AUX_KEY} (needed without a target config)")
        aux = default_aux_layers(target_config.num_hidden_layers)
    n_layers = target_config.num_hidden_layers if target_config is not None else None
    if len(aux) != 3 or any(not isinstance(k, int) or k < 0 or (n_layers is not None and k >= n_layers) for k in aux):
        raise UserError(f"{where}: {AUX_KEY}={aux}: three target layer ids expected"
                        + (f" in 0..{n_layers - 1}" if n_layers else ""))
    state = _read_weights(p, where)
    dv = int(raw.get("draft_vocab_size") or cfg.vocab_size)
    head = Eagle3Head(cfg, aux, dv)
    if "d2t" not in state:  # vLLM drafts over the full vocabulary then
        if dv != cfg.vocab_size:
            raise UserError(f"{where}: no d2t tensor but draft_vocab_size {dv} != vocab_size {cfg.vocab_size}")
        state["d2t"] = torch.zeros(dv, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    embed = state.pop("embed_tokens.weight", None)
    expected = {k: v.shape for k, v in head.state_dict().items() if not k.startswith("rotary_emb")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(state[k].shape)} != {tuple(s)}" for k, s in expected.items() if k in state and state[k].shape != s]
    if missing or unexpected or wrong:
        raise UserError(f"{where}: not an EAGLE-3 head for this target (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}, shapes {wrong[:2]})")
    d2t, t2d = state["d2t"].long(), state["t2d"].bool()
    tids = d2t + torch.arange(dv)
    if bool((tids < 0).any() or (tids >= cfg.vocab_size).any()):
        raise UserError(f"{where}: d2t maps draft ids outside the vocabulary 0..{cfg.vocab_size - 1}")
    if int(t2d.sum()) != dv or not bool(t2d[tids].all()):
        raise UserError(f"{where}: t2d does not mark exactly the {dv} target ids that d2t maps to")
    state["d2t"], state["t2d"] = d2t, t2d
    head.load_state_dict(state, strict=False)  # rotary inv_freq is not persistent
    if embed is not None:
        if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise UserError(f"{where}: embed_tokens.weight {tuple(embed.shape)} != {(cfg.vocab_size, cfg.hidden_size)}")
        head.embed_tokens = nn.Embedding.from_pretrained(embed.float(), freeze=True)
    return head


def random_eagle3(target: nn.Module, seed: int = 0, aux_layers: Sequence[int] | None = None) -> Eagle3Head:
    """A seeded random head over the full vocabulary (drafts are poor; verification keeps output exact)."""
    return init_eagle3(target, torch.arange(target.config.vocab_size), aux_layers, seed)


def aux_hidden_states(target: nn.Module, input_ids: torch.Tensor, layers: Sequence[int],
                      attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The HF causal LM `target`'s inputs of decoder layers `layers` (residual stream, before any
    norm), concatenated: [B, T, len(layers)*h]. One forward (output_hidden_states), no lm_head."""
    out = target.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       output_hidden_states=True, use_cache=False)
    return aux_features(out.hidden_states, layers)
