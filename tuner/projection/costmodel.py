"""Cost of speculative decoding steps: measured here, projected there.

Acceptance (engine.measure.profile) says how many tokens a configuration commits per target forward;
this module says what a forward costs. Two sources, one interface (`StepCost`):

- `Roofline` ("there"): a hardware profile's datasheet peaks. A forward over `n` tokens for each of
  `batch` sequences with `context` tokens of KV cache takes
  max(weight + KV bytes / HBM bandwidth, FLOPs / tensor peak) + per-step and per-layer overhead
  + tensor-parallel all-reduces, with FP8 weights (1 byte, FP8 peak) and FP8 KV when deployed.
- `Measured` ("here"): a short microbenchmark of the built-in engine's target forward against
  tokens verified and context length, alone and as one batched step of each concurrency level
  asked for (engine.measure.microbench), cached per machine and engine, plus the draft time per
  step that the acceptance profile measured while it replayed each configuration.

Predicted throughput of a point = tau / (verify time(budget, batch) + draft time(point)).
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tuner.schema.config import BuiltinEngineConfig, HardwareConfig, ModelConfig, SpecConfig, UserError
from tuner.schema.methods import method as method_info

GB = 1e9


class StepCost(Protocol):
    """Seconds of one verification forward and of one configuration's drafting."""

    def verify_s(self, tokens: int, batch: int, context: int) -> float: ...

    def draft_s(self, spec: SpecConfig, batch: int, context: int) -> float: ...


@dataclass(frozen=True)
class Prediction:
    """One configuration at one concurrency."""

    spec: SpecConfig
    concurrency: int
    tau: float
    step_s: float  # verify + draft, one decoding step of the whole batch
    verify_s: float
    draft_s: float
    tpot_ms: float  # per sequence: step time / tokens committed per step
    tok_s: float  # all sequences together
    speedup: float  # over autoregressive decoding at the same concurrency


def predict(cost: StepCost, spec: SpecConfig, tau: float, concurrency: int, context: int,
            verified: float | Mapping[int | str, float] | None = None) -> Prediction:
    """tau / (verify time(budget, batch) + draft time) against one autoregressive forward.
    `verified`: what a step verifies when drafts are not always full (an n-gram lookup without a
    match verifies the root alone): the share of steps verifying n tokens (the verify time is then
    averaged over them, since it is not linear in n), or their mean; the budget otherwise."""
    off = spec.method == "off"
    shares = {int(n): float(w) for n, w in verified.items()} if isinstance(verified, Mapping) and verified else None
    n = 1 if off else (verified if isinstance(verified, (int, float)) else spec.budget)
    if not off and spec.k_per_batch_size:  # vLLM K schedule: the K of this batch size
        k = next((k for lo, hi, k in spec.k_per_batch_size if lo <= concurrency <= hi), spec.depth)
        n, off, shares = k + 1, k == 0, None
    if shares and not off:
        v = sum(w * cost.verify_s(t, concurrency, context) for t, w in shares.items()) / sum(shares.values())
    else:
        v = cost.verify_s(n, concurrency, context)
    d = 0.0 if off else cost.draft_s(spec, concurrency, context)
    ar = cost.verify_s(1, concurrency, context)
    tau = 1.0 if off else tau
    step = v + d
    return Prediction(spec=spec, concurrency=concurrency, tau=tau, step_s=step, verify_s=v, draft_s=d,
                      tpot_ms=1e3 * step / tau, tok_s=concurrency * tau / step, speedup=tau * ar / step)


# ---- there: the roofline of a hardware profile --------------------------------------------------

def draft_params_b(name: str | None, default: float = 1.0) -> float:
    """Parameters (billions) of a draft model named like '...-1B-...' / '0.5B'; `default` otherwise."""
    m = re.search(r"(\d+(?:\.\d+)?)[Bb](?![a-z])", name or "")
    return float(m.group(1)) if m else default


@dataclass(frozen=True)
class Roofline:
    """A model served on `tp` GPUs of a hardware profile (one replica)."""

    model: ModelConfig
    hw: HardwareConfig
    tp: int = 1
    fp8_weights: bool = False
    fp8_kv: bool = False
    draft_model_b: float = 1.0  # parameters of a draft_model drafter, billions
    draft_layers: int | None = None  # its decoder layers (None: the target's, scaled by size^(1/3))

    @property
    def weight_bytes(self) -> float:
        return self.model.params_b * 1e9 * (1 if self.fp8_weights else 2)

    @property
    def peak_flops(self) -> float:
        # FP8 GEMMs only where the GPU has FP8 tensor cores; elsewhere FP8 weights are upcast
        tflops = self.hw.fp8_tflops if self.fp8_weights and self.hw.fp8_tflops > 0 else self.hw.bf16_tflops
        return tflops * 1e12 * self.hw.compute_efficiency

    @property
    def bandwidth(self) -> float:
        return self.hw.hbm_bandwidth_tbs * 1e12 * self.hw.bandwidth_efficiency

    def _layer_params(self) -> float:
        m = self.model
        lm = m.vocab_size * m.hidden_size
        return max(m.params_b * 1e9 - 2 * lm, 0.0) / m.num_layers

    def _forward(self, params: float, layers: int, tokens: int, kv_read: float, attn_pairs: float,
                 wbytes: float) -> float:
        """One forward of a decoder stack over `tokens` new tokens (all sequences together) reading
        `kv_read` cached tokens, with `attn_pairs` (new token, cached token) attention pairs."""
        m, tp = self.model, self.tp
        kv_shards = min(tp, m.num_kv_heads)  # KV heads split across GPUs; fewer heads than GPUs: replicated
        kv_bytes = kv_read * m.kv_bytes_per_token(1 if self.fp8_kv else 2) * layers / m.num_layers / kv_shards
        mem_s = (params * wbytes / tp + kv_bytes) / self.bandwidth
        attn_flops = 4 * layers * m.num_attention_heads * m.head_dim * attn_pairs  # QK^T and PV
        flop_s = (2 * params * tokens + attn_flops) / tp / self.peak_flops
        return max(mem_s, flop_s) + self._allreduce(layers, tokens) + layers * self.hw.layer_overhead_us * 1e-6

    def _allreduce(self, layers: int, tokens: int) -> float:
        if self.tp <= 1:
            return 0.0
        if self.hw.interconnect_gbs <= 0:
            raise UserError(f"hardware {self.hw.name}: tensor parallelism {self.tp} needs interconnect_gbs > 0")
        msg = tokens * self.model.hidden_size * 2  # bf16 activations
        ring = 2 * (self.tp - 1) / self.tp * msg / (self.hw.interconnect_gbs * GB)
        return 2 * layers * (ring + self.hw.allreduce_latency_us * 1e-6)  # after attention and after the MLP

    def verify_s(self, tokens: int, batch: int, context: int) -> float:
        """One target forward over `tokens` per sequence for `batch` sequences at `context` tokens."""
        return self.hw.step_overhead_ms * 1e-3 + self._forward(
            self.model.params_b * 1e9, self.model.num_layers, tokens * batch, batch * context,
            batch * tokens * context, 1 if self.fp8_weights else 2)

    def draft_s(self, spec: SpecConfig, batch: int, context: int) -> float:
        """All draft steps of one decoding step. n-gram lookup runs on the CPU beside the GPU (free);
        EAGLE / EAGLE-3 run one decoder layer plus the lm_head per depth step over the frontier
        (topk nodes per sequence); Medusa's heads run once; a draft model runs its stack per step."""
        m = self.model
        lm = m.vocab_size * m.hidden_size
        wbytes = 1 if self.fp8_weights else 2
        info = method_info(spec.method)
        if info.training_free:  # a lookup on the CPU beside the GPU
            return 0.0
        width = spec.topk * batch
        if info.trained_by == "eagle":
            head = self._layer_params() + 2 * m.hidden_size ** 2 * (1.5 if spec.method == "eagle3" else 1) + lm
            one = self._forward(head, 1, width, batch * context, width * context, 2)  # heads are served in 16 bit
            return spec.depth * (one + self.hw.step_overhead_ms * 1e-3 / 2)
        if info.trained_by == "medusa":
            return self._forward(spec.depth * (m.hidden_size ** 2 + lm), 1, batch, 0, 0, 2)
        # draft_model: a small model of the same family, layers scaled with its size
        params = self.draft_model_b * 1e9
        layers = self.draft_layers or max(1, round(m.num_layers * (self.draft_model_b / m.params_b) ** (1 / 3)))
        kv = batch * context * layers / m.num_layers  # the draft's own cache, fewer layers
        one = self._forward(params, layers, width, kv, width * context * layers / m.num_layers, wbytes)
        return spec.depth * (one + self.hw.step_overhead_ms * 1e-3)


# ---- here: measured on this machine with the built-in engine ------------------------------------

# Bumped whenever the engine's forward changes speed, so that cost tables cached by an older engine
# are measured again (2: one-row CPU linears through oneDNN, a faster decode step; 4: CPU linear
# forms chosen per machine by engine.models.kernels.calibrate_linears).
ENGINE_REVISION = 4


def machine_key(engine_key: str) -> str:
    """Identity of this machine and engine setting: where a measured cost model is valid."""
    import torch

    from engine.models.machine import cpu_signature

    raw = f"{platform.node()}|{cpu_signature()}|{torch.__version__}|{engine_key}|r{ENGINE_REVISION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


@dataclass
class Measured:
    """Target forward seconds by (tokens, context), interpolated linearly in both, for one sequence
    and for batched steps of the sizes in `batched`; draft seconds per decoding step of one sequence
    by configuration key, from the acceptance profile's replay."""

    forward: dict[str, float]  # "tokens,context" -> seconds, one sequence
    draft: dict[str, float] = field(default_factory=dict)  # spec key -> seconds per decoding step
    key: str = ""
    # batch size -> "tokens,context" -> seconds of one step of that many sequences, each verifying tokens
    batched: dict[int, dict[str, float]] = field(default_factory=dict)

    def _at(self, tokens: float, context: int, batch: int = 1) -> float:
        table = self.forward if batch == 1 else self.batched[batch]
        toks = sorted({int(k.split(",")[0]) for k in table})
        ctxs = sorted({int(k.split(",")[1]) for k in table})

        def interp(xs: list[int], x: float) -> tuple[int, int, float]:
            if x <= xs[0]:
                return xs[0], xs[0], 0.0
            if x >= xs[-1]:  # beyond the grid: extrapolate from the last segment
                a, b = (xs[-2], xs[-1]) if len(xs) > 1 else (xs[-1], xs[-1])
                return a, b, (x - a) / (b - a) if b > a else 0.0
            b = next(v for v in xs if v >= x)
            a = max(v for v in xs if v <= x)
            return a, b, (x - a) / (b - a) if b > a else 0.0

        t0, t1, ft = interp(toks, tokens)
        c0, c1, fc = interp(ctxs, context)

        def f(t: int, c: int) -> float:
            return table[f"{t},{c}"]

        lo = f(t0, c0) + (f(t1, c0) - f(t0, c0)) * ft
        hi = f(t0, c1) + (f(t1, c1) - f(t0, c1)) * ft
        return max(lo + (hi - lo) * fc, 1e-6)

    def verify_s(self, tokens: float, batch: int, context: int) -> float:
        if batch != 1 and batch not in self.batched:
            measured = ", ".join(map(str, [1, *sorted(self.batched)]))
            raise UserError(f"concurrency {batch}: the measured cost model of this machine has batched steps of "
                            f"{measured} sequences only; project to a hardware profile instead")
        return self._at(tokens, context, batch)

    def draft_s(self, spec: SpecConfig, batch: int, context: int) -> float:
        """One sequence's measured draft time, for `batch` sequences: drafters that draft alone
        (lookups, draft models, Medusa) one after another, so `batch` times it; EAGLE heads in
        lockstep (engine.drafters.lockstep), one head forward over every sequence's rows, so it
        grows as the target's measured forward grows from one sequence's top-k rows to all of theirs."""
        if spec.method in ("off",):
            return 0.0
        if spec.key() not in self.draft:
            raise UserError(f"{spec.key()}: no measured draft time (profile it with `tuner profile`)")
        one = self.draft[spec.key()]
        if batch == 1:
            return one
        if method_info(spec.method).trained_by == "eagle":
            return one * self._at(spec.topk * batch, context) / self._at(spec.topk, context)
        return one * batch


def cache_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / "costmodel" / f"{key}.json"


def measured_cost(target, engine_key: str, cache_dir: Path, refresh: bool = False,
                  builtin: BuiltinEngineConfig | None = None, spectune_cache: str | None = None,
                  batches: tuple[int, ...] = (1,)) -> Measured:
    """The measured forward costs of this machine and engine setting (`engine_key` names the
    forward; `builtin` selects it) for one sequence and for a batched step of each of `batches`,
    from the cache or measured now (seconds for a 135M model on 2 cores; a batch size the cache
    lacks is measured and added). `spectune_cache` is the configured cache_dir (compiled
    artifacts of the lean forward)."""
    from engine.measure import microbench

    key = machine_key(engine_key)
    path = cache_path(Path(cache_dir), key)
    data = json.loads(path.read_text()) if path.is_file() and not refresh else {}
    fwd = data.get("forward")
    batched = {int(b): t for b, t in data.get("batched", {}).items()}
    todo = [b for b in sorted(set(batches)) if b > 1 and b not in batched]
    if fwd is not None and not todo:
        return Measured(forward=fwd, key=key, batched=batched)
    if fwd is None:
        fwd = microbench.measure_forward(target, builtin=builtin, cache_dir=spectune_cache)
    for b in todo:
        batched[b] = microbench.measure_forward(target, builtin=builtin, cache_dir=spectune_cache, batch=b)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"engine": engine_key, "forward": fwd,
                               "batched": {str(b): t for b, t in sorted(batched.items())}}, indent=1))
    tmp.replace(path)
    return Measured(forward=fwd, key=key, batched=batched)


def roofline_for(model: ModelConfig, hw: HardwareConfig, tp: int, quantization: str, kv_cache_dtype: str,
                 draft_model: str | None = None) -> Roofline:
    """The roofline of one replica: FP8 weights / KV as deployed, a draft model's size from its name."""
    if hw.hbm_bandwidth_tbs <= 0 or hw.bf16_tflops <= 0:
        raise UserError(f"hardware {hw.name}: hbm_bandwidth_tbs and bf16_tflops must be > 0 for a projection")
    return Roofline(model=model, hw=hw, tp=tp, fp8_weights=quantization == "fp8", fp8_kv=kv_cache_dtype == "fp8",
                    draft_model_b=draft_params_b(draft_model))

