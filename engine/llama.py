"""The engine's own Llama forward (the "lean" path): small direct PyTorch over a static KV cache.

Built from a loaded HF causal LM (Llama, or Qwen2 with its q/k/v biases) without copying weights:
q/k/v and gate/up are fused into one weight each, and the HF modules' weights become views of the
fused tensors, so the HF model (the reference, EAGLE training, `forward: hf`) keeps working on the
same memory. One forward runs N new tokens (a decode step, a chain or a branching tree) against
the committed prefix in `KVCache`; the tree's ancestor mask enters SDPA as an additive mask.

`LeanForward.step` is what the decode loop calls. Decoder layers run either eagerly or through
`torch.compile` (inductor) of one layer function shared by all layers, with the cache length
dynamic; compiled artifacts go to inductor's on-disk cache under the spectune cache dir. On CUDA
every step is compiled at bucketed token counts (padded to the bucket) under CUDA graphs
("reduce-overhead"), where launch overhead is what compiling removes. On CPU only the one-row
decode step is compiled: there inductor's fused GEMV beats oneDNN, while for several rows the
eager kernels are as fast and padding a tree to its bucket would only add rows.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.machine import cpu_signature, measured_once
from tuner.schema import UserError

# model_type -> whether q/k/v carry a bias; anything else is refused in one line
SUPPORTED = {"llama": False, "qwen2": True}
# RoPE variants whose frequencies are fixed (a table computed once is exact); "dynamic" rescales with length
_STATIC_ROPE = ("default", "llama3", "linear", "yarn", "longrope")
# token-count buckets of the compiled layer: a step of n tokens runs padded to the next bucket
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_NEG = float("-inf")


def check_supported(config) -> None:
    """Raise UserError (one line) when the lean forward cannot run this architecture exactly."""
    mt = getattr(config, "model_type", "?")
    if mt not in SUPPORTED:
        raise UserError(f"engine.builtin.forward=lean: model type {mt} is not supported "
                        f"(supported: {', '.join(SUPPORTED)}); use engine.builtin.forward=hf")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE:
        raise UserError(f"engine.builtin.forward=lean: rope_type {rope} is not supported "
                        f"({', '.join(_STATIC_ROPE)}); use engine.builtin.forward=hf")
    if getattr(config, "use_sliding_window", False):
        raise UserError("engine.builtin.forward=lean: sliding-window attention is not supported; "
                        "use engine.builtin.forward=hf")
    if getattr(config, "mlp_bias", False) or (mt == "llama" and getattr(config, "attention_bias", False)):
        raise UserError("engine.builtin.forward=lean: linear biases outside q/k/v are not supported; "
                        "use engine.builtin.forward=hf")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserError(f"engine.builtin.forward=lean: hidden_act {config.hidden_act} is not supported (silu); "
                        "use engine.builtin.forward=hf")


@dataclass
class Block:
    """One decoder layer's weights: fused qkv [(H+2K)*d, h] (+ bias), o [h, H*d], fused gate/up [2I, h], down."""

    ln1: torch.Tensor | None  # None: no input norm (an EAGLE-1 head's layer)
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    ln2: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor


def _fuse(mods: list[torch.nn.Linear], name: str = "weight") -> torch.Tensor:
    """Concatenate the `name` parameters of `mods` (same input) and point each module's at its rows."""
    fused = torch.cat([getattr(m, name).detach() for m in mods], dim=0).contiguous()
    at = 0
    for m in mods:
        n = getattr(m, name).shape[0]
        setattr(m, name, torch.nn.Parameter(fused[at:at + n], requires_grad=False))
        at += n
    return fused


def _fuse_bias(mods: list[torch.nn.Linear]) -> torch.Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    return _fuse(mods, "bias")


class LeanLlama:
    """Weights and shapes of a Llama-family decoder, read from (and shared with) an HF model."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        cfg = hf_model.config
        check_supported(cfg)
        inner = hf_model.model
        self.config = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.lm_head = hf_model.lm_head.weight.detach()  # the embedding itself when tied
        self.blocks: list[Block] = []
        with torch.no_grad():
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                self.blocks.append(Block(
                    ln1=layer.input_layernorm.weight.detach(),
                    wqkv=_fuse([a.q_proj, a.k_proj, a.v_proj]), bqkv=_fuse_bias([a.q_proj, a.k_proj, a.v_proj]),
                    wo=a.o_proj.weight.detach(), ln2=layer.post_attention_layernorm.weight.detach(),
                    w13=_fuse([m.gate_proj, m.up_proj]), w2=m.down_proj.weight.detach()))
        self.inv_freq, self.rope_scale = inner.rotary_emb.inv_freq.detach().float(), float(inner.rotary_emb.attention_scaling)
        self.device, self.dtype = self.embed.device, self.embed.dtype
        self._rope_len = 0
        self.cos = self.sin = torch.empty(0)
        self.packed = pack_weights([self.lm_head] + [w for b in self.blocks for w in (b.wqkv, b.wo, b.w13, b.w2)])

    def weight_bytes(self) -> int:
        """Bytes a decode step reads: every decoder weight, the final norm and the lm_head."""
        ts = [self.norm, self.lm_head] + [t for b in self.blocks for t in (b.ln1, b.wqkv, b.bqkv, b.wo, b.ln2, b.w13, b.w2)
                                          if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [>= length, d] (HF's layout: the half-frequencies repeated)."""
        if length > self._rope_len:
            self.cos, self.sin = rope_table(self.inv_freq, self.rope_scale, length, self.device, self.dtype)
            self._rope_len = self.cos.shape[0]
        return self.cos, self.sin


def rope_table(inv_freq: torch.Tensor, scale: float, length: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, d] for positions 0..n-1, n the next power of two >= length (at least 256), so a
    growing sequence recomputes the table a handful of times, never per step."""
    n = 1 << max(8, math.ceil(math.log2(max(length, 1))))
    freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv_freq.float().to(device)[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


class KVCache:
    """Static keys/values [layers, kv_heads, capacity, d] written by index; `length` positions are valid.

    A forward of N tokens writes slots length..length+N-1 (padding rows of a bucket write past them,
    never read). After verification, `commit` keeps the prefix plus the accepted nodes, moving them
    down in place when they are not already the first ones; dropping the rest is a length change."""

    def __init__(self, model: LeanLlama, capacity: int) -> None:
        shape = (len(model.blocks), model.n_kv, capacity, model.head_dim)
        # empty, not zeros: a step attends only to slots that are committed or written by itself
        self.k = torch.empty(shape, device=model.device, dtype=model.dtype)
        self.v = torch.empty(shape, device=model.device, dtype=model.dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def commit(self, prefix_len: int, accepted: list[int]) -> None:
        """Keep [0, prefix_len) and the accepted tree nodes (indices relative to the tree, in path order)."""
        m = len(accepted)
        if accepted != list(range(m)):
            src = torch.tensor(accepted, device=self.k.device) + prefix_len
            # index_select copies first: source and destination ranges may overlap
            self.k[:, :, prefix_len:prefix_len + m] = self.k.index_select(2, src)
            self.v[:, :, prefix_len:prefix_len + m] = self.v.index_select(2, src)
        self.length = prefix_len + m

    def crop(self, length: int) -> None:
        """Roll back to the first `length` positions."""
        self.length = min(self.length, length)

    def reserve(self, need: int) -> None:
        """Room for `need` positions: a full cache doubles, keeping its valid entries (draft heads,
        whose sequence length is not known up front; the target's cache is sized per request)."""
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], cap, old.shape[3])
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)


def _onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn()
SKINNY_MAX_ROWS = 4  # rows up to which _cpu_linear uses the w @ x.T form on plain weights (measured 2-16 rows)
PACK_ROWS = 16  # the row count packed weights are laid out for (verification steps are 3-64 rows)
# CPU fp32 forms of x @ w.T on a packed target weight: oneDNN on the packed copy, MKL (F.linear), MKL
# as w @ x.T. Which is fastest for a few rows depends on the CPU (see LinearPlan), so it is measured.
FORMS = ("onednn", "mkl", "wxt")
PLAN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # row counts calibrate_linears times; more rows: oneDNN
CALIBRATE_MIN_BYTES = 32 << 20  # smaller models keep the default plan (their linears take microseconds)


@dataclass(frozen=True)
class LinearPlan:
    """Which form each CPU fp32 linear over a packed weight takes, by row count, and which one-row form
    the compiled decode step traces ("prodsum": a product and a sum inductor fuses into one pass over
    the weight; "mkl": an extern MKL call). The default is what measured fastest on a 2-core AVX2 EPYC
    (prodsum 36 -> 22 ms per decode step, two rows w @ x.T 44 -> 25 ms, oneDNN packed beyond); on a
    2-core AVX-512 Xeon the same forms measured 1.6x (one row, compiled) and 2x (two rows) slower than
    MKL there, hence `calibrate_linears`."""

    eager: tuple[tuple[int, str], ...] = ((1, "onednn"), (2, "wxt"))
    compiled_one_row: str = "prodsum"
    # the calibration's timings (rows -> form -> ms over the decoder's linears), for reports only
    ms: dict[str, dict[str, float]] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # rows -> form, looked up by every eager linear of a step: built once, not searched per call
        last = self.eager[-1][0]
        object.__setattr__(self, "_by_rows", tuple(next(f for n, f in self.eager if n >= r) for r in range(last + 1)))

    def form(self, rows: int) -> str:
        """The eager form for `rows` rows: that of the smallest planned row count >= rows, else oneDNN."""
        return self._by_rows[rows] if rows < len(self._by_rows) else "onednn"


_PLAN = LinearPlan()


def linear_plan() -> LinearPlan:
    """The plan CPU linears follow in this process."""
    return _PLAN


def set_linear_plan(plan: LinearPlan) -> None:
    """Make `plan` the process's plan (compiled graphs traced before keep the form they traced)."""
    global _PLAN
    _PLAN = plan


def pack_weights(weights: list[torch.Tensor]) -> bool:
    """Give each CPU fp32 weight a copy in oneDNN's blocked layout (attribute `_onednn_packed`), which
    `linear` uses outside compiled graphs. oneDNN otherwise re-lays a plain weight out on every call:
    packed, 30 layers' linears over 8 rows took 17.6 ms instead of 30.5, over 16 rows 23.7 instead
    of 38.4. The copy doubles the weights' memory, so it is made only while it takes at most a
    quarter of physical memory. The weights must not change afterwards (the engine never does)."""
    if not (_ONEDNN and weights and weights[0].device.type == "cpu" and weights[0].dtype == torch.float32):
        return False
    total = sum(w.numel() * w.element_size() for w in weights)
    if total > os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 4:
        return False
    with torch.no_grad():
        for w in weights:
            if getattr(w, "_onednn_packed", None) is None:
                w._onednn_packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
    return True


def _form_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, form: str,
                 packed: torch.Tensor | None) -> torch.Tensor:
    if form == "mkl":
        return F.linear(x, w, b)
    if form == "wxt":
        y = torch.mm(w, x.t()).t().contiguous()
        return y if b is None else y + b
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w if packed is None else packed, b, "none", [], "")


def _cpu_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """CPU fp32 x @ w.T (+ b) outside a compiled graph. A packed (target) weight takes the form the
    process's LinearPlan names for the row count. A plain weight (draft heads) takes w @ x.T for 2-4
    rows, which streams it near the read bandwidth where oneDNN's small-M GEMM on a plain weight
    reads at 17-18 GB/s, and oneDNN otherwise."""
    rows = x.shape[0] if x.dim() == 2 else 0
    packed = getattr(w, "_onednn_packed", None)
    if packed is not None:
        return _form_linear(x, w, b, _PLAN.form(rows) if rows else "onednn", packed)
    return _form_linear(x, w, b, "wxt" if 2 <= rows <= SKINNY_MAX_ROWS else "onednn", None)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b). CPU fp32 outside a compiled graph: `_cpu_linear`. Inside one (on CPU only the
    one-row step is compiled) a single row is written as the plan says: by default a product and a
    sum, which inductor fuses into one pass over the weight (on the AVX2 machine faster than oneDNN's
    GEMV: a compiled decode step 36 -> 22 ms)."""
    if _ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32:
        if not torch.compiler.is_compiling():
            return _cpu_linear(x, w, b)
        if x.dim() == 2 and x.shape[0] == 1 and _PLAN.compiled_one_row == "prodsum":
            y = (x[:, None, :] * w).sum(-1)
            return y if b is None else y + b
    return F.linear(x, w, b)


_PRODSUM: Callable[..., torch.Tensor] | None = None


def _time_form(weights: list[torch.Tensor], rows: int, form: str, repeats: int) -> float:
    """Best-of-`repeats` seconds of `form` (one of FORMS, or "prodsum": the compiled one-row product
    and sum) over every weight, on random inputs of `rows` rows."""
    global _PRODSUM
    if form == "prodsum":
        if _PRODSUM is None:
            _PRODSUM = torch.compile(lambda x, w: (x[:, None, :] * w).sum(-1), dynamic=False)
        fn, repeats = _PRODSUM, repeats + 1  # the first pass compiles each weight shape
    else:
        def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return _form_linear(x, w, None, form, getattr(w, "_onednn_packed", None))
    xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for w in weights:
                fn(xs[w.shape[1]], w)
            best = min(best, time.perf_counter() - t)
    return best


def calibrate_linears(model: "LeanLlama", cache_dir: str | os.PathLike | None = None, compiled: bool = False,
                      repeats: int = 3) -> LinearPlan:
    """Time every form over the model's decoder weights at each of PLAN_ROWS (and, when `compiled`,
    the compiled product-sum one-row linear against MKL's), keep the fastest, and make that the
    process's plan. Measured once per (CPU, torch, threads, shapes) and cached in
    <cache>/linear_plan.json: a few seconds the first time (plus compiling the product-sum)."""
    from engine.model import cache_root

    weights = [w for b in model.blocks for w in (b.wqkv, b.wo, b.w13, b.w2)]
    key = f"{cpu_signature()}|torch {torch.__version__}|{sorted({tuple(w.shape) for w in weights})}"

    def measure(old: dict | None) -> dict:
        got = dict(old or {})
        ms = got["ms"] = dict(got.get("ms", {}))  # kept for reports: rows -> form -> ms over every layer
        if "eager" not in got:
            for n in PLAN_ROWS:
                ms[str(n)] = {f: round(_time_form(weights, n, f, repeats) * 1e3, 2) for f in FORMS}
            got["eager"] = [(n, min(FORMS, key=ms[str(n)].__getitem__)) for n in PLAN_ROWS]
        if compiled and "compiled_one_row" not in got:  # the product-sum against an extern MKL call
            ms["1 compiled"] = {f: round(_time_form(weights, 1, f, repeats) * 1e3, 2) for f in ("prodsum", "mkl")}
            got["compiled_one_row"] = min(("prodsum", "mkl"), key=ms["1 compiled"].__getitem__)
        return got

    path = cache_root(cache_dir) / "linear_plan.json"
    got = measured_once(path, key, measure)
    if compiled and "compiled_one_row" not in got:  # calibrated before for an eager forward only
        got = measured_once(path, key, measure, remeasure=True)
    plan = LinearPlan(tuple((int(n), str(f)) for n, f in got["eager"]),
                      got.get("compiled_one_row", _PLAN.compiled_one_row), got.get("ms", {}))
    set_linear_plan(plan)
    return plan


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def layer_forward(x: torch.Tensor, ln1: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None,
                  wo: torch.Tensor, ln2: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  ck: torch.Tensor, cv: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  mask: torch.Tensor | None, length: int, n_heads: int, n_kv: int, eps: float,
                  attn_in: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder layer over x [n, h]. Writes this step's keys/values at `slots` of the layer's cache
    ck/cv [K, C, d] and attends over its first `length` positions through the additive `mask`
    [n, length] (None: every row sees all of them, a single decode row). `attn_in` replaces
    rms_norm(x, ln1) as the input of q/k/v (draft heads: EAGLE-1 feeds x unnormed, EAGLE-3 the
    2h-wide normed embedding and feature), x staying the residual."""
    n = x.shape[0]
    d = ck.shape[-1]
    qkv = linear(rms_norm(x, ln1, eps) if attn_in is None else attn_in, wqkv, bqkv)
    q, k, v = qkv.split((n_heads * d, n_kv * d, n_kv * d), dim=-1)
    q = _rotate(q.view(n, n_heads, d).transpose(0, 1), cos, sin)
    k = _rotate(k.view(n, n_kv, d).transpose(0, 1), cos, sin)
    ck.index_copy_(1, slots, k)
    cv.index_copy_(1, slots, v.view(n, n_kv, d).transpose(0, 1))
    o = F.scaled_dot_product_attention(q[None], ck[None, :, :length], cv[None, :, :length],
                                       attn_mask=mask, enable_gqa=n_heads != n_kv)
    x = x + linear(o[0].transpose(0, 1).reshape(n, n_heads * d), wo)
    gate, up = linear(rms_norm(x, ln2, eps), w13).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w2)


def additive_mask(prefix_len: int, n: int, ancestors: torch.Tensor | None, rows: int, length: int,
                  device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[rows, length] additive mask: the prefix is visible to the n real rows, each sees its ancestors
    (causal when `ancestors` is None); padding rows (n..rows) see only themselves; slots past the
    real tree are hidden from everyone but their own padding row."""
    m = torch.full((rows, length), _NEG, device=device, dtype=dtype)
    m[:n, :prefix_len] = 0
    anc = torch.ones(n, n, dtype=torch.bool, device=device).tril() if ancestors is None else ancestors.to(device)
    m[:n, prefix_len:prefix_len + n].masked_fill_(anc, 0.0)
    idx = torch.arange(n, rows, device=device)
    m[idx, prefix_len + idx] = 0
    return m


def visibility_mask(visible: torch.Tensor | None, n: int, prefix_len: int, device: torch.device,
                    dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask [n, prefix_len + n] of a bool visibility matrix (None: causal after the
    prefix); None when every row sees every position (SDPA then needs no mask)."""
    if visible is None and n > 1:
        visible = torch.ones(n, prefix_len + n, dtype=torch.bool, device=device).tril(prefix_len)
    if visible is None or bool(visible.all()):
        return None
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, _NEG)


def _bucket(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


_COMPILE_LOCK = threading.Lock()


def compile_cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    """Where inductor keeps compiled artifacts (reused by later processes): <cache>/inductor."""
    from engine.model import cache_root

    return cache_root(cache_dir) / "inductor"


class LeanForward:
    """The lean target forward the decode loop drives: `new_cache`, `step`, then the cache's commit/crop.

    `compile=True` runs the decoder layers through one compiled layer function (see module doc:
    every step on CUDA, the one-row step on CPU); `compile_s` accumulates the wall time of steps
    that compiled something (the first call at each token bucket), which callers report apart
    from tokens/s."""

    def __init__(self, model: LeanLlama, compile: bool = False, cache_dir: str | None = None) -> None:
        self.model = model
        self.compiled = compile
        self.compile_s = 0.0
        self._seen: set[int] = set()
        self._compiled = layer_forward
        self._buckets = compile and model.device.type == "cuda"
        if compile:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir

            # torch writes its /tmp default into the environment on first use: replace only that
            cur = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            if cur is None or os.path.abspath(cur) == os.path.abspath(default_cache_dir()):
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir(cache_dir))
            mode = "reduce-overhead" if model.device.type == "cuda" else None
            self._compiled = torch.compile(layer_forward, dynamic=None, mode=mode)

    def new_cache(self, need: int) -> KVCache:
        """An empty cache for a generation of up to `need` positions, plus room for bucket padding."""
        return KVCache(self.model, -(-(need + BUCKETS[-1]) // 256) * 256)

    def rows_for(self, n: int) -> int:
        """The rows a step of n tokens runs with: the bucket when compiled on CUDA (beyond the largest: n)."""
        return (_bucket(n) or n) if self._buckets else n

    def step(self, cache: KVCache, tokens: list[int], depths: list[int] | None = None,
             ancestors: torch.Tensor | None = None, last_only: bool = False,
             aux_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Run `tokens` after the cache's committed prefix: positions prefix + depth (prefix + i when
        `depths` is None: a prompt or a chain), attention causal or along `ancestors` [n, n] bool.
        Returns (final normed hidden [n, h], logits [n or 1, V], the inputs of `aux_layers`
        concatenated [n, len*h] or None). The cache then holds the prefix and the n tokens
        (`KVCache.commit`/`crop` decide what stays)."""
        m = self.model
        n, p = len(tokens), cache.length
        dev = m.device
        rows = self.rows_for(n)
        if p + rows > cache.capacity:
            raise ValueError(f"KV cache full: {p}+{rows} > {cache.capacity}")
        pos = torch.arange(p, p + n, device=dev) if depths is None else torch.tensor(depths, device=dev) + p
        ids = torch.tensor(tokens, device=dev)
        if rows > n:  # padding rows: token 0 at the first free position, written past the tree
            pos = torch.cat([pos, torch.full((rows - n,), p, device=dev, dtype=pos.dtype)])
            ids = torch.cat([ids, ids.new_zeros(rows - n)])
        slots = torch.arange(p, p + rows, device=dev)
        cos_t, sin_t = m.rope(int(pos.max()) + 1)
        cos, sin = cos_t[pos], sin_t[pos]
        length = p + rows
        mask = None if rows == 1 else additive_mask(p, n, ancestors, rows, length, dev, m.dtype)
        layer = self._compiled if self._buckets or rows == 1 else layer_forward
        t0 = time.perf_counter() if layer is not layer_forward and rows not in self._seen else None
        x, aux = self._layers(layer, cache, F.embedding(ids, m.embed), slots, cos, sin, mask, length, n, aux_layers)
        if t0 is not None:
            self._seen.add(rows)
            self.compile_s += time.perf_counter() - t0
        x = rms_norm(x[:n], m.norm, m.eps)
        logits = linear(x[-1:] if last_only else x, m.lm_head)
        cache.length = p + n
        aux_t = torch.cat([aux[k] for k in aux_layers], dim=-1) if aux_layers else None
        return x, logits, aux_t

    def _layers(self, layer: Callable[..., torch.Tensor], cache: KVCache, x: torch.Tensor, slots: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, length: int, n: int,
                aux_layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        m = self.model
        aux = {}  # layer id -> its input; aux_layers may be unordered or repeat a layer (small targets)
        for i, b in enumerate(m.blocks):
            if aux_layers and i in aux_layers:
                aux[i] = x[:n]
            x = layer(x, b.ln1, b.wqkv, b.bqkv, b.wo, b.ln2, b.w13, b.w2, cache.k[i], cache.v[i], slots,
                      cos, sin, mask, length, m.n_heads, m.n_kv, m.eps)
        return x, aux

    def run(self, cache: KVCache, tokens: list[int], positions: torch.Tensor,
            visible: torch.Tensor | None) -> torch.Tensor:
        """The general step a draft model needs: `tokens` at rotary `positions` [n] after the cache's
        `length` entries, row i attending to the entries marked in `visible[i]` (bool [n, length + n];
        None: causal), so a tree level sees the uncommitted slots of the levels before it. Eager,
        unpadded. Appends the n entries (growing the cache when full); returns the final normed
        hidden states [n, h]."""
        m = self.model
        n, p = len(tokens), cache.length
        length = p + n
        cache.reserve(length)
        cos_t, sin_t = m.rope(int(positions.max()) + 1)
        mask = visibility_mask(visible, n, p, m.device, m.dtype)
        x = F.embedding(torch.tensor(tokens, device=m.device), m.embed)
        slots = torch.arange(p, length, device=m.device)
        x, _ = self._layers(layer_forward, cache, x, slots, cos_t[positions], sin_t[positions], mask, length, n)
        cache.length = length
        return rms_norm(x, m.norm, m.eps)

    def warm_up(self) -> float:
        """Compile (or load from the on-disk cache) the layer graphs a generation needs: a multi-row
        step, a one-row step, and a second multi-row size, after which the row count is dynamic.
        Returns the seconds it took (its first step at each size also counts in compile_s)."""
        t = time.perf_counter()
        with torch.inference_mode():
            # two cache capacities and an unbucketed prompt: a generation's own cache and prompt then
            # hit graphs whose cache length and row count are already dynamic (no recompile mid-run)
            for need in (64, 600):
                cache = self.new_cache(need)
                for n in (8, 1, 1, 4, 16, 100):
                    if cache.length + self.rows_for(n) <= cache.capacity:
                        self.step(cache, [0] * n)
        return time.perf_counter() - t


_LEAN: dict[tuple, LeanForward] = {}


def lean_forward(target, compile: bool = False, cache_dir: str | None = None,
                 linear_plan: str = "calibrated") -> LeanForward:
    """The LeanForward of a loaded Target, built once per process (weights shared with target.model).
    `linear_plan` is engine.builtin.linear_plan: "calibrated" makes a CPU fp32 target of at least
    CALIBRATE_MIN_BYTES of decoder weights follow this machine's measured LinearPlan
    (calibrate_linears, cached), set before anything is compiled; "default" the default plan."""
    fw = lean_forward_of(target.model, compile, cache_dir)
    m = fw.model
    if linear_plan == "default":
        set_linear_plan(LinearPlan())
    elif m.packed and sum(w.numel() * w.element_size() for b in m.blocks for w in (b.wqkv, b.wo, b.w13, b.w2)) \
            >= CALIBRATE_MIN_BYTES:
        calibrate_linears(m, cache_dir, compiled=compile)
    return fw


def lean_forward_of(hf_model: torch.nn.Module, compile: bool = False, cache_dir: str | None = None) -> LeanForward:
    """The LeanForward of an HF causal LM (a target or a draft model), built once per process and
    model; every LeanForward of one model shares its LeanLlama (the weights are fused once)."""
    key = (id(hf_model), compile)
    with _COMPILE_LOCK:
        if key not in _LEAN:
            same = next((f for (i, _), f in _LEAN.items() if i == id(hf_model)), None)
            model = same.model if same is not None else LeanLlama(hf_model)
            _LEAN[key] = LeanForward(model, compile, cache_dir)
        return _LEAN[key]
