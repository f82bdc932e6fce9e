"""Acceptance profile (engine.measure.profile): the offline replay of one greedy pass predicts every
configuration's tau exactly as the live engine measures it, drafts the very trees the engine
drafts (EAGLE features fed from the reference pass), and is stored and reloaded."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.api import SamplingParams
from engine.drafters import Drafter, make_drafter
from engine.decode.loop import Engine
from tuner.study.measurer import open_engine
from engine.models.target import random_llama, smollm2_tokenizer_dir
from engine.measure.profile import accepted_path, load_profile, make_profile, profile_points, reference_pass
from engine.trees.tree import Tree
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig, UserError

PROMPTS = ["def fib(n):", "Write a haiku about the sea.", "a b c d a b c d a b c d a b"]
N_NEW = 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recorder(Drafter):
    """Wraps a drafter and records every tree it drafts (position, tokens, parents)."""

    def __init__(self, inner: Drafter) -> None:
        super().__init__(inner.spec)
        self.inner, self.trees = inner, []
        self.aux_layers = inner.aux_layers  # EAGLE-3 asks for inner target layers

    def reset(self, prompt_ids):
        self.inner.reset(prompt_ids)

    def observe(self, features, aux=None):
        if aux is None:
            self.inner.observe(features)
        else:
            self.inner.observe(features, aux)

    def draft(self, ids, params, generator=None) -> Tree:
        tree = self.inner.draft(ids, params, generator)
        self.trees.append((len(ids), tuple(tree.tokens), tuple(tree.parents)))
        return tree


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    return [engine.encode_prompt(p, True) for p in PROMPTS]


@pytest.fixture(scope="module")
def refs(engine: Engine, prompts):
    params = SamplingParams(max_new_tokens=N_NEW)
    return [reference_pass(engine.target, p, params, engine.eos, engine.max_context) for p in prompts]


@pytest.fixture(scope="module")
def noisy_draft_dir(tmp_path_factory):
    """The target's own weights plus noise, with its tokenizer: a draft model that accepts about
    half of its tokens, so acceptance is neither nothing nor everything."""
    cfg = load_config(["model=tiny-random"]).model
    model = random_llama(cfg, seed=0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.model.layers.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.std())
    out = tmp_path_factory.mktemp("noisy")
    model.save_pretrained(str(out))
    for f in smollm2_tokenizer_dir().iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy(f, out / f.name)
    return out


def _live(engine: Engine, prompts, spec: SpecConfig, params: SamplingParams) -> tuple[float, int, int, list]:
    drafter = make_drafter(spec, engine.target, engine.seed)
    rec = Recorder(drafter) if drafter is not None else None
    engine.set_drafter(rec, spec)
    new = fwd = acc = drafted = 0
    for p in prompts:
        st = engine.generate(p, params).stats
        new, fwd, acc, drafted = new + st.new_tokens, fwd + st.target_forwards, acc + st.accepted_tokens, drafted + st.drafted_tokens
    return new / fwd, acc, drafted, (rec.trees if rec else [])


def _replayed(engine: Engine, refs, spec: SpecConfig, params: SamplingParams):
    recs: list[Recorder] = []

    def factory(s: SpecConfig):
        d = make_drafter(s, engine.target, engine.seed)
        if d is None:
            return None
        recs.append(Recorder(d))
        return recs[-1]

    (res,) = profile_points(engine.target, refs, [spec], params, engine.max_context, drafter_factory=factory)
    return res, (recs[0].trees if recs else [])


SPECS = [
    SpecConfig(method="off"),
    SpecConfig(method="ngram", depth=4, topk=1, budget=5),
    SpecConfig(method="ngram", depth=3, topk=1, budget=4, ngram_min=1, ngram_max=1),
    SpecConfig(method="eagle", depth=3, topk=1, budget=4),
    SpecConfig(method="eagle", depth=3, topk=4, budget=8),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key() + f" n{s.ngram_min}")
def test_greedy_tau_equals_live(engine: Engine, prompts, refs, spec: SpecConfig) -> None:
    params = SamplingParams(max_new_tokens=N_NEW)
    tau, acc, drafted, live_trees = _live(engine, prompts, spec, params)
    res, trees = _replayed(engine, refs, spec, params)
    assert res.tau == tau and res.accepted_tokens == acc and res.drafted_tokens == drafted
    assert not res.estimate
    # the shares of steps by tokens verified (what cost predictions average over) agree with the mean
    assert sum(res.verified_shares.values()) == pytest.approx(1.0)
    assert sum(n * w for n, w in res.verified_shares.items()) == pytest.approx(res.verified_per_step)
    assert (set(res.verified_shares) == {1}) == (res.drafted_tokens == 0)
    # the same trees at the same positions: the EAGLE head saw the same features in the same order
    assert trees == live_trees


@pytest.mark.parametrize("shape", [(4, 1, 5), (3, 2, 5)], ids=lambda s: "d%d k%d b%d" % s)
def test_draft_model_partial_acceptance_equals_live(engine: Engine, prompts, refs, noisy_draft_dir, shape) -> None:
    d, k, b = shape
    spec = SpecConfig(method="draft_model", depth=d, topk=k, budget=b, draft_model=str(noisy_draft_dir))
    params = SamplingParams(max_new_tokens=N_NEW)
    tau, acc, _, _ = _live(engine, prompts, spec, params)
    res, _ = _replayed(engine, refs, spec, params)
    assert 1.2 < tau < spec.depth + 1  # some but not all drafts accepted: the walk is really exercised
    assert res.tau == tau and res.accepted_tokens == acc


def test_stops_at_eos_like_the_engine(engine: Engine, prompts) -> None:
    """A token of the reference declared EOS: the replay ends where the engine ends."""
    params = SamplingParams(max_new_tokens=N_NEW)
    ref = reference_pass(engine.target, prompts[1], params, engine.eos, engine.max_context)
    eos_tok = ref.tokens[9]
    if eos_tok in ref.tokens[:9]:
        pytest.skip("token repeats earlier in the reference")
    eng = Engine(engine.target, engine.max_context)
    eng.eos = {eos_tok}
    spec = SpecConfig(method="ngram", depth=3, topk=1, budget=4, ngram_min=1, ngram_max=1)
    tau, _, _, _ = _live(eng, prompts[1:2], spec, params)
    ref2 = reference_pass(engine.target, prompts[1], params, {eos_tok}, engine.max_context)
    assert ref2.n_new == 9 and ref2.end == 10 and len(ref2.tokens) > ref2.end
    (res,) = profile_points(engine.target, [ref2], [spec], params, engine.max_context)
    assert res.tau == tau and res.new_tokens == 9


def test_accepted_path_follows_the_continuation() -> None:
    # root 5; children 7 (node 1) and 8 (node 2); node 1 has child 9 (node 3)
    tree = Tree(tokens=[5, 7, 8, 9], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2])
    assert accepted_path(tree, [7, 9, 1]) == [0, 1, 3]
    assert accepted_path(tree, [8, 9]) == [0, 2]
    assert accepted_path(tree, [1]) == [0]
    assert accepted_path(tree, [7]) == [0, 1]  # the continuation ends


def test_sampling_estimate_is_labelled_and_plausible(engine: Engine, prompts) -> None:
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0.8, seed=1)
    refs = [reference_pass(engine.target, p, params, engine.eos, engine.max_context) for p in prompts[:2]]
    assert refs[0].probs is not None and torch.allclose(refs[0].probs.sum(-1), torch.ones(len(refs[0].tokens)))
    specs = [SpecConfig(method="off"), SpecConfig(method="eagle", depth=2, topk=2, budget=4)]
    off, eagle = profile_points(engine.target, refs, specs, params, engine.max_context)
    assert off.estimate and eagle.estimate
    assert off.tau == pytest.approx(1.0)
    assert 1.0 <= eagle.tau < 1.1  # a random head: nearly nothing is expected to be accepted


def test_profile_roundtrip_and_lookup(engine: Engine, prompts, tmp_path) -> None:
    params = SamplingParams(max_new_tokens=8)
    specs = [SpecConfig(method="ngram", depth=2, topk=1, budget=3)]
    prof = make_profile(engine.target, prompts[:1], ["p0"], specs, params, engine.eos, engine.max_context,
                        model="tiny-random", hf_id="x/y", fp8=False, workload="code")
    path = prof.save(tmp_path)
    back = load_profile(tmp_path)
    assert path.name == "profile.json" and back.model == "tiny-random" and back.exact
    assert back.tau(SpecConfig(method="off")) == pytest.approx(1.0)  # 'off' is always profiled
    assert back.tau(specs[0]) == prof.points[1]["tau"]
    assert back.tau(SpecConfig(method="ngram", depth=5, topk=1, budget=6)) is None
    with pytest.raises(UserError, match="acceptance profile"):
        load_profile(tmp_path / "nothing.json")


def test_fp8_deployment_profiles_fp8_weights() -> None:
    """deploy.quantization=fp8: the profile replays the FP8-rounded target, and its greedy tau equals
    the live engine's under engine.builtin.weights=fp8 (the weights that will be served)."""
    from tuner.projection.profiling import profile_config

    over = ["model=tiny-random", "+workload=code", "search.trial_prompts=2", "workload.max_new_tokens=24"]
    spec = SpecConfig(method="ngram", depth=3, topk=1, budget=4, ngram_min=1, ngram_max=1)
    fp8 = profile_config(load_config([*over, "deploy=vllm"]), [spec])
    full = profile_config(load_config(over), [spec])
    assert fp8.fp8 and not full.fp8
    # e4m3 rounding changes the tiny model's greedy continuation: these really are other weights
    assert [s["tokens"] for s in fp8.sequences] != [s["tokens"] for s in full.sequences]
    live = open_engine(load_config([*over, "engine.builtin.weights=fp8", "spec.method=off"]))
    from engine.measure.workloads import load_prompts

    params = SamplingParams(max_new_tokens=24, seed=0)
    prompts = [live.encode_prompt(p.text, True) for p in load_prompts(load_config(over).workload, "tune")[:2]]
    assert [live.generate(p, params).tokens for p in prompts] == [s["tokens"][:s["n_new"]] for s in fp8.sequences]
    tau, _, _, _ = _live(live, prompts, spec, params)
    assert fp8.tau(spec) == tau


@pytest.mark.slow
def test_smollm2_ngram_tau_equals_live() -> None:
    """The real model: n-gram chains profiled once equal the engine's tau on the same prompts."""
    from tuner.projection.profiling import profile_config
    from engine.measure.workloads import load_prompts

    over = ["+workload=code", "search.trial_prompts=2", "workload.max_new_tokens=24"]
    cfg = load_config(over)
    specs = [SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1, ngram_min=m, ngram_max=4)
             for d, m in ((4, 2), (6, 1))]
    prof = profile_config(cfg, specs)
    eng = open_engine(load_config([*over, "spec.method=off"]))
    params = SamplingParams(max_new_tokens=24, seed=0)
    prompts = [eng.encode_prompt(p.text, True) for p in load_prompts(cfg.workload, "tune")[:2]]
    taus = []
    for spec in specs:
        tau, acc, _, _ = _live(eng, prompts, spec, params)
        assert prof.tau(spec) == tau
        taus.append(tau)
    assert max(taus) > 1.2  # the real model's code answers repeat the prompt: drafts are accepted


@pytest.mark.parametrize("shape", [(3, 1, 4), (3, 2, 5)], ids=lambda s: "d%d k%d b%d" % s)
def test_eagle3_reads_inner_layers_from_the_reference(engine: Engine, prompts, shape) -> None:
    """EAGLE-3 drafts from inner target layers: the reference pass keeps their inputs and the replay
    hands them over as the engine does; same tau, same trees (a random EAGLE-3 head)."""
    d, k, b = shape
    spec = SpecConfig(method="eagle3", depth=d, topk=k, budget=b)
    params = SamplingParams(max_new_tokens=N_NEW)
    layers = make_drafter(spec, engine.target, engine.seed).aux_layers
    assert layers
    refs = [reference_pass(engine.target, p, params, engine.eos, engine.max_context, aux_layers=layers)
            for p in prompts]
    tau, acc, drafted, live_trees = _live(engine, prompts, spec, params)
    res, trees = _replayed(engine, refs, spec, params)
    assert res.tau == tau and res.drafted_tokens == drafted and trees == live_trees
