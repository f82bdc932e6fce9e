"""Acceptance profile: what every speculative configuration would accept, from one target pass.

Acceptance does not depend on the hardware, cost does not depend on the tokens. At T=0
speculation is lossless, so every configuration commits exactly the tokens of one greedy
generation. After that one pass per prompt (the *reference*: tokens, the target's final features
at every position and, at T>0, its distributions), the accepted length of any tree drafted at any
position follows offline: the drafter runs on the known prefix (through the ordinary `Drafter`
interface, fed the reference's features, and the logits of its committed positions, as the engine
would feed them) and its tree is matched
against the known continuation. Replaying the engine's walk (draft at position p, accept a(p),
commit a(p)+1 tokens, observe their features) gives each configuration's exact greedy tau and
acceptance per depth without running the target again.

At T>0 the committed tokens depend on the configuration, so the profile *estimates*: each node's
acceptance probability comes from the draft distribution and the target's distribution at the
reference position of its depth (deterministic siblings: r(x); sampled ones: sum min(q, r)).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from engine.api import SamplingParams
from engine.models.cache import new_cache
from engine.models.eagle3_head import aux_features
from engine.drafters import Drafter, make_drafter
from engine.drafters.suffix import restore_caches, snapshot_caches
from engine.models.target import Target
from engine.trees.tree import Tree
from engine.trees.verify import argmax_token, process_logits
from engine.measure.workloads import Prompt, encode, sampling_params
from engine.measure.profile_file import KIND, PROFILE_FILE, Profile, load_profile  # noqa: F401 (re-exported)
from tuner.schema.config import BuiltinEngineConfig, ModelConfig, SpecConfig, UserError, WorkloadConfig
from tuner.schema.methods import method as method_info

LOOKAHEAD = 16  # reference tokens generated past the end: drafts are matched that far (SpecConfig.depth <= 16)


@dataclass
class Reference:
    """One prompt's target pass. `tokens` continue LOOKAHEAD tokens past where generation ends
    (`end` tokens pushed, the EOS included when it ended it; `n_new` reported, EOS excluded), so a
    draft at the last step is matched like the engine's verification would match it."""

    prompt: list[int]
    tokens: list[int]
    end: int
    n_new: int
    features: torch.Tensor  # [len(prompt) + len(tokens) - 1, h]: final hidden state at every position
    probs: torch.Tensor | None = None  # [len(tokens), V]: processed target distribution of tokens[i] (T>0)
    aux: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> its input at every position

    def aux_of(self, layers: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        """What the engine hands a drafter with `aux_layers`: those layers' inputs, concatenated."""
        return aux_features(self.aux, layers, slice(lo, hi))


@dataclass
class PointResult:
    """One configuration's replayed (T=0: exact) or estimated (T>0) acceptance over all prompts."""

    spec: SpecConfig
    tau: float
    estimate: bool
    new_tokens: int
    forwards: float
    draft_steps: int
    drafted_tokens: int
    accepted_tokens: float
    accepted_per_pos: list[float] = field(default_factory=list)
    draft_s_per_step: float = 0.0  # drafting time of one decoding step on this machine (batch 1)
    verified_per_step: float = 1.0  # tokens verified per decoding forward (root + drafted), on average
    # share of decoding forwards verifying n tokens: a step's cost is not linear in n (one row is the
    # compiled decode step), so predictions average the cost over this, not take it at the mean
    verified_shares: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["spec"] = self.spec.model_dump(mode="json")
        d["key"] = self.spec.key()
        return d


@torch.inference_mode()
def reference_pass(target: Target, prompt: list[int], params: SamplingParams, eos: set[int], max_context: int,
                   lookahead: int = LOOKAHEAD, aux_layers: tuple[int, ...] = ()) -> Reference:
    """Autoregressive generation as the engine runs it (prefill, then one token per forward, the
    same stop rules), continued `lookahead` tokens past the end; the inputs of `aux_layers` are
    kept for drafters that read inner target layers (EAGLE-3). Stop strings are not replayable."""
    if params.stop:
        raise UserError("profile: workloads with stop strings cannot be profiled (the engine cuts their text)")
    model, dev = target.model, target.device
    gen = None
    if params.temperature > 0:
        gen = torch.Generator(device=dev)
        gen.manual_seed(params.seed if params.seed is not None else 0)
    cache = new_cache(model.config)
    feats, probs, tokens = [], [], []
    aux: dict[int, list[torch.Tensor]] = {k: [] for k in aux_layers}  # a layer may repeat in aux_layers
    end = n_new = None
    ids = torch.tensor([prompt], device=dev)
    pos = torch.arange(len(prompt), device=dev)[None]
    while True:
        out = model.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True,
                          output_hidden_states=bool(aux_layers))
        hidden = out.last_hidden_state[0]
        feats.append(hidden)
        for k in aux:
            aux[k].append(out.hidden_states[k][0])
        logits = model.lm_head(hidden[-1:])[0]
        if params.temperature > 0:
            r = process_logits(logits, params)
            probs.append(r)
            tok = int(torch.multinomial(r, 1, generator=gen))
        else:
            tok = argmax_token(logits)
        tokens.append(tok)
        if end is None:
            if tok in eos:
                end, n_new = len(tokens), len(tokens) - 1
            elif len(tokens) >= params.max_new_tokens:
                end = n_new = len(tokens)
        n_ctx = len(prompt) + len(tokens)  # the engine stops once the next root no longer fits
        if end is None and n_ctx > max_context:
            end = n_new = len(tokens)
        if (end is not None and len(tokens) >= end + lookahead) or n_ctx >= max_context:
            break
        ids = torch.tensor([[tok]], device=dev)
        pos = torch.tensor([[n_ctx - 1]], device=dev)
    if end is None:
        end = n_new = len(tokens)
    return Reference(prompt=list(prompt), tokens=tokens, end=end, n_new=n_new, features=torch.cat(feats),
                     probs=torch.stack(probs) if probs else None, aux={k: torch.cat(v) for k, v in aux.items()})


def accepted_path(tree: Tree, continuation: Sequence[int]) -> list[int]:
    """Greedy verification against a known continuation: the node path (root first) whose tokens
    equal it; the engine's rule with the target argmax replaced by the reference tokens."""
    path = [0]
    while len(path) - 1 < len(continuation):
        child = tree.children(path[-1]).get(continuation[len(path) - 1])
        if child is None:
            break
        path.append(child)
    return path


def expected_acceptance(tree: Tree, ref: Reference, i: int) -> list[float]:
    """T>0 estimate: per depth, the expected number of accepted nodes of a tree rooted after
    tokens[i-1]. A node's probability of being reached is the product over its path of the
    acceptance probability against the reference distribution of that depth."""
    reach = [1.0] + [0.0] * (tree.size - 1)
    per_depth = [0.0] * max(tree.depths)
    for n in range(1, tree.size):
        p, d = tree.parents[n], tree.depths[n]
        if i + d - 1 >= len(ref.tokens):
            continue
        r = ref.probs[i + d - 1]
        if p in tree.sampled:  # drawn from q: E[min(1, r/q)] over the draw
            acc = float(torch.minimum(tree.q[p].to(r), r).sum())
        else:  # deterministic sibling: accepted with probability r(x), siblings exclusive
            acc = float(r[tree.tokens[n]])
        reach[n] = reach[p] * acc
        per_depth[d - 1] += reach[n]
    return per_depth


def replay(ref: Reference, drafter: Drafter | None, params: SamplingParams, max_context: int,
           generator: torch.Generator | None = None,
           lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
    """The engine's walk over one reference with one drafter. Greedy: exact forwards, draft steps,
    drafted and accepted tokens. T>0: the expected acceptance, moving by its rounded value.
    A drafter that reads the target's logits (`wants_logits`: Token Recycling) gets them as the
    engine hands them (`Drafter.observe_logits`): `lm_head` of the committed positions' features,
    the prompt's last position after the prompt, the accepted path's after each step."""
    sampling = params.temperature > 0
    prompt, toks = ref.prompt, ref.tokens
    P = len(prompt)
    layers = getattr(drafter, "aux_layers", None)

    def observe(lo: int, hi: int) -> None:  # as the engine: features, plus inner layers when asked
        if layers:
            drafter.observe(ref.features[lo:hi], ref.aux_of(layers, lo, hi))
        else:
            drafter.observe(ref.features[lo:hi])

    wants_logits = drafter is not None and drafter.wants_logits
    if wants_logits and lm_head is None:
        raise ValueError("replay: this drafter reads the target's logits; pass lm_head")

    def observe_logits(lo: int, hi: int, tokens: list[int]) -> None:
        if wants_logits:
            drafter.observe_logits(tokens, lm_head(ref.features[lo:hi]))

    if drafter is not None:
        drafter.reset(prompt)
        observe(0, P)
        observe_logits(P - 1, P, prompt[-1:])
    ids = prompt + toks[:1]
    i = 1  # generated tokens committed
    out = {"forwards": 1, "draft_steps": 0, "drafted": 0, "accepted": 0.0, "per_pos": [], "exp_steps": [],
           "draft_s": 0.0, "sizes": Counter()}
    while i < ref.end:
        prefix = len(ids) - 1
        t = time.perf_counter()
        tree = drafter.draft(ids, params, generator) if drafter is not None else Tree([ids[-1]], [-1], [0])
        out["draft_s"] += time.perf_counter() - t
        if prefix + tree.size > max_context:
            if prefix + 1 > max_context:
                break
            tree = Tree([ids[-1]], [-1], [0])
        out["forwards"] += 1
        out["sizes"][tree.size] += 1
        if tree.size > 1:
            out["draft_steps"] += 1
            out["drafted"] += tree.size - 1
            if sampling:
                per = expected_acceptance(tree, ref, i)
                a = min(int(round(sum(per))), max(tree.depths))
            else:
                a = len(accepted_path(tree, toks[i:])) - 1
                per = [1.0] * a
            out["exp_steps"].append(sum(per))
            out["accepted"] += sum(per)
            for d, v in enumerate(per):
                if d >= len(out["per_pos"]):
                    out["per_pos"].append(0.0)
                out["per_pos"][d] += v
        else:
            a = 0
            out["exp_steps"].append(0.0)
        if drafter is not None:
            observe(prefix, prefix + a + 1)
            observe_logits(prefix, prefix + a + 1, ids[prefix:] + toks[i:i + a])
        ids.extend(toks[i:i + a + 1])
        i += a + 1
    if sampling:  # forwards implied by the mean expected acceptance, not the rounded walk
        mean_a = sum(out["exp_steps"]) / len(out["exp_steps"]) if out["exp_steps"] else 0.0
        out["forwards"] = 1 + (ref.end - 1) / (1 + mean_a)
    return out


def profile_points(target: Target, refs: list[Reference], specs: Sequence[SpecConfig], params: SamplingParams,
                   max_context: int, seed: int = 0,
                   on_point: Callable[[PointResult], None] | None = None,
                   drafter_factory: Callable[[SpecConfig], Drafter | None] | None = None) -> list[PointResult]:
    """Replay every configuration over every reference. Drafters come from engine.drafters.make_drafter
    (the engine's own factory) unless `drafter_factory` builds them."""
    results = []
    suffix_state = snapshot_caches(target)  # every point starts from the same global suffix cache
    for spec in specs:
        t0 = time.perf_counter()
        restore_caches(target, suffix_state)
        drafter = drafter_factory(spec) if drafter_factory else make_drafter(spec, target, seed)
        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device=target.device)
            gen.manual_seed(seed)
        tot = {"forwards": 0.0, "draft_steps": 0, "drafted": 0, "accepted": 0.0, "draft_s": 0.0}
        sizes: Counter[int] = Counter()
        per_pos: list[float] = []
        with torch.inference_mode():
            for ref in refs:
                w = replay(ref, drafter, params, max_context, gen, target.model.lm_head)
                for k in tot:
                    tot[k] += w[k]
                sizes.update(w["sizes"])
                for d, v in enumerate(w["per_pos"]):
                    per_pos += [0.0] * (d + 1 - len(per_pos))
                    per_pos[d] += v
        steps = max(tot["draft_steps"], 1)
        new = sum(r.n_new for r in refs)
        res = PointResult(spec=spec, tau=new / tot["forwards"] if tot["forwards"] else 0.0,
                          estimate=params.temperature > 0, new_tokens=new, forwards=tot["forwards"],
                          draft_steps=tot["draft_steps"], drafted_tokens=tot["drafted"],
                          accepted_tokens=tot["accepted"], accepted_per_pos=[v / steps for v in per_pos],
                          draft_s_per_step=tot["draft_s"] / max(tot["forwards"] - len(refs), 1),
                          verified_per_step=1 + tot["drafted"] / max(tot["forwards"] - len(refs), 1),
                          verified_shares={n: c / sum(sizes.values()) for n, c in sorted(sizes.items())},
                          seconds=time.perf_counter() - t0)
        results.append(res)
        if on_point is not None:
            on_point(res)
    restore_caches(target, suffix_state)  # and the cache is left as it was found
    return results


def make_profile(target: Target, prompt_ids: list[list[int]], names: list[str], specs: Sequence[SpecConfig],
                 params: SamplingParams, eos: set[int], max_context: int, *, model: str, hf_id: str, fp8: bool,
                 workload: str, seed: int = 0, engine: str = "",
                 on_point: Callable[[PointResult], None] | None = None) -> Profile:
    """One reference pass per prompt, then every configuration replayed over them."""
    t0 = time.perf_counter()
    specs = list(specs)
    aux = tuple(sorted({k for s in specs if not method_info(s.method).training_free
                        for k in (getattr(make_drafter(s, target, seed), "aux_layers", None) or ())}))
    refs = [reference_pass(target, p, params, eos, max_context, aux_layers=aux) for p in prompt_ids]
    ref_s = time.perf_counter() - t0
    if not any(s.method == "off" for s in specs):
        specs.insert(0, SpecConfig(method="off"))
    results = profile_points(target, refs, specs, params, max_context, seed, on_point)
    return Profile(model=model, hf_id=hf_id, fp8=fp8, workload=workload, temperature=params.temperature,
                   max_new_tokens=params.max_new_tokens, prompts=list(names),
                   sequences=[{"prompt_len": len(r.prompt), "end": r.end, "n_new": r.n_new,
                               "tokens": r.tokens[:r.end]} for r in refs],
                   points=[r.to_dict() for r in results], reference_s=ref_s, engine=engine)


def profile_prompts(model: ModelConfig, builtin: BuiltinEngineConfig, workload: WorkloadConfig,
                    prompts: Sequence[Prompt], specs: Sequence[SpecConfig], *, fp8: bool, cache_dir: str | None = None,
                    seed: int = 0, on_point: Callable[[PointResult], None] | None = None) -> Profile:
    """The profile of `specs` for `model` on the built-in engine set by `builtin`, its weights
    FP8-rounded when `fp8` (the precision that will be served), over `prompts` played as `workload`
    plays them (chat template, sampling)."""
    from engine.decode.loop import Engine
    from engine.models.target import load_target

    if builtin.threads:
        torch.set_num_threads(builtin.threads)
    target = load_target(model, builtin.model_copy(update={"weights": "fp8" if fp8 else builtin.weights}), cache_dir, seed)
    engine = Engine(target, model.max_context, seed=seed)
    ids = [encode(engine, p, workload.chat_template) for p in prompts]  # a file's request: its own turns
    return make_profile(target, ids, [p.id for p in prompts], specs, sampling_params(workload, seed=seed),
                        engine.eos, model.max_context, model=model.name, hf_id=model.hf_id, fp8=fp8,
                        workload=workload.name, seed=seed, on_point=on_point,
                        engine=engine_key(target, builtin.forward, builtin.compile, builtin.linear_plan))


def engine_key(target: Target, forward: str = "hf", compile: bool = False, linear_plan: str = "calibrated") -> str:
    """What a cost measured with this target depends on besides the machine: the forward the
    engine verifies with (`engine.builtin.forward`, compiled or not, and a lean forward's
    `linear_plan` when not the calibrated one) included."""
    kind = forward + ("+compile" if compile and forward == "lean" else "")
    plan = f"|plan={linear_plan}" if forward == "lean" and linear_plan != "calibrated" else ""
    return f"{target.name}|{target.device}|{target.dtype}|threads={torch.get_num_threads()}|forward={kind}{plan}"
