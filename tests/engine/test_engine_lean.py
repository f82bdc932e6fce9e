"""engine/models/llama.py and forward.py, the lean forward: logits equal the HF model's (prefill, decode, chains, branching
trees, other architectures), its static cache's commit/rollback equals recomputation from scratch,
greedy output is token-identical to autoregressive for every drafter, compiled equals eager."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from engine.api import SamplingParams
from engine.drafters import DraftModelDrafter
import engine.models.kernels as kernels
import engine.models.machine as machine
from engine.models.kernels import (FORMS, PLAN_ROWS, LinearPlan, calibrate_linears, linear, linear_plan, pack_weights,
                                   set_linear_plan)
from engine.models.forward import LeanForward, additive_mask, lean_forward
from engine.models.kvpool import BUCKETS, KVCache
from engine.models.llama import LeanLlama, check_supported
from engine.decode.loop import Engine
from tuner.study.measurer import open_engine
from engine.models.target import load_target
from engine.trees.tree import Tree
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig, UserError

PROMPTS = ["def fib(n):", "Write a haiku about the sea.", "a b c d a b c d a b c d a b"]
N_NEW = 32
ATOL = 1e-4  # fp32: summation order differs (fused projections, oneDNN), nothing else

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    """(the HF-forward engine, the lean one) over the same loaded target."""
    over = ["model=tiny-random", "spec.method=off"]
    return open_engine(load_config(over)), open_engine(load_config([*over, "engine.builtin.forward=lean"]))


@pytest.fixture(scope="module")
def prompts(engines) -> list[list[int]]:
    return [engines[0].encode_prompt(p, True) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(engines, prompts) -> list[list[int]]:
    hf = engines[0]
    hf.set_spec(SpecConfig(method="off"))
    return [hf.generate(p, SamplingParams(max_new_tokens=N_NEW)).tokens for p in prompts]


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def _random_tree(rng: random.Random, n: int, vocab: int) -> Tree:
    parents, depths = [-1], [0]
    for i in range(1, n):
        p = rng.randrange(i)
        parents.append(p)
        depths.append(depths[p] + 1)
    return Tree([rng.randrange(vocab) for _ in range(n)], parents, depths)


def _path(tree: Tree, node: int) -> list[int]:
    out = [node]
    while tree.parents[out[-1]] >= 0:
        out.append(tree.parents[out[-1]])
    return out[::-1]


def test_logits_equal_hf_prefill_decode_chain_tree(engines) -> None:
    hf = engines[0].model
    fw = LeanForward(LeanLlama(hf))
    rng = random.Random(0)
    ids = [rng.randrange(49152) for _ in range(11)]
    with torch.inference_mode():
        cache = fw.new_cache(64)
        hidden, logits, _ = fw.step(cache, ids)
        ref = _hf_logits(hf, ids)
        assert torch.allclose(logits, ref, atol=ATOL) and hidden.shape == (11, hf.config.hidden_size)
        for tok in (5, 900):  # decode steps
            ids.append(tok)
            _, logits, _ = fw.step(cache, [tok])
            assert torch.allclose(logits[0], _hf_logits(hf, ids)[-1], atol=ATOL)
        chain = [7, 8, 9, 10]
        _, logits, _ = fw.step(cache, chain)
        assert torch.allclose(logits, _hf_logits(hf, ids + chain)[-4:], atol=ATOL)
        cache.crop(len(ids))
        tree = _random_tree(rng, 9, 49152)
        assert not tree.is_chain
        _, logits, _ = fw.step(cache, tree.tokens, tree.depths, tree.ancestors())
        for node in range(tree.size):  # each node sees the prefix and its ancestors only
            want = _hf_logits(hf, ids + [tree.tokens[i] for i in _path(tree, node)])[-1]
            assert torch.allclose(logits[node], want, atol=ATOL), node


def test_padded_rows_change_nothing(engines) -> None:
    """A tree padded to its bucket (what compiled steps run) gives the unpadded logits and cache."""
    hf = engines[0].model
    plain, padded = LeanForward(LeanLlama(hf)), LeanForward(LeanLlama(hf))
    padded.rows_for = lambda n: 16  # as a compiled forward's bucket would
    rng = random.Random(1)
    ids = [rng.randrange(49152) for _ in range(6)]
    tree = _random_tree(rng, 5, 49152)
    with torch.inference_mode():
        outs = []
        for fw in (plain, padded):
            cache = fw.new_cache(64)
            fw.step(cache, ids)
            _, logits, _ = fw.step(cache, tree.tokens, tree.depths, tree.ancestors())
            cache.commit(len(ids), [0, 1])
            _, nxt, _ = fw.step(cache, [3])
            outs.append((logits, nxt))
    assert torch.allclose(outs[0][0], outs[1][0], atol=ATOL) and torch.allclose(outs[0][1], outs[1][1], atol=ATOL)


def test_additive_mask_layout() -> None:
    anc = Tree([1, 2, 3], [-1, 0, 0], [0, 1, 1]).ancestors()
    m = additive_mask(2, 3, anc, 4, 6, torch.device("cpu"), torch.float32)
    seen = (m == 0).int().tolist()
    assert seen == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 1]]


def test_commit_and_rollback_equal_recomputation(engines) -> None:
    """Trees whose accepted paths are not the first nodes move entries in place; the cache then
    equals a fresh prefill of the committed tokens, and so do the next step's logits."""
    hf = engines[0].model
    fw = LeanForward(LeanLlama(hf))
    rng = random.Random(2)
    ids = [rng.randrange(49152) for _ in range(8)]
    with torch.inference_mode():
        cache = fw.new_cache(128)
        fw.step(cache, ids[:-1])
        for _ in range(4):
            tree = _random_tree(rng, 10, 49152)
            tree.tokens[0] = ids[-1]
            fw.step(cache, tree.tokens, tree.depths, tree.ancestors())
            path = _path(tree, rng.randrange(1, tree.size))
            prefix = len(ids) - 1
            cache.commit(prefix, path)
            ids += [tree.tokens[i] for i in path[1:]] + [rng.randrange(49152)]
            assert cache.length == len(ids) - 1
            fw.step(cache, [7, 8, 9])  # a rejected chain: rollback is a length change
            cache.crop(len(ids) - 1)
        fresh = fw.new_cache(128)
        fw.step(fresh, ids[:-1])
        n = len(ids) - 1
        for a, b in zip(cache.k + cache.v, fresh.k + fresh.v):
            assert torch.allclose(a[:, :n], b[:, :n], atol=ATOL)
        _, logits, _ = fw.step(cache, ids[-1:])
        assert torch.allclose(logits[0], _hf_logits(hf, ids)[-1], atol=ATOL)


class Oracle(DraftModelDrafter):
    """Drafts with the target itself, sharpened so the greedy path survives the budget cut: every
    step accepts whole paths, through branching trees (commits that move entries)."""

    def _catch_up(self, ids):
        return super()._catch_up(ids) * 100

    def _run(self, *args):
        return super()._run(*args) * 100


SPECS = [
    SpecConfig(method="off"),
    SpecConfig(method="ngram", depth=4, topk=1, budget=5, ngram_min=1, ngram_max=2),
    SpecConfig(method="eagle", depth=4, topk=3, budget=10),
    SpecConfig(method="eagle3", depth=3, topk=2, budget=6),
    SpecConfig(method="draft_model", depth=4, topk=1, budget=5, draft_model="oracle"),
    SpecConfig(method="draft_model", depth=3, topk=2, budget=7, draft_model="oracle"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_greedy_identical_to_autoregressive(engines, prompts, reference, spec: SpecConfig) -> None:
    lean = engines[1]
    if spec.method == "draft_model":
        lean.set_drafter(Oracle(spec, lean.model), spec)
    else:
        lean.set_spec(spec)
    drafted = 0
    for p, ref in zip(prompts, reference):
        res = lean.generate(p, SamplingParams(max_new_tokens=N_NEW))
        assert res.tokens == ref
        drafted += res.stats.drafted_tokens
        if spec.method == "draft_model":  # the oracle's whole paths are accepted
            assert res.stats.accepted_tokens == spec.depth * res.stats.draft_steps
    assert spec.method in ("off", "ngram") or drafted > 0  # a random model rarely repeats itself
    lean.set_spec(SpecConfig(method="off"))


def test_medusa_greedy_identical(engines, prompts, reference) -> None:
    medusa = pytest.importorskip("engine.models.medusa_head")
    from engine.drafters.medusa import MedusaDrafter

    lean = engines[1]
    spec = SpecConfig(method="medusa", depth=3, topk=2, budget=7)
    heads = medusa.new_heads(lean.model, "tiny-random", 3).eval()
    lean.set_drafter(MedusaDrafter(spec, heads), spec)
    for p, ref in zip(prompts, reference):
        assert lean.generate(p, SamplingParams(max_new_tokens=N_NEW)).tokens == ref
    lean.set_spec(SpecConfig(method="off"))


def test_aux_states_equal_hf_hidden_states(engines) -> None:
    hf = engines[0].model
    fw = LeanForward(LeanLlama(hf))
    ids = list(range(100, 112))
    with torch.inference_mode():
        _, _, aux = fw.step(fw.new_cache(32), ids, aux_layers=(0, 1))
        hs = hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert torch.allclose(aux, torch.cat([hs[0][0], hs[1][0]], dim=-1), atol=ATOL)


def _tiny_hf(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    if kind == "qwen2":
        cfg, cls = Qwen2Config(**common, tie_word_embeddings=False), Qwen2ForCausalLM
    else:  # Llama 3.1's rope scaling, untied head
        cfg, cls = LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if kind == "qwen2":  # biases are zero at init: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_()
                layer.self_attn.k_proj.bias.normal_()
    return model


@pytest.mark.parametrize("kind", ["qwen2", "llama3-rope"])
def test_other_architectures_match_hf(kind: str) -> None:
    """The architectures of conf/model (Llama 3.x rope scaling, Qwen2.5 q/k/v biases, untied heads)."""
    hf = _tiny_hf(kind)
    fw = LeanForward(LeanLlama(hf))
    ids = list(range(1, 200, 3))  # past the rope scaling's original context
    with torch.inference_mode():
        _, logits, _ = fw.step(fw.new_cache(128), ids)
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    assert torch.allclose(logits, ref, atol=ATOL)


def test_unsupported_architectures_refused_in_one_line() -> None:
    from transformers import LlamaConfig, MistralConfig

    with pytest.raises(UserError, match=r"model type mistral is not supported .*forward=hf"):
        check_supported(MistralConfig())
    with pytest.raises(UserError, match="rope_type dynamic"):
        check_supported(LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}))
    for name, hw in (("smollm2-135m", "cpu"), ("llama-3.1-8b-instruct", "h100x8"), ("qwen2.5-7b-instruct", "h100x8")):
        # (an 8B model in fp32 does not fit the cpu profile's host: refused for engine=builtin there)
        cfg = load_config([f"model={name}", f"hardware={hw}", "engine.builtin.forward=lean"])
        assert cfg.engine.builtin.forward == "lean"


def test_cache_full_is_an_error(engines) -> None:
    fw = LeanForward(LeanLlama(engines[0].model))
    cache = KVCache(fw.model, 8)
    with torch.inference_mode(), pytest.raises(ValueError, match="KV cache full"):
        fw.step(cache, list(range(9)))


def test_compiled_equals_eager(prompts, reference) -> None:
    """One compiled engine (inductor, artifacts in the on-disk cache): AR and a branching-tree
    drafter give the eager tokens. Small on purpose: compiling takes tens of seconds on 2 cores."""
    cfg = load_config(["model=tiny-random", "spec.method=off", "engine.builtin.forward=lean",
                       "engine.builtin.compile=true", "engine.builtin.native_step=false"])
    eng = open_engine(cfg)
    # on CPU only the one-row step is compiled, and no step is padded (CUDA pads to BUCKETS)
    assert eng.lean.compiled and eng.lean.rows_for(5) == 5 and eng.lean.rows_for(100) == 100
    assert BUCKETS[-1] == 64
    spec = SpecConfig(method="draft_model", depth=2, topk=2, budget=4, draft_model="oracle")
    for drafter in (None, Oracle(spec, eng.model)):
        eng.set_drafter(drafter, spec if drafter else SpecConfig(method="off"))
        res = eng.generate(prompts[0], SamplingParams(max_new_tokens=12))
        assert res.tokens == reference[0][:12]
    assert eng.lean.compile_s > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_equal_eager() -> None:
    """On CUDA the compiled layer runs under CUDA graphs ("reduce-overhead"): same tokens as eager."""
    over = ["model=tiny-random", "spec.method=off", "engine.builtin.device=cuda", "engine.builtin.forward=lean"]
    eager = open_engine(load_config(over))
    comp = open_engine(load_config([*over, "engine.builtin.compile=true"]))
    p = eager.encode_prompt(PROMPTS[0], True)
    spec = SpecConfig(method="ngram", depth=4, topk=1, budget=5)
    for e in (eager, comp):
        e.set_spec(spec)
    assert comp.generate(p, SamplingParams(max_new_tokens=24)).tokens == \
        eager.generate(p, SamplingParams(max_new_tokens=24)).tokens


@pytest.mark.slow
def test_smollm2_logits_equal_hf() -> None:
    cfg = load_config(["model=smollm2-135m", "engine.builtin.onednn_linears=false", "engine.builtin.weights=fp32"])
    target = load_target(cfg.model, cfg.engine.builtin, cfg.cache_dir, cfg.seed)
    fw = lean_forward(target)
    ids = target.tokenizer.encode("def quicksort(xs):\n    ")
    tree = Tree([11, 12, 13, 14, 15], [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2])
    with torch.inference_mode():
        cache = fw.new_cache(64)
        _, first, _ = fw.step(cache, ids)
        _, logits, _ = fw.step(cache, tree.tokens, tree.depths, tree.ancestors())
        assert torch.allclose(first, _hf_logits(target.model, ids), atol=1e-3)
        for node in range(tree.size):
            want = _hf_logits(target.model, ids + [tree.tokens[i] for i in _path(tree, node)])[-1]
            assert torch.allclose(logits[node], want, atol=1e-3)


@pytest.fixture
def restore_plan():
    """Tests that set or calibrate the process's LinearPlan put the one before back."""
    before = linear_plan()
    yield
    set_linear_plan(before)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_every_cpu_linear_path_equals_f_linear(rows: int, bias: bool, form: str, restore_plan) -> None:
    """Each form a LinearPlan can name for a packed weight (oneDNN on the packed copy, MKL, MKL as
    w @ x.T, the few-row kernel in passes of 8 rows, its last block of columns padded: 96 is not a
    multiple of its block), and a plain weight's own rule (w @ x.T for 2-4 rows, oneDNN otherwise),
    with and without a bias (Qwen2's q/k/v): the same product as F.linear."""
    set_linear_plan(LinearPlan(tuple((n, form) for n in PLAN_ROWS)))
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 64, generator=g), torch.randn(rows, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    ref = torch.nn.functional.linear(x, w, b)
    plain = linear(x, w, b)
    packed_w = w.clone()
    assert pack_weights([packed_w]) and packed_w._onednn_packed is not None
    packed = linear(x, packed_w, b)
    for out in (plain, packed):
        assert out.shape == ref.shape and out.is_contiguous()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_plan_names_a_form_for_every_row_count() -> None:
    plan = LinearPlan(((1, "mkl"), (2, "wxt"), (4, "mkl"), (8, "onednn")))
    assert [plan.form(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == ["mkl", "wxt", "mkl", "mkl", "onednn", "onednn",
                                                                  "onednn", "onednn"]
    assert LinearPlan().form(1) == "onednn" and LinearPlan().form(2) == "wxt" and LinearPlan().form(3) == "onednn"


def test_calibration_keeps_the_fastest_form_per_row_count_and_caches_it(tmp_path, monkeypatch, restore_plan) -> None:
    """With made-up timings the plan takes each row count's fastest form and the faster compiled
    one-row form; it becomes the process's plan; a second call reads the cached plan without timing
    anything, and a call for a compiled step adds only the compiled one-row form to it."""
    model = LeanLlama(open_engine(load_config(["model=tiny-random", "spec.method=off"])).model)
    fastest = {n: FORMS[n % len(FORMS)] for n in PLAN_ROWS}
    timed = []

    def fake(weights, rows, form, repeats):
        timed.append((rows, form))
        if form == "prodsum":
            return 0.2
        return 0.1 if form == fastest[rows] else 1.0 + (form == "mkl")  # MKL slower than the product-sum

    monkeypatch.setattr(kernels, "_time_form", fake)
    monkeypatch.setattr(machine, "others_share", lambda mark: 0.0)  # timed on a quiet machine
    set_linear_plan(LinearPlan())  # an eager calibration keeps the compiled one-row form it finds
    plan = calibrate_linears(model, tmp_path)
    assert plan.eager == tuple((n, fastest[n]) for n in PLAN_ROWS) and plan.compiled_one_row == "prodsum"
    assert linear_plan() == plan and {r for r, _ in timed} == set(PLAN_ROWS)
    # the forms take turns round by round (a load change on a shared machine hits them all)
    assert timed[:2 * len(FORMS)] == [(PLAN_ROWS[0], f) for f in FORMS] * 2
    assert plan.ms["2"] == {f: 100.0 if f == fastest[2] else 1000.0 + 1000.0 * (f == "mkl") for f in FORMS}
    timed.clear()
    compiled = calibrate_linears(model, tmp_path, compiled=True)
    assert timed == [(1, "prodsum"), (1, "mkl")] * kernels.CALIBRATE_ROUNDS, "within DROP_FACTOR: both every round"
    assert compiled.eager == plan.eager
    assert compiled.compiled_one_row == ("mkl" if fastest[1] == "mkl" else "prodsum")
    monkeypatch.setattr(kernels, "_time_form", lambda *a: pytest.fail("timed again instead of reading the cache"))
    assert calibrate_linears(model, tmp_path, compiled=True) == compiled


def test_a_form_far_behind_the_leader_is_timed_no_more(monkeypatch) -> None:
    """After DROP_AFTER rounds a form over DROP_FACTOR x the leader's best is dropped, keeping its best so
    far; one within that factor is timed every round and can still win in a later round."""
    times = {"a": [1.0] * 5, "b": [1.9, 1.9, 0.5, 1.9, 1.9], "c": [2.1] * 5}
    calls: list[str] = []

    def fake(weights, rows, form, repeats):
        calls.append(form)
        return times[form][calls.count(form) - 1]

    monkeypatch.setattr(kernels, "_time_form", fake)
    best = kernels._time_forms([], 1, ("a", "b", "c"), 5)
    assert calls.count("c") == kernels.DROP_AFTER and best["c"] == 2.1, "2.1x the leader: dropped, its best kept"
    assert calls.count("b") == 5 and best["b"] == 0.5, "within the factor: timed on, and wins in round 3"
    assert min(best, key=best.__getitem__) == "b"


def test_a_plan_timed_while_others_kept_the_cpus_busy_is_used_but_not_cached(tmp_path, monkeypatch, capsys,
                                                                              restore_plan) -> None:
    """Other processes kept 40% of the CPUs busy while the forms were timed: the plan is this
    process's, the cache keeps none and this process does not time it again (adding the compiled
    one-row form times that alone); the next process, timing quietly, caches its own."""
    model = LeanLlama(open_engine(load_config(["model=tiny-random", "spec.method=off"])).model)
    timed = []

    def fake(weights, rows, form, repeats):
        timed.append((rows, form))
        return 0.1 if form == "mkl" else 1.0

    monkeypatch.setattr(kernels, "_time_form", fake)
    monkeypatch.setattr(machine, "_LOADED_HERE", {})
    monkeypatch.setattr(machine, "others_share", lambda mark: 0.4)
    plan = calibrate_linears(model, tmp_path)
    assert linear_plan() == plan and plan.form(4) == "mkl" and not (tmp_path / "linear_plan.json").exists()
    assert "the linear plan was timed while other processes kept 40% of the CPUs busy" in capsys.readouterr().err
    timed.clear()
    assert calibrate_linears(model, tmp_path) == plan and timed == []
    compiled = calibrate_linears(model, tmp_path, compiled=True)
    assert {r for r, _ in timed} == {1} and compiled.eager == plan.eager  # the compiled one-row form alone
    assert not (tmp_path / "linear_plan.json").exists() and "40%" in capsys.readouterr().err  # loaded still
    monkeypatch.setattr(machine, "_LOADED_HERE", {})  # another process
    monkeypatch.setattr(machine, "others_share", lambda mark: 0.0)
    timed.clear()
    calibrate_linears(model, tmp_path)
    assert {r for r, _ in timed} == set(PLAN_ROWS)
    (got,) = json.loads((tmp_path / "linear_plan.json").read_text()).values()
    assert got["others"] == 0.0 and capsys.readouterr().err == ""


def test_small_targets_keep_the_default_plan(engines, tmp_path, restore_plan) -> None:
    set_linear_plan(LinearPlan())
    lean_forward(engines[1].target, cache_dir=str(tmp_path))
    assert linear_plan() == LinearPlan() and not (tmp_path / "linear_plan.json").exists()


def test_weights_are_not_packed_past_a_quarter_of_memory(monkeypatch) -> None:
    w = torch.randn(64, 64)
    page = os.sysconf("SC_PAGE_SIZE")
    monkeypatch.setattr(os, "sysconf", lambda name: (w.numel() * 4 * 4 - 1) // page if name == "SC_PHYS_PAGES" else page)
    assert not pack_weights([w]) and getattr(w, "_onednn_packed", None) is None
    # room for one packed copy but not two: oneDNN's only, and the plan never names the few-row form for it
    monkeypatch.setattr(os, "sysconf", lambda name: (w.numel() * 4 * 8 - 1) // page if name == "SC_PHYS_PAGES" else page)
    assert pack_weights([w]) and w._onednn_packed is not None and getattr(w, "_smallm_packed", None) is None
    assert "smallm" not in kernels.forms_for(w)


def test_the_few_row_kernel_builds_here_and_is_timed_by_the_calibration() -> None:
    """This machine kind has g++ (inductor needs it): the kernel builds, every packed weight carries
    its layout, and the calibration times it beside the other forms."""
    from engine.models import smallm

    assert smallm.library() is not None, smallm.error()
    w = torch.randn(smallm.BW * 3, 40)
    assert pack_weights([w]) and w._smallm_packed.shape == (3, 40, smallm.BW) and kernels.forms_for(w) == FORMS
    assert torch.equal(w._smallm_packed[1, :, 0], w[smallm.BW])  # block 1, column 0: output row BW, k-major


def test_packed_copies_lie_together_on_2mb_pages_with_their_own_values() -> None:
    """pack_weights places the few-row copies it makes in one buffer (smallm.on_huge_pages): in order,
    each at a 4 KB boundary, the buffer at a 2 MB one, so weights under 2 MB get huge pages too; each
    copy holds what `pack` makes of its weight (an overlap or a wrong offset would overwrite one)."""
    from engine.models import smallm

    assert smallm.library() is not None, smallm.error()
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(192, 2000 + 8 * i, generator=g) for i in range(3)]  # over 2 MB together, each less
    fmts = ["fp32", "bf16", "fp8"]
    assert pack_weights(ws, fmts)
    at = [w._smallm_packed.data_ptr() for w in ws]
    sizes = [w._smallm_packed.numel() * w._smallm_packed.element_size() for w in ws]
    assert at[0] % smallm.HUGE_PAGE == 0 and max(sizes) < smallm.HUGE_PAGE <= sum(sizes)
    assert at[1:] == [a + -(-n // 4096) * 4096 for a, n in zip(at, sizes[:-1])]
    for w, fmt in zip(ws, fmts):
        alone, scale = smallm.pack(w, fmt)
        assert w._smallm_scale == scale and torch.equal(w._smallm_packed.view(torch.uint8), alone.view(torch.uint8))


def test_the_compiled_one_row_linear_equals_f_linear() -> None:
    """Inside a compiled graph a one-row CPU linear is a product and a sum (what inductor fuses into
    one pass over the weight); it must stay the same product."""
    g = torch.Generator().manual_seed(0)
    w, x, b = torch.randn(96, 64, generator=g), torch.randn(1, 64, generator=g), torch.randn(96, generator=g)
    compiled = torch.compile(linear, dynamic=False)
    torch.testing.assert_close(compiled(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
