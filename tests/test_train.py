"""Draft-head training on the tiny random Llama: data never uses held-out prompts, training lowers
the loss and beats a random head, the public layout round-trips and serves in the engine, an
interrupted run resumes to the same weights, and the head cache is reused unless retrain=True."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.api import SamplingParams
from engine.distill import DistillData, collect_prompts, generate_data
from engine.eagle import load_head, save_head
from engine.loop import Engine
from engine.workloads import load_prompts
from engine import train as T
from tuner.config import load_config
from tuner.schema import SpecConfig

SMALL = ["model=tiny-random", "+workload=code", "train.prompts=6", "train.max_new_tokens=24", "train.samples=1",
         "train.gen_batch=6", "train.batch=4", "train.seq_len=96", "train.draft_vocab=256", "train.warmup=2",
         "train.eval_fraction=0.34", "train.lr=3e-3", "train.unroll=2"]
PUBLIC = {"fc.weight", "layers.0.post_attention_layernorm.weight"} | {
    f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cfg_of(*extra: str, tmp=None):
    return load_config(SMALL + list(extra) + ([f"cache_dir={tmp}"] if tmp else []))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_config(load_config(["model=tiny-random", "spec.method=off"]))


@pytest.fixture(scope="module")
def data(engine: Engine) -> DistillData:
    cfg = cfg_of()
    prompts = collect_prompts(cfg.workload, [], cfg.train.prompts, 0)
    return generate_data(engine.model, engine.tokenizer, lambda s: engine.encode_prompt(s, True), prompts, cfg.train,
                         engine.eos)


def test_prompts_exclude_every_heldout_prompt() -> None:
    code = load_config(["+workload=code"]).workload
    chat = load_config(["+workload=chat"]).workload
    math = load_config(["+workload=math"]).workload
    got = collect_prompts(code, [chat, math], 200, seed=0)
    texts = {p.text for p in got}
    assert len(texts) == len(got) == 200
    for w in (code, chat, math):
        assert not texts & {p.text for p in load_prompts(w, "heldout")}
    # the workload's own tuning prompts come first, and it provides about half
    tune = [p.text for p in load_prompts(code, "tune")]
    assert [p.text for p in got[:len(tune)]] == tune
    assert sum(p.source == "humaneval" for p in got) >= 100
    assert {p.source.split("/")[0] for p in got} >= {"humaneval", "mtbench", "gsm"}


def test_data_layout(data: DistillData, engine: Engine) -> None:
    assert data.num_sequences == 12 and data.sampled.tolist().count(1) == 6
    tok, feat, lab, start = data.sequence(0)
    # features are the target's final normed hidden states; labels its greedy next tokens
    with torch.no_grad():
        hidden = engine.model.model(input_ids=tok[None]).last_hidden_state[0]
    assert torch.allclose(feat, hidden, atol=2e-2, rtol=1e-2)
    assert torch.equal(lab, engine.model.lm_head(hidden).argmax(-1))
    # greedy answers: each response token is the target's greedy choice after the previous position
    g = data.sampled.tolist().index(0)
    tok, _, lab, start = data.sequence(g)
    assert (tok[start:] == lab[start - 1:-1]).float().mean() > 0.9


def test_training_lowers_loss_and_beats_random_head(data: DistillData, engine: Engine, tmp_path) -> None:
    """A random target's text cannot be predicted from so little data, but it can be learnt: the head
    must then draft the target's answers to its training prompts, offline and inside the engine (which
    checks that training and drafting agree on which token and feature go where)."""
    tc = cfg_of("train.steps=60", "train.checkpoint_every=1000", "train.eval_fraction=0").train
    head, summary = T.train_head(data, engine.model, tc, tmp_path, eos=sorted(engine.eos))
    hist = torch.load(tmp_path / T.CKPT, weights_only=False)["history"]
    assert sum(hist[-10:]) / 10 < 0.5 * sum(hist[:5]) / 5
    greedy = [i for i in range(data.num_sequences) if data.sampled[i] == 0]
    embed = engine.model.get_input_embeddings().weight
    ids = head.draft_ids
    lm = engine.model.lm_head.weight[ids]
    rand = T.init_head(engine.model.config, 1).eval()
    got = T.evaluate(head, embed, lm, ids, data, greedy, tc.seq_len)
    base = T.evaluate(rand, embed, lm, ids, data, greedy, tc.seq_len)
    assert got["acceptance_per_depth"][0] > base["acceptance_per_depth"][0] + 0.3
    assert got["acceptance_per_depth"][1] > base["acceptance_per_depth"][1] + 0.1  # unrolled steps learnt too
    # inside the engine, on a training prompt: more drafts accepted, output unchanged
    tok, _, _, start = data.sequence(greedy[0])
    prompt = tok[:start].tolist()
    params = SamplingParams(max_new_tokens=20)
    engine.set_spec(SpecConfig(method="off"))
    ref = engine.generate(prompt, params).tokens
    from engine.drafters import EagleDrafter

    spec = SpecConfig(method="eagle", depth=3, topk=2, budget=6)
    accepted = {}
    for name, h in (("trained", head), ("random", rand)):
        engine.set_drafter(EagleDrafter(spec, h, engine.model), spec)
        out = engine.generate(prompt, params)
        assert out.tokens == ref
        accepted[name] = out.stats.accepted_tokens
    engine.set_spec(SpecConfig(method="off"))
    assert accepted["trained"] >= accepted["random"] + 5


def test_public_layout_roundtrip_and_engine_load(data: DistillData, engine: Engine, tmp_path) -> None:
    tc = cfg_of("train.steps=4").train
    head, _ = T.train_head(data, engine.model, tc, tmp_path / "work", eos=sorted(engine.eos))
    out = save_head(head, tmp_path / "head")
    assert set(load_file(str(out / "model.safetensors"))) == PUBLIC  # no input_layernorm, no fc.bias, no extras
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    loaded = load_head(out, engine.model.config)
    assert torch.equal(loaded.draft_ids, head.draft_ids) and len(head.draft_ids) == 256
    x, f = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        assert torch.allclose(loaded(x, f, pos)[0], head(x, f, pos)[0], atol=1e-6)
    # served by the engine's EAGLE drafter from spec.head_path: lossless, drafts only draft-vocab tokens
    p = engine.encode_prompt("def add(a, b):", True)
    params = SamplingParams(max_new_tokens=24)
    engine.set_spec(SpecConfig(method="off"))
    ref = engine.generate(p, params).tokens
    engine.set_spec(SpecConfig(method="eagle", depth=3, topk=2, budget=6, head_path=str(out)))
    drafter = engine.drafter
    seen: list[int] = []
    orig = drafter.draft

    def spy(ids, params, generator=None):
        tree = orig(ids, params, generator)
        seen.extend(tree.tokens[1:])
        return tree

    drafter.draft = spy
    assert engine.generate(p, params).tokens == ref
    engine.set_spec(SpecConfig(method="off"))
    assert seen and set(seen) <= set(head.draft_ids.tolist())


def test_resume_after_interruption_matches_uninterrupted(data: DistillData, engine: Engine, tmp_path) -> None:
    tc = cfg_of("train.steps=8", "train.checkpoint_every=3").train
    full, s_full = T.train_head(data, engine.model, tc, tmp_path / "a", eos=sorted(engine.eos))

    class Stop(Exception):
        pass

    def interrupt(phase, done, total, info):
        if done == 7:
            raise Stop

    with pytest.raises(Stop):
        T.train_head(data, engine.model, tc, tmp_path / "b", report=interrupt, eos=sorted(engine.eos))
    assert torch.load(tmp_path / "b" / T.CKPT, weights_only=False)["step"] == 6
    resumed, s_res = T.train_head(data, engine.model, tc, tmp_path / "b", eos=sorted(engine.eos))
    assert s_res["resumed_from"] == 6 and s_full["resumed_from"] == 0
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
    assert s_res["loss_last"] == pytest.approx(s_full["loss_last"], rel=1e-5)
    # a changed setting does not resume from a foreign checkpoint
    other = cfg_of("train.steps=8", "train.checkpoint_every=3", "train.lr=1e-3").train
    _, s_other = T.train_head(data, engine.model, other, tmp_path / "b", eos=sorted(engine.eos))
    assert s_other["resumed_from"] == 0


def test_cache_reused_and_retrain(engine: Engine, tmp_path, monkeypatch) -> None:
    cfg = cfg_of("train.steps=3", "train.prompts=3", "train.samples=0", tmp=tmp_path)
    calls = {"train": 0, "gen": 0}
    real_train, real_gen = T.train_head, T.generate_data

    def counting_train(*a, **k):
        calls["train"] += 1
        return real_train(*a, **k)

    def counting_gen(*a, **k):
        calls["gen"] += 1
        return real_gen(*a, **k)

    monkeypatch.setattr(T, "train_head", counting_train)
    monkeypatch.setattr(T, "generate_data", counting_gen)
    p1 = T.ensure_head(cfg, engine)
    meta = T.read_meta(p1)
    assert meta["steps"] == 3 and meta["workload"] == "code" and meta["target_hash"] == T.target_hash(cfg)
    assert "tau_chain_offline" in meta and meta["data"]["prompts"] == 3
    assert T.ensure_head(cfg, engine) == p1 and calls == {"train": 1, "gen": 1}
    assert T.ensure_head(cfg, engine, retrain=True) == p1 and calls == {"train": 2, "gen": 1}  # data reused
    # another workload is another head
    p2 = T.ensure_head(cfg.model_copy(update={"workload": load_config(["+workload=math"]).workload}), engine)
    assert p2 != p1 and p2.parent == p1.parent


def test_unrolled_training_forward_is_what_the_drafter_computes(data: DistillData, engine: Engine) -> None:
    """Training-time test must see exactly what drafting sees: step 0 at index t = the drafter's
    catch-up output at t (token t+1, feature t, position t); step 1 at index t = a depth-1 tree node
    drafted after position t (its own token, the root's predicted feature, position t+1)."""
    from engine.drafters import EagleDrafter

    head = T.init_head(engine.model.config, 3).eval()
    tok, feat, _, start = data.sequence(0)
    n = start + 5  # ids[:n+1] committed, ids[n] the root
    outs = T.unrolled(head, engine.model.get_input_embeddings().weight, tok[None], feat[None], 2)
    spec = SpecConfig(method="eagle", depth=2, topk=1, budget=3)
    d = EagleDrafter(spec, head, engine.model)
    with torch.no_grad():
        d.reset(tok[:n].tolist())
        d.observe(feat[:n])
        d._catch_up(tok[:n + 1].tolist())
        assert torch.allclose(d._root_feat, outs[0][0, n - 1], atol=1e-5)
        d._slot, d._n_slots = {}, 0
        d._expand([1], [int(tok[n + 1])], [0], 1)
        assert torch.allclose(d._slot_feat[0], outs[1][0, n - 1], atol=1e-5)
