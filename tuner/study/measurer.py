"""What a study measures with: its prompts, the draft it needs, and the Measurer over the
built-in engine (in this process) or over a launched vLLM / SGLang server (HTTP).

Both go through the one load generator (engine.measure.runner), so a trial's figures mean the same on
every engine. A launched server is restarted when its flags change, and before every pass of a
spec that remembers earlier requests (suffix: vLLM's cache cannot be restored, only emptied with
its process); a start-up is never part of a measurement (it runs outside the trial's clock,
tuner.study.limits).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.projection.profiling import (CHECK, CHECK_PASS, PROXY_DEPTHS, PromptProxy, check_order, check_prompt_count,
                                        matched_check, mismatch, side_context, side_tau, tuning_prompts)
from tuner.schema.compose import packaged_workloads
from tuner.study.limits import startup_excluded
from tuner.study.objective import Sample, Split
from tuner.schema.config import Config, HeadBound, Level, Rate, SpecConfig, UserError
from tuner.schema.methods import head_methods

if TYPE_CHECKING:  # the engine's heavy modules (torch) load only where a study runs
    from engine.decode.loop import Engine
    from engine.heads.pipeline import TrainJob
    from engine.launch.launcher import Launcher
    from engine.measure.runner import LoadTarget
    from engine.measure.workloads import Encoder, Prompt

    TargetFor = Callable[[SpecConfig], LoadTarget]

LAUNCHED = ("vllm", "sglang")


def study_prompts(cfg: Config, engine: Engine | None = None) -> dict[str, list[Prompt]]:
    """The prompts a study measures: the tuning prompts for trials (tuner.projection.profiling),
    every held-out prompt for the winner's re-measurement and as many tuning prompts to compare
    them with (split CHECK; both in turn in the check's pass, CHECK_PASS: with_check_pass), and for a mix each part's own
    (`part_split(label)`), on which the winner's tau and speedup per part are measured. The user's
    requests are tokenised here (`request_encoder`) for their budgets and the context check."""
    from engine.measure.workloads import load_prompts, mix_prompts, part_labels

    enc = request_encoder(cfg, engine)
    ctx = cfg.model.max_context if enc is not None else None
    out = {"tune": tuning_prompts(cfg, encoder=enc), "heldout": load_prompts(cfg.workload, "heldout", enc, ctx),
           CHECK: tuning_prompts(cfg, n=check_prompt_count(cfg), encoder=enc)}
    split = "heldout" if cfg.workload.num_heldout > 0 else "tune"
    for label in part_labels(cfg.workload):
        out[part_split(label)] = mix_prompts(cfg.workload, split, enc, ctx, only=label)
    with_check_pass(out)
    w = cfg.workload
    # rates replayed from a trace need every request's timestamp: refused before any trial
    if w.request_rate and w.arrival == "trace" and any(p.arrival_s is None for ps in out.values() for p in ps):
        raise UserError(f"workload.arrival=trace: the requests of workload '{w.name}' carry no arrival timestamps "
                        "(a request log's `timestamp`); use workload.arrival=poisson or constant")
    return out


def check_proxies(cfg: Config, engine: Engine, prompts: list[Prompt]) -> list[PromptProxy]:
    """Each prompt's PromptProxy: its answer generated once by `engine` (speculation off, every
    prompt in one closed loop of engine.builtin.max_batch clients: a greedy answer is the target's
    whatever decodes beside it, and a step reads the weights once for all its rows), replayed under
    the chains of PROXY_DEPTHS. Cached in the cache directory by the model, the engine's settings,
    the prompts' token ids and the sampling (counts only: no text), so a study pays it once."""
    import hashlib
    import json

    from engine.drafters.ngram import replayed_forwards
    from engine.measure.workloads import encode, params_of, sampling_params
    from engine.models.machine import cache_root

    w = cfg.workload
    ids = [encode(engine, p, w.chat_template) for p in prompts]
    params = [params_of(p, sampling_params(w, seed=cfg.seed)) for p in prompts]
    timed = auto_weights_timed(cfg)
    key = hashlib.sha256(json.dumps({
        "model": cfg.model.model_dump(mode="json"), "engine": cfg.engine.builtin.model_dump(mode="json"),
        "weights": timed[0] if timed is not None else cfg.engine.builtin.weights, "ids": ids,
        "params": [repr(x) for x in params], "depths": PROXY_DEPTHS}, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_root(cfg.cache_dir) / "check_proxy" / f"{key}.json"
    try:
        return [PromptProxy(p, a, tuple(f)) for p, a, f in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        pass
    before = engine.spec
    try:
        engine.set_spec(SpecConfig(method="off"))
        reqs = engine.batcher().closed_loop(ids, params, concurrency=engine.max_batch)
    finally:
        engine.set_spec(before)
    for r in reqs:  # as a lone generation would: a failed answer fails the study before its trials
        if r.exception is not None:
            raise r.exception
        if r.error is not None:
            raise RuntimeError(r.error)
    answers = [list(r.result.tokens) for r in reqs]
    out = [PromptProxy(len(x), len(a), tuple(replayed_forwards(x, a, d) for d in PROXY_DEPTHS))
           for x, a in zip(ids, answers)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([[p.prompt_tokens, p.answer_tokens, list(p.forwards)] for p in out]))
    tmp.replace(path)
    return out


# Tuning prompts the check side is chosen among, per prompt it plays: 6 of 12 by default, and a
# large split pays answers for twice the check's prompts, not for every tuning prompt.
CHECK_CANDIDATES = 2


def match_check_side(cfg: Config, engine: Engine | None, prompts: dict[str, list[Prompt]]) -> str:
    """Choose the held-out check's tuning side (prompts[CHECK]) among the first CHECK_CANDIDATES x
    check_prompt_count tuning prompts (their answers cost a generation each): as many as the check
    plays, matched to the held-out prompts (tuner.projection.profiling.matched_check)
    on their answers' PromptProxy, so that the two sides' prompts differ as little as a split can make
    them in what drives a speedup. Needs the built-in engine (the answers); a launched server keeps
    the first tuning prompts. Returns one line for the log (and best.yaml heldout_check.check_side)."""
    from engine.measure.workloads import load_prompts

    w = cfg.workload
    n = check_prompt_count(cfg)
    if w is None or w.num_heldout == 0 or not prompts.get("heldout"):
        return "no held-out prompts"
    if engine is None:
        return f"the first {n} tuning prompts (matching them to the held-out ones needs the built-in engine's answers)"
    ctx = cfg.model.max_context if user_requests(cfg) else None
    tune = load_prompts(w, "tune", request_encoder(cfg, engine), ctx)[: CHECK_CANDIDATES * n]
    if n >= len(tune):
        return f"all {len(tune)} tuning prompts"
    proxies = check_proxies(cfg, engine, [*tune, *prompts["heldout"]])
    t, h = proxies[:len(tune)], proxies[len(tune):]
    pick = matched_check(t, h, n)
    prompts[CHECK] = [tune[i] for i in pick]
    with_check_pass(prompts)
    taus = " / ".join(f"{side_tau([t[i] for i in pick], k):.2f}" for k in range(len(PROXY_DEPTHS)))
    held = " / ".join(f"{side_tau(h, k):.2f}" for k in range(len(PROXY_DEPTHS)))
    first = mismatch(t[:n], h)
    return (f"{n} of {len(tune)} tuning prompts matched to the {len(h)} held-out ones (tuning prompts "
            f"{', '.join(str(i) for i in pick)}): replayed n-gram tau at depths "
            f"{', '.join(map(str, PROXY_DEPTHS))} {taus} against {held}, context {side_context([t[i] for i in pick]):.0f} "
            f"against {side_context(h):.0f} tokens; mismatch {mismatch([t[i] for i in pick], h):.3f} "
            f"(the first {n}: {first:.3f})")


def with_check_pass(prompts: dict[str, list[Prompt]]) -> None:
    """Set prompts[CHECK_PASS], what the held-out check plays in one pass: the check's tuning
    prompts (prompts[CHECK]) and the held-out ones in turn, one prompt at a time (check_order)."""
    tune, held = prompts.get(CHECK, []), prompts.get("heldout", [])
    at_t, at_h = check_order(len(tune), len(held))
    both: list[Prompt] = [*tune, *held]
    for i, p in [*zip(at_t, tune), *zip(at_h, held)]:
        both[i] = p
    prompts[CHECK_PASS] = both


def per_prompt(requests: list[tuple[int, float]], n: int) -> list[tuple[int, float]] | None:
    """Each of a split's `n` prompts' (output tokens, seconds), summed over the requests that played
    it (request j plays prompt j % n: the prompts repeat up to the level or the rate's requests);
    None when the load generator recorded no requests."""
    if not requests or n < 1:
        return None
    out = [(0, 0.0)] * n
    for j, (tokens, seconds) in enumerate(requests):
        t, s = out[j % n]
        out[j % n] = (t + tokens, s + seconds)
    return out


def part_split(label: str) -> str:
    """The name of a mix part's prompts in study_prompts."""
    return f"part:{label}"


def user_requests(cfg: Config) -> bool:
    """Whether cfg's workload plays the user's own requests (a file, or a mix with a file part)."""
    w = cfg.workload
    return w is not None and (w.source == "file" or any(p.path for p in w.mix))


def request_encoder(cfg: Config, engine: Encoder | None = None) -> Encoder | None:
    """What tokenises the user's requests (their ShareGPT budgets, the context check): the built-in
    engine, else the model's tokenizer when the model is on this machine; None for packaged
    workloads, or when the tokenizer is not here (a launched server then refuses what does not fit,
    and the study counts and skips it)."""
    if not user_requests(cfg):
        return None
    if engine is not None:
        return engine
    if not (cfg.model.local_path or cfg.model.gguf or cfg.model.random_init):
        import sys

        print(f"note: the tokenizer of {cfg.model.name} is not on this machine: ShareGPT budgets are "
              f"workload.max_new_tokens and the server checks the context", file=sys.stderr)
        return None
    from engine.launch.launcher import model_ref
    from engine.models.target import ChatTokenizer, load_tokenizer

    return ChatTokenizer(load_tokenizer(model_ref(cfg.model, cfg.cache_dir)))


def open_engine(cfg: Config) -> Engine:
    """The built-in engine of cfg.model under cfg.engine.builtin, set to cfg.spec (the target is
    loaded once per process)."""
    from engine.decode.loop import Engine

    return Engine.from_config(cfg.model, cfg.engine.builtin, cfg.spec, cache_dir=cfg.cache_dir, seed=cfg.seed)


def auto_weights_timed(cfg: Config) -> tuple[str, str] | None:
    """(format, reason) engine.builtin.weights=auto took for cfg's built-in engine here where a timed
    decode step decides it: what the engine's timing left in the cache when it loaded
    (engine.models.target.auto_choice; never timed here: best.yaml records what the trials ran at);
    None where the config or a rule decides (tuner.schema.config.weights_reason), or where no engine
    timed it on this machine (the reason then says the choice was not recorded here)."""
    from tuner.schema.config import auto_weights_of

    b = cfg.engine.builtin
    if cfg.engine.kind != "builtin" or b.weights != "auto" or len(auto_weights_of(cfg)[0]) == 1:
        return None
    from engine.models.target import auto_choice, resolve_device

    return auto_choice(b, cfg.model, resolve_device(b.device), cfg.cache_dir, cfg.seed, time_here=False)


def open_launcher(cfg: Config, *, log_dir: str | Path | None = None) -> Launcher:
    """A launcher (engine.launch.launcher.Launcher) for cfg.engine (vllm / sglang) serving cfg.model
    with the command the manifests carry (tuner.schema.engine_command.server_settings): on GPUs the
    deployment's tensor parallelism, context length and FP8 flags, so trials measure the server
    that will be deployed."""
    from engine.launch.launcher import Launcher, model_ref
    from tuner.schema.engine_command import server_settings

    kind = cfg.engine.kind
    if kind not in LAUNCHED:
        raise UserError(f"engine.kind={kind}: not a launched engine (allowed: {', '.join(LAUNCHED)})")
    return Launcher(kind, getattr(cfg.engine, kind), model_ref(cfg.model, cfg.cache_dir),
                    settings=server_settings(cfg, kind), accelerator=cfg.hardware.accelerator, log_dir=log_dir)


def engine_target_for(engine: Engine, chat_template: bool) -> TargetFor:
    """target_for(spec): the built-in engine switched to `spec` (only when it changes), as a
    load-generator target."""
    from engine.measure.runner import InProcessTarget

    target = InProcessTarget(engine, chat_template=chat_template)
    current: list[SpecConfig | None] = [None]

    def target_for(spec: SpecConfig) -> LoadTarget:
        if current[0] != spec:
            current[0] = None  # a failing set_spec must not leave a stale 'current'
            engine.set_spec(spec)
            current[0] = spec
        return target

    return target_for


def server_target_for(launcher: Launcher, chat_template: bool) -> TargetFor:
    """target_for(spec): the launched server serving `spec` (restarted when its flags change, the
    start-up outside the trial's clock), as a load-generator target over HTTP."""
    from engine.measure.runner import HttpTarget

    def target_for(spec: SpecConfig) -> LoadTarget:
        with startup_excluded():  # bounded by engine.<kind>.startup_timeout_s, not the trial's limit
            url = launcher.ensure(spec)
        return HttpTarget(url, launcher.model, chat_template)

    return target_for


class Measurer:
    """A study's MeasureFn, `measurer(spec, split, concurrency) -> Sample`: plays `prompts[split]`
    against `target_for(spec)` with the workload's sampling, `concurrency` requests in flight (the
    prompts repeat until there are at least that many). A configuration that breaks requests raises
    (its trial fails). It is a tuner.study.objective.ServerMeasureFn: `serving(spec)` (is a launched
    server up with that spec now? never in process) and `startups()` (cumulative start-ups and their
    seconds), which the objective uses to measure the served spec first and to keep start-ups out of
    measurements. A spec that remembers
    earlier requests (suffix) starts every pass from one cache state: on the built-in engine the
    one the study found (held-out: after the tuning prompts), on a launched server an empty one."""

    def __init__(self, target_for: TargetFor, cfg: Config, prompts: dict[Split, list[Prompt]],
                 launcher: Launcher | None = None, engine: Engine | None = None) -> None:
        from engine.measure.workloads import sampling_params

        self.target_for, self.prompts, self.cfg = target_for, prompts, cfg
        self.params = sampling_params(cfg.workload, seed=cfg.seed)
        self.launcher = launcher
        self._draft_mb: dict[tuple[str, str], float | None] = {}  # (spec, split) -> MB, measured once
        self.engine = engine  # the built-in engine, whose suffix caches every run starts from the same state
        self._suffix: dict[Split, dict[int, tuple[tuple[int, ...], ...]]] = {}  # split -> the suffix-cache state its runs start from
        self.skipped: set[str] = set()  # ids of the user's requests the engine refused (counted, reported)
        # (the target features a drafter reads, split): whose prompts' prefill the prefix cache holds
        self._warm: set[tuple[str, Split]] = set()

    def serving(self, spec: SpecConfig) -> bool:
        """Whether the launched server up now serves `spec` (always False in process)."""
        return self.launcher is not None and self.launcher.serves(spec)

    @property
    def engine_version(self) -> str | None:
        """The release of the launched engine that served the trials (None: built-in, or not read)."""
        return self.launcher.version if self.launcher is not None else None

    def startups(self) -> tuple[int, float]:
        """Server start-ups so far and their seconds (none in process)."""
        if self.launcher is None:
            return 0, 0.0
        return self.launcher.starts, self.launcher.total_startup_s

    def __call__(self, spec: SpecConfig, split: Split, level: Level) -> Sample:
        """Measure `spec` on `prompts[split]` at one level: `level` requests in flight (an int), or
        requests arriving at a Rate (workload.rate_requests of them, the prompts repeating; the
        same seeded arrivals for every configuration, so a pair meets the same traffic)."""
        from engine.drafters.memory import target_draft_memory
        from engine.measure.runner import arrival_times

        if self.launcher is not None and spec.remembers_requests:
            self._fresh_server(spec)
        target = self.target_for(spec)
        prompts = self.prompts[split]
        self._warm_prefix(target, spec, split)
        if self.engine is not None and spec.remembers_requests:
            self._start_suffix_run(split)
        w = self.cfg.workload
        if isinstance(level, Rate):
            n = max(len(prompts), w.rate_requests) if split != "probe" else len(prompts)
            played = [prompts[i % len(prompts)] for i in range(n)] if prompts else prompts
            at = arrival_times(len(played), level.rps, w.arrival, w.seed, [p.arrival_s for p in played])
            m = target.run(played, self.params, 1, arrivals_s=at, rate=level.rps)
        else:
            played = [prompts[i % len(prompts)] for i in range(max(len(prompts), level))] if prompts else prompts
            m = target.run(played, self.params, level)
        if m.errors and not self._skip_refused(m.errors, m.n_requests):  # a configuration that breaks requests is no candidate
            raise RuntimeError(f"{len(m.errors)}/{len(played)} requests failed; first: {m.errors[0]}")
        if self.engine is not None and spec.remembers_requests and split == "tune" and "heldout" not in self._suffix:
            from engine.drafters.suffix import snapshot_caches

            # held-out prompts meet a cache that saw the tuning prompts only, as a server would have
            # seen other users' requests
            self._suffix["heldout"] = snapshot_caches(self.engine.target)
        key = (spec.model_dump_json(), split)
        if key not in self._draft_mb:
            w = self.cfg.workload
            mem = target_draft_memory(target, prompts, w.max_new_tokens, w.chat_template)
            self._draft_mb[key] = None if mem is None else mem["total_mb"]
        slo = self.cfg.workload.slo
        forwards = per_prompt([(f, 0.0) for f in m.request_forwards], len(prompts)) if m.request_forwards else None
        return Sample(m.output_tokens_per_s, m.tau, m.ttft_p99_ms, m.tpot_p99_ms, self._draft_mb[key],
                      itl_p50_ms=m.itl_p50_ms, itl_p99_ms=m.itl_p99_ms,
                      goodput=m.goodput(slo.ttft_p99_ms, slo.tpot_p99_ms), wall_s=m.wall_s,
                      ttft_p50_ms=m.ttft_p50_ms, tpot_p50_ms=m.tpot_p50_ms, queue_p50_ms=m.queue_p50_ms,
                      queue_p99_ms=m.queue_p99_ms, waiting_mean=m.waiting_mean, batch_sizes=m.batch_sizes or None,
                      per_prompt=per_prompt(m.requests, len(prompts)),
                      per_prompt_forwards=[f for f, _ in forwards] if forwards else None)

    def _warm_prefix(self, target: LoadTarget, spec: SpecConfig, split: Split) -> None:
        """Before the first timed pass on `split`, an untimed pass of one new token per prompt under
        `spec` (target_for has set it), so that the built-in engine's prefix cache holds every
        prompt's prefill before any pass is timed; once per split and per set of target features
        the drafter reads (an EAGLE-3 head's cache entries carry them, so its first pass warms its
        own), so trials after the first warm nothing.

        Without it the first pass over a set of prompts runs their whole prefill and every later
        pass copies it (docs/results.md, benchmarks/heldout_sides.py). Whichever side of a pair came first
        paid for it, so the held-out check's first round read the held-out side's speedup high and
        the tuning side's low (the pair orders alternate between the sides). A launched server
        starts empty for every spec, so both sides of a pair pay there alike: only the built-in
        engine is warmed."""
        from engine.measure.workloads import params_of  # the engine's modules load with the engine

        if self.engine is None or self.engine.prefix_cache is None:
            return
        drafter = self.engine.drafter
        key = (repr(drafter.aux_layers if drafter is not None else None), split)
        if key in self._warm:
            return
        self._warm.add(key)
        if spec.remembers_requests:  # the cache state every suffix run starts from is taken before any pass
            self._start_suffix_run(split)
        once = [replace(p, params=replace(params_of(p, self.params), max_new_tokens=1, min_tokens=0))
                for p in dict.fromkeys(self.prompts[split])]
        target.run(once, self.params, 1)

    def _skip_refused(self, errors: list[str], finished: int) -> bool:
        """With the user's own requests, one the engine refuses as such (HTTP 400: too long for the
        context, a field it cannot honour) is a bad record, not a bad configuration: counted, said
        once, and skipped. True when every error is such a refusal and some requests finished."""
        refused = [e.split(": ", 1)[0] for e in errors if ": HTTP 400" in e]
        if not user_requests(self.cfg) or len(refused) < len(errors) or finished == 0:
            return False
        new = set(refused) - self.skipped
        if new:
            import sys

            self.skipped |= new
            print(f"note: the engine refused {len(new)} request(s) of the workload ({', '.join(sorted(new))}); "
                  f"skipped, {len(self.skipped)} so far", file=sys.stderr)
        return True

    def _fresh_server(self, spec: SpecConfig) -> None:
        """A launched server's suffix cache can only be emptied by a new process: a running server
        with these flags was started for an earlier pass of them (only passes start servers here),
        so it is stopped and target_for starts a fresh one. Every pass of a trial's repeats and
        levels, and the held-out pass, thus meets an empty cache; the start-up is outside the
        trial's clock and counted in its server_starts like any other."""
        if self.launcher.serves(spec):
            with startup_excluded():  # stopping vLLM takes seconds: not the trial's measuring time
                self.launcher.stop()

    def _start_suffix_run(self, split: Split) -> None:
        """Every suffix run starts from one cache state (the one the study found), so no trial wins
        by a cache that earlier trials warmed."""
        from engine.drafters.suffix import restore_caches, snapshot_caches

        if "tune" not in self._suffix:
            self._suffix["tune"] = snapshot_caches(self.engine.target)
        restore_caches(self.engine.target, self._suffix.get(split, self._suffix["tune"]))


def queue_note(cfg: Config) -> str | None:
    """The line a study on the built-in engine prints when a concurrency level exceeds
    engine.builtin.max_batch (allowed: the requests beyond it wait for a slot)."""
    mb = cfg.engine.builtin.max_batch
    over = [c for c in (cfg.workload.concurrency if cfg.workload else []) if c > mb]
    if cfg.engine.kind != "builtin" or not over:
        return None
    return (f"note: workload.concurrency level(s) {over} exceed engine.builtin.max_batch={mb}: requests beyond "
            f"{mb} queue until a slot frees (raise engine.builtin.max_batch to decode them together)")


def make_measure(engine: Engine, cfg: Config, prompts: dict[Split, list[Prompt]]) -> Measurer:
    """The Measurer over the built-in engine in this process."""
    note = queue_note(cfg)
    if note:
        import sys

        print(note, file=sys.stderr)
    return Measurer(engine_target_for(engine, cfg.workload.chat_template), cfg, prompts, engine=engine)


def make_launched_measure(launcher: Launcher, cfg: Config, prompts: dict[Split, list[Prompt]]) -> Measurer:
    """The Measurer over a launched vLLM / SGLang server (engine.launch.launcher.Launcher)."""
    return Measurer(server_target_for(launcher, cfg.workload.chat_template), cfg, prompts, launcher)


@contextmanager
def study_measure(cfg: Config, engine: Engine | None, prompts: dict[Split, list[Prompt]],
                  run_dir: Path) -> Iterator[Measurer]:
    """The MeasureFn of a study on cfg.engine: a launched server for engine=vllm/sglang (stopped
    on leaving; its logs in RUN_DIR/servers), else the given built-in engine."""
    if cfg.engine.kind in LAUNCHED:
        with open_launcher(cfg, log_dir=run_dir / "servers") as launcher:
            yield make_launched_measure(launcher, cfg, prompts)
        return
    if engine is None:
        raise ValueError("engine.kind=builtin: the study's built-in engine must be loaded first (open_engine)")
    # adaptive trials time the engine's step-cost curve at every batch size up to engine.builtin.max_batch,
    # most of it at sizes a study of a few requests in flight never reads: capped for the study's duration
    old, engine.batch_cap = engine.batch_cap, closed_loop_batch(cfg)
    try:
        yield make_measure(engine, cfg, prompts)
    finally:
        engine.batch_cap = old


def closed_loop_batch(cfg: Config) -> int | None:
    """The most requests a study of cfg decodes together on the built-in engine where that is known
    before it runs: the largest concurrency level when every level is closed-loop and no capacity is
    searched (request rates queue up to engine.builtin.max_batch); None otherwise."""
    levels = cfg.workload.levels
    if cfg.search.capacity or not levels or any(isinstance(x, Rate) for x in levels):
        return None
    return max(x for x in levels if isinstance(x, int))


def train_job(cfg: Config) -> TrainJob:
    """What training cfg's drafts reads (engine.heads.pipeline.TrainJob): the target, the built-in
    engine settings, the workload (one must be given), the training settings."""
    from engine.heads.pipeline import TrainJob

    if cfg.workload is None:
        raise UserError("train-draft needs a workload: add +workload=NAME")
    return TrainJob(model=cfg.model, builtin=cfg.engine.builtin, workload=cfg.workload, train=cfg.train,
                    cache_dir=cfg.cache_dir, seed=cfg.seed)


def needs_head(cfg: Config) -> bool:
    """Whether the searched methods need a trained draft head."""
    return any(m in head_methods() for m in cfg.search.methods)


def spec_with_trained_draft(cfg: Config) -> SpecConfig:
    """cfg.spec with the trained draft it drafts with: its own spec.head_path, else the head (or
    Medusa heads) `tuner train-draft` cached for this target and workload. Without either it is a
    user error naming both ways: a command never drafts with an untrained (random) head."""
    spec = cfg.spec
    if spec.method not in head_methods() or spec.head_path:
        return spec
    fix = (f"run `tuner train-draft spec.method={spec.method} +workload=NAME` first, or give spec.head_path=DIR "
           "(a trained head)")
    if cfg.workload is None:
        raise UserError(f"spec.method={spec.method} without spec.head_path: add +workload=NAME to use the head "
                        f"trained for that workload; {fix}")
    from engine.heads.pipeline import cached_head

    found = cached_head(train_job(cfg), spec.method)
    if found is None:
        raise UserError(f"spec.method={spec.method}: no trained head for {cfg.model.name} on workload "
                        f"{cfg.workload.name}; {fix}")
    return spec.model_copy(update={"head_path": str(found)})


def existing_draft(cfg: Config, method: str) -> str | None:
    """Where head `method`'s draft comes from without training, or None (it must be trained), in
    order: `spec.head_path` when spec.method is that method, the model's published head on an
    external engine (`model.draft_sources`), the cached head of this target and workload."""
    from engine.heads.pipeline import cached_head

    published = getattr(cfg.model.draft_sources, method, [])
    if cfg.spec.head_path and cfg.spec.method == method:
        return cfg.spec.head_path
    if cfg.engine.kind in LAUNCHED and published:
        return published[0]
    if cfg.workload is not None and (cached := cached_head(train_job(cfg), method)) is not None:
        return str(cached)
    return None


def get_drafts(cfg: Config, engine: Engine | None, quiet: bool = False,
               phases: dict[str, float] | None = None, bounds: list[HeadBound] | None = None) -> dict[str, str]:
    """The trained drafts the searched methods need, by method: n-gram needs none. For each head
    method, in order: `spec.head_path` when spec.method is that method, the model's published head
    on an external engine (`model.draft_sources`), else the cached head of this target and workload
    or a newly trained one (engine.heads.drafts: the trainer of each method). A draft trained now
    adds its wall seconds to `phases`: "<method> answers" (its data) and "<method> training".

    With the built-in `engine` and `bounds` (a list to fill), a head that would be trained now is
    first bounded (tuner.study.headbound); one that cannot beat speculation off here is not trained
    and is absent from the result: the caller leaves it out of the search (`without_methods`)."""
    from rich.console import Console

    from engine.heads.drafts import ensure_draft
    from engine.heads.pipeline import read_meta
    from tuner.study.headbound import describe, head_bound, probed_methods
    from tuner.study.progress import head_progress

    console = Console(stderr=True, quiet=quiet)
    out: dict[str, str] = {}
    probed = probed_methods(cfg) if engine is not None and bounds is not None else []
    for m in (m for m in cfg.search.methods if m in head_methods()):
        if (found := existing_draft(cfg, m)) is not None:
            out[m] = found
            continue
        if m in probed and bounds is not None:
            t0 = time.monotonic()
            with head_progress(quiet) as report:
                b = head_bound(cfg, engine, m, train_job(cfg), report,
                               lambda line: console.print(line, highlight=False, markup=False))
            bounds.append(b)
            if phases is not None:
                spent = round(time.monotonic() - t0, 1)
                pilot = b.pilot.seconds if b.pilot is not None and b.pilot.seconds <= spent else 0.0  # 0: read back
                phases[f"{m} bound"] = round(spent - pilot, 1)
                if pilot:
                    phases[f"{m} pilot"] = pilot
            console.print(describe(b), highlight=False, markup=False)
            if not b.trained:
                continue
        console.print(f"training the {m} draft for {cfg.model.name} on workload {cfg.workload.name} "
                      "(once: cached for later studies)", highlight=False)
        # The other packaged workloads add diversity and, above all, their held-out prompts are excluded.
        with head_progress(quiet) as report:
            out[m] = str(ensure_draft(train_job(cfg), m, engine, workloads=packaged_workloads(cfg),
                                      report=report))
        if phases is not None:
            meta = read_meta(out[m])
            phases[f"{m} answers"] = meta["data_seconds"]
            phases[f"{m} training"] = round(meta["total_seconds"] - meta["data_seconds"], 1)
    return out


def without_methods(cfg: Config, bounds: list[HeadBound]) -> Config:
    """cfg searching without the head methods whose bound left them out (a copy; cfg itself when none)."""
    out = {b.method for b in bounds if not b.trained}
    if not out:
        return cfg
    cfg = cfg.model_copy(deep=True)
    cfg.search.methods = [m for m in cfg.search.methods if m not in out]
    return cfg
