"""The built-in engine on the tiny random Llama: greedy output token-identical to autoregressive for
every drafter, an oracle drafter accepting whole paths, stops exactly where AR stops, streaming,
EAGLE heads in the public layout, draft-model tokenizer check, FP8 emulation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.api import SamplingParams
from engine.drafters import DraftModelDrafter
from engine.models.eagle_head import load_head, random_head, save_head
from engine.models.fp8 import apply_weights, quantize_e4m3
from engine.decode.loop import Engine
from tuner.study.measurer import open_engine
from engine.models.target import random_llama, smollm2_tokenizer_dir
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig, UserError

PROMPTS = ["def fib(n):", "Write a haiku about the sea.", "a b c d a b c d a b c d a b"]
N_NEW = 40


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    return [engine.encode_prompt(p, True) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(engine: Engine, prompts) -> list[list[int]]:
    engine.set_spec(SpecConfig(method="off"))
    return [engine.generate(p, SamplingParams(max_new_tokens=N_NEW)).tokens for p in prompts]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A different random Llama (1 layer, other seed) shipping the target's tokenizer."""
    cfg = load_config(["model=tiny-random", "model.num_layers=1"]).model
    out = tmp_path_factory.mktemp("draft")
    random_llama(cfg, seed=1).save_pretrained(str(out))
    for f in smollm2_tokenizer_dir().iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy(f, out / f.name)
    return out


SPECS = [
    SpecConfig(method="ngram", depth=4, topk=1, budget=5),
    SpecConfig(method="ngram", depth=2, topk=1, budget=3, ngram_min=1, ngram_max=2),
    SpecConfig(method="eagle", depth=3, topk=1, budget=4),
    SpecConfig(method="eagle", depth=4, topk=3, budget=10),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.key())
def test_greedy_identical_to_autoregressive(engine: Engine, prompts, reference, spec: SpecConfig) -> None:
    engine.set_spec(spec)
    drafted = 0
    for p, ref in zip(prompts, reference):
        res = engine.generate(p, SamplingParams(max_new_tokens=N_NEW))
        assert res.tokens == ref
        st = res.stats
        assert st.new_tokens == len(res.tokens) and st.accepted_tokens <= st.drafted_tokens
        assert st.target_forwards >= 1 + st.draft_steps and st.tau == pytest.approx(st.new_tokens / st.target_forwards)
        assert sum(st.accepted_per_pos) == st.accepted_tokens
        drafted += st.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("chain", [True, False])
def test_draft_model_greedy_identical(engine: Engine, prompts, reference, draft_dir, chain: bool) -> None:
    spec = (SpecConfig(method="draft_model", depth=3, topk=1, budget=4, draft_model=str(draft_dir)) if chain else
            SpecConfig(method="draft_model", depth=3, topk=2, budget=6, draft_model=str(draft_dir)))
    engine.set_spec(spec)
    for p, ref in zip(prompts, reference):
        res = engine.generate(p, SamplingParams(max_new_tokens=N_NEW))
        assert res.tokens == ref and res.stats.drafted_tokens > 0


class Oracle(DraftModelDrafter):
    """Drafts with the target itself, its logits sharpened so that the target's greedy path outscores
    every sibling branch and therefore always survives the EAGLE-2 budget cut."""

    def _catch_up(self, ids):
        return super()._catch_up(ids) * 100

    def _run(self, *args):
        return super()._run(*args) * 100


@pytest.mark.parametrize("depth,topk,budget", [(4, 1, 5), (3, 2, 7), (3, 3, 9)])
def test_oracle_drafter_accepts_whole_paths(engine: Engine, prompts, reference, depth, topk, budget) -> None:
    """Drafting with the target itself: every step accepts `depth` tokens plus the bonus, so the KV
    pruning (index_select for branching trees) and the bonus token are exercised on every step."""
    spec = SpecConfig(method="draft_model", depth=depth, topk=topk, budget=budget, draft_model="oracle")
    engine.set_drafter(Oracle(spec, engine.model), spec)
    try:
        for p, ref in zip(prompts, reference):
            res = engine.generate(p, SamplingParams(max_new_tokens=N_NEW))
            st = res.stats
            assert res.tokens == ref
            assert st.accepted_tokens == depth * st.draft_steps
            assert st.accepted_per_pos == [st.draft_steps] * depth
            assert st.target_forwards == 1 + -(-(N_NEW - 1) // (depth + 1))
    finally:
        engine.set_spec(SpecConfig(method="off"))


def _stop_cases(engine: Engine, prompt: list[int], ref: list[int]) -> list[tuple[SamplingParams, set[int] | None]]:
    text = engine.tokenizer.decode(ref)
    mid = engine.tokenizer.decode(ref[:15])
    stop = text[len(mid) - 1: len(mid) + 2]  # spans a token boundary inside the output
    return [
        (SamplingParams(max_new_tokens=N_NEW, stop=[stop]), None),
        (SamplingParams(max_new_tokens=N_NEW, stop=["\x00never", stop[-2:]]), None),
        (SamplingParams(max_new_tokens=7), None),
        (SamplingParams(max_new_tokens=1), None),
        (SamplingParams(max_new_tokens=N_NEW), {ref[11]}),  # an EOS that the model emits
    ]


@pytest.mark.parametrize("spec", [SpecConfig(method="ngram", depth=4, topk=1, budget=5),
                                  SpecConfig(method="draft_model", depth=3, topk=2, budget=7, draft_model="oracle")],
                         ids=lambda s: s.key())
def test_stops_where_autoregressive_stops(engine: Engine, prompts, reference, spec: SpecConfig) -> None:
    eos = engine.eos
    try:
        for p, ref in zip(prompts, reference):
            for params, eos_override in _stop_cases(engine, p, ref):
                engine.eos = eos_override or eos
                engine.set_spec(SpecConfig(method="off"))
                ar = engine.generate(p, params)
                if spec.draft_model == "oracle":
                    engine.set_drafter(Oracle(spec, engine.model), spec)
                else:
                    engine.set_spec(spec)
                streamed: list[int] = []
                sp = engine.generate(p, params, on_tokens=streamed.extend)
                assert (sp.tokens, sp.text, sp.finish_reason) == (ar.tokens, ar.text, ar.finish_reason)
                assert streamed == sp.tokens
                assert len(sp.tokens) <= params.max_new_tokens
                for s in params.stop:
                    assert s not in sp.text
                    assert s not in engine.tokenizer.decode(streamed)
                if eos_override:
                    assert sp.finish_reason == "stop" and not (set(sp.tokens) & eos_override)
                    assert sp.tokens == ref[:ref.index(next(iter(eos_override)))]
                elif params.stop and params.stop[0] != "\x00never":
                    assert sp.finish_reason == "stop" and len(sp.tokens) < len(ref)
                    assert engine.tokenizer.decode(ref).startswith(sp.text)
    finally:
        engine.eos = eos
        engine.set_spec(SpecConfig(method="off"))


def test_sampling_reproducible_with_seed(engine: Engine, prompts) -> None:
    for spec in [SpecConfig(method="off"), SpecConfig(method="eagle", depth=3, topk=2, budget=5),
                 SpecConfig(method="eagle", depth=3, topk=1, budget=4),
                 SpecConfig(method="ngram", depth=3, topk=1, budget=4)]:
        engine.set_spec(spec)
        params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=3)
        a = engine.generate(prompts[0], params)
        b = engine.generate(prompts[0], params)
        assert a.tokens == b.tokens and len(a.tokens) > 0
    engine.set_spec(SpecConfig(method="off"))


def test_eagle_head_public_layout_roundtrip(engine: Engine, prompts, reference, tmp_path) -> None:
    head = random_head(engine.model.config, seed=5)
    save_head(head, tmp_path / "head")
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "head" / "model.safetensors")))
    assert keys == {"fc.weight", "layers.0.post_attention_layernorm.weight",
                    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    loaded = load_head(tmp_path / "head", engine.model.config)
    h = engine.model.config.hidden_size
    x, f = torch.randn(1, 5, h), torch.randn(1, 5, h)
    pos = torch.arange(5)[None]
    with torch.inference_mode():
        assert torch.allclose(head(x, f, pos)[0], loaded(x, f, pos)[0])
        # embedding first in the concatenation: swapping the halves changes the output
        assert not torch.allclose(head(f, x, pos)[0], head(x, f, pos)[0])
    engine.set_spec(SpecConfig(method="eagle", depth=3, topk=2, budget=6, head_path=str(tmp_path / "head")))
    for p, ref in zip(prompts, reference):
        assert engine.generate(p, SamplingParams(max_new_tokens=N_NEW)).tokens == ref
    engine.set_spec(SpecConfig(method="off"))


def test_eagle_head_with_fc_bias_from_pytorch_bin(engine: Engine, tmp_path) -> None:
    """Some published EAGLE-1 heads have fc.bias and ship pytorch_model.bin plus the embedding."""
    head = random_head(engine.model.config, seed=6)
    save_head(head, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state = dict(head.state_dict())
    state["fc.bias"] = torch.randn(engine.model.config.hidden_size)
    state["embed_tokens.weight"] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "pytorch_model.bin")
    loaded = load_head(tmp_path, engine.model.config)
    assert loaded.fc.bias is not None and torch.equal(loaded.fc.bias, state["fc.bias"])
    state["layers.0.input_layernorm.weight"] = torch.ones(engine.model.config.hidden_size)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match="input_layernorm"):
        load_head(tmp_path, engine.model.config)


def test_draft_model_with_other_tokenizer_is_refused(engine: Engine, draft_dir, tmp_path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(draft_dir, bad)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(draft_dir))
    tok.add_tokens(["<my-extra-token>"])
    tok.save_pretrained(str(bad))
    with pytest.raises(UserError, match="tokenizer differs"):
        engine.set_spec(SpecConfig(method="draft_model", depth=2, topk=1, budget=3, draft_model=str(bad)))
    engine.set_spec(SpecConfig(method="off"))


def test_target_loaded_once_per_process(engine: Engine) -> None:
    again = open_engine(load_config(["model=tiny-random", "spec.method=ngram"]))
    assert again.model is engine.model and again.spec.method == "ngram"
    again.set_spec(SpecConfig(method="eagle", depth=2, topk=1, budget=3))
    assert again.model is engine.model
    assert engine.model_name == "tiny-random" and engine.max_context == 2048


def test_fp8_weights() -> None:
    """vLLM's fp8 scheme: one scale per tensor (absmax / 448), the tensors being the fused ones vLLM's
    kernels see (q/k/v share a scale, gate/up share one); everything else rounded to bf16."""
    torch.manual_seed(0)
    w = torch.randn(16, 32)
    w8, scale = quantize_e4m3(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.numel() == 1
    deq = w8.float() * scale
    assert ((deq - w).abs() <= w.abs() * 2 ** -4 + scale * 2 ** -10).all()  # e4m3: 3 mantissa bits, RNE
    assert torch.allclose(deq.abs().amax(), w.abs().amax())  # the tensor max is exact
    cfg = load_config(["model=tiny-random"]).model
    m = random_llama(cfg)
    before = m.model.layers[0].mlp.up_proj.weight.clone()
    emb = m.model.embed_tokens.weight.clone()
    assert apply_weights(m, "fp8") == 7 * cfg.num_layers and m.spectune_weights == "fp8"
    layer = m.model.layers[0]
    after = layer.mlp.up_proj.weight
    assert not torch.equal(before, after) and torch.equal(m.model.embed_tokens.weight, emb.bfloat16().float())
    # one scale per fused tensor: every value of q, k and v is a multiple of the shared scale by an e4m3 value
    qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    s = qkv.abs().amax() / 448
    torch.testing.assert_close((qkv / s).to(torch.float8_e4m3fn).float() * s, qkv, rtol=1e-6, atol=0)
    # (and at least one of them has a smaller max, so a scale of its own would differ)
    assert any(t.weight.abs().amax() < qkv.abs().amax() for t in (layer.self_attn.q_proj, layer.self_attn.k_proj))
    assert len(torch.unique(after)) <= 256
    e = open_engine(load_config(["model=tiny-random", "engine.builtin.weights=fp8", "spec.method=ngram"]))
    res = e.generate(e.encode_prompt("hello", True), SamplingParams(max_new_tokens=5))
    assert len(res.tokens) == 5


def test_context_limit_stops_like_autoregressive(engine: Engine, prompts) -> None:
    limit = len(prompts[2]) + 9
    saved = engine.max_context
    engine.max_context = limit
    try:
        outs = []
        for spec in [SpecConfig(method="off"), SpecConfig(method="ngram", depth=4, topk=1, budget=5,
                                                          ngram_min=1, ngram_max=2)]:
            engine.set_spec(spec)
            res = engine.generate(prompts[2], SamplingParams(max_new_tokens=N_NEW))
            assert res.finish_reason == "length" and len(prompts[2]) + len(res.tokens) <= limit + 1
            outs.append(res.tokens)
        assert outs[0] == outs[1] and len(outs[0]) == 10
        with pytest.raises(UserError, match="max_context"):
            engine.generate([1] * (limit + 1), SamplingParams(max_new_tokens=2))
    finally:
        engine.max_context = saved
        engine.set_spec(SpecConfig(method="off"))
