"""The lean forward runner: `LeanForward.step` is what the decode drivers call.

One step runs N new tokens (a decode step, a chain or a branching tree) against the committed prefix
of a `KVCache`; `step_batch` runs several sequences in one forward (engine.models.batchplan).
Decoder layers run either eagerly or through `torch.compile` (inductor) of one layer function
shared by all layers, with the cache length dynamic; compiled artifacts go to inductor's on-disk
cache under the spectune cache dir. On CUDA every step is compiled at bucketed token counts (padded
to the bucket) under CUDA graphs ("reduce-overhead"), where launch overhead is what compiling
removes. On CPU only the one-row decode step is compiled: there inductor's fused GEMV beats oneDNN,
while for several rows the eager kernels are as fast and padding a tree to its bucket would only
add rows. Steps on CPU run as the C++ step where it can (engine.models.decode_step): one call, or
for a step past its rows (a long prompt) several calls in pieces, so that every row sums in the
one order that step has.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models import attention, batchplan, decode_step, smallm
from engine.models.eagle3_head import aux_features
from engine.models.kernels import CALIBRATE_MIN_BYTES, LinearPlan, set_linear_plan, linear, calibrate_linears
from engine.models.kvpool import BUCKETS, KVCache, KVPool, padded_capacity
from engine.models.llama import LeanLlama, layer_forward, rms_norm
from engine.models.batchplan import BatchRows, batch_layer_forward
from tuner.schema.config import UserError

_NEG = float("-inf")


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
    from engine.models.machine import cache_root

    return cache_root(cache_dir) / "inductor"


class LeanForward:
    """The lean target forward the decode loop drives: `new_cache`, `step`, then the cache's commit/crop.

    `compile=True` runs the decoder layers through one compiled layer function (see module doc:
    every step on CUDA, the one-row step on CPU); `compile_s` accumulates the wall time of steps
    that compiled something (the first call at each token bucket), which callers report apart
    from tokens/s."""

    def __init__(self, model: LeanLlama, compile: bool = False, cache_dir: str | None = None,
                 native: bool = False) -> None:
        self.model = model
        # steps as C++ calls of up to decode_step.MAX_ROWS rows (engine.models.decode_step), where it runs
        self.native = decode_step.NativeStep.of(model) if native else None
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
        return KVCache(self.model, padded_capacity(need))

    def pool(self, slots: int, capacity: int) -> KVPool:
        """The caches of a batch of `slots` places, each of at least `capacity` positions (it grows)."""
        return KVPool(self.model, slots, capacity)

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
        if self.native is not None:
            got = self._native([cache], [tokens], [depths], [ancestors], [last_only], aux_layers)
            if got is not None:
                return got[0]
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
        aux_t = aux_features(aux, aux_layers)
        return x, logits, aux_t

    def greedy(self, cache: KVCache, token: int, k: int, stops: tuple[int, ...]) -> list[int] | None:
        """Up to k greedy decode steps of one sequence in one native call, `token` first
        (`NativeStep.greedy`): the tokens that k one-row `step`s and argmax_rows pick, stopping after
        a token of `stops`; the cache then holds them all but the last. None without the native step."""
        return None if self.native is None else self.native.greedy(cache, token, k, stops)

    def step_batch(self, caches: list[KVCache], tokens: list[list[int]], depths: list[list[int] | None],
                   ancestors: list[torch.Tensor | None], last_only: list[bool],
                   aux_layers: tuple[int, ...] | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """`step` for several sequences in ONE forward: sequence i runs tokens[i] after caches[i]'s
        committed prefix (positions prefix + depths[i], attention along ancestors[i]). The rows of
        all sequences are concatenated (no padding): linears and the lm_head run once over all of
        them. Caches that are views of one `KVPool` attend together (see `batch_plan`), others per
        sequence. One sequence takes `step` (the compiled one-row path at batch 1). Returns `step`'s
        triple per sequence."""
        if len(caches) == 1:
            return [self.step(caches[0], tokens[0], depths[0], ancestors[0], last_only[0], aux_layers)]
        if self.native is not None:
            got = self._native(caches, tokens, depths, ancestors, last_only, aux_layers)
            if got is not None:
                return got
        m = self.model
        dev = m.device
        seqs, pos, ids, pick = [], [], [], []
        at = 0
        # rows in slot order, so a step of one-row sequences in consecutive slots attends without gathers
        order = sorted(range(len(caches)), key=lambda i: caches[i].slot) if all(c.pool is not None for c in caches) \
            else list(range(len(caches)))
        for i in order:
            cache, toks, dep, anc, last = caches[i], tokens[i], depths[i], ancestors[i], last_only[i]
            n, p = len(toks), cache.length
            if p + n > cache.capacity:
                raise ValueError(f"KV cache full: {p}+{n} > {cache.capacity}")
            pos.append(torch.arange(p, p + n) if dep is None else torch.tensor(dep) + p)
            ids.extend(toks)
            mask = None if n == 1 else additive_mask(p, n, anc, n, p + n, dev, m.dtype)
            seqs.append(BatchRows(cache, at, at + n, torch.arange(p, p + n, device=dev), p + n, mask))
            pick.extend([at + n - 1] if last else range(at, at + n))
            at += n
        posv = torch.cat(pos).to(dev)
        cos_t, sin_t = m.rope(int(posv.max()) + 1)
        cos, sin = cos_t[posv], sin_t[posv]
        x = F.embedding(torch.tensor(ids, device=dev), m.embed)
        plan = batchplan.batch_plan(seqs, [ancestors[i] for i in order], dev, m.dtype, m.n_heads // m.n_kv)
        aux = {}
        for i, b in enumerate(m.blocks):
            if aux_layers and i in aux_layers:
                aux[i] = x
            x = batch_layer_forward(x, b, i, plan, cos, sin, m.n_heads, m.n_kv, m.eps)
        x = rms_norm(x, m.norm, m.eps)
        logits = linear(x[torch.tensor(pick, device=dev)], m.lm_head)  # the lm_head read once for every sequence
        aux_t = aux_features(aux, aux_layers)
        out: list = [None] * len(caches)
        li = 0
        for i, s in zip(order, seqs):
            s.cache.length = s.length
            nl = 1 if last_only[i] else s.stop - s.start
            out[i] = (x[s.start:s.stop], logits[li:li + nl], None if aux_t is None else aux_t[s.start:s.stop])
            li += nl
        return out

    def _native(self, caches: list[KVCache], tokens: list[list[int]], depths: list[list[int] | None],
                ancestors: list[torch.Tensor | None], last_only: list[bool], aux_layers: tuple[int, ...] | None
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None:
        """`step_batch` as native calls of at most decode_step.MAX_ROWS rows (`native_calls`): one call
        when the rows fit, else a long prompt or chain cut into pieces that follow one another, and
        sequences spread over calls. None when a branching tree alone has more rows than a call
        takes (its rows see only their ancestors: it runs whole, on the torch path).

        Why every row the native step can run goes through it: its rows are bit-identical in any
        call (tests/engine/test_decode_step.py), while the torch path sums in other orders. A prompt
        past MAX_ROWS on the torch path gave its last position other logits than the one-row step
        that runs it when the prefix cache holds the rest, so a greedy near-tie could differ between
        a prompt's first pass and every later one (docs/results.md, issue 40); and a decode row beside
        such a prompt took the torch path's sums with it."""
        calls = native_calls([len(t) for t in tokens], [d is None and a is None for d, a in zip(depths, ancestors)])
        if calls is None:
            return None
        if len(calls) == 1:
            return self.native(caches, tokens, depths, ancestors, last_only, aux_layers)
        parts: list[list[tuple[bool, tuple]]] = [[] for _ in caches]
        for call in calls:
            # a piece before its sequence's last takes its last row's logits (a call gives each sequence
            # at least one row of them), which are dropped: one lm_head row per piece
            outs = self.native([caches[i] for i, _, _ in call], [tokens[i][a:b] for i, a, b in call],
                               [depths[i] for i, _, _ in call], [ancestors[i] for i, _, _ in call],
                               [last_only[i] or b < len(tokens[i]) for i, _, b in call], aux_layers)
            for (i, _, b), out in zip(call, outs):
                parts[i].append((b == len(tokens[i]) or not last_only[i], out))
        return [(torch.cat([o[0] for _, o in ps]), torch.cat([o[1] for keep, o in ps if keep]),
                 None if ps[0][1][2] is None else torch.cat([o[2] for _, o in ps])) for ps in parts]

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
        """Compile (or load from the on-disk cache) the layer graphs a generation needs: the one-row
        step (and on CUDA a multi-row step and a second multi-row size, after which the row count is
        dynamic).
        Returns the seconds it took (its first step at each size also counts in compile_s)."""
        t = time.perf_counter()
        # two cache capacities and an unbucketed prompt: a generation's own cache and prompt then hit
        # graphs whose cache length and row count are already dynamic (no recompile mid-run). On CPU
        # only the one-row step is compiled, so there a short prefix and two one-row steps per
        # capacity are all the graphs need; the eager multi-row steps would only cost time.
        if self.native is not None and not self._buckets:
            return 0.0  # CPU decoding runs the native step: no step runs a compiled graph
        rows = (8, 1, 1, 4, 16, 100) if self._buckets else (8, 1, 1)
        with torch.inference_mode():
            for need in (64, 600):
                cache = self.new_cache(need)
                for n in rows:
                    if cache.length + self.rows_for(n) <= cache.capacity:
                        self.step(cache, [0] * n)
        return time.perf_counter() - t


def native_calls(rows: list[int], cuttable: list[bool], most: int = decode_step.MAX_ROWS
                 ) -> list[list[tuple[int, int, int]]] | None:
    """How a step of sequences of `rows` rows runs as calls of at most `most` rows: per call the
    (sequence, first row, end row) it runs. A sequence of more than `most` rows that is `cuttable`
    (a prompt or a chain: each row sees every row before it) is cut into equal pieces, each in a
    later call than the piece before it (a call writes the keys the next piece attends to); the
    pieces and the other sequences fill the calls in order. None when a sequence that cannot be cut
    has more than `most` rows."""
    calls: list[list[tuple[int, int, int]]] = []
    call: list[tuple[int, int, int]] = []
    used = 0
    for i, (n, cut) in enumerate(zip(rows, cuttable)):
        if n > most and not cut:
            return None
        k = max(1, -(-n // most))
        bounds = [n * j // k for j in range(k + 1)]
        for a, b in zip(bounds, bounds[1:]):
            if call and (used + b - a > most or a > 0):
                calls.append(call)
                call, used = [], 0
            call.append((i, a, b))
            used += b - a
    if call:
        calls.append(call)
    return calls


_LEAN: dict[tuple, LeanForward] = {}


def prebuild_kernels() -> None:
    """Start building (or loading, when cached) the C++ kernels of the CPU lean forward on background
    threads, so that a first build overlaps the weights' load instead of following it."""
    for mod in (decode_step, smallm, attention):
        mod._NATIVE.prebuild()


def lean_forward(target, compile: bool = False, cache_dir: str | None = None,
                 linear_plan: str = "calibrated", native: bool | str = "auto") -> LeanForward:
    """The LeanForward of a loaded Target, built once per process (weights shared with target.model).
    `linear_plan` is engine.builtin.linear_plan: "calibrated" makes a CPU fp32 target of at least
    CALIBRATE_MIN_BYTES of decoder weights follow this machine's measured LinearPlan
    (calibrate_linears, cached), set before anything is compiled; "default" the default plan.
    `native` is engine.builtin.native_step: "auto" runs steps of a few rows through the native step
    where it can run, True requires it (UserError naming why it cannot), False never."""
    if native is True:
        why = native_step_refusal(target.model)
        if why:
            raise UserError(f"engine.builtin.native_step=true: {why}; allowed: auto (use it where it runs) or false")
    fw = lean_forward_of(target.model, compile, cache_dir, native=native is not False)
    m = fw.model
    if native == "auto" and m.weights != "fp32" and fw.native is None and m.device.type == "cpu" \
            and m.dtype == torch.float32:
        # the torch path would read the rounded values at 4 bytes: another speed than the format's
        raise UserError(f"engine.builtin.weights={m.weights}: the native step that reads them cannot run for this "
                        f"model ({native_step_refusal(target.model)}); allowed: fp32, or native_step=false to "
                        "measure the rounded values through the fp32 torch path")
    if linear_plan == "default":
        set_linear_plan(LinearPlan())
    elif m.packed and sum(w.numel() * w.element_size() for b in m.blocks for w in (b.wqkv, b.wo, b.w13, b.w2)) \
            >= CALIBRATE_MIN_BYTES:
        # the compiled one-row form is timed only where a compiled graph will run it (not under the native step)
        calibrate_linears(m, cache_dir, compiled=compile and fw.native is None)
    return fw


def lean_forward_of(hf_model: torch.nn.Module, compile: bool = False, cache_dir: str | None = None,
                    native: bool = False) -> LeanForward:
    """The LeanForward of an HF causal LM (a target or a draft model), built once per process and
    model; every LeanForward of one model shares its LeanLlama (the weights are fused once).
    `native`: its steps of a few rows run as the native step where that can run."""
    key = (id(hf_model), compile, native)
    with _COMPILE_LOCK:
        if key not in _LEAN:
            same = next((f for (i, *_), f in _LEAN.items() if i == id(hf_model)), None)
            model = same.model if same is not None else LeanLlama(hf_model)
            _LEAN[key] = LeanForward(model, compile, cache_dir, native)
        return _LEAN[key]


def lean_model_of(hf_model: torch.nn.Module) -> LeanLlama | None:
    """The LeanLlama built for `hf_model` in this process (its weights fused and packed), or None when
    no lean forward of it was built: what draft heads share the target's packed lm_head through."""
    with _COMPILE_LOCK:
        return next((f.model for (i, *_), f in _LEAN.items() if i == id(hf_model)), None)


def native_step_refusal(hf_model: torch.nn.Module) -> str | None:
    """Why the native step cannot run for this model here (None: it can)."""
    p = next(hf_model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return f"it runs on CPU in float32 only (this model: {p.device.type}, {str(p.dtype).removeprefix('torch.')})"
    if decode_step.library() is None:
        return f"the C++ step could not be built here ({decode_step.error()})"
    fw = lean_forward_of(hf_model, native=True)
    if fw.native is None:
        return ("its weights have no packed copy (memory too small for it), or the head size "
                f"{fw.model.head_dim} is not one of {attention.HEAD_DIMS}")
    return None
