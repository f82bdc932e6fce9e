"""EAGLE-3 on the tiny random Llama (4 layers): vLLM's checkpoint layout, the d2t/t2d mapping, the
head's in-place cache against a from-scratch forward, the engine's aux-state plumbing, and greedy
output token-identical to autoregressive with random and trained heads, chains and trees."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from engine.api import SamplingParams
from engine.models.cache import KVBuffer
from engine.drafters import Eagle3Drafter
from engine.drafters.base import to_target_vocab
from engine.models.eagle_head import random_head, save_head
from engine.models.eagle3_head import (Eagle3Head, aux_hidden_states, default_aux_layers, init_eagle3, load_eagle3,
                           save_eagle3)
from engine.decode.loop import Engine
from tuner.study.measurer import open_engine
from engine.trees.tree import Tree
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig, UserError

AUX = (1, 2, 3)  # distinct layers, so a swapped or shifted layer would show
N_NEW = 32
PROMPTS = ["def fib(n):", "Write a haiku about the sea.", "a b c d a b c d a b"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return open_engine(load_config(["model=tiny-random", "model.num_layers=4", "spec.method=off"]))


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    return [engine.encode_prompt(p, True) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(engine: Engine, prompts) -> list[list[int]]:
    engine.set_spec(SpecConfig(method="off"))
    return [engine.generate(p, SamplingParams(max_new_tokens=N_NEW)).tokens for p in prompts]


def _subset(vocab: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:n]


def _perturbed_head(engine: Engine, n_vocab: int = 3000, seed: int = 0, aux=AUX) -> Eagle3Head:
    """A head over a random draft vocabulary with every weight random (norms included), so a
    save/load that dropped or swapped any tensor changes the logits."""
    head = init_eagle3(engine.model, _subset(engine.model.config.vocab_size, n_vocab, seed), aux, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return head.eval()


def _inputs(head: Eagle3Head, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = head.config.hidden_size
    return torch.randn(1, t, h, generator=g), torch.randn(1, t, 3 * h, generator=g), torch.arange(t)[None]


def test_save_load_same_logits_and_vllm_layout(engine: Engine, tmp_path) -> None:
    from safetensors import safe_open

    head = _perturbed_head(engine)
    out = save_eagle3(head, tmp_path / "h3")
    cfg = engine.model.config
    h, v, kv = cfg.hidden_size, cfg.vocab_size, cfg.num_key_value_heads * cfg.head_dim
    inter, dv = cfg.intermediate_size, head.draft_vocab_size
    expected = {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (cfg.num_attention_heads * cfg.head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h), "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, cfg.num_attention_heads * cfg.head_dim),
        "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,),
        "lm_head.weight": (dv, h), "d2t": (dv,), "t2d": (v,),
    }
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(expected)
        shapes = {k: tuple(f.get_tensor(k).shape) for k in f.keys()}
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert shapes == expected
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["num_hidden_layers"] == 1
    assert conf["draft_vocab_size"] == dv == 3000 and conf["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert conf["hidden_size"] == h and conf["vocab_size"] == v and conf["tie_word_embeddings"] is False

    back = load_eagle3(out, cfg).eval()
    assert back.aux_layers == AUX and torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
    emb, aux, pos = _inputs(head, 7)
    with torch.no_grad():
        a = head.logits(head(emb, head.fuse(aux), pos))
        b = back.logits(back(emb, back.fuse(aux), pos))
    assert a.shape == (1, 7, dv) and torch.equal(a, b)


def test_d2t_t2d_round_trip(engine: Engine) -> None:
    v = engine.model.config.vocab_size
    ids = torch.cat([_subset(v, 500, 3), torch.tensor([0, v - 1, 7, 7])])  # duplicates, unsorted, both ends
    head = init_eagle3(engine.model, ids, AUX)
    want = torch.unique(ids)
    assert head.draft_vocab_size == want.numel()
    tids = head.to_target_ids(torch.arange(head.draft_vocab_size))
    assert torch.equal(tids, want) and torch.equal(head.target_ids(), want)
    assert int(head.t2d.sum()) == want.numel() and bool(head.t2d[tids].all())
    # back: the draft id of a target id in the vocabulary is its rank among the marked ids
    back = torch.cumsum(head.t2d.long(), 0) - 1
    assert torch.equal(back[tids], torch.arange(head.draft_vocab_size))
    # lm_head rows start as the target's (tied) embedding rows of the draft vocabulary
    assert torch.equal(head.lm_head.weight, engine.model.get_output_embeddings().weight[want])
    assert default_aux_layers(32) == (2, 16, 29) and default_aux_layers(2) == (1, 1, 1)


def test_tree_built_in_draft_ids_maps_to_target_ids() -> None:
    vocab = torch.tensor([3, 10, 11, 40])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tree = Tree(tokens=[99, 2, 0, 3], parents=[-1, 0, 1, 2], depths=[0, 1, 2, 3], q={1: q}, sampled={1: [0, 1]})
    out = to_target_vocab(tree, vocab, 50)
    assert out.tokens == [99, 11, 3, 40] and out.parents == tree.parents and out.sampled == {1: [3, 10]}
    assert out.q[1].shape == (50,) and torch.equal(out.q[1][vocab], q) and float(out.q[1].sum()) == pytest.approx(1.0)


def test_cached_incremental_forward_equals_from_scratch(engine: Engine) -> None:
    head = _perturbed_head(engine, seed=1)
    t = 12
    emb, aux, pos = _inputs(head, t, seed=2)
    with torch.no_grad():
        full = head(emb, head.fuse(aux), pos)  # causal, no cache
        cache = KVBuffer()
        first = head(emb[:, :5], head.fuse(aux[:, :5]), pos[:, :5], None, cache)
        buf = cache.k.data_ptr()
        rest = head(emb[:, 5:], head.fuse(aux[:, 5:]), pos[:, 5:], None, cache)  # causal after a prefix
        # fp32: the kernels block 5, 7 and 12 rows differently (on an AVX-512 Xeon 1.2e-5 apart); a
        # wrong position or mask is off by orders of magnitude more
        torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-4, atol=1e-4)
        # a tree step: two sibling nodes at position t, then rollback; the buffer never moves
        feats = full[:, -1:].expand(1, 2, -1)
        mask = torch.ones(1, 1, 2, t + 2, dtype=torch.bool)
        mask[..., t:] = torch.eye(2, dtype=torch.bool)
        node = head(emb[:, :2], feats, torch.full((1, 2), t), mask, cache)
        assert cache.length == t + 2 and cache.k.data_ptr() == buf
        for i in range(2):  # each sibling equals a from-scratch causal forward with it appended
            e = torch.cat([emb, emb[:, i:i + 1]], 1)
            f = torch.cat([head.fuse(aux), full[:, -1:]], 1)
            ref = head(e, f, torch.arange(t + 1)[None])[:, -1]
            torch.testing.assert_close(node[:, i], ref, rtol=1e-5, atol=1e-5)
        cache.crop(t)
        again = head(emb[:, :2], feats, torch.full((1, 2), t), mask, cache)
        assert torch.equal(again, node) and cache.k.data_ptr() == buf


def _check_greedy(engine: Engine, prompts, reference, spec: SpecConfig) -> tuple[int, int]:
    drafted = accepted = 0
    for p, ref in zip(prompts, reference):
        res = engine.generate(p, SamplingParams(max_new_tokens=N_NEW))
        assert res.tokens == ref
        st = res.stats
        assert st.accepted_tokens <= st.drafted_tokens and sum(st.accepted_per_pos) == st.accepted_tokens
        drafted += st.drafted_tokens
        accepted += st.accepted_tokens
    assert drafted > 0
    return drafted, accepted


SPECS = [SpecConfig(method="eagle3", depth=3, topk=1, budget=4), SpecConfig(method="eagle3", depth=4, topk=3, budget=10)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_random_head_greedy_identical_to_autoregressive(engine: Engine, prompts, reference, spec) -> None:
    engine.set_spec(spec)  # no head_path: the seeded random head over the full vocabulary
    assert isinstance(engine.drafter, Eagle3Drafter) and engine.drafter.draft_vocab is None
    _check_greedy(engine, prompts[:1], reference[:1], spec)  # its 49k-row lm_head is the slow part
    sub = Eagle3Drafter(spec, _perturbed_head(engine), engine.model)
    assert sub.draft_vocab is not None
    engine.set_drafter(sub, spec)
    _check_greedy(engine, prompts[1:], reference[1:], spec)
    engine.set_spec(SpecConfig(method="off"))


@pytest.mark.parametrize("forward", ["hf", "lean"])
def test_engine_hands_the_drafter_aligned_aux_states(engine: Engine, prompts, forward: str) -> None:
    """Over a generation with trees, the aux states observed equal one forward over the final text;
    the layers are out of order and repeated, as vLLM's default gives for small targets."""
    if forward == "lean":
        engine = open_engine(load_config(["model=tiny-random", "model.num_layers=4", "spec.method=off",
                                                 "engine.builtin.forward=lean"]))
        assert engine.lean is not None and engine.model is not None
    spec = SpecConfig(method="eagle3", depth=3, topk=2, budget=6)
    aux_layers = (3, 1, 1)
    seen = []

    class Spy(Eagle3Drafter):
        def observe(self, features, aux=None):
            seen.append(aux.clone())
            super().observe(features, aux)

    engine.set_drafter(Spy(spec, _perturbed_head(engine, seed=4, aux=aux_layers), engine.model), spec)
    res = engine.generate(prompts[0], SamplingParams(max_new_tokens=N_NEW))
    engine.set_spec(SpecConfig(method="off"))
    ids = prompts[0] + res.tokens
    with torch.inference_mode():
        want = aux_hidden_states(engine.model, torch.tensor([ids[:-1]]), aux_layers)[0]
    got = torch.cat(seen)
    assert got.shape == want.shape == (len(ids) - 1, 3 * engine.model.config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _fit_head(engine: Engine, ids: list[int], steps: int = 60) -> Eagle3Head:
    """Overfit a head to one greedy text (step 0 on the target's features, then 2 unrolled steps on
    its own), through the same aux_hidden_states a trainer uses."""
    model = engine.model
    x = torch.tensor([ids])
    with torch.no_grad():
        aux = aux_hidden_states(model, x, AUX)
    head = init_eagle3(model, torch.unique(x), AUX, seed=0)
    embed = model.get_input_embeddings()
    labels = head.t2d.long().cumsum(0) - 1  # target id -> draft id
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    n = x.shape[1] - 1
    for _ in range(steps):
        cache, feat, loss = KVBuffer(), head.fuse(aux[:, :n]), 0.0
        for j in range(3):
            m = n - j - 1  # input position t: token t+1+j; label token t+2+j
            e = embed(torch.cat([x[:, 1 + j:], x.new_zeros(1, j)], 1))  # index t: token t+1+j (padded)
            mask = None if j == 0 else torch.cat([torch.ones(n, n).tril()] + [torch.eye(n)] * j, 1).bool()[None, None]
            feat = head(e.detach(), feat, torch.arange(n)[None] + j, mask, cache)
            logits = head.logits(feat[:, :m])
            loss = loss + 0.8 ** j * F.cross_entropy(logits[0], labels[x[0, 2 + j:n + 1]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def fitted(engine: Engine, prompts, reference) -> Eagle3Head:
    return _fit_head(engine, prompts[0] + reference[0])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_trained_head_is_accepted_and_exact(engine: Engine, prompts, reference, fitted, spec) -> None:
    engine.set_drafter(Eagle3Drafter(spec, fitted, engine.model), spec)
    res = engine.generate(prompts[0], SamplingParams(max_new_tokens=N_NEW))
    engine.set_spec(SpecConfig(method="off"))
    assert res.tokens == reference[0]
    # a head fitted to this very text must be accepted most of the time, at depth too
    assert res.stats.tau > 2.0 and res.stats.accepted_per_pos[1] > 0


def test_bad_head_dirs_are_refused_in_one_line(engine: Engine, tmp_path) -> None:
    cfg = engine.model.config
    spec = lambda p: SpecConfig(method="eagle3", depth=2, topk=1, budget=3, head_path=str(p))  # noqa: E731
    save_head(random_head(cfg), tmp_path / "eagle1")
    good = save_eagle3(_perturbed_head(engine), tmp_path / "good")
    other = load_config(["model=tiny-random", "model.num_layers=4", "model.hidden_size=32",
                         "model.num_attention_heads=2", "model.num_kv_heads=1"]).model
    from engine.models.target import random_llama

    save_eagle3(init_eagle3(random_llama(other), torch.arange(100), AUX), tmp_path / "small")
    (tmp_path / "empty").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((good / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    state = load_file(str(good / "model.safetensors"))
    del state["midlayer.hidden_norm.weight"]
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text((good / "config.json").read_text())
    save_file(state, str(tmp_path / "partial" / "model.safetensors"))
    cases = {"empty": "no config.json", "eagle1": "not an EAGLE-3 head", "small": "hidden_size 32",
             "noweights": "no model.safetensors", "partial": "midlayer.hidden_norm.weight"}
    for name, why in cases.items():
        with pytest.raises(UserError) as err:
            engine.set_spec(spec(tmp_path / name))
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("spec.head_path=") and why in msg, msg
    engine.set_spec(spec(good))
    assert isinstance(engine.drafter, Eagle3Drafter)
    engine.set_spec(SpecConfig(method="off"))


def test_aux_features_stack_the_layers_in_the_heads_order() -> None:
    """The one concatenation every EAGLE-3 path uses (engine forward, lean forward, data, profile):
    the layers in aux_layers' order (a repeated layer twice), each indexed by the same rows."""
    from engine.models.eagle3_head import aux_features

    states = {k: torch.full((3, 2, 4), float(k)) for k in (1, 2, 5)}
    out = aux_features(states, (5, 1, 1), (0, slice(None, 1)))
    assert out.shape == (1, 12) and out[0].tolist() == [5.0] * 4 + [1.0] * 8
    assert aux_features(states, (), 0) is None and aux_features(states, None) is None
