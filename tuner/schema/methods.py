"""The one registry of speculative methods: what each method is, who trains it, what each engine
calls it and which engines run it (as a chain, as a tree). Every place that asks about a method
asks here: the SpecConfig literal and rules, the engine checks of a config, the search space, the
cost model, the flags mapping, the deployment adaptations, the built-in drafter factory, the
head-training pipelines and the study's draft preparation.

Engines: `builtin` (the in-process engine), `vllm`, `sglang`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TrainedBy = Literal["eagle", "medusa", "draft_model"]
ENGINES = ("builtin", "vllm", "sglang")


@dataclass(frozen=True)
class Method:
    """One speculative method.

    head: the drafter is a trained head on the target's features (needs `spec.head_path` or a
        head that `tuner train-draft` trains). trained_by: which training makes its drafter:
        "eagle" (engine.heads.pipeline, EAGLE-1 and EAGLE-3 heads), "medusa"
        (engine.heads.medusa_train), "draft_model" (engine.heads.draft_model_train), None
        (training-free: the drafter reads the context or the target's own outputs).
    draft_field: the SpecConfig field naming its checkpoint (None: none is needed).
    vllm / sglang: the engine's name for it (vLLM `speculative_config.method`, SGLang
        `--speculative-algorithm`), None where that engine does not run it.
    chain_engines / tree_engines: the engines that run it with topk == 1 / topk > 1.
    """

    name: str
    head: bool
    trained_by: TrainedBy | None
    draft_field: str | None
    vllm: str | None
    sglang: str | None
    chain_engines: tuple[str, ...]
    tree_engines: tuple[str, ...]

    @property
    def tree(self) -> bool:
        """Whether its drafter can branch (topk > 1) on some engine."""
        return bool(self.tree_engines)

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines that run it in some shape."""
        return tuple(e for e in ENGINES if e in self.chain_engines or e in self.tree_engines)

    @property
    def training_free(self) -> bool:
        return self.trained_by is None


_ALL = ("builtin", "vllm", "sglang")
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("off", head=False, trained_by=None, draft_field=None, vllm=None, sglang=None,
           chain_engines=_ALL, tree_engines=()),
    # topk 1: vLLM's prompt lookup, a chain (the latest earlier occurrence of the context's suffix);
    # topk > 1: SGLang's NGRAM, a trie of every continuation. A chain tuned here is vLLM's, a tree SGLang's.
    Method("ngram", head=False, trained_by=None, draft_field=None, vllm="ngram", sglang="NGRAM",
           chain_engines=("builtin", "vllm"), tree_engines=("builtin", "sglang")),
    # SuffixDecoding; vLLM (through arctic-inference) verifies its best path only: a chain there.
    Method("suffix", head=False, trained_by=None, draft_field=None, vllm="suffix", sglang=None,
           chain_engines=("builtin", "vllm"), tree_engines=("builtin",)),
    # Token Recycling: a successor table filled from the target's own verify logits.
    Method("recycle", head=False, trained_by=None, draft_field=None, vllm=None, sglang=None,
           chain_engines=("builtin",), tree_engines=("builtin",)),
    Method("draft_model", head=False, trained_by="draft_model", draft_field="draft_model", vllm="draft_model",
           sglang=None, chain_engines=("builtin", "vllm"), tree_engines=("builtin",)),
    Method("eagle", head=True, trained_by="eagle", draft_field="head_path", vllm="eagle", sglang="EAGLE",
           chain_engines=_ALL, tree_engines=("builtin", "sglang")),
    Method("eagle3", head=True, trained_by="eagle", draft_field="head_path", vllm="eagle3", sglang="EAGLE3",
           chain_engines=_ALL, tree_engines=("builtin", "sglang")),
    Method("medusa", head=True, trained_by="medusa", draft_field="head_path", vllm="medusa", sglang=None,
           chain_engines=("builtin", "vllm"), tree_engines=("builtin",)),
)}

METHOD_NAMES: tuple[str, ...] = tuple(METHODS)
SpecMethod = Literal[METHOD_NAMES]  # type: ignore[valid-type]  # the registry's names, in order


def method(name: str) -> Method:
    """The registry entry of a method name (a KeyError names an unknown one)."""
    return METHODS[name]


def head_methods() -> tuple[str, ...]:
    """Methods whose drafter is a trained head."""
    return tuple(m.name for m in METHODS.values() if m.head)


def trained_by(kind: TrainedBy) -> tuple[str, ...]:
    """Methods whose drafter the training `kind` makes."""
    return tuple(m.name for m in METHODS.values() if m.trained_by == kind)


def engine_methods(engine: str) -> tuple[str, ...]:
    """Methods an engine runs in some shape (chain or tree)."""
    return tuple(m.name for m in METHODS.values() if engine in m.engines)


def tree_engines(name: str) -> tuple[str, ...]:
    return METHODS[name].tree_engines


def can_branch(name: str, engine: str | None = None) -> bool:
    """Whether `name` may draft a tree (topk > 1), on `engine` or on some engine."""
    m = METHODS[name]
    return engine in m.tree_engines if engine is not None else m.tree


def engine_refusal(name: str, topk: int, engine: str) -> str | None:
    """Why `engine` cannot run `name` with this topk, one line naming the keys; None when it can."""
    m = METHODS[name]
    if name == "off" or engine in (m.tree_engines if topk > 1 else m.chain_engines):
        return None
    if engine not in m.engines:
        return f"spec.method={name} with engine={engine}: allowed are {', '.join(engine_methods(engine))}"
    if topk > 1:
        if not any(engine in m.tree_engines for m in METHODS.values()):
            return f"spec.topk={topk} with engine={engine}: it verifies chains only, topk must be 1"
        return (f"spec.topk={topk} with spec.method={name} and engine={engine}: {engine} runs {name} as a chain "
                f"only, topk must be 1 (trees of {name}: {', '.join(m.tree_engines)})")
    return (f"spec.topk=1 with spec.method={name} and engine={engine}: {engine} runs {name} as a tree only "
            f"(topk >= 2; {name} chains: {', '.join(m.chain_engines)})")


def search_refusal(methods: "list[str] | tuple[str, ...]", topk: "list[int] | tuple[int, ...]", engine: str) -> str | None:
    """Why `engine` cannot run every point kind of a search over `methods` and `topk` (search.*),
    one line naming the keys and what is allowed; None when it can. A method must run on the engine
    in some shape, and one it runs as a tree only needs a searched topk >= 2."""
    bad = [m for m in methods if engine not in METHODS[m].engines]
    if bad:
        others = [e for e in ENGINES if all(e in METHODS[m].engines for m in bad)]
        return (f"search.methods={bad} with engine={engine}: this engine runs {', '.join(engine_methods(engine))}; "
                f"remove them from search.methods" + (f", or use engine={' or engine='.join(others)}" if others else ""))
    tree_only = [m for m in methods if m != "off" and engine not in METHODS[m].chain_engines]
    if tree_only and not any(k > 1 for k in topk):
        return (f"search.topk={list(topk)} with {', '.join(tree_only)} in search.methods and engine={engine}: "
                f"{engine} runs {', '.join(tree_only)} as a tree only, add a topk >= 2 (e.g. search.topk=[2,4])")
    return None
