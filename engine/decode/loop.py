"""The built-in engine (`Engine`) and one generation's state (`Decoding`).

Autoregressive decoding is the tree with only a root, speculation the same step with drafted
nodes. Each step: draft a tree rooted at the last committed token, run ONE target forward over
prefix cache + tree, verify, commit the accepted nodes' KV and drop the rest. The one driver of
those steps is engine.decode.batch: a single request (`Engine.generate`) is a batch of one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from engine.api import GenResult, GenStats, SamplingParams, TokenCallback
from engine.decode.batch import BatchEngine, Control, schedule_of
from engine.decode.prefix import PrefixCache
from engine.decode.stepcost import StepCost, step_cost
from engine.drafters import Drafter, make_drafter
from engine.models import attention, decode_step, smallm
from engine.models.forward import LeanForward, lean_forward, prebuild_kernels
from engine.models.hf_forward import HFCache, HFForward
from engine.models.kvpool import KVCache
from engine.models.target import ChatTokenizer, Target, hf_checkpoint_dir, load_target, resolve_device
from engine.trees.tree import Tree
from engine.trees.verify import argmax_token, process_logits, verify
from tuner.schema.config import BuiltinEngineConfig, ModelConfig, SpecConfig, UserError


class _Stopper:
    """Decides, token by token, where generation ends; identical for every drafter, so speculative
    output stops exactly where autoregressive output does. Tokens that might begin a stop string are
    held back from the stream until that is settled (a stop string is never emitted)."""

    def __init__(self, tokenizer, eos: set[int], params: SamplingParams, on_tokens: TokenCallback | None) -> None:
        self.tok, self.eos, self.params, self.on_tokens = tokenizer, eos, params, on_tokens
        self.stops = [s for s in params.stop if s]
        self.tokens: list[int] = []
        self.emitted = 0
        self.finish: str | None = None
        self.cut: int | None = None  # text length when a stop string ended generation

    def push(self, new: Iterable[int]) -> bool:
        """Commit tokens in order; returns True once generation is finished."""
        p = self.params
        for t in new:
            # below min_tokens (and with ignore_eos at all) an end-of-sequence token is kept as text
            if t in self.eos and not p.ignore_eos and len(self.tokens) >= p.min_tokens:
                self.finish = "stop"
                break
            self.tokens.append(t)
            if self.stops and len(self.tokens) > p.min_tokens and self._check_stop():
                break
            if len(self.tokens) >= self.params.max_new_tokens:
                self.finish = "length"
                break
        self._flush()
        return self.finish is not None

    def _check_stop(self) -> bool:
        text = self.tok.decode(self.tokens, skip_special_tokens=False)
        # a stop string must end past the first min_tokens tokens' text (none ends the request before)
        floor = len(self.tok.decode(self.tokens[: self.params.min_tokens], skip_special_tokens=False)) \
            if self.params.min_tokens else 0
        hits = [i for i in (text.find(s, max(0, floor - len(s) + 1)) for s in self.stops) if i >= 0]
        if hits:
            self.finish, self.cut = "stop", min(hits)
            # keep the tokens whose text ends before the stop string
            k = len(self.tokens) - 1
            while k > 0 and len(self.tok.decode(self.tokens[:k], skip_special_tokens=False)) > self.cut:
                k -= 1
            del self.tokens[k:]
            return True
        return False

    def _safe_len(self) -> int:
        """How many tokens may be streamed: all, except those whose text could begin a stop string."""
        if not self.stops or self.finish is not None:
            return len(self.tokens)
        text = self.tok.decode(self.tokens, skip_special_tokens=False)
        held = max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)
        if held == 0:
            return len(self.tokens)
        k = len(self.tokens)
        while k > self.emitted and len(self.tok.decode(self.tokens[:k], skip_special_tokens=False)) > len(text) - held:
            k -= 1
        return k

    def _flush(self) -> None:
        n = self._safe_len()
        if n > self.emitted and self.on_tokens is not None:
            self.on_tokens(self.tokens[self.emitted:n])
        self.emitted = max(self.emitted, n)

    def text(self) -> str:
        if self.cut is None:
            return self.tok.decode(self.tokens, skip_special_tokens=True)
        return self.tok.decode(self.tokens, skip_special_tokens=False)[: self.cut]  # cut was found in this text


class Engine:
    """The built-in engine: one target per process, any drafter, the TextEngine contract."""

    def __init__(self, target: Target, max_context: int, spec: SpecConfig | None = None, seed: int = 0,
                 lean: LeanForward | None = None) -> None:
        self.target = target
        self.lean = lean  # the engine's own forward (engine.models.forward); None: the HF model's
        self.forward: LeanForward | HFForward = lean if lean is not None else HFForward(target.model)
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.model_name = target.name
        self.max_context = max_context
        self.seed = seed
        self.device = target.device
        self.eos = self._eos_ids()
        self.spec = SpecConfig()
        self.drafter: Drafter | None = None
        # continuous batching (engine.decode.batch), set from engine.builtin by from_config
        self.max_batch, self.prefill, self.kv_tokens = 1, "mixed", None
        self.prefix_cache: PrefixCache | None = None  # the batch scheduler's (engine.decode.prefix)
        self._one: BatchEngine | None = None  # generate's batch of one, kept while the drafter is
        self._given = False  # whether the drafter was handed in (set_drafter), not made from the spec
        self.cache_dir: str | None = None  # where measured facts are cached (engine.models.machine)
        self._costs: dict[tuple[int, int], dict] = {}  # step-cost curves timed: (max_batch, rows) -> curve
        # the most requests its callers ever decode together, when fewer than max_batch (a study of closed-loop
        # concurrency levels, tuner.study.measurer.study_measure): the curve's larger batch sizes are never read
        self.batch_cap: int | None = None
        # what adaptive control learnt, per (max_batch, schedule): every scheduler `batcher` makes
        # for a schedule goes on from where the last one left off, as one server's scheduler would
        self._controls: dict[tuple[int, tuple[tuple[int, int, str], ...]], Control] = {}
        # every scheduler's adaptive steps are reported to this, when set (engine.decode.batch.BatchEngine.trace)
        self.trace: Callable[[dict[str, Any]], None] | None = None
        if spec is not None:
            self.set_spec(spec)

    @classmethod
    def from_config(cls, model: ModelConfig, builtin: BuiltinEngineConfig, spec: SpecConfig | None = None, *,
                    cache_dir: str | None = None, seed: int = 0) -> "Engine":
        """Load (or reuse) the target `model` under the engine settings `builtin` and apply `spec`
        (None: speculation off); `cache_dir` holds converted checkpoints and compiled forwards, `seed`
        seeds a random_init target and sampling."""
        if builtin.threads:
            torch.set_num_threads(builtin.threads)
        if builtin.forward == "lean" and builtin.native_step is not False and resolve_device(builtin.device).type == "cpu":
            prebuild_kernels()
            if not model.random_init:
                # convert the checkpoint (once) while the kernels build on their threads: weights: auto
                # waits for the built kernels before its timing loads the model, which left the conversion
                # to follow the build instead of overlapping it
                hf_checkpoint_dir(model, cache_dir)
        target = load_target(model, builtin, cache_dir, seed)
        lean = (lean_forward(target, builtin.compile, cache_dir, builtin.linear_plan, builtin.native_step)
                if builtin.forward == "lean" else None)
        if lean is not None and lean.compiled and lean.compile_s == 0:
            lean.warm_up()  # compile (or load) before any timed step: its seconds land in compile_s
        engine = cls(target, model.max_context, None, seed, lean)
        engine.cache_dir = cache_dir
        if lean is not None:
            engine.max_batch, engine.prefill, engine.kv_tokens = builtin.max_batch, builtin.prefill, builtin.kv_tokens
            # it lives as long as the engine (a server, a study), as vLLM's lives as long as its server
            engine.prefix_cache = PrefixCache(builtin.prefix_cache_tokens) if builtin.prefix_cache_tokens else None
        if spec is not None:
            engine.set_spec(spec)  # after max_batch: an adaptive spec times its step-cost curve for it
        return engine

    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(int(x) for x in src)
        return ids

    def set_spec(self, spec: SpecConfig) -> None:
        """Switch the speculative configuration; the target is never reloaded, draft models and heads
        are loaded once per process."""
        drafter = make_drafter(spec, self.target, self.seed)
        if spec.adaptive:  # at start-up, outside any timed run
            self.step_costs(self.max_batch, self.cache_room(spec))
        self.drafter, self.spec = drafter, spec
        self._one, self._given = None, False

    def step_costs(self, max_batch: int, rows: int) -> StepCost:
        """The step-cost curve of adaptive speculation (engine.decode.stepcost) for batches of up to
        `max_batch` requests (at most `batch_cap` when set) of up to `rows` rows each: timed once per
        machine and forward (cached on disk), a fresh copy of its online figures per call."""
        if self.batch_cap is not None:
            max_batch = min(max_batch, self.batch_cap)
        if self.lean is None:
            raise UserError("spec.adaptive=true needs engine.builtin.forward=lean (its step-cost curve is timed "
                            "over the lean forward); allowed: forward=lean, or spec.adaptive=false")
        got = next((c for (b, r), c in self._costs.items() if b >= max_batch and r >= rows), None)
        if got is None:
            m = self.lean.model
            # the native kernels' versions too: a curve timed with an older kernel is timed again (and
            # one timed while steps past a native call's rows took the torch path)
            signature = (f"{self.model_name}|{m.weights}|{m.dtype}|{m.device}|{len(m.blocks)} layers|"
                         f"native {self.lean.native is not None} in calls of {decode_step.MAX_ROWS}|"
                         f"compiled {self.lean.compiled}|"
                         f"kernels {decode_step.TAG} {smallm.TAG} {attention.TAG}")
            got = self._costs[(max_batch, rows)] = step_cost(self.lean, max_batch, rows, signature,
                                                             self.cache_dir).to_json()
        return StepCost.from_json(got)

    def set_drafter(self, drafter: Drafter | None, spec: SpecConfig) -> None:
        """Use a drafter built elsewhere (tests: an oracle that drafts with the target)."""
        self.drafter, self.spec = drafter, spec
        self._one, self._given = None, drafter is not None

    def encode_prompt(self, text: str, chat_template: bool) -> list[int]:
        """Token ids of a user prompt, through the model's chat template (with the assistant prefix) or raw."""
        return ChatTokenizer(self.tokenizer).encode_prompt(text, chat_template)

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the assistant's turn."""
        return ChatTokenizer(self.tokenizer).encode_messages(messages)

    def _pick(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
        if params.temperature <= 0:
            return argmax_token(logits)
        return int(torch.multinomial(process_logits(logits, params), 1, generator=gen))

    def start(self, prompt_ids: list[int], params: SamplingParams, on_tokens: TokenCallback | None,
              drafter: Drafter | None, cache: KVCache | HFCache) -> "Decoding":
        """A generation's state before its first forward: `cache` is its place in a batch's pool,
        `drafter` the one it starts with (None: none yet; a batch adds its bands' drafters)."""
        if not prompt_ids:
            raise UserError("prompt is empty: at least one token is needed")
        if len(prompt_ids) >= self.max_context:
            raise UserError(f"prompt has {len(prompt_ids)} tokens; model.max_context={self.max_context}")
        return Decoding(self, prompt_ids, params, on_tokens, drafter, cache)

    def cache_room(self, spec: SpecConfig | None = None) -> int:
        """Positions a step may write past the committed prefix under `spec` (the engine's by default)."""
        spec = self.spec if spec is None else spec
        return max(spec.budget, spec.depth + 1) if spec.method != "off" else 1

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 on_tokens: TokenCallback | None = None) -> GenResult:
        """Generate from prompt ids with the engine's drafter; on_tokens receives each batch of newly
        committed tokens. A batch of one in the one decode driver (engine.decode.batch); what fails
        the request is raised here."""
        one = self._batch_of_one()
        req = one.submit(prompt_ids, params, on_tokens)
        try:
            while not req.finished:
                one.step()
        except BaseException:  # interrupted mid-step (the step itself fails only requests): start afresh
            self._one = None
            raise
        if req.exception is not None:
            raise req.exception
        if req.error is not None:
            raise RuntimeError(req.error)
        return req.result

    def _batch_of_one(self) -> BatchEngine:
        """The batch `generate` runs in: one place, the engine's own drafter (kept until it changes)."""
        if self._one is None:
            spec = self.drafter.spec if self.drafter is not None else self.spec
            self._one = BatchEngine(self, 1, [(1, 1, spec)], drafter=self.drafter)
        return self._one

    def batcher(self) -> BatchEngine:
        """A scheduler of this engine's requests (engine.decode.batch): up to engine.builtin.max_batch
        decode together (the hf forward: one at a time), each with drafters of its own, under the
        spec's bands; a drafter handed in by `set_drafter` is one object, so with it requests run
        one at a time, all drafted by it. Under an adaptive spec it starts from what the last
        scheduler of the same schedule learnt (`Control`): a study's passes alternate specs, each pass
        a new scheduler, and each would otherwise measure a cold controller where a server keeps one."""
        if self._given:
            return self._batch_of_one()
        schedule = schedule_of(self.spec, self.max_batch)
        key = (self.max_batch, tuple((lo, hi, s.key()) for lo, hi, s in schedule))
        batch = BatchEngine(self, self.max_batch, schedule, self.prefill, self.kv_tokens,
                            control=self._controls.get(key))
        if batch.control.cost is not None:
            self._controls[key] = batch.control
        return batch


class Decoding:
    """One generation's state between target forwards: its cache, committed ids, drafter, stopper and
    stats. `plan` drafts the next forward's tokens, `absorb` verifies its logits and commits; the
    batch scheduler (engine.decode.batch) drives it, alone or beside other requests."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams,
                 on_tokens: TokenCallback | None, drafter: Drafter | None, cache: KVCache | HFCache) -> None:
        self.engine, self.params, self.drafter = engine, params, drafter
        self.t_start = time.perf_counter()
        dev = engine.device
        self.gen = None
        if params.temperature > 0:
            self.gen = torch.Generator(device=dev)
            self.gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        spec = drafter.spec if drafter is not None else SpecConfig()
        self.stats = GenStats(accepted_per_pos=[0] * (spec.depth if drafter else 0))
        self.stop = _Stopper(engine.tokenizer, engine.eos, params, on_tokens)
        self.cache = cache
        if drafter is not None:
            drafter.reset(prompt_ids)
        # every drafter fed the committed tokens (a batch may switch drafters between steps); `feeds`:
        # those that read the target's features (a lookup drafter does not: no rows gathered for it)
        self.observers: list[Drafter] = [drafter] if drafter is not None else []
        self.feeds: list[Drafter] = [d for d in self.observers if _reads_features(d)]
        self.prompt_ids = list(prompt_ids)
        self.ids = list(prompt_ids)
        self.prefilled = False
        self.done = False
        self.path: list[int] = [0]  # the last verify step's accepted nodes (root first)
        self._t = 0.0
        # prompt positions whose KV a prefix cache put in the cache, and their features
        self.reused = 0
        self._reused: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.prompt_features: tuple[torch.Tensor, torch.Tensor | None] | None = None  # after the prefill

    def reuse_prefix(self, n: int, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        """The cache already holds the first n prompt positions (engine.decode.prefix): the prefill
        runs only the rest, and drafters are fed `hidden` / `aux` for those n positions."""
        if self.prefilled or not 0 < n < len(self.prompt_ids):
            raise ValueError(f"a prefix of {n} positions cannot be reused here")
        self.reused, self._reused = n, (hidden, aux)

    @property
    def prefix(self) -> int:
        """Committed positions in the target's cache (the root is committed but not yet cached)."""
        return self.reused if not self.prefilled else len(self.ids) - 1

    @property
    def depth_left(self) -> int:
        """The deepest draft node whose acceptance could still add a token: a step commits the
        accepted path and one token more, at most the tokens left before max_new_tokens, and a
        tree that would overrun the context is not verified at all (`plan`)."""
        room = min(self.params.max_new_tokens - len(self.stop.tokens), self.engine.max_context - self.prefix)
        return max(room - 1, 0)

    @property
    def will_draft(self) -> bool:
        """Whether the next `plan` drafts a tree (the prompt has run and there is a drafter)."""
        return self.prefilled and self.drafter is not None

    def plan(self, drafted: Tree | None = None, draft_s: float = 0.0,
             draft: bool = True) -> tuple[Tree | None, list[int] | None, bool]:
        """The next forward: (tree, tokens, last_only). The prompt first (tree None), then the drafted
        tree rooted at the last committed token; tokens None when the context is full (done).
        `drafted`: the tree when the caller drafted it with this request's drafter, ids, params and
        generator (engine.decode.batch drafts several requests in lockstep), `draft_s` the seconds
        that took. `draft` False: without `drafted`, the row speculation off runs (the drafter is not
        called: adaptive control drafts only what it chose)."""
        if not self.prefilled:
            self._t = time.perf_counter()
            return None, self.ids[self.reused:], True
        prefix = self.prefix
        t = time.perf_counter()
        ids = self.ids
        if drafted is not None:
            tree, t = drafted, t - draft_s
        elif self.drafter is not None and draft:
            tree = self.drafter.draft(ids, self.params, self.gen)
        else:
            tree = Tree([ids[-1]], [-1], [0])
        self._t = time.perf_counter()
        self.stats.draft_s += self._t - t
        max_context = self.engine.max_context
        if prefix + tree.size > max_context:
            if prefix + 1 > max_context:
                self.stop.finish = "length"
                self.done = True
                return None, None, False
            tree = Tree([ids[-1]], [-1], [0])  # near the context limit: decode as AR would
        return tree, tree.tokens, False

    def absorb(self, tree: Tree | None, hidden: torch.Tensor, logits: torch.Tensor,
               aux: torch.Tensor | None) -> bool:
        """Verify the forward `plan` asked for, commit, stream; returns True once generation ended."""
        e, stats, params, drafter = self.engine, self.stats, self.params, self.drafter
        if tree is None:  # the prompt
            if self._reused is not None:  # the positions a prefix cache supplied come first
                h0, a0 = self._reused
                hidden = torch.cat([h0, hidden])
                aux = None if aux is None or a0 is None else torch.cat([a0, aux])
                self._reused = None
            self.prompt_features = (hidden, aux)
            self.ids.append(e._pick(logits[-1], params, self.gen))
            self._observe_logits(self.ids[-2:-1], logits[-1:])
            self._observe(hidden, aux, None)
            self.prefilled = True
            stats.target_forwards = 1
            stats.verify_s += time.perf_counter() - self._t
            stats.ttft_s = time.perf_counter() - self.t_start
            self.done = self.stop.push(self.ids[-1:])
            return self.done
        prefix = len(self.ids) - 1
        n = tree.size
        if n == 1:
            path, bonus = [0], e._pick(logits[0], params, self.gen)
        else:
            path, bonus = verify(tree, logits, params, self.gen)
            self.cache.commit(prefix, path)
            stats.draft_steps += 1
            stats.drafted_tokens += n - 1
            stats.accepted_tokens += len(path) - 1
            for d in range(1, len(path)):
                if d > len(stats.accepted_per_pos):
                    stats.accepted_per_pos.append(0)
                stats.accepted_per_pos[d - 1] += 1
        self.path = path
        if any(d.wants_logits for d in self.observers):  # logits[path] copies rows: only for a drafter that reads them
            self._observe_logits([tree.tokens[i] for i in path], logits[path])
        self._observe(hidden, aux, path if len(path) > 1 else [0])
        return self._commit([tree.tokens[i] for i in path[1:]] + [bonus], 1)

    def absorb_run(self, tokens: list[int]) -> bool:
        """Commit the greedy tokens of several one-row steps run in one call (`LeanForward.greedy`,
        speculation off, nothing observing): what `absorb` commits after each of those steps, in
        turn; returns True once generation ended."""
        self.path = [0]
        return self._commit(tokens, len(tokens))

    def _commit(self, new: list[int], forwards: int) -> bool:
        """Count `forwards` target forwards and their time, commit `new` and push it to the stopper;
        returns True once generation ended."""
        self.stats.target_forwards += forwards
        self.stats.verify_s += time.perf_counter() - self._t
        self.ids.extend(new)
        self.done = self.stop.push(new)
        return self.done

    def add_observer(self, drafter: Drafter) -> None:
        """Feed `drafter` every committed feature from now on (before the prompt runs: all of them)."""
        if self.prefilled:
            raise ValueError("a drafter joins a generation before its prompt runs")
        drafter.reset(self.prompt_ids)
        self.observers.append(drafter)
        if _reads_features(drafter):
            self.feeds.append(drafter)

    def _observe_logits(self, tokens: list[int], logits: torch.Tensor) -> None:
        """The committed positions' target logits, for drafters that learn from them (Token Recycling)."""
        for d in self.observers:
            if d.wants_logits:
                d.observe_logits(tokens, logits)

    def _observe(self, hidden: torch.Tensor, aux: torch.Tensor | None, rows: list[int] | None) -> None:
        if not self.feeds:  # AR, or drafters that read no features: no rows to gather, every token
            return
        if rows is not None:
            hidden = hidden[rows]
            aux = None if aux is None else aux[rows]
        for d in self.feeds:
            _observe(d, hidden, aux if d.aux_layers else None, None)

    def result(self) -> GenResult:
        stop, stats = self.stop, self.stats
        stats.new_tokens = len(stop.tokens)
        stats.total_s = time.perf_counter() - self.t_start
        return GenResult(tokens=list(stop.tokens), text=stop.text(), finish_reason=stop.finish or "length",
                         stats=stats)


def _reads_features(drafter: Drafter) -> bool:
    """Whether a drafter reads the target's features (its class has an `observe` of its own)."""
    return type(drafter).observe is not Drafter.observe


def _observe(drafter: Drafter, hidden: torch.Tensor, aux: torch.Tensor | None, rows: list[int] | None) -> None:
    """Hand the drafter the committed positions' features (`rows` of this forward, None: all)."""
    if rows is not None:
        hidden = hidden[rows]
        aux = None if aux is None else aux[rows]
    if aux is None:
        drafter.observe(hidden)
    else:
        drafter.observe(hidden, aux)
