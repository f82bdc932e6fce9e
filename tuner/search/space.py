"""The search space: SpecConfig points encoded so that every point Optuna samples is valid.

Parameters (Optuna names): `method` (only when several are searched), `depth` (`medusa_depth`
for Medusa points), `topk` (tree methods on tree engines only; `tree_topk` where the engine runs
no chain of the method: SGLang n-gram), `budget` (only when the tree leaves a choice), the
training-free trees' own (`ngram_match` for n-gram trees, `suffix_spec_factor` and
`suffix_min_prob` for suffix, each only when several values are searched), `adaptive` (the built-in
engine with search.adaptive: the engine sizes each request's draft per step, depth and budget its
bounds) and, for engines with a per-batch-size schedule and several load levels, the K of each
higher band of a static point (an adaptive one has no schedule): `k_c{level}` for a concurrency
level, `k_r{rate}` for a request rate.

The K bands follow the batch sizes each level runs (`batch_bands`): a concurrency level runs its own
batch size; a request rate runs the distribution of sizes off recorded at it, known once trial 0 has
measured it and refined by every paired baseline after (`with_rate_sizes`). Between two levels the
band edge is the size that puts the fewest of either level's steps in the other's band.

The rules of `SpecConfig` are built into the ranges instead of being rejected afterwards:
budget is drawn from [depth+1, min(budget_max, 1 + depth*topk)], topk=1 fixes budget=depth+1,
n-gram lookup and vLLM draft chains (topk=1), depth never exceeds budget_max-1 (a chain of
depth d verifies d+1 tokens), and a Medusa point never exceeds its head count (head k drafts
token k+1, so H heads draft at most H tokens).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from tuner.schema.compose import medusa_heads
from tuner.schema.config import Config, SpecConfig, UserError
from tuner.schema.methods import METHOD_NAMES, can_branch, method as method_info, search_refusal

# Engines' published defaults, enqueued (clipped to the space) right after the baseline so the
# search starts from what a user would get without tuning.
KNOWN_DEFAULTS: dict[str, tuple[int, int, int]] = {
    "sglang": (5, 4, 8),  # --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8
    "eagle": (5, 8, 60),  # EAGLE-2 paper: depth 5, top-k 8, 60 draft tokens
}
# n-gram prompt lookup as vLLM serves it: a chain of 4 (the defaults above clip n-gram to trees, and
# a study of 10 trials must still try the chain every engine can serve)
NGRAM_CHAIN_DEFAULT = (4, 1, 5)


Sizes = tuple[tuple[int, int], ...]  # (batch size, steps run at it), ascending by size


def _median(sizes: Sizes) -> int:
    """The step-weighted median batch size."""
    total, run = sum(n for _, n in sizes), 0
    for size, n in sizes:
        run += n
        if 2 * run >= total:
            return size
    return sizes[-1][0]


def _share_above(sizes: Sizes, t: int) -> float:
    return sum(n for s, n in sizes if s > t) / max(1, sum(n for _, n in sizes))


def batch_bands(levels: list[tuple[str, Sizes]]) -> list[tuple[int, int, str]]:
    """K bands [(lo, hi, the level whose K it takes)] for levels given as (parameter name, batch sizes
    run): ordered by their median batch size, levels of one median sharing the first one's band. The
    edge between adjacent levels A and B is the size t in [median A, median B - 1] that minimises
    A's share of steps above t plus B's share at or below t (the smallest t among ties, so a
    concurrency level c, all its steps at c, ends its band at c); the last band ends at the largest
    size its level ran. Fewer than two distinct medians: no bands."""
    groups: list[tuple[int, str, Sizes]] = []
    for name, sizes in sorted(levels, key=lambda x: _median(x[1])):
        med = _median(sizes)
        if groups and groups[-1][0] == med:
            merged: dict[int, int] = dict(groups[-1][2])
            for size, n in sizes:
                merged[size] = merged.get(size, 0) + n
            groups[-1] = (med, groups[-1][1], tuple(sorted(merged.items())))
        else:
            groups.append((med, name, sizes))
    if len(groups) < 2:
        return []
    bands, lo = [], 1
    for (med_a, name, a), (med_b, _, b) in zip(groups, groups[1:]):
        cut = min(range(med_a, med_b), key=lambda t: (_share_above(a, t) + 1 - _share_above(b, t), t))
        bands.append((lo, cut, name))
        lo = cut + 1
    last = groups[-1]
    bands.append((lo, max(lo, last[2][-1][0]), last[1]))
    return bands


@dataclass(frozen=True)
class SearchSpace:
    """The valid SpecConfig points of one study."""

    methods: tuple[str, ...]
    depth_min: int
    depth_max: int
    topk: tuple[int, ...]
    budget_max: int
    chain_only: bool = False
    engine: str = "builtin"  # which engine runs the points: which methods may branch there (tuner.schema.methods)
    banded: bool = False  # the engine applies a per-batch-size schedule (vLLM's K bands; the built-in's bands)
    concurrency: tuple[int, ...] = (1,)
    rates: tuple[float, ...] = ()  # request-rate levels (requests/s)
    # per rate, the batch sizes its baseline ran; None until trial 0 has measured them
    rate_sizes: tuple[tuple[float, Sizes], ...] | None = None
    head_paths: dict[str, str] | None = None  # trained head per method (eagle / eagle3 / medusa points)
    draft_model: str | None = None
    medusa_heads: int | None = None  # heads of the Medusa head set: its deepest draft (None: no cap)
    # the training-free trees' own parameters (first value: the one defaults and clipped points take)
    ngram_match: tuple[str, ...] = ("bfs",)  # n-gram trees (topk > 1)
    suffix_spec_factor: tuple[float, ...] = (1.0,)
    suffix_min_prob: tuple[float, ...] = (0.1,)
    adaptive: bool = False  # spec.adaptive is searched (the built-in engine only: it runs the controller)

    @classmethod
    def from_config(cls, cfg: Config, head_paths: dict[str, str] | None = None) -> "SearchSpace":
        """The space of `cfg.search` for `cfg.engine` and the workload's concurrency levels; Medusa
        points are capped by the heads of head_paths["medusa"] (or of what train-draft trains)."""
        s = cfg.search
        # `off` is trial 0, never sampled (SearchConfig refuses a list of nothing else)
        methods = tuple(m for m in s.methods if m != "off")
        conc = tuple(sorted(set(cfg.workload.concurrency))) if cfg.workload else (1,)
        return cls(
            methods=methods,
            depth_min=s.depth.min,
            depth_max=s.depth.max,
            topk=tuple(sorted(set(s.topk))),
            budget_max=s.budget_max,
            chain_only=not any(can_branch(m, cfg.engine.kind) for m in METHOD_NAMES),  # vLLM: chains only
            engine=cfg.engine.kind,
            banded=cfg.engine.kind in ("vllm", "builtin"),
            concurrency=conc,
            rates=tuple(sorted(set(float(r) for r in cfg.workload.request_rate))) if cfg.workload else (),
            head_paths=head_paths or {},
            # spec.draft_model, else the model's published draft model (tuner.schema.config refuses neither)
            draft_model=cfg.spec.draft_model or next(iter(cfg.model.draft_sources.draft_model), None),
            medusa_heads=medusa_heads(cfg, (head_paths or {}).get("medusa"))[0] if "medusa" in methods else None,
            ngram_match=tuple(dict.fromkeys(s.ngram_match)),
            suffix_spec_factor=tuple(dict.fromkeys(s.suffix_spec_factor)),
            suffix_min_prob=tuple(dict.fromkeys(s.suffix_min_prob)),
            adaptive=s.adaptive and cfg.engine.kind == "builtin",
        )

    def __post_init__(self) -> None:
        # A chain of depth d verifies d+1 tokens: depths beyond budget_max-1 hold no valid point.
        capped = min(self.depth_max, self.budget_max - 1)
        if capped < self.depth_min:
            raise UserError(
                f"search.depth.min={self.depth_min} with search.budget_max={self.budget_max}: a chain of depth d "
                "verifies d+1 tokens, so depth.min must be <= budget_max-1"
            )
        object.__setattr__(self, "depth_max", capped)
        refusal = search_refusal(self.methods, self.topk, self.engine)  # the config's own check, for spaces built here
        if refusal:
            raise UserError(refusal)
        if "medusa" in self.methods and self.depth_max_of("medusa") < self.depth_min:
            raise UserError(
                f"search.depth.min={self.depth_min} with medusa in search.methods: its head set has "
                f"{self.medusa_heads} heads, so it drafts at most {self.medusa_heads} tokens (lower "
                "search.depth.min or train more heads, train.medusa_heads)"
            )

    # ---- structure -------------------------------------------------------------------------
    def depth_max_of(self, method: str) -> int:
        """The deepest point of `method` (Medusa: no deeper than its heads)."""
        if method == "medusa" and self.medusa_heads is not None:
            return min(self.depth_max, self.medusa_heads)
        return self.depth_max

    @staticmethod
    def depth_param(method: str) -> str:
        """The Optuna name of a method's depth. Medusa's range is capped by its heads and a name
        has one distribution per study, so its depth is a parameter of its own (TPE's grouped
        multivariate model treats it as conditional on method=medusa, like topk)."""
        return "medusa_depth" if method == "medusa" else "depth"

    def is_tree(self, method: str) -> bool:
        """Whether points of this method may branch (topk > 1)."""
        return can_branch(method, self.engine) and not self.chain_only and any(k > 1 for k in self.topk)

    def topk_of(self, method: str) -> tuple[int, ...]:
        """The topk values of `method`'s points: 1 only where the engine runs its chains, the
        searched values > 1 only where it runs its trees."""
        chain = self.engine in method_info(method).chain_engines
        ks = tuple(k for k in self.topk if k > 1) if self.is_tree(method) else ()
        return ((1,) if chain and (1 in self.topk or not ks) else ()) + ks

    def topk_param(self, method: str) -> str:
        """The Optuna name of a method's topk: `tree_topk` where the engine runs no chain of it
        (SGLang n-gram), so each name keeps one distribution per study."""
        return "topk" if self.engine in method_info(method).chain_engines else "tree_topk"

    def _extras(self, method: str, topk: int) -> list[tuple[str, tuple]]:
        """The method's own searched parameters at this topk: (Optuna name, choices)."""
        if method == "ngram" and topk > 1:
            return [("ngram_match", self.ngram_match)]
        if method == "suffix":
            return [("suffix_spec_factor", self.suffix_spec_factor), ("suffix_min_prob", self.suffix_min_prob)]
        return []

    def budget_range(self, depth: int, topk: int) -> tuple[int, int]:
        """Inclusive valid budget range for a depth and topk (a single value for chains)."""
        if topk == 1:
            return depth + 1, depth + 1
        return depth + 1, min(self.budget_max, 1 + depth * topk)

    @property
    def waits_for_rate_sizes(self) -> bool:
        """Whether the K bands follow the batch sizes the rates' baseline runs (known from trial 0 on)."""
        return self.banded and bool(self.rates) and len(self.concurrency) + len(self.rates) > 1

    def with_rate_sizes(self, sizes: dict[float, dict[int, int]]) -> "SearchSpace":
        """This space with the batch sizes each rate's baseline ran (rate -> size -> steps)."""
        return replace(self, rate_sizes=tuple((r, tuple(sorted(sizes.get(r, {}).items()))) for r in self.rates))

    @property
    def bands(self) -> list[tuple[int, int, str]]:
        """The K bands (lo, hi, the level whose K parameter they take; the first drafts `depth`)."""
        if not self.banded:
            return []
        levels: list[tuple[str, Sizes]] = [(f"k_c{c}", ((c, 1),)) for c in self.concurrency]
        # a rate with no recorded batch size (no gauge over HTTP) gets no band of its own
        levels += [(f"k_r{r:g}", sizes) for r, sizes in self.rate_sizes or () if sizes]
        return batch_bands(levels)

    @property
    def k_bands(self) -> list[tuple[int, int]]:
        """Batch-size bands [lo, hi] (inclusive) for a per-batch-size K; empty for one level."""
        return [(lo, hi) for lo, hi, _ in self.bands]

    @property
    def k_params(self) -> list[str]:
        """The Optuna names of the K of each band after the first (the first drafts `depth`)."""
        return [name for _, _, name in self.bands[1:]]

    def _all_k_params(self) -> list[str]:
        """Every K name the bands may come to use, before the rates' batch sizes are known."""
        if not self.banded or len(self.concurrency) + len(self.rates) < 2:
            return []
        return [f"k_c{c}" for c in self.concurrency] + [f"k_r{r:g}" for r in self.rates]

    def _spec(self, method: str, depth: int, topk: int, budget: int, ks: list[int] | None = None,
              own: dict[str, Any] | None = None, adaptive: bool = False) -> SpecConfig:
        extra: dict[str, Any] = dict(own or {})
        if adaptive:
            extra["adaptive"] = True
        field = method_info(method).draft_field
        if field == "head_path":
            extra["head_path"] = (self.head_paths or {}).get(method)
        elif field == "draft_model":
            extra["draft_model"] = self.draft_model
        if ks is not None:
            extra["k_per_batch_size"] = [(lo, hi, k) for (lo, hi), k in zip(self.k_bands, [depth, *ks])]
        return SpecConfig(method=method, depth=depth, topk=topk, budget=budget, **extra)

    # ---- Optuna ------------------------------------------------------------------------------
    def suggest(self, trial: Any) -> SpecConfig:
        """Draw one point from an Optuna trial (fixed params of enqueued trials are honoured)."""
        method = trial.suggest_categorical("method", list(self.methods)) if len(self.methods) > 1 else self.methods[0]
        depth = trial.suggest_int(self.depth_param(method), self.depth_min, self.depth_max_of(method))
        choices = self.topk_of(method)
        topk = trial.suggest_categorical(self.topk_param(method), list(choices)) if len(choices) > 1 else choices[0]
        lo, hi = self.budget_range(depth, topk)
        budget = trial.suggest_int("budget", lo, hi) if hi > lo else lo
        own = {name: trial.suggest_categorical(name, list(vals)) if len(vals) > 1 else vals[0]
               for name, vals in self._extras(method, topk)}
        adaptive = bool(trial.suggest_categorical("adaptive", [False, True])) if self.adaptive else False
        ks = None
        if self.k_bands and not adaptive:
            ks = [trial.suggest_int(name, 0, depth) for name in self.k_params]
        return self._spec(method, depth, topk, budget, ks, own, adaptive)

    def params_of(self, spec: SpecConfig) -> dict[str, Any]:
        """The Optuna params that make `suggest` return `spec` (for enqueue_trial)."""
        p: dict[str, Any] = {}
        if len(self.methods) > 1:
            p["method"] = spec.method
        p[self.depth_param(spec.method)] = spec.depth
        if len(self.topk_of(spec.method)) > 1:
            p[self.topk_param(spec.method)] = spec.topk
        lo, hi = self.budget_range(spec.depth, spec.topk)
        if hi > lo:
            p["budget"] = spec.budget
        for name, vals in self._extras(spec.method, spec.topk):
            if len(vals) > 1:
                p[name] = getattr(spec, name)
        if self.adaptive:
            p["adaptive"] = spec.adaptive
        if spec.adaptive:  # no schedule, no K
            return p
        bands = spec.k_per_batch_size or []
        if all(k == spec.depth for _, _, k in bands):
            # one K everywhere (the defaults): every band's K, also those the rates' sizes will add
            p.update({name: spec.depth for name in self._all_k_params()})
        else:
            p.update({name: k for name, (_, _, k) in zip(self.k_params, bands[1:])})
        return p

    def contains(self, spec: SpecConfig) -> bool:
        """Whether `spec` is a point of this space."""
        if spec.method not in self.methods or not (self.depth_min <= spec.depth <= self.depth_max_of(spec.method)):
            return False
        if spec.adaptive and (not self.adaptive or spec.k_per_batch_size):
            return False
        if spec.topk not in self.topk_of(spec.method):
            return False
        if any(getattr(spec, name) not in vals for name, vals in self._extras(spec.method, spec.topk)):
            return False
        lo, hi = self.budget_range(spec.depth, spec.topk)
        return lo <= spec.budget <= hi

    def clip(self, method: str, depth: int, topk: int, budget: int) -> SpecConfig:
        """The nearest point of the space to a (possibly invalid) configuration."""
        depth = max(self.depth_min, min(self.depth_max_of(method), depth))
        topk = min(self.topk_of(method), key=lambda k: (abs(k - topk), k))
        lo, hi = self.budget_range(depth, topk)
        budget = max(lo, min(hi, budget))
        ks = [depth] * (len(self.k_bands) - 1) if self.k_bands else None  # one K everywhere
        return self._spec(method, depth, topk, budget, ks, {n: v[0] for n, v in self._extras(method, topk)})

    def defaults(self) -> list[SpecConfig]:
        """The engines' known defaults, clipped to the space, duplicates removed (enqueue order)."""
        out: list[SpecConfig] = []
        for method in self.methods:
            known = list(KNOWN_DEFAULTS.values()) + ([NGRAM_CHAIN_DEFAULT] if method == "ngram" else [])
            for d, k, b in known:
                spec = self.clip(method, d, k, b)
                if spec not in out:
                    out.append(spec)
        return out

    def arms(self) -> list[SpecConfig]:
        """The adaptive arm enqueued after the defaults (search.adaptive): the first searched method
        at the space's widest bounds, a chain where the engine runs one (the controller shortens it
        per request and step), else its widest tree. Empty when adaptive is not searched."""
        if not self.adaptive:
            return []
        method = self.methods[0]
        depth = self.depth_max_of(method)
        topk = 1 if 1 in self.topk_of(method) else max(self.topk_of(method))
        point = self.clip(method, depth, topk, self.budget_range(depth, topk)[1])
        return [SpecConfig.model_validate({**point.model_dump(), "adaptive": True, "k_per_batch_size": None})]

    def points(self) -> list[SpecConfig]:
        """Every point of the space (the exhaustive grid), in a fixed order."""
        out: list[SpecConfig] = []
        seen: set[str] = set()  # a set of dumps: comparing models in a list is quadratic, and a banded space has thousands
        for method in self.methods:
            for depth in range(self.depth_min, self.depth_max_of(method) + 1):
                for topk in self.topk_of(method):
                    lo, hi = self.budget_range(depth, topk)
                    if topk > 1 and hi < lo:
                        continue
                    extras = self._extras(method, topk)
                    for values in itertools.product(*(v for _, v in extras)):
                        own = {n: x for (n, _), x in zip(extras, values)}
                        for budget in range(lo, hi + 1):
                            band_ks = (itertools.product(range(depth + 1), repeat=len(self.k_bands) - 1)
                                       if self.k_bands else [None])
                            for ks in band_ks:
                                spec = self._spec(method, depth, topk, budget, list(ks) if ks is not None else None, own)
                                dump = spec.model_dump_json()
                                if dump not in seen:
                                    seen.add(dump)
                                    out.append(spec)
                            if self.adaptive:  # the same bounds, sized per step by the engine
                                out.append(self._spec(method, depth, topk, budget, None, own, adaptive=True))
        return out
