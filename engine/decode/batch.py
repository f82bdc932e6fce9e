"""The one decode driver of the built-in engine, with continuous batching: a single request
(`Engine.generate`) is a batch of one. Every step runs ONE target forward over all active
requests, each with its own draft tree, cache, positions and ancestor mask (engine.models.batchplan
`LeanForward.step_batch`: rows concatenated; the caches are slots of one `KVPool`, so the decode
rows of all requests attend in one call; the hf forward, engine.models.hf_forward, runs them one
after the other). Requests whose drafters share an EAGLE head draft in
lockstep before it, one head forward per draft step for all of them (engine.drafters.lockstep);
other drafters draft request by request.

Requests join between steps and free their slot the moment they finish. A new request's prompt
runs in the step after it joins, beside the other requests' decode rows ("mixed") or in a forward
of its own before them ("separate"): `engine.builtin.prefill`. At most `max_batch` requests are
active (vLLM's `max_num_seqs`) and their KV caches together hold at most `kv_tokens` positions;
a request that does not fit waits, it is never truncated.

The speculative configuration follows the number of active requests: `schedule` is a list of bands
(lo, hi, SpecConfig), like vLLM's `num_speculative_tokens_per_batch_size` but with a whole spec
per band (method, depth, top-k, budget, or off). Each request keeps one drafter per band, fed every
committed feature from its prompt on, so a band change never loses drafter state.

A band whose spec is adaptive (`spec.adaptive`) sizes each request's draft every step within the
spec's depth and budget (engine.decode.control): before drafting from the requests' acceptance
estimates (engine.decode.acceptance) and the step-cost curve (engine.decode.stepcost), drafters
drafting at most that many nodes or not at all; after drafting from the drafts' real sizes, each
draft cut to the nodes that pay. Every PROBE_EVERY steps the stalest requests may draft one node
more each (`control.probe`), verified whatever the cut, as many as the probes' budget pays for
what they are expected to lose (`control.ProbeBudget`); between probe steps a batch whose best first node is below the
last full choice's pay floor, or whose last full choice drafted nothing, drafts nothing without
pricing (`control.pay_floor`); in the second case the step is exactly off's (`_screened`: no
estimate read, the forward called as off calls it). Every verify
step then updates the estimates. What
the controller learns (`Control`) outlives a scheduler: a server runs one scheduler for its life,
and the engine hands the same `Control` to every scheduler of the same schedule (`Engine.batcher`),
so a study's passes measure a controller as warm as a server's.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.api import GenResult, SamplingParams, TokenCallback
from engine.decode.acceptance import BATCH_RATE, Acceptance, Calibration
from engine.decode.control import (DOUBT, MARGIN, PROBE_EVERY, SLACK, ProbeBudget, backoff, choose, pay_floor, probe,
                                   probe_loss, rows_price)
from engine.decode.stepcost import StepCost
from engine.drafters import Drafter, make_drafter
from engine.drafters.lockstep import draft_together, lockstep_groups
from engine.trees.tree import Tree
from tuner.schema.config import SpecConfig, UserError

Band = tuple[int, int, SpecConfig]


# Greedy decode steps of a lone request with nothing drafted that one native call runs (`_greedy_run`):
# the interpreter after each step of its own starts cold (docs/results.md, issue 40); a request
# arriving meanwhile waits for the run, and the tokens stream in groups of up to this many
GREEDY_RUN = 8


def spec_for(schedule: Sequence[Band], active: int) -> SpecConfig:
    """The band's spec for `active` requests (bands are inclusive, contiguous from 1)."""
    for lo, hi, spec in schedule:
        if lo <= active <= hi:
            return spec
    return schedule[-1][2]


def schedule_of(spec: SpecConfig, max_batch: int) -> list[Band]:
    """The bands a SpecConfig asks for: one band of itself, or its `k_per_batch_size` (vLLM's shape:
    K drafted tokens per band, 0 off; a tree keeps its top-k and its budget capped by the depth).
    The last band reaches max_batch."""
    if not spec.k_per_batch_size or spec.method == "off":
        return [(1, max_batch, spec)]
    bands: list[Band] = []
    for lo, hi, k in spec.k_per_batch_size:
        if k == 0:
            s = SpecConfig(method="off")
        else:
            budget = k + 1 if spec.topk == 1 else min(spec.budget, 1 + k * spec.topk)
            s = spec.model_copy(update={"depth": k, "budget": budget, "k_per_batch_size": None})
        bands.append((lo, hi, s))
    lo, hi, s = bands[-1]
    bands[-1] = (lo, max(hi, max_batch), s)
    return bands


def bounded(spec: SpecConfig, nodes: int) -> SpecConfig:
    """`spec` drafting at most `nodes` nodes (besides the root): a chain of that depth, a tree of
    that budget within the spec's depth."""
    if spec.topk == 1:
        return spec.model_copy(update={"depth": nodes, "budget": nodes + 1})
    return spec.model_copy(update={"depth": min(spec.depth, nodes), "budget": nodes + 1})


def check_schedule(schedule: Sequence[Band], max_batch: int) -> None:
    """Bands must cover 1..max_batch without gaps or overlaps; one line naming the problem."""
    want = 1
    for lo, hi, _ in schedule:
        if lo != want or hi < lo:
            raise UserError(f"speculation schedule {[(a, b, s.key()) for a, b, s in schedule]}: bands must be "
                            f"contiguous from 1 without overlaps (band starting at {lo} expected at {want})")
        want = hi + 1
    if want <= max_batch:
        raise UserError(f"speculation schedule covers batch sizes 1..{want - 1}; engine.builtin.max_batch={max_batch} "
                        "needs every size up to it covered")


def _interpolated(table: Sequence[float]) -> Callable[[float], float]:
    """A price table's seconds at a total of rows, linear between whole totals (the expected rows of
    drafters that do not always fill their nodes)."""
    if len(table) == 1:
        return lambda n: table[0]
    last = len(table) - 2

    def step_s(n: float) -> float:  # called a few hundred times a step: no builtins
        i = int(n)
        if i > last:
            i = last
        lo = table[i]
        return lo + (table[i + 1] - lo) * (n - i)
    return step_s


@dataclass
class Control:
    """What adaptive control learns while it runs: the step cost with its live figures
    (engine.decode.stepcost), per adaptive spec the batch's acceptance estimate (each new
    request's starting point) and its drafters' confidence bands (engine.decode.acceptance), and
    what the probes may still spend (engine.decode.control)."""

    cost: StepCost | None
    accept: dict[str, Acceptance]
    calib: dict[str, Calibration]
    probes: ProbeBudget = field(default_factory=ProbeBudget)
    # per adaptive spec, the steps so far in which nobody drafted: counted once for the batch, each
    # request's estimate catching up with the count when it is next read (Acceptance.catch_up)
    quiet: dict[str, int] = field(default_factory=dict)

    @classmethod
    def fresh(cls, engine: Any, schedule: Sequence[Band], max_batch: int, room: int) -> "Control":
        """Nothing learnt yet: the step-cost curve as timed (once per machine and forward), the prior."""
        adaptive = [s for _, _, s in schedule if s.adaptive and s.method != "off"]
        return cls(engine.step_costs(max_batch, room) if adaptive else None,
                   {s.key(): Acceptance(s.budget - 1, rate=BATCH_RATE) for s in adaptive},
                   {s.key(): Calibration() for s in adaptive}, quiet={s.key(): 0 for s in adaptive})


@dataclass
class Request:
    """A submitted generation and, once admitted, its decoding state."""

    prompt_ids: list[int]
    params: SamplingParams
    on_tokens: TokenCallback | None = None
    on_done: Callable[["Request"], None] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    result: GenResult | None = None
    error: str | None = None
    exception: Exception | None = None  # what set `error`, when an exception did (Engine.generate raises it)
    cancelled: bool = False
    state: Any = None  # its engine.decode.loop.Decoding once admitted
    drafters: dict[str, Drafter | None] = field(default_factory=dict)
    need: int = 0  # cache positions this request holds
    cache: Any = None  # its place in the pool while admitted (a KVCache, or an HFCache)
    accept: dict[str, Acceptance] = field(default_factory=dict)  # per adaptive spec: its acceptance estimate

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def fail(self, exc: Exception) -> None:
        """The request ends with `exc` (the batch goes on)."""
        self.error, self.exception = f"{type(exc).__name__}: {exc}", exc


class BatchEngine:
    """The scheduler over one engine (engine.decode.loop.Engine): `submit` from any thread, `step`
    from one thread to decode. `drafter`: one drafter every request uses instead of drafters of its
    own (a batch of one place: `Engine.generate` with the engine's drafter). `control`: what an
    earlier scheduler of the same schedule and max_batch learnt (None: a fresh one)."""

    def __init__(self, engine: Any, max_batch: int = 8, schedule: Sequence[Band] | None = None,
                 prefill: str = "mixed", kv_tokens: int | None = None, drafter: Drafter | None = None,
                 control: Control | None = None) -> None:
        if engine.lean is None and max_batch > 1:
            raise UserError("batching needs engine.builtin.forward=lean (the hf forward decodes one request at a time)")
        if drafter is not None and max_batch > 1:
            raise ValueError("one drafter object serves a batch of one place only")
        if max_batch < 1:
            raise UserError(f"engine.builtin.max_batch={max_batch}: must be >= 1")
        if prefill not in ("mixed", "separate"):
            raise UserError(f"engine.builtin.prefill={prefill}: allowed mixed, separate")
        self.engine = engine
        self.max_batch = max_batch
        self.given = drafter
        self.schedule: list[Band] = list(schedule) if schedule else [(1, max(max_batch, 1), engine.spec)]
        check_schedule(self.schedule, max_batch)
        self._bounds: dict[tuple[int, int], SpecConfig] = {}  # (id of a schedule's spec, nodes) -> its bounded copy
        self._keys = {id(s): s.key() for _, _, s in self.schedule}  # key() per request and step adds up
        self.prefill = prefill
        self.kv_tokens = kv_tokens
        self.room = max(engine.cache_room(s) for _, _, s in self.schedule)
        # adaptive bands: the step-cost curve (timed once per machine and forward), the batch's
        # acceptance estimate per spec (each request's starting point) and its confidence bands
        self.control = control if control is not None else Control.fresh(engine, self.schedule, max_batch, self.room)
        # the step overhead the step cost learns (adaptive only): the last step's start, its decode
        # batch, its seconds in forwards and drafting, and whether the controller priced it in full
        # and it ran draft rows (None: not priced), while the next step follows at once
        self._last: tuple[float, int, float, bool | None] | None = None
        self._busy, self._decoded = 0.0, 0
        self._priced = False  # the step's controller priced its rows in full (not screened out)
        self._drafted = False  # the step's decode forward ran draft rows
        # the step's own seconds verifying and committing its decode rows, learning from them and
        # cutting its drafts (StepCost.observe_work: what drafting at all adds, timed in this thread)
        self._work = 0.0
        # What the controller prices as its own cost (the pricing, the drafter's seconds per node,
        # the work above) is this thread's CPU time on a CPU engine (`_own`), not the wall clock: served,
        # the HTTP thread wakes to stream each step's tokens and takes the GIL while this thread
        # runs Python, so on the wall clock the drafting of a large batch was charged the streaming,
        # which runs whether anything is drafted or not (docs/results.md, issue 36, session 37)
        # one slot per batch place, its capacity grown to the longest request admitted so far; made
        # at the first admission, inside inference mode like every other cache the compiled step sees
        # (a tensor made outside it has other dispatch keys, and the compiled layer would recompile)
        self.pool: Any = None  # the forward's pool: a KVPool (lean), an HFPool (hf)
        self.aux_layers = self._aux_layers()
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self._lock = threading.Lock()  # submit runs on other threads than step
        self.steps = 0
        # steps by the sequences their forwards ran (0..max_batch): how full the batch was kept
        # (engine.serving.metrics exposes it; benchmarks/adaptive.py reads it per pass)
        self.occupancy = [0] * (max_batch + 1)
        self._ran = 0  # sequences the step's forwards ran so far
        # adaptive bands: called with one record per step the controller sized (what it weighed and
        # chose, and the forward's seconds), for benchmarks/adaptive_engine.py --trace
        self.trace: Callable[[dict[str, Any]], None] | None = engine.trace
        self._record: dict[str, Any] | None = None
        # per batch size, the last full choice's pay floor, step seconds and whether it drafted
        # nothing (engine.decode.control.pay_floor)
        self._floors: dict[int, tuple[float, float, bool]] = {}
        # per batch size, the steps between its probe steps (engine.decode.control.backoff), the step
        # the next is due at, and whether the last probe's accepted nodes paid for its rows;
        # the probe in flight (its requests and their nodes, the accepted nodes that pay for them,
        # the batch size)
        self._every: dict[int, int] = {}
        self._due: dict[int, int] = {}
        self._found: dict[int, bool] = {}
        self._probe: tuple[list[tuple[Request, int]], float, int] | None = None

    # ---- submission (any thread) --------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_tokens: TokenCallback | None = None,
               on_done: Callable[[Request], None] | None = None) -> Request:
        """Queue a request; it joins the batch at the next step with room. Bad input fails here."""
        if not prompt_ids:
            raise UserError("prompt is empty: at least one token is needed")
        if len(prompt_ids) >= self.engine.max_context:
            raise UserError(f"prompt has {len(prompt_ids)} tokens; model.max_context={self.engine.max_context}")
        req = Request(list(prompt_ids), params, on_tokens, on_done)
        req.need = min(len(prompt_ids) + params.max_new_tokens, self.engine.max_context) + self.room
        if self.kv_tokens is not None and req.need > self.kv_tokens:
            raise UserError(f"request needs {req.need} KV positions; engine.builtin.kv_tokens={self.kv_tokens}")
        with self._lock:
            self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request: it leaves the batch (its slot freed) before the next step."""
        req.cancelled = True

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    # ---- the loop (the caller's thread: a server's engine thread, or closed_loop) ----------------

    @torch.inference_mode()
    def step(self) -> None:
        """Admit what fits, run one forward over every active request, verify, commit, retire."""
        start = time.perf_counter()
        if self._last is not None and self.cost is not None:
            was, batch, busy, drafted = self._last
            self.cost.observe_overhead(batch, start - was - busy, drafted)
        self._last, self._busy, self._decoded, self._ran = None, 0.0, 0, 0
        self._priced = self._drafted = False
        self._work = 0.0
        self._probe = None  # (one whose step failed before its verification found nothing)
        self._retire_cancelled()
        fresh = self._admit()
        if self.prefill == "separate" and fresh:
            self._forward(fresh, spec=None)
            fresh_ids = {id(r) for r in fresh}
            rest = [r for r in self.active if id(r) not in fresh_ids and not r.finished]
            if rest:
                self._forward(rest, spec_for(self.schedule, len(self.active)))
        elif self.active:
            self._forward(list(self.active), spec_for(self.schedule, len(self.active)))
        self.steps += 1
        if self._ran:
            self.occupancy[self._ran] += 1
        self._retire_finished()
        if self._decoded and self._priced:
            self.cost.observe_work(self._decoded, self._work, self._drafted)
        if self._decoded and self.active:  # a step follows at once (a loop waits only when idle)
            self._last = (start, self._decoded, self._busy, self._drafted if self._priced else None)

    def _admit(self) -> list[Request]:
        fresh = []
        with self._lock:
            used = sum(r.need for r in self.active)
            while self.waiting and len(self.active) < self.max_batch:
                req = self.waiting[0]
                if req.cancelled:
                    self.waiting.popleft()
                    continue
                if self.kv_tokens is not None and used + req.need > self.kv_tokens:
                    break  # waits for memory; never truncated
                self.waiting.popleft()
                used += req.need
                self.active.append(req)
                fresh.append(req)
        if fresh and self.pool is None:
            self.pool = self.engine.forward.pool(self.max_batch, max(r.need for r in fresh))
        for req in fresh:
            try:
                req.cache = self.pool.acquire(req.need)
                req.state = self.engine.start(req.prompt_ids, req.params, req.on_tokens, self.given, req.cache)
                if self.given is not None:
                    req.drafters = {spec.key(): self.given for _, _, spec in self.schedule if spec.method != "off"}
                self._reuse_prefix(req)
                for _, _, spec in self.schedule:  # every band's drafter sees the request from its prompt on
                    self._drafter(req, spec)
            except Exception as exc:  # noqa: BLE001 - the request fails, the batch goes on
                req.fail(exc)
        return [r for r in fresh if r.error is None]

    def _reuse_prefix(self, req: Request) -> None:
        """Copy the longest cached prefix of the request's prompt into its slot (engine.decode.prefix)."""
        pc = self.engine.prefix_cache
        if pc is None:
            return
        n, entry = pc.lookup(req.prompt_ids, self.aux_layers)
        if entry is not None:
            pc.restore(entry, n, req.cache)
            req.state.reuse_prefix(n, entry.hidden[:n], None if entry.aux is None else entry.aux[:n])

    def _drafter(self, req: Request, spec: SpecConfig) -> Drafter | None:
        """This request's drafter for `spec` (made at admission, fed every committed feature)."""
        if spec.method == "off":
            return None
        key = self._key(spec)
        if key not in req.drafters:
            d = make_drafter(spec, self.engine.target, self.engine.seed)
            if d is not None:
                req.state.add_observer(d)
            req.drafters[key] = d
        return req.drafters[key]

    def _aux_layers(self) -> tuple[int, ...] | None:
        """The target layers whose inputs the schedule's drafters read (EAGLE-3); one set at most."""
        sets = set()
        for _, _, spec in self.schedule:
            if spec.method != "off":
                d = self.given or make_drafter(spec, self.engine.target, self.engine.seed)
                if d is not None and d.aux_layers:
                    sets.add(tuple(d.aux_layers))
        if len(sets) > 1:
            raise UserError(f"speculation schedule: its drafters read different target layers {sorted(sets)}; "
                            "use one EAGLE-3 head across the bands")
        return next(iter(sets), None)

    def _forward(self, reqs: list[Request], spec: SpecConfig | None) -> None:
        """One target forward over `reqs`: each plans (its prompt, or a draft under `spec`; drafters
        that share a head forward draft in lockstep first)."""
        for req in reqs:
            try:
                if req.state.prefilled and spec is not None:
                    req.state.drafter = self._drafter(req, spec)
            except Exception as exc:  # noqa: BLE001 - a drafter that cannot be made fails its request only
                req.fail(exc)
        live = [r for r in reqs if r.error is None]
        # under an adaptive spec only the controller drafts: a request it leaves without a draft
        # (and every request of a step screened out) plans off's row, its drafter not called
        adaptive = spec is not None and spec.adaptive and spec.method != "off"
        screened = adaptive and self._screened(live, spec)
        if screened:
            drafted = {}
        elif adaptive:
            drafted = self._draft_adaptively(live, spec)
        else:
            drafted = self._draft_in_lockstep(live)
        plans = []
        for req in reqs:
            if req.error is not None:
                continue
            st = req.state
            try:
                tree, dt = drafted.get(id(req), (None, 0.0))
                if isinstance(tree, Exception):
                    raise tree
                tree, tokens, last_only = st.plan(tree, dt, draft=not adaptive)
            except Exception as exc:  # noqa: BLE001 - a drafter crash fails its request only
                req.fail(exc)
                continue
            if tokens is None:
                req.result = st.result()
                continue
            plans.append((req, tree, tokens, last_only))
        if not plans:
            return
        self._ran += len(plans)
        if self._greedy_run(plans):
            return
        dev = self.engine.device
        branching = [t is not None and not t.is_chain for _, t, _, _ in plans]
        t = time.perf_counter()
        try:
            outs = self.engine.forward.step_batch(
                [r.state.cache for r, _, _, _ in plans], [toks for _, _, toks, _ in plans],
                [t.depths if b else None for (_, t, _, _), b in zip(plans, branching)],
                [t.ancestors(dev) if b else None for (_, t, _, _), b in zip(plans, branching)],
                [last for _, _, _, last in plans], self.aux_layers)
        except Exception as exc:  # noqa: BLE001 - the step's requests fail; the scheduler (and a server) goes on
            for req, _, _, _ in plans:
                req.fail(exc)
            return
        forward_s = time.perf_counter() - t
        self._busy += forward_s
        # decode rows only. A screened step is off's forward, timed as every other: what a step
        # without rows costs now, and with each one the older steps' rows weigh less. Left out, a
        # batch size that stopped drafting learnt from its few probe steps alone, and a slope set by
        # a few slow drafting steps (served at 8, the first) priced its rows out for a dozen passes
        if self.cost is not None and all(tree is not None for _, tree, _, _ in plans):
            rows = sum(len(toks) - 1 for _, _, toks, _ in plans)
            self.cost.observe_step(len(plans), rows, forward_s)
            if not screened:  # (a screened step's overhead is not a priced step's)
                self._decoded, self._drafted = len(plans), rows > 0
        rec, self._record = self._record, None
        if rec is not None:
            rec.update(forward_s=forward_s, rows=sum(len(toks) - 1 for _, _, toks, _ in plans),
                       prefill=any(tree is None for _, tree, _, _ in plans))
        pc = self.engine.prefix_cache
        worked = self._own()
        for (req, tree, _, _), (hidden, logits, aux) in zip(plans, outs):
            try:
                st = req.state
                done = st.absorb(tree, hidden, logits, aux)
                if tree is None and st.prompt_features is not None:
                    if pc is not None:  # the prompt's KV, before any later step writes past it
                        pc.store(st.prompt_ids, st.cache, *st.prompt_features, self.aux_layers)
                    st.prompt_features = None
                if done:
                    req.result = st.result()
            except Exception as exc:  # noqa: BLE001
                req.fail(exc)
        if rec is not None and self.trace is not None:  # the draft tokens the verify steps accepted
            rec["accepted"] = sum(len(r.state.path) - 1 for r, tree, _, _ in plans if tree is not None and r.error is None)
            self.trace(rec)
        if spec is not None and self.accept and self._key(spec) in self.accept:
            self._learn(spec, [(req, tree) for req, tree, _, _ in plans if tree is not None and req.error is None])
        self._work += self._own() - worked

    def _greedy_run(self, plans: list[tuple[Request, Tree | None, list[int], bool]]) -> bool:
        """A batch of one decoding greedily with nothing drafted runs up to GREEDY_RUN steps in one
        native call (`LeanForward.greedy`): the tokens as many steps pick, committed as they would
        be, streamed together. False where it does not apply: more requests or any waiting, a
        prompt or a draft, sampling, a drafter fed the target's steps, a controller pricing steps,
        no native step, or room for fewer than two steps."""
        if len(plans) != 1 or self.waiting or self.cost is not None or self.aux_layers:
            return False
        req, tree, tokens, _ = plans[0]
        st = req.state
        run = getattr(self.engine.forward, "greedy", None)
        if run is None or tree is None or tree.size != 1 or st.params.temperature > 0 or st.observers:
            return False
        k = min(GREEDY_RUN, st.params.max_new_tokens - len(st.stop.tokens), self.engine.max_context - st.prefix,
                st.cache.capacity - st.cache.length)
        if k < 2:
            return False
        stops = () if st.params.ignore_eos else tuple(sorted(self.engine.eos))
        t = time.perf_counter()
        try:
            new = run(st.cache, tokens[0], k, stops)
            if new is None:
                return False
            self._busy += time.perf_counter() - t
            if st.absorb_run(new):
                req.result = st.result()
        except Exception as exc:  # noqa: BLE001 - the step's request fails; the scheduler goes on
            req.fail(exc)
        return True

    @property
    def cost(self) -> StepCost | None:
        """The step cost adaptive control prices rows with (its `Control`'s)."""
        return self.control.cost

    @property
    def accept(self) -> dict[str, Acceptance]:
        """Per adaptive spec, the batch's acceptance estimate (its `Control`'s)."""
        return self.control.accept

    @property
    def calib(self) -> dict[str, Calibration]:
        """Per adaptive spec, its drafters' confidence bands (its `Control`'s)."""
        return self.control.calib

    def _own(self) -> float:
        """The clock the controller times its own seconds by (see __init__): this thread's CPU time
        on a CPU engine; the wall clock on an accelerator, where the thread waits for the device's
        work (a drafter's forwards, the verify's copies back) off the CPU."""
        return time.thread_time() if self.engine.device.type == "cpu" else time.perf_counter()

    def _bounded(self, spec: SpecConfig, nodes: int) -> SpecConfig:
        """`bounded(spec, nodes)`, made once per schedule's spec and count (a copy a drafting request
        and step costs more than the drafting of a lookup drafter)."""
        key = (id(spec), nodes)
        got = self._bounds.get(key)
        if got is None:
            got = self._bounds[key] = bounded(spec, nodes)
        return got

    def _key(self, spec: SpecConfig) -> str:
        """`spec.key()`, once per schedule's spec."""
        key = self._keys.get(id(spec))
        return key if key is not None else spec.key()

    def _estimate(self, req: Request, spec: SpecConfig) -> Acceptance:
        """The request's acceptance estimate under an adaptive spec (the batch's, when it starts),
        caught up with the steps in which nobody drafted (`Control.quiet`)."""
        key = self._key(spec)
        quiet = self.control.quiet[key]
        est = req.accept.get(key)
        if est is None:
            est = req.accept[key] = self.accept[key].fork()
            est.mark = quiet
            return est
        return est.catch_up(quiet)

    def _probe_step(self, batch: int) -> bool:
        """Whether this step is a probe step at `batch` requests (priced in full, a probe allowed):
        every PROBE_EVERY steps until its first, then as engine.decode.control.backoff spaces them."""
        due = self._due.get(batch)
        return self.steps % PROBE_EVERY == 0 if due is None else self.steps >= due

    @staticmethod
    def _joining(reqs: list[Request]) -> int:
        """Rows beyond one per sequence that a step runs anyway: the prompts joining it."""
        return sum(len(r.state.ids) - r.state.reused - 1 for r in reqs if not r.state.prefilled)

    @staticmethod
    def _live(reqs: list[Request]) -> list[Request]:
        """The requests the controller weighs: those that draft and have a node left to gain. One
        with one token left (its last step: no draft node could add one) plans off's row, as one
        without a drafter, so a probe step where nobody has a node left is no probe that found
        nothing and stays due (counted as one, the backoff doubled on such steps, and where requests
        end every 32 steps the probes came back to the same last steps: a batch of one never drafted
        again)."""
        return [r for r in reqs if r.state.will_draft and r.state.depth_left]

    def _screened(self, reqs: list[Request], spec: SpecConfig) -> bool:
        """Whether the step is off's without pricing anything (engine.decode.control.pay_floor):
        between probe steps, at a batch size whose last full choice drafted nothing (the estimates
        move only by what is verified, so the next steps would choose the same; the floor alone is
        loose there: a fixed cost of drafting spreads over every node the batch could draft), or
        whose best first node is below that choice's pay floor. The first case reads no estimate:
        the step then runs exactly as off's (no drafter call, no tree but off's, the same forward,
        nothing learnt but the count of steps nobody drafted in and the forward's seconds, a step
        without rows to the step cost's live fit). A step whose joining prompts add
        more than SLACK of the step prices everything (drafts weigh less against a longer step)."""
        batch = len(reqs)
        if self._probe_step(batch):
            return False
        floor = self._floors.get(batch)
        if floor is None:
            return False
        cost, extra = self.cost, self._joining(reqs)
        if extra and cost.step_s(batch, extra) - cost.step_s(batch, 0) > SLACK * floor[1]:
            return False
        key, nodes = self._key(spec), spec.budget - 1
        batch_est, cal = self.accept[key], self.calib[key]
        live = self._live(reqs) if not floor[2] or self.trace is not None else []
        if not floor[2] and live and nodes:
            # each request's first index only, its pending drift unapplied (`first`): `upper`'s
            # first gain is that times the band ratio, within [0, 1]
            first = max(self._estimate(r, spec).first(batch_est.p[0]) for r in live) * cal.first_ratio(batch_est)
            if min(max(first, 0.0), 1.0) >= floor[0] * (1 - SLACK):
                return False
        self.control.probes.earn(floor[1])
        if self.trace is not None:
            est = [self._estimate(r, spec) for r in live]
            for e in est:
                e.settle(batch_est.p)
            self._record = self._note(batch, extra, [floor[1]], cal.upper(est, batch_est, nodes),
                                      [e.rows for e in est], [0] * len(live), False, True, time.perf_counter())
        return True

    def _draft_adaptively(self, reqs: list[Request], spec: SpecConfig) -> dict[int, tuple[Tree | Exception, float]]:
        """`_draft_in_lockstep` under the controller (engine.decode.control): each request drafts at
        most the nodes expected to pay (none: no draft call), then each draft is cut to the nodes
        that pay given every draft's real size."""
        began = time.perf_counter()
        live = self._live(reqs)
        if not live:
            return {}
        batch, extra = len(reqs), self._joining(reqs)
        cost = self.cost
        est = [self._estimate(r, spec) for r in live]
        nodes = spec.budget - 1
        batch_est, cal = self.accept[self._key(spec)], self.calib[self._key(spec)]
        # before drafting, each request's gains as its most confident drafts' (Calibration.upper):
        # the cut after drafting keeps only the nodes whose real confidence pays, so a node allowed
        # costs its drafting alone when it is cut, and a draft the average would refuse may pay
        fills = [e.rows for e in est]
        budget = self.control.probes
        probing = self._probe_step(batch)
        self._priced = True
        pricing = self._own()
        for e in est:
            e.settle(batch_est.p)
        # a chain's nodes past what its request may still commit (its max_new_tokens, the context)
        # are verified for nothing, and in the last steps of a batch's requests they were rows the
        # controller counted as gains (a tree's siblings within that depth may each be the one accepted)
        gains = cal.upper(est, batch_est, nodes)
        if spec.topk == 1:
            gains = [g[:r.state.depth_left] for g, r in zip(gains, live)]
        # every total of draft rows the controller weighs, priced once (a call per total costs a
        # few ms a step at batch 32, more than the rows it saves); between totals (the expected
        # rows of drafters that do not always fill their nodes) linearly. The totals go up to the
        # expected rows of every node allowed (a lookup drafter's fill is often a fraction of a row)
        top = math.ceil(sum(len(g) * f for g, f in zip(gains, fills))) + 1
        table = cost.table(batch, extra, top)
        paying = pay_floor(batch, table, cost.draft_s, MARGIN) if extra == 0 else None
        step_s = _interpolated(table)
        spread = [e.spread(g) for e, g in zip(est, gains)]
        limits = choose(gains, batch, step_s, cost.draft_s, MARGIN, fills, spread, DOUBT)
        if paying is not None:  # what screens the next steps at this batch size, until a probe step
            self._floors[batch] = (paying, table[0], not any(limits))
        drafts = any(limits)
        # what the last probe at this batch size found: accepted nodes that paid for its rows (True),
        # nothing (False), no evidence (None: its drafters drafted nothing)
        last = self._found.pop(batch, None) if probing else None
        probed: list[int] = []
        wait, pays = 0, 0.0
        budget.earn(table[0])
        if probing:  # a node each beyond the choice for the stalest requests, for what the estimates learn
            # rows priced at no more than the average row: a count of rows never run is measured
            # where it could pay at that price (the live table, engine.decode.stepcost, learns it)
            cheap = cost.table(batch, extra, top, optimistic=True)
            ranked = probe(limits, gains, [e.age for e in est], batch, _interpolated(cheap), cost.draft_s,
                           MARGIN, fills)
            # paid for at the prices the choice weighed: what they are expected to lose comes out of the budget
            losses = probe_loss(limits, gains, batch, step_s, ranked, cost.draft_s, fills, MARGIN, spread, DOUBT)
            n, loss = budget.afford(losses, table[0])
            if not ranked:
                self._found[batch] = False  # no node would pay even if accepted: nothing to find
            elif n:
                probed = ranked[:n]
                for i in probed:
                    limits[i] += 1
                # the accepted tokens per probed row that pay for the rows (the step's seconds per token)
                more = sum(fills[i] for i in probed)
                n_rows = sum(k * f for k, f in zip(limits, fills)) - more
                pays = rows_price(step_s, n_rows, more, cost.draft_s, MARGIN) / more * batch / table[0]
            else:  # not paid for yet: the next probe step when the budget will have earned it (if ever)
                wait = budget.wait(loss, table[0])
        if probing or drafts:  # the next probe step (drafting again: at most PROBE_EVERY steps away)
            every = self._every[batch] = backoff(self._every.get(batch, PROBE_EVERY), PROBE_EVERY, drafts,
                                                 last is False)
            due = self.steps + max(every, wait)
            self._due[batch] = due if probing else min(self._due.get(batch, due), due)
        if extra == 0:  # what pricing costs at this batch size (a prompt's rows make a step of their own kind)
            cost.observe_pricing(batch, self._own() - pricing)
        if self.trace is not None:
            self._record = self._note(batch, extra, table[:9], gains, fills, list(limits), len(probed), False,
                                      began)
            self._record["spread"] = [v[:3] for v in spread]  # the gains' variances (their doubt)
        if not any(limits):  # nothing pays: the step is off's, no drafter call, no cut
            return {}
        drafting = [(r, n) for r, n in zip(live, limits) if n > 0]
        full = {id(r): r.state.drafter.spec for r, _ in drafting}
        for r, n in drafting:
            r.state.drafter.spec = self._bounded(spec, n)
        for r, _ in drafting:  # outside the drafter's timing: indexing the context is not a node's cost
            try:
                r.state.drafter.catch_up(r.state.ids)
            except Exception:  # noqa: BLE001, S110 - its draft call below raises it and fails its request only
                pass
        t, cpu = time.perf_counter(), self._own()
        try:
            out = self._draft_in_lockstep([r for r, _ in drafting])
            for r, _ in drafting:  # the drafters that draft alone
                if id(r) not in out:
                    t1 = time.perf_counter()
                    try:
                        tree: Tree | Exception = r.state.drafter.draft(r.state.ids, r.state.params, r.state.gen)
                    except Exception as exc:  # noqa: BLE001 - fails its request only (in plan)
                        tree = exc
                    out[id(r)] = (tree, time.perf_counter() - t1)
        finally:
            for r, _ in drafting:
                r.state.drafter.spec = full[id(r)]
        sizes = [out[id(r)][0].size - 1 if id(r) in out and isinstance(out[id(r)][0], Tree) else 0 for r in live]
        cut = self._own()
        drafting_s = time.perf_counter() - t
        self._busy += drafting_s  # priced per node (draft_s), not as the step's overhead
        cost.observe_draft(cut - cpu, sum(sizes))
        for e, n, size in zip(est, limits, sizes):
            e.observe_fill(n, size)
            batch_est.observe_fill(n, size)
        real = [cal.gains(e, batch_est, out[id(r)][0].conf if s > 0 else None, s) for r, e, s in zip(live, est, sizes)]
        if sum(sizes) >= len(table):  # the real drafts hold more rows than the fills expected
            step_s = _interpolated(cost.table(batch, extra, sum(sizes)))
        keep = choose(real, batch, step_s, margin=MARGIN, spread=[e.spread(g) for e, g in zip(est, real)], doubt=DOUBT)
        for i in probed:  # the probes are verified whatever the cut says
            keep[i] = max(keep[i], min(limits[i], sizes[i]))
        # the probed nodes drafted (a lookup that found nothing verifies nothing): whether their
        # accepted ones pay for them is what the probe found (`_learn`)
        drawn = [(live[i], limits[i]) for i in probed if sizes[i] >= limits[i]]
        if drawn:
            self._probe = (drawn, pays * len(drawn), batch)
        if self._record is not None:
            kept = [min(k, s) for k, s in zip(keep, sizes)]
            self._record.update(sizes=sizes, kept=kept, drafting_s=drafting_s,
                                expected=sum(sum(g[:k]) for g, k in zip(real, kept)),
                                control_s=time.perf_counter() - began - drafting_s)
        for r, k, size in zip(live, keep, sizes):
            if id(r) in out and k < size:  # (a request the controller chose no draft for plans off's row)
                tree, dt = out[id(r)]
                out[id(r)] = (tree.first(k + 1), dt)
        self._work += self._own() - cut
        return out

    def _note(self, batch: int, extra: int, table: list[float], gains: list[list[float]], fills: list[float],
              allowed: list[int], probed: int, screened: bool, began: float) -> dict[str, Any]:
        """A step's trace record as the controller left it (benchmarks/adaptive_engine.py --trace)."""
        cost = self.cost
        return {"batch": batch, "extra": extra, "table": table, "overhead": cost.overhead_s(batch),
                "setup": cost.setup_s(batch),
                "draft_s": cost.draft_s, "gains": [g[:3] for g in gains], "fills": fills, "allowed": allowed,
                "probe": probed, "kept": [0] * len(allowed), "screened": screened,
                "control_s": time.perf_counter() - began, "drafting_s": 0.0}

    def _learn(self, spec: SpecConfig, verified: list[tuple[Request, Tree]]) -> None:
        """Update the acceptance estimates from a step's verifications: each request's own, and
        the batch's from every request's; indices nobody verified drift back (engine.decode.acceptance)."""
        key = self._key(spec)
        batch, cal = self.accept[key], self.calib[key]
        if self._probe is not None:
            probed, pays, size = self._probe
            ran = {id(req) for req, _ in verified}
            found = sum(node in req.state.path for req, node in probed if id(req) in ran)
            self._found[size] = found >= pays
            self._probe = None
        if all(tree.size == 1 for _, tree in verified):
            # nobody drafted: the batch's estimate holds, so the requests' drift towards it is only
            # counted, once for the batch (`_estimate` catches an estimate up with the count, and
            # Acceptance.settle applies it when the estimate is next read in full)
            if verified:
                self.control.quiet[key] += 1
            return
        quiet = self.control.quiet[key]
        for req in self.active:  # the batch's estimate is about to move: the counted drift first
            pending = req.accept.get(key)
            if pending is not None:
                pending.catch_up(quiet).settle(batch.p)
        most = 0
        for req, tree in verified:
            if req.state.drafter is None:
                continue  # nothing drafted: nothing to learn
            est = self._estimate(req, spec)
            drafted = tree.size - 1
            est.update(drafted, req.state.path)
            est.drift(drafted, batch.p)
            cal.update(batch, tree.conf, drafted, req.state.path)
            batch.update(drafted, req.state.path)
            most = max(most, drafted)
        batch.drift(most)

    def _draft_in_lockstep(self, reqs: list[Request]) -> dict[int, tuple[Tree | Exception, float]]:
        """Draft the requests whose drafters share a head forward together (engine.drafters.lockstep):
        id(request) -> (its tree or the exception that failed it, the group's drafting seconds)."""
        live = [r for r in reqs if r.state.will_draft]
        out: dict[int, tuple[Tree | Exception, float]] = {}
        for group in lockstep_groups([r.state.drafter for r in live]):
            rs = [live[i] for i in group]
            t = time.perf_counter()
            trees = draft_together([r.state.drafter for r in rs], [r.state.ids for r in rs],
                                   [r.state.params for r in rs], [r.state.gen for r in rs])
            dt = time.perf_counter() - t
            out.update({id(r): (tree, dt) for r, tree in zip(rs, trees)})
        return out

    def _retire_cancelled(self) -> None:
        with self._lock:
            gone = [r for r in self.active if r.cancelled]
            self.active = [r for r in self.active if not r.cancelled]
        for r in gone:
            r.error = r.error or "cancelled"
            self._free(r)

    def _retire_finished(self) -> None:
        with self._lock:
            done = [r for r in self.active if r.finished]
            self.active = [r for r in self.active if not r.finished]
        for r in done:
            self._free(r)
            if r.on_done is not None:
                r.on_done(r)

    def _free(self, req: Request) -> None:
        if req.cache is not None:
            self.pool.release(req.cache)
            req.cache = None

    def abort(self, error: str) -> list[Request]:
        """Fail every active request with `error` and free their slots (a step that raised); returns them."""
        with self._lock:
            gone, self.active = self.active, []
        for r in gone:
            r.error = r.error or error
            self._free(r)
        return gone

    # ---- a closed loop of clients (the in-process load generator) ----------------------------

    def closed_loop(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
                    concurrency: int, on_tokens: Callable[[int, list[int]], None] | None = None,
                    on_done: Callable[[int, Request], None] | None = None) -> list[Request]:
        """Play `prompts` with `concurrency` clients, each sending its next prompt when its last one
        finished; runs the steps in the calling thread. Returns the requests in prompt order.
        `params`: one for all, or each request's own."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        out: list[Request | None] = [None] * len(prompts)
        nxt = 0

        def send(i: int) -> None:
            def tok(toks: list[int], i: int = i) -> None:
                if on_tokens is not None:
                    on_tokens(i, toks)

            def done(r: Request, i: int = i) -> None:
                nonlocal nxt
                if on_done is not None:
                    on_done(i, r)
                if nxt < len(prompts):
                    nxt += 1
                    send(nxt - 1)

            try:
                out[i] = self.submit(prompts[i], each[i], tok, done)
            except UserError as exc:
                r = Request(list(prompts[i]), each[i], error=str(exc), exception=exc)
                out[i] = r
                done(r)

        while nxt < min(concurrency, len(prompts)):
            nxt += 1
            send(nxt - 1)
        while self.waiting or self.active:
            self.step()
        return [r for r in out if r is not None]
