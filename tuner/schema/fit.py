"""Fit check: how many GPUs a model needs in FP8 on a hardware profile (pure arithmetic)."""

from __future__ import annotations

from tuner.schema.precision import packed_copies
from tuner.schema.config import (BuiltinEngineConfig, Config, DeployConfig, HardwareConfig, ModelConfig, UserError,
                                 trained_drafts)

GIB = 1024**3
# FP8 checkpoints keep embeddings, lm_head, norms and scales in 16 bit: a few percent over 1 byte/param.
FP8_OVERHEAD = 1.05


def fp8_weight_gib(model: ModelConfig) -> float:
    """Weight bytes of the model served with FP8 weights, in GiB."""
    return model.params_b * 1e9 * FP8_OVERHEAD / GIB


def builtin_load_gib(model: ModelConfig) -> float:
    """Host memory the built-in engine's load takes: every checkpoint is read in float32 on one
    device (engine.models.target.load_target), whatever engine.builtin.dtype it then runs in."""
    return model.params_b * 1e9 * 4 / GIB


# bytes a weight takes in each engine.builtin.weights format's packed copy (engine.models.smallm.pack)
FORMAT_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}


def builtin_weight_bytes(model: ModelConfig, dtype: str, weights: str, cpu: bool,
                         memory_gib: float = 0.0) -> tuple[float, str]:
    """(bytes, in words) of the weights the built-in engine holds. The model keeps every parameter at
    `dtype` (bf16 / fp8 weights are rounded values in it, engine.models.fp8). On CPU at float32, on a
    machine of `memory_gib`, the linears also get oneDNN's packed fp32 copy and the native step's copy
    in the `weights` format (under fp8 the lm_head's in bf16) where packed_copies allows; the copies are
    counted over every parameter (an untied embedding has none: a slight over-count). `auto` left to a
    pod's node (bf16 on a CPU with native bf16, else fp32) is counted at fp32, its larger copy, so the
    memory request holds on either CPU."""
    params = model.params_b * 1e9
    at = 4 if dtype == "float32" else 2
    words = f"{model.params_b:g}B params x {at} bytes at {dtype}"
    if not cpu or dtype != "float32":
        return params * at, words
    onednn, few = packed_copies(params * 4, memory_gib * GIB)
    fmt = weights if weights in FORMAT_BYTES else "fp32"
    lm_head = model.vocab_size * model.hidden_size
    held = params * at + (params * 4 if onednn else 0)
    held += (params * FORMAT_BYTES[fmt] + (lm_head if fmt == "fp8" else 0)) if few else 0
    words += (" + oneDNN's fp32 copy" if onednn else "") + (f" + the native step's {fmt} copy" if few else "")
    if few and weights == "auto":  # fp8 was resolved when the config loaded; bf16 or fp32 depend on the node's CPU
        words += " (engine.builtin.weights=auto, resolved on the node: counted at fp32, the most it takes there)"
    return held, words


def head_training_gib(model: ModelConfig) -> float:
    """What training a draft head adds on the target's device: about one decoder layer plus its input
    projection (3h x h), trained in fp32 with Adam (weights, gradient, two moments: 16 bytes a parameter)."""
    params = model.params_b * 1e9 / model.num_layers + 3 * model.hidden_size**2
    return params * 16 / GIB


def builtin_fit_problem(model: ModelConfig, hardware: HardwareConfig, builtin: BuiltinEngineConfig | None = None,
                        extra_gib: float = 0.0) -> tuple[float, str, str] | None:
    """(GiB needed, what needs them, what they exceed) when the built-in engine, which also trains
    every draft head, cannot hold `model` on `hardware`; None when it can. It reads the checkpoint in
    float32 into host memory, then (on a cuda profile, unless engine.builtin.device=cpu) moves it to
    ONE GPU at engine.builtin.weights / dtype; `extra_gib` more on that device (head training)."""
    b = builtin or BuiltinEngineConfig()
    load = builtin_load_gib(model) + (extra_gib if hardware.accelerator == "cpu" or b.device == "cpu" else 0.0)
    if load > hardware.memory_gib:
        return (load, f"its single-device fp32 load needs {load:.0f} GiB ({model.params_b:g}B params x 4 bytes)",
                f"hardware {hardware.name} has {hardware.memory_gib:g} GiB (hardware.memory_gib)")
    if hardware.accelerator == "cuda" and b.device != "cpu":
        held, words = builtin_weight_bytes(model, b.dtype, b.weights, cpu=False)
        need = held / GIB + extra_gib
        if need > hardware.gpu_memory_gib:
            return (need, f"its weights on one GPU need {need:.0f} GiB ({words}, "
                          f"engine.builtin.weights={b.weights} rounds their values)",
                    f"one GPU of hardware {hardware.name} has {hardware.gpu_memory_gib:g} GiB")
    return None


def check_builtin_fits(model: ModelConfig, hardware: HardwareConfig, builtin: BuiltinEngineConfig | None = None) -> None:
    """Refuse, when the config loads, engine=builtin for a model it cannot hold on this hardware
    (builtin_fit_problem): the 70B/72B configs on every packaged profile, 7B/8B on a 24 GiB host."""
    problem = builtin_fit_problem(model, hardware, builtin)
    if problem is not None:
        _, what, limit = problem
        raise UserError(
            f"engine=builtin with model {model.name}: {what} but {limit}; run this model with engine=vllm or "
            "engine=sglang on a GPU profile (they shard it over the GPUs), or set hardware.memory_gib to this "
            "host's memory if it has more")


def check_study_fits(cfg: Config) -> None:
    """Refuse, in one line and before any trial, run directory or download: a built-in engine that
    cannot hold the model on this hardware, and a head the study would train (the built-in engine
    loads its target) where the built-in engine cannot hold the target. Checked when a study starts,
    not at every config load: `tuner render deploy=vllm hardware=h100x8` runs no engine."""
    if cfg.engine.kind == "builtin":
        check_builtin_fits(cfg.model, cfg.hardware, cfg.engine.builtin)
    for m in trained_drafts(cfg):
        problem = builtin_fit_problem(cfg.model, cfg.hardware, cfg.engine.builtin, head_training_gib(cfg.model))
        if problem is not None:
            need, _, limit = problem
            raise UserError(f"search.methods contains {m}: {cfg.model.name} lists no {m} head and training one needs "
                            f"~{need:.0f} GiB on one device, but {limit}; drop it or set model.draft_sources.{m}")


def tensor_parallel_size(model: ModelConfig, hardware: HardwareConfig, deploy: DeployConfig) -> int:
    """Smallest tensor-parallel size whose per-GPU share of FP8 weights plus KV headroom fits.

    TP must divide the attention heads and be at most the GPU count. Raises UserError (one line)
    when even all GPUs of the profile cannot hold the model.
    """
    if hardware.accelerator == "cpu":
        return 1
    usable = hardware.gpu_memory_gib * deploy.gpu_memory_utilization
    headroom = hardware.gpu_memory_gib * deploy.kv_headroom_frac
    weights = fp8_weight_gib(model) if deploy.quantization == "fp8" else model.params_b * 2e9 / GIB
    tp = 1
    while tp <= hardware.gpu_count:
        if model.num_attention_heads % tp == 0 and weights / tp + headroom <= usable:
            return tp
        tp *= 2
    precision = "FP8" if deploy.quantization == "fp8" else "16-bit"
    raise UserError(
        f"model {model.name} does not fit hardware {hardware.name}: {weights:.1f} GiB of {precision} weights "
        f"+ {headroom:.1f} GiB KV headroom per GPU exceed {hardware.gpu_count} x {hardware.gpu_memory_gib:g} GiB "
        f"at gpu_memory_utilization={deploy.gpu_memory_utilization} (choose hardware with more or larger GPUs)"
    )


def tensor_parallel_why(model: ModelConfig, hardware: HardwareConfig, deploy: DeployConfig, tp: int) -> str:
    """Where tensor_parallel_size's answer came from, in one line (a manifest comment)."""
    usable = hardware.gpu_memory_gib * deploy.gpu_memory_utilization
    headroom = hardware.gpu_memory_gib * deploy.kv_headroom_frac
    fp8 = deploy.quantization == "fp8"
    weights = fp8_weight_gib(model) if fp8 else model.params_b * 2e9 / GIB
    return (f"TP {tp}: the smallest power of two dividing {model.num_attention_heads} heads where "
            f"{weights:.1f} GiB of {'FP8' if fp8 else '16-bit'} weights / TP + {headroom:.1f} GiB KV headroom "
            f"(deploy.kv_headroom_frac={deploy.kv_headroom_frac:g}) fit {usable:.1f} GiB per GPU "
            f"({hardware.gpu_memory_gib:g} GiB x deploy.gpu_memory_utilization={deploy.gpu_memory_utilization:g}, "
            f"hardware {hardware.name})")


# Model load rate assumed for the startup budget: the first start downloads the weights from the
# Hub into the cache volume, at a rate that varies with the link; a slow one must not trip the startup
# probe, so the rate assumed is a low one.
LOAD_GIB_PER_S = 0.1
# Engine start beyond reading weights: CUDA graph capture, torch.compile, drafter load, warm-up.
ENGINE_INIT_S = {"vllm": 180, "sglang": 180, "builtin": 60}


# Online FP8 quantization of the loaded 16-bit weights (vLLM / SGLang --quantization fp8): an assumed
# rate, generous for a GPU (it reads and writes each weight once) so that slow first starts still fit.
QUANTIZE_GIB_PER_S = 1.0


def served_weight_gib(model: ModelConfig, quantization: str) -> float:
    """Weight GiB the server holds in GPU memory: FP8 when quantized, else the model's native dtype."""
    if quantization == "fp8":
        return fp8_weight_gib(model)
    return downloaded_weight_gib(model)


def downloaded_weight_gib(model: ModelConfig) -> float:
    """Weight GiB the server downloads and reads at start: the hub checkpoint in its native dtype
    (an FP8 deployment quantizes it online after loading; nothing FP8 is downloaded)."""
    native_bytes = 4 if model.native_dtype == "float32" else 2
    return model.params_b * 1e9 * native_bytes / GIB


def startup_budget_s(model: ModelConfig, deploy: DeployConfig) -> int:
    """Seconds a pod may take to become healthy: engine init + the downloaded checkpoint at the load
    rate + its online quantization when deployed FP8."""
    gib = downloaded_weight_gib(model)
    quantize = gib / QUANTIZE_GIB_PER_S if deploy.quantization == "fp8" else 0.0
    return int(ENGINE_INIT_S[deploy.target] + gib / LOAD_GIB_PER_S + quantize)


def startup_why(model: ModelConfig, deploy: DeployConfig, period_s: int) -> str:
    """Where the startup probe's budget came from, in one line (a manifest comment)."""
    budget = startup_budget_s(model, deploy)
    gib = downloaded_weight_gib(model)
    quantize = (f" + online FP8 quantization at {QUANTIZE_GIB_PER_S:g} GiB/s" if deploy.quantization == "fp8" else "")
    return (f"{-(-budget // period_s)} x {period_s} s >= {budget} s start-up budget: {ENGINE_INIT_S[deploy.target]} s "
            f"{deploy.target} start + {gib:.1f} GiB {model.native_dtype} checkpoint at {LOAD_GIB_PER_S:g} GiB/s (the "
            f"first start downloads it){quantize}")


def kv_headroom_tokens(model: ModelConfig, hardware: HardwareConfig, deploy: DeployConfig, tp: int) -> int:
    """KV-cache tokens the headroom kept beside the weights holds (deploy.kv_headroom_frac of each
    GPU's memory, at deploy.kv_cache_dtype): what the fit check reserves. KV heads shard across the
    TP group, so the headroom adds up over it."""
    kv_elem = 1.0 if deploy.kv_cache_dtype == "fp8" else 2.0
    return int(hardware.gpu_memory_gib * deploy.kv_headroom_frac * tp * GIB / model.kv_bytes_per_token(kv_elem))


def kv_cache_tokens(model: ModelConfig, hardware: HardwareConfig, deploy: DeployConfig, tp: int) -> int:
    """KV-cache tokens a served engine holds over every sequence in flight: the memory it may take
    (deploy.gpu_memory_utilization of `tp` GPUs) less the served weights, at deploy.kv_cache_dtype."""
    kv_elem = 1.0 if deploy.kv_cache_dtype == "fp8" else 2.0
    free = hardware.gpu_memory_gib * deploy.gpu_memory_utilization * tp - served_weight_gib(model, deploy.quantization)
    return max(0, int(free * GIB / model.kv_bytes_per_token(kv_elem)))


def max_model_len_why(model: ModelConfig, hardware: HardwareConfig, deploy: DeployConfig, tp: int) -> str:
    """Where max_model_len's answer came from, in one line (a manifest comment)."""
    if deploy.max_model_len is not None:
        return f"deploy.max_model_len={deploy.max_model_len} (given; model.max_context={model.max_context})"
    if hardware.accelerator == "cpu":
        return f"model.max_context={model.max_context}"
    kv_tokens = kv_headroom_tokens(model, hardware, deploy, tp)
    return (f"min(model.max_context={model.max_context}, {kv_tokens} tokens of {deploy.kv_cache_dtype} KV in "
            f"the {deploy.kv_headroom_frac:g} x {hardware.gpu_memory_gib:g} GiB headroom of {tp} GPU(s)), "
            "rounded down to 1024")


def max_model_len(model: ModelConfig, hardware: HardwareConfig, deploy: DeployConfig, tp: int) -> int:
    """Context length to serve: deploy.max_model_len, else the model's context capped by what the
    KV headroom of `tp` GPUs holds for one sequence (engines refuse to start otherwise).

    KV heads shard across tensor-parallel ranks, so the headroom adds up over the TP group.
    Rounded down to a multiple of 1024 for readable manifests.
    """
    if deploy.max_model_len is not None:
        return deploy.max_model_len
    if hardware.accelerator == "cpu":
        return model.max_context
    return max(1024, min(model.max_context, kv_headroom_tokens(model, hardware, deploy, tp) // 1024 * 1024))


def builtin_memory_gib(model: ModelConfig, hardware: HardwareConfig, dtype: str, weights: str) -> tuple[int, str]:
    """(GiB, how) of the memory request of a built-in (CPU) server pod: half the node, more when the
    engine needs it: the weights it holds (builtin_weight_bytes: the values and their packed copies)
    + half the values again for activations and the KV cache + 1 GiB for the process; one line when
    the node cannot hold that."""
    held, words = builtin_weight_bytes(model, dtype, weights, cpu=True, memory_gib=hardware.memory_gib)
    need = (held + model.params_b * 1e9 * (4 if dtype == "float32" else 2) / 2) / GIB + 1
    if need > hardware.memory_gib:
        raise UserError(
            f"model {model.name} needs ~{need:.0f} GiB of memory on the built-in server ({words}, "
            f"engine.builtin.weights={weights}) but hardware {hardware.name} has {hardware.memory_gib:g} GiB "
            "(choose a smaller model, or deploy=vllm on GPUs)"
        )
    return int(min(hardware.memory_gib, max(hardware.memory_gib / 2, need))), f"{words}, + half the values + 1 GiB"
