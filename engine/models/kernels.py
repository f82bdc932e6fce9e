"""CPU kernels: which form each fp32 linear takes (oneDNN, MKL, w @ x.T, a compiled product-sum),
measured per machine (`LinearPlan`, `calibrate_linears`), packed weights, and the `hf` path's
oneDNN linear layers.

fp32 linear layers on CPU through oneDNN where MKL's small-batch GEMM is slow.

On the 2-core AVX2 EPYC, for SmolLM2's shapes, MKL (`F.linear`) costs about twice as much for 2-16
rows as for one, and oneDNN (`torch.ops.mkldnn._linear_pointwise`, the op Inductor emits for CPU
linears) less for the lm_head and for the decoder projections from 2 rows on (the figures:
docs/results.md, "Figures behind the code"). Speculative verification runs 2-16 rows per forward,
so this moves the cost of a verification step closer to that of an autoregressive one.

Only inference goes through oneDNN (that op has no autograd formula): with gradients enabled
(EAGLE head training back-propagates through the frozen lm_head) the layer is a plain nn.Linear.
Results agree with MKL to ~1e-6 (fp32 summation order).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.models import smallm
from engine.models.machine import cpu_signature, timed_once
from tuner.schema.precision import packed_copies

# The lm_head-sized layers (vocabulary rows) win on a single row too.
_WIDE = 8192


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN linear op (CPU wheels with MKLDNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDnnLinear(torch.nn.Linear):
    """nn.Linear whose inference forward uses oneDNN for multi-row inputs and wide layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32 or (
                self.out_features < _WIDE and x.numel() <= self.in_features):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Switch every plain nn.Linear of a CPU fp32 model to OneDnnLinear in place (weights, state
    dict and checkpoints unchanged). Returns how many layers were switched (0 without oneDNN)."""
    if not onednn_available():
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:  # exactly nn.Linear: FP8 and other custom layers keep theirs
            mod.__class__ = OneDnnLinear
            n += 1
    return n


_ONEDNN = onednn_available()
SKINNY_MAX_ROWS = 4  # rows up to which _cpu_linear uses the w @ x.T form on plain weights (measured 2-16 rows)
PACK_ROWS = 16  # the row count packed weights are laid out for (verification steps are 3-64 rows)
# CPU fp32 forms of x @ w.T on a packed target weight: oneDNN on the packed copy, MKL (F.linear), MKL
# as w @ x.T, and engine.models.smallm's few-row kernel on its own packed copy (where this machine
# builds it). Which is fastest for a few rows depends on the CPU (see LinearPlan), so it is measured.
FORMS = ("onednn", "mkl", "wxt", "smallm")
PLAN_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # row counts calibrate_linears times; more rows: oneDNN
CALIBRATE_MIN_BYTES = 32 << 20  # smaller models keep the default plan (their linears take microseconds)


@dataclass(frozen=True)
class LinearPlan:
    """Which form each CPU fp32 linear over a packed weight takes, by row count, and which one-row form
    the compiled decode step traces ("prodsum": a product and a sum inductor fuses into one pass over
    the weight; "mkl": an extern MKL call). The default is what measured fastest on a 2-core AVX2 EPYC
    (prodsum for the compiled row, w @ x.T for two rows, oneDNN packed beyond); on a 2-core AVX-512
    Xeon the same forms measured slower than MKL there (docs/results.md, "Figures behind the code"),
    hence `calibrate_linears`."""

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


def pack_weights(weights: list[torch.Tensor], formats: list[str] | None = None) -> bool:
    """Give each CPU fp32 weight a copy in oneDNN's blocked layout (attribute `_onednn_packed`), which
    `linear` uses outside compiled graphs. oneDNN otherwise re-lays a plain weight out on every call,
    which costs a large share of a multi-row step (docs/results.md, "Figures behind the code"). The copy doubles the weights' memory, so it is made only while it takes at most a
    quarter of physical memory. The weights must not change afterwards (the engine never does).
    Where the few-row kernel builds, each weight also gets its layout (`_smallm_packed`, with its
    `_smallm_scale`) in its entry of `formats` (fp32 | bf16 | fp8; default fp32), within the same
    memory bound. A CPU fp32 weight of format bf16 or fp8 is marked (`_bf16_inputs`): `linear` rounds
    its input to bf16, as the few-row kernel does (engine.models.smallm)."""
    if not (_ONEDNN and weights and weights[0].device.type == "cpu" and weights[0].dtype == torch.float32):
        return False
    for w, fmt in zip(weights, formats or ["fp32"] * len(weights)):
        w._bf16_inputs = fmt != "fp32"
    total = sum(w.numel() * w.element_size() for w in weights)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    onednn, few = packed_copies(total, memory)
    if not onednn:
        return False
    with_smallm = few and smallm.library() is not None
    fresh = []  # the few-row copies made here: placed together on 2 MB pages (smallm.on_huge_pages)
    with torch.no_grad():
        for w, fmt in zip(weights, formats or ["fp32"] * len(weights)):
            if getattr(w, "_onednn_packed", None) is None:
                w._onednn_packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
            if with_smallm and getattr(w, "_smallm_packed", None) is None:
                w._smallm_packed, w._smallm_scale = smallm.pack(w, fmt, huge=False)
                fresh.append(w)
    for w, placed in zip(fresh, smallm.on_huge_pages([w._smallm_packed for w in fresh])):
        w._smallm_packed = placed
    return True


def forms_for(w: torch.Tensor) -> tuple[str, ...]:
    """The FORMS a packed weight can take (smallm only where it was packed for it)."""
    return FORMS if getattr(w, "_smallm_packed", None) is not None else FORMS[:-1]


def _form_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, form: str,
                 packed: torch.Tensor | None) -> torch.Tensor:
    if form == "smallm":
        return smallm.linear(x, w._smallm_packed, w.shape[0], b, w._smallm_scale)
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
    reads well below it, and oneDNN otherwise."""
    rows = x.shape[0] if x.dim() == 2 else 0
    packed = getattr(w, "_onednn_packed", None)
    if packed is not None:
        return _form_linear(x, w, b, _PLAN.form(rows) if rows else "onednn", packed)
    return _form_linear(x, w, b, "wxt" if 2 <= rows <= SKINNY_MAX_ROWS else "onednn", None)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b). CPU fp32 outside a compiled graph: `_cpu_linear`. Inside one (on CPU only the
    one-row step is compiled) a single row is written as the plan says: by default a product and a
    sum, which inductor fuses into one pass over the weight (on the AVX2 machine faster than oneDNN's
    GEMV). A weight of format bf16 or fp8 (`pack_weights`) takes its input rounded to bf16, as in
    the served bf16 model: every form computes what the few-row kernel and the native step do."""
    if x.dtype == torch.float32 and getattr(w, "_bf16_inputs", False):
        x = x.bfloat16().float()
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


CALIBRATE_ROUNDS = 5  # rounds in which every form is timed once (the best round counts)
# After DROP_AFTER rounds a form whose best is over DROP_FACTOR times the leader's is timed no more: only
# rounds that ran it more than that much faster could still make it win. On the 2-core AVX2 EPYC MKL ran
# several times the few-row kernel's time from 2 rows on, and took the largest share of a cold plan's time.
DROP_AFTER = 2
DROP_FACTOR = 2.0


def _time_forms(weights: list[torch.Tensor], rows: int, forms: tuple[str, ...], rounds: int) -> dict[str, float]:
    """Best seconds of each form over `rounds` rounds, the forms taking turns within a round, so a
    load change on a shared machine hits every form alike instead of the one timed at that moment;
    a form far behind the leader after DROP_AFTER rounds keeps its best so far."""
    best = {f: float("inf") for f in forms}
    timed = list(forms)
    for r in range(rounds):
        if r == DROP_AFTER:
            timed = [f for f in timed if best[f] <= DROP_FACTOR * min(best.values())]
        for f in timed:
            best[f] = min(best[f], _time_form(weights, rows, f, 1))
    return best


def calibrate_linears(model: Any, cache_dir: str | os.PathLike | None = None, compiled: bool = False,
                      repeats: int = CALIBRATE_ROUNDS) -> LinearPlan:
    """Time every form over the model's decoder weights at each of PLAN_ROWS (and, when `compiled`,
    the compiled product-sum one-row linear against MKL's), keep the fastest, and make that the
    process's plan. Measured once per (CPU, torch, threads, shapes) and cached in
    <cache>/linear_plan.json: a few seconds the first time (plus compiling the product-sum)."""
    from engine.models.machine import cache_root

    weights = [w for b in model.blocks for w in (b.wqkv, b.wo, b.w13, b.w2)]
    forms = forms_for(weights[0])
    # the rounds, forms and the few-row kernel's version in the key: plans timed before the forms
    # took turns, without a form this process has, or with another kernel are measured again
    key = (f"{cpu_signature()}|torch {torch.__version__}|{sorted({tuple(w.shape) for w in weights})}|{repeats} rounds"
           f"|{','.join(forms)}" + (f"|smallm {smallm.TAG} {weights[0]._smallm_packed.dtype}" if "smallm" in forms else ""))

    def measure(old: dict | None) -> dict:
        got = dict(old or {})
        ms = got["ms"] = dict(got.get("ms", {}))  # kept for reports: rows -> form -> ms over every layer
        if "eager" not in got:
            for n in PLAN_ROWS:
                ms[str(n)] = {f: round(t * 1e3, 2) for f, t in _time_forms(weights, n, forms, repeats).items()}
            got["eager"] = [(n, min(forms, key=ms[str(n)].__getitem__)) for n in PLAN_ROWS]
        if compiled and "compiled_one_row" not in got:  # the product-sum against an extern MKL call
            ms["1 compiled"] = {f: round(t * 1e3, 2) for f, t in _time_forms(weights, 1, ("prodsum", "mkl"), repeats).items()}
            got["compiled_one_row"] = min(("prodsum", "mkl"), key=ms["1 compiled"].__getitem__)
        return got

    path = cache_root(cache_dir) / "linear_plan.json"
    got = timed_once(path, key, measure, "the linear plan")
    if compiled and "compiled_one_row" not in got:  # calibrated before for an eager forward only
        got = timed_once(path, key, measure, "the linear plan", remeasure=True)
    plan = LinearPlan(tuple((int(n), str(f)) for n, f in got["eager"]),
                      got.get("compiled_one_row", _PLAN.compiled_one_row), got.get("ms", {}))
    set_linear_plan(plan)
    return plan
