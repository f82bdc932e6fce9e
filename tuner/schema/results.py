"""What a study reports: measured figures, provenance, a projection, and `BestResult` (best.yaml).
Part of the one config schema: import these from `tuner.schema.config`.
"""

from __future__ import annotations

from typing import Literal

from tuner.schema.spec import SpecConfig, Strict as _Strict


class Figures(_Strict):
    """Measured figures of one configuration (medians with a confidence interval)."""

    output_tokens_per_s: float
    ci_low: float | None = None
    ci_high: float | None = None
    tau: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_p50_ms: float | None = None  # inter-token latency: gaps between streamed chunks
    itl_p99_ms: float | None = None
    draft_mb: float | None = None  # drafter parameters + KV cache at the longest request (built-in engine)


class MeasuredServer(_Strict):
    """The server a study's trials ran (best.yaml): what `tuner render` compares with what it deploys."""

    engine: str
    version: str | None = None  # the engine release measured (vLLM / SGLang); None: not known
    hardware: str
    tensor_parallel_size: int = 1
    context_length: int | None = None
    quantization: str | None = None
    kv_cache_dtype: str | None = None


class Provenance(_Strict):
    study: str
    trial: int | None = None
    storage: str | None = None
    date: str  # ISO 8601
    model: str
    hardware: str
    engine: str
    workload: str
    # Which weights were measured (tuner.schema.config.measured_weights), e.g. the packaged GGUF
    # dequantized, and which the manifests serve (model.hf_id): a winner tuned on the one is served on the other.
    measured_weights: str | None = None
    served_weights: str | None = None
    # why the built-in engine measured at its engine.builtin.weights, one line (tuner.schema.config.weights_reason)
    weights_reason: str | None = None
    spectune_version: str = "0.1.0"
    server: MeasuredServer | None = None  # vLLM / SGLang studies: the measured server's version and settings


class ProjectedPoint(_Strict):
    """The predicted figures of a projected configuration at one concurrency level."""

    concurrency: int
    spec: str  # the configuration serving this level (a K schedule serves each band with its own K)
    tau: float
    tpot_ms: float
    tok_s: float
    speedup: float  # over autoregressive decoding at the same concurrency, on the same hardware


class Projection(_Strict):
    """How a projected configuration was chosen (`tuner render --from RUN --projected`): acceptance
    measured once (RUN/profile.json), cost from the hardware profile; predicted, not measured there."""

    hardware: str  # projected onto
    run: str  # the run directory
    profile: str  # the acceptance profile
    acceptance: str  # where the taus came from (tuner.projection.projector.Acceptance.source)
    tau_is_estimate: bool = False
    cost_model: str  # "roofline" or "measured here"
    tensor_parallel_size: int
    context: int
    concurrency: list[int]  # the levels the choice was made for (the workload's)
    predicted_speedup: float  # geometric mean over the levels (what a study maximises)
    predicted_tpot_ms: float  # geometric mean over the levels
    per_concurrency: list[ProjectedPoint]
    measured_spec: str | None = None  # the run's measured winner (best.yaml), for comparison


class CapacityProbe(_Strict):
    """One rate a capacity search measured for one configuration."""

    spec: str  # the configuration's key ("off" for the baseline)
    rate: float  # requests per second offered
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    goodput: float | None = None
    ok: bool  # every request finished and the workload's SLOs held


class Capacity(_Strict):
    """The highest request rate at which the workload's SLOs held (`search.capacity=true`), for
    the baseline and the winner, found by a bracketing search over rates (tuner.study.capacity)."""

    baseline_rps: float | None  # None: the SLOs broke at every rate tried
    winner_rps: float | None
    baseline_bounded: bool  # False: the SLOs held at every rate tried, so the capacity is a lower bound
    winner_bounded: bool
    slo_ttft_p99_ms: float | None = None
    slo_tpot_p99_ms: float | None = None
    probes: list[CapacityProbe] = []


class PartResult(_Strict):
    """The winner on one part of a mixed workload, against the baseline measured beside it."""

    name: str  # the part's workload name or file name
    weight: float
    requests: int  # requests of the part played (held-out when the workload has them, else tuning)
    split: str  # "heldout" or "tune"
    tau: float | None = None
    speedup: float | None = None
    output_tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None


class ArmLevel(_Strict):
    """The three arms at one measured level: output tok/s of speculation off (the study's baseline
    trial) and, for the best static schedule and the best adaptive configuration, their speedup
    over the baseline measured beside them and that speedup x off's tok/s (drift-corrected, as the
    study ranks trials). None: that arm was not measured."""

    level: str  # "c=4" (requests in flight) or "1.5 req/s"
    off_tok_s: float | None = None
    static_speedup: float | None = None
    static_tok_s: float | None = None
    adaptive_speedup: float | None = None
    adaptive_tok_s: float | None = None


class Arms(_Strict):
    """The adaptive arm against the best static schedule and speculation off (search.adaptive on the
    built-in engine): which of the three the study chose, and the evidence per level."""

    choice: Literal["adaptive", "static", "off"]
    adaptive: SpecConfig | None = None  # the best adaptive configuration measured (None: none completed)
    static: SpecConfig | None = None  # the best static schedule measured (None: none completed)
    static_beats_off: bool = False  # it beat off by the winner's rules: the second best to an adaptive winner
    adaptive_speedup: float | None = None  # over every level (geometric mean of the pairs' ratios)
    static_speedup: float | None = None
    levels: list[ArmLevel] = []


class SplitSpeedup(_Strict):
    """The winner's speedup on one set of prompts in the held-out check: the geometric mean of its
    pairs' ratios over the baseline measured beside each, with the two-sided 95% interval on logs."""

    prompts: int
    speedup: float
    ci_low: float | None = None
    ci_high: float | None = None
    tau: float | None = None
    # the winner's and the baseline's output tok/s on these prompts (mean over the pairs): whether off
    # itself runs faster on one set (shorter prompts and answers) than on the other in the same minutes
    tok_s: float | None = None
    baseline_tok_s: float | None = None


class HeldoutCheck(_Strict):
    """Does the winner's speedup hold on prompts the study never tuned on? The held-out prompts
    against as many tuning prompts, both in each pass, prompt by prompt, until both intervals are
    tight; `gap` = held-out / tuning - 1 (negative: slower held out)."""

    pairs: int  # pairs per set of prompts
    tuning: SplitSpeedup
    heldout: SplitSpeedup
    gap: float
    # the gap's 95% interval, resampling each side's prompts and pairs (tuner.study.selection.gap_interval):
    # how far two sets of this many prompts read apart by which prompts they hold and by the timing
    gap_ci_low: float | None = None
    gap_ci_high: float | None = None
    # with one pair a side: the spread of one pair's log ratio that the study's trials measured
    # (tuner.study.selection.pair_noise), which widens both sides' intervals and the gap's
    pair_noise: float | None = None
    # why a pair of the check was measured again (a baseline pass that was an outlier against the
    # study's recent baseline passes, a ratio above tau), per side: the check counts the re-measured pair
    remeasured: list[str] | None = None
    # why pairs of the check still read implausible when kept (after their re-measurements, or once the
    # check's were spent: tuner.study.objective.CHECK_RETRIES); the check counts them as they read
    implausible: str | None = None
    # holds: the interval holds 0 and excludes a held-out speedup of 1.0 (speculation still pays);
    # below / above: the interval lies on one side of 0; inconclusive: it holds 0 and 1.0x alike
    verdict: Literal["holds", "below", "above", "inconclusive"] | None = None
    # which tuning prompts the check compared with and why (tuner.study.measurer.match_check_side)
    check_side: str | None = None
    # per pair: how many cores other processes kept busy while it was measured (engine.models.cpuload.
    # others_cores; None where the machine could not be read): above tuner.study.selection.LOAD_CORES the
    # pair was contended, and the check measured more pairs
    load_cores: list[float | None] | None = None
    # the limit that stopped the check's pairs before the pairs it asked for (search.trial_timeout_s, as
    # a trial's repeats: tuner.study.objective.Objective.check), when one did
    pairs_cut: str | None = None


class HeadPilot(_Strict):
    """A head trained on a share of the full budget's answers (tuner.study.headbound), its acceptance
    measured on answers it did not see, and the bound that follows for the full budget's head."""

    prompts: int  # prompts answered for the pilot (a share of them held back for the measurement)
    steps: int  # its training steps (the full recipe's epochs over its share)
    positions: int  # held-back answer positions its acceptance was measured on
    acceptance: list[float]  # chains: P(the first d drafts accepted), d = 1, 2, ...
    topk: int  # the widest top-k searched (1: chains only)
    tree_acceptance: list[float]  # P(the first d target tokens each among the head's topk best): a tree's most
    tree_nodes: list[float] = []  # the most often accepted nodes of its top-k tree: their shares, largest first
    growth: float  # the full budget's acceptance at a depth is taken to be at most this times the pilot's
    # "d<depth>" (chains) and "d<depth> b<budget>" (the best tree of that depth) -> the tau assumed there,
    # and that tau x off step / the least such a draft's step can cost (tuner.study.headbound)
    tau: dict[str, float]
    bounds: dict[str, float]
    bound: float  # the best of them
    beat: float  # what it had to reach: 1.0 or the reference's upper confidence bound, grown by noise_rel (headbound.to_beat)
    seconds: float  # its answers, training and measurement


class HeadBound(_Strict):
    """The best speedup a head of `method` could reach on this machine, measured before its answers
    and training (tuner.study.headbound): an untrained head of the trained head's shape timed against
    speculation off, its chains assumed to commit min(depth + 1, tau) tokens a step."""

    method: str
    tau: float  # the generous acceptance assumed: the highest published for the head family
    off_step_ms: float  # one decode step, speculation off
    step_ms: dict[str, float]  # spec key of each measured chain -> one step with the untrained head
    bounds: dict[str, float]  # spec key -> min(depth + 1, tau) x off step / its step
    bound: float  # the best of them
    # the draft and the verification (target forward, acceptance) seconds of a decode step, per spec key:
    # a tree's step costs at least its depth's chain's drafting and the verification of as many tokens
    draft_ms: dict[str, float] = {}
    verify_ms: dict[str, float] = {}
    # a training-free chain the study always measures, timed against off on the trials' prompts (when
    # the published tau's bound clears 1.0): the figure a head must beat to win
    reference: str | None = None
    reference_speedup: float | None = None  # its lowest round that another round confirms (headbound.reference_figure)
    reference_rounds: list[float] = []  # every round's speedup, in the order measured
    # the one-sided upper confidence bound of its agreeing rounds and their spread on logs (floored at the
    # study's noise figure), what the bar is read on (headbound.rival_upper)
    reference_upper: float | None = None
    reference_spread: float | None = None
    # the training budget's ceiling (headbound.budget_tau): the answer tokens the config trains on at most,
    # the most tau a head trained on them reaches (the published tau beyond the measured table), and the best
    # any searched draft could reach at that tau (headbound.ceiling); the pilot runs only when it clears the rival
    budget_tokens: int | None = None
    budget_tau: float | None = None
    ceiling: float | None = None
    beat: float | None = None  # what the ceiling had to reach when it decided without a pilot (headbound.to_beat)
    trained: bool  # bound >= 1.0, the budget's ceiling clears the rival and with a pilot its bound does too
    pilot: HeadPilot | None = None  # run when the budget's ceiling clears the rival (headbound.to_beat)


class BestResult(_Strict):
    """`best.yaml` in a run directory: written by `tuner optimize`, read by `tuner render --from`."""

    spec: SpecConfig  # the winner (method 'off' when speculation did not beat the baseline)
    chain_spec: SpecConfig | None = None  # best chain (topk=1) of the study, for vLLM targets
    k_schedule_note: str | None = None
    metrics: Figures | None = None  # the winner on the tuning prompts
    baseline: Figures | None = None  # speculation off, measured adjacent in time
    speedup: float | None = None
    heldout: Figures | None = None  # the winner re-measured on the held-out prompts
    heldout_baseline: Figures | None = None  # speculation off on the held-out prompts, adjacent to `heldout`
    heldout_speedup: float | None = None
    heldout_check: HeldoutCheck | None = None  # held-out against as many tuning prompts, with both intervals
    reason: str | None = None  # why the winner is what it is (e.g. the slowdown trap)
    provenance: Provenance
    projection: Projection | None = None  # set when the spec was projected, not measured (render --projected)
    capacity: Capacity | None = None  # search.capacity=true: the SLO-attained rate of the baseline and the winner
    parts: list[PartResult] = []  # a mixed workload: the winner per part
    skipped_requests: int = 0  # the user's requests the engine refused as such (counted, not played)
    arms: Arms | None = None  # search.adaptive: adaptive against the best static schedule and off, per level
    # wall seconds of each phase of the run that wrote it, in order (engine load, a draft's answers
    # and training when made in that run, the check side's answers, the fit probe and its baseline
    # passes, trials, confirmation round, held-out check)
    phases_s: dict[str, float] = {}
    head_bounds: list[HeadBound] = []  # a head's bound measured before training it (tuner.study.headbound)
