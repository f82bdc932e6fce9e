"""The draft-head pipeline on the tiny random Llama (engine.heads): prompts never held out, batched
answers equal the engine's batch-1 greedy answers, the data layout, the draft vocabulary's maps,
training lowers the validation loss and beats a random head inside the engine, the public layout
round-trips, an interrupted run resumes to the same weights, and the head cache key covers every
training setting."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from engine.api import SamplingParams
from engine.models.eagle_head import load_head, save_head
from engine.heads import pipeline as P
from engine.heads import schedule as S
from engine.heads import trainer as T
from engine.heads.answers import answer_batch, generate_answers, teacher_force
from engine.heads.data import FIXED_TEXT, IGNORE, DistillData
from engine.heads.evaluate import chain_acceptance
from engine.heads.prompts import collect_prompts, fixed_code_texts, stdlib_code_prompts
from engine.heads.vocab import DraftVocab, always_kept, build_vocab
from engine.decode.loop import Engine
from engine.measure.workloads import CODE_PREFIX, humaneval_prompts, load_prompts
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig
from tuner.study.measurer import train_job

SMALL = ["model=tiny-random", "+workload=code", "train.prompts=8", "train.max_new_tokens=24",
         "train.gen_batch=4", "train.batch=4", "train.seq_len=96", "train.draft_vocab=256", "train.warmup=2",
         "train.eval_fraction=0.25", "train.lr=3e-3", "train.unroll=2", "train.eval_every=5", "train.patience=0"]
PUBLIC = {"fc.weight", "layers.0.post_attention_layernorm.weight"} | {
    f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cfg_of(*extra: str, tmp=None):
    return load_config(SMALL + list(extra) + ([f"cache_dir={tmp}"] if tmp else []))


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    cfg = cfg_of()
    return [engine.encode_prompt(p.text, True) for p in collect_prompts(cfg.workload, [], cfg.train.prompts, 0)]


@pytest.fixture(scope="module")
def data(engine: Engine, prompts) -> DistillData:
    return generate_answers(engine.forward, prompts, 24, engine.eos, batch=4, topk=4)


def test_prompts_exclude_every_heldout_prompt_and_mix_sources() -> None:
    code = load_config(["+workload=code"]).workload
    chat = load_config(["+workload=chat"]).workload
    math = load_config(["+workload=math"]).workload
    json_w = load_config(["+workload=json"]).workload
    got = collect_prompts(code, [chat, math, json_w], 600, seed=0)
    texts = [p.text for p in got]
    assert len(set(texts)) == len(got) == 600
    # no prompt a study measures: held-out ones, and the tuning prompts the trials run
    measured = {p.text for w in (code, chat, math, json_w) for split in ("tune", "heldout") for p in load_prompts(w, split)}
    assert not set(texts) & measured
    # those HumanEval problems are kept out entirely, also when embedded in another prompt
    bodies = [t[len(CODE_PREFIX):] for t in measured if t.startswith(CODE_PREFIX)]
    assert bodies and not any(b in t for b in bodies for t in texts)
    # code tasks dominate a code head's data
    sources = [p.source.split("/")[0] for p in got]
    assert sources.count("stdlib-code") + sources.count("humaneval") >= 0.6 * len(got)
    assert {"stdlib-code", "humaneval", "mtbench", "gsm", "stdlib-doc"} <= set(sources)
    assert collect_prompts(code, [chat, math, json_w], 600, seed=0) == got  # deterministic


def test_stdlib_code_prompts_look_like_humaneval() -> None:
    tasks = stdlib_code_prompts()
    assert len(tasks) > 500
    t = next(p for p in tasks if p.id == "stdlib/textwrap.dedent")
    assert t.text.startswith(CODE_PREFIX + "def dedent(text):\n    \"\"\"\n")
    assert humaneval_prompts()[0].text.startswith(CODE_PREFIX)


def test_batched_answers_equal_batch1_greedy(engine: Engine, prompts) -> None:
    """Prefilling together, the per-row positions and dropping finished rows must not change a token,
    through the engine's forward and through transformers' behind the same interface."""
    from engine.models.hf_forward import HFForward

    res = answer_batch(engine.forward, prompts[:4], 20, engine.eos, topk=4)
    hf = answer_batch(HFForward(engine.model), prompts[:4], 20, engine.eos, topk=4)
    assert [r["answer"] for r in hf] == [r["answer"] for r in res]
    for p, r in zip(prompts[:4], res):
        assert engine.generate(p, SamplingParams(max_new_tokens=20)).tokens == r["answer"]
        # features are the target's final normed hidden states of prompt + answer (but the last token)
        seq = torch.tensor([p + r["answer"]])
        with torch.no_grad():
            hidden = engine.model.model(input_ids=seq).last_hidden_state[0]
            top = torch.softmax(engine.model.lm_head(hidden), -1).topk(4, dim=-1)
        n = seq.shape[1]
        assert torch.allclose(r["features"].float(), hidden[:n - 1], atol=2e-2, rtol=1e-2)
        m = len(r["answer"])
        assert torch.equal(r["topk_ids"], top.indices[n - 1 - m:n - 1])
        assert torch.allclose(r["topk_probs"].float(), top.values[n - 1 - m:n - 1], atol=2e-3)


def test_early_eos_rows_leave_the_batch(engine: Engine, prompts) -> None:
    """A row that ends early leaves the batch (its cache rows are dropped); the rows that go on must
    still produce exactly their batch-1 greedy answers."""
    first = answer_batch(engine.forward, prompts[:1], 3, engine.eos)[0]["answer"]
    stop = first[1]  # make prompt 0's second token an EOS: it finishes at step 2
    res = answer_batch(engine.forward, prompts[:3], 12, engine.eos | {stop})
    assert res[0]["answer"] == first[:2]
    full = answer_batch(engine.forward, prompts[1:3], 12, engine.eos)
    for r, f, p in zip(res[1:], full, prompts[1:3]):
        cut = next((i + 1 for i, t in enumerate(f["answer"]) if t == stop), len(f["answer"]))
        assert r["answer"] == f["answer"][:cut]
        assert len(r["features"]) == len(p) + len(r["answer"]) - 1


def test_sampled_answers_keep_the_targets_greedy_labels_and_distribution(engine: Engine, prompts) -> None:
    """A sampled row draws its tokens, but its labels are the target's greedy choice and its top-k the
    target's own distribution at each position of that drawn context; greedy rows beside it are
    untouched, and the draw is reproducible by seed."""
    temps = [0.0, 1.0, 0.0, 1.0]
    res = answer_batch(engine.forward, prompts[:4], 16, engine.eos, topk=4, temperatures=temps, seed=3)
    greedy = answer_batch(engine.forward, prompts[:4], 16, engine.eos, topk=4)
    assert [res[i]["answer"] for i in (0, 2)] == [greedy[i]["answer"] for i in (0, 2)]
    assert "labels" not in res[0] and any(res[i]["answer"] != greedy[i]["answer"] for i in (1, 3))
    for i in (1, 3):
        p, r = prompts[i], res[i]
        seq = torch.tensor([p + r["answer"]])
        with torch.no_grad():
            hidden = engine.model.model(input_ids=seq).last_hidden_state[0]
            top = torch.softmax(engine.model.lm_head(hidden), -1).topk(4, dim=-1)
        n, m = seq.shape[1], len(r["answer"])
        assert torch.equal(r["topk_ids"], top.indices[n - 1 - m:n - 1])
        assert torch.equal(r["labels"], top.indices[n - 1 - m:n - 1, 0])
        assert torch.allclose(r["features"].float(), hidden[:n - 1], atol=2e-2, rtol=1e-2)
    again = answer_batch(engine.forward, prompts[:4], 16, engine.eos, topk=4, temperatures=temps, seed=3)
    other = answer_batch(engine.forward, prompts[:4], 16, engine.eos, topk=4, temperatures=temps, seed=4)
    assert [r["answer"] for r in again] == [r["answer"] for r in res]
    assert [r["answer"] for r in other] != [r["answer"] for r in res]


def test_answers_per_prompt_lays_out_greedy_then_sampled_answers_per_prompt(engine: Engine, tmp_path) -> None:
    """train.answers_per_prompt=3: every prompt's greedy answer and two sampled ones, under that
    prompt's index (so the validation split keeps them together), the greedy ones as before; the
    data and head keys change with it, and not at all while it is 1."""
    one = train_job(cfg_of("train.prompts=3", tmp=tmp_path))
    three = train_job(cfg_of("train.prompts=3", "train.answers_per_prompt=3", tmp=tmp_path))
    d1, d3 = P.build_data(one, engine), P.build_data(three, engine)
    assert d3.num_sequences == 9 and d3.prompt_idx.tolist() == [0, 1, 2] * 3
    assert d3.sampled.tolist() == [0] * 3 + [1] * 6 and d3.meta["prompts"] == 3
    for i in range(3):
        assert torch.equal(d3.sequence(i)[0], d1.sequence(i)[0])  # the greedy answers unchanged
    for i in range(3, 9):
        tok, _, lab, start = d3.sequence(i)
        a, b = int(d3.offsets[i]), int(d3.offsets[i + 1])
        assert torch.equal(lab[start - 1:-1], d3.topk_ids[a + start - 1:b - 1, 0])  # greedy labels
    assert len({tuple(d3.sequence(i)[0].tolist()) for i in range(9)}) > 3  # the draws differ
    train, val = S.split_prompts(d3, 0.34, 0)
    assert {int(d3.prompt_idx[i]) for i in train}.isdisjoint({int(d3.prompt_idx[i]) for i in val}) and val
    hot = train_job(cfg_of("train.prompts=3", "train.answers_per_prompt=3", "train.answer_temperature=0.5", tmp=tmp_path))
    assert len({P.head_dir(one), P.head_dir(three), P.head_dir(hot)}) == 3
    assert P.head_dir(train_job(cfg_of("train.prompts=3", "train.answer_temperature=0.5", tmp=tmp_path))) == P.head_dir(one)


def test_data_layout(data: DistillData, prompts) -> None:
    assert data.num_sequences == len(prompts)
    for i, p in enumerate(prompts):
        tok, feat, lab, start = data.sequence(i)
        assert tok[:start].tolist() == p and start == len(p)
        # labels: the greedy answer itself, from the last prompt position on
        assert (lab[:start - 1] == IGNORE).all() and torch.equal(lab[start - 1:-1], tok[start:])
        assert (feat[-1] == 0).all() and (feat[:-1].abs().sum(-1) > 0).all()
    a, b = int(data.offsets[0]), int(data.offsets[1])
    assert torch.equal(data.topk_ids[a + data.starts[0] - 1:b - 1, 0], data.tokens[a + data.starts[0]:b])


def test_teacher_forced_fixed_text_labels_are_the_targets_own(engine: Engine, data: DistillData) -> None:
    """Fixed text keeps its own tokens as context, but every label and soft label is the target's
    distribution there (what a one-sequence forward gives), batched with right padding."""
    task, reply = fixed_code_texts()[0]
    assert reply.startswith("```python\ndef ") and task.id.startswith("stdlib/")
    seqs = [(engine.encode_prompt(t.text, True)[:20], engine.tokenizer.encode(r)[:n])
            for (t, r), n in zip(fixed_code_texts()[:3], (9, 30, 17))]
    fixed = teacher_force(engine.model, seqs, topk=4, batch=2)
    assert fixed.sampled.tolist() == [FIXED_TEXT] * 3 and fixed.meta["fixed_tokens"] == 9 + 30 + 17
    for i, (p, r) in enumerate(seqs):
        tok, feat, lab, start = fixed.sequence(i)
        assert tok.tolist() == p + r and start == len(p)
        with torch.no_grad():
            hidden = engine.model.model(input_ids=tok[None]).last_hidden_state[0]
            top = torch.softmax(engine.model.lm_head(hidden), -1).topk(4, dim=-1)
        assert torch.allclose(feat[:-1].float(), hidden[:-1], atol=2e-2, rtol=1e-2)
        assert torch.equal(lab[start - 1:-1], top.indices[start - 1:-1, 0])  # the target's choice, not the text
        assert (lab[:start - 1] == IGNORE).all()
    both = DistillData.concat([data, fixed])
    assert both.num_sequences == data.num_sequences + 3 and both.num_tokens == data.num_tokens + fixed.num_tokens
    assert torch.equal(both.sequence(data.num_sequences + 1)[0], fixed.sequence(1)[0])
    assert set(both.prompt_idx[:data.num_sequences].tolist()).isdisjoint(both.prompt_idx[data.num_sequences:].tolist())
    train, val = S.split_prompts(both, 0.25, 0)
    assert val and all(both.sampled[i] != FIXED_TEXT for i in val)  # validation: the target's own answers only
    assert set(range(data.num_sequences, both.num_sequences)) <= set(train)


def test_save_load_roundtrip(data: DistillData, tmp_path) -> None:
    data.save(tmp_path)
    back = DistillData.load(tmp_path)
    for f in ("tokens", "labels", "topk_ids", "offsets", "starts", "prompt_idx"):
        assert torch.equal(getattr(back, f), getattr(data, f)), f
    assert torch.equal(back.features, data.features) and back.meta == data.meta


def test_draft_vocab_maps_round_trip(data: DistillData, engine: Engine) -> None:
    forced = always_kept(engine.tokenizer, 49152, sorted(engine.eos))
    assert set(engine.eos) <= set(forced)
    assert any(engine.tokenizer.decode([i]) == "    " for i in forced)  # indentation is always draftable
    v = build_vocab(data, 300, 49152, forced)
    assert len(v.ids) == max(300, len(forced)) and torch.equal(v.ids, v.ids.sort().values)
    draft = torch.arange(len(v.ids))
    assert torch.equal(draft + v.d2t, v.ids)  # target id = draft id + d2t[draft id]
    assert torch.equal(v.t2d[v.ids], draft)  # and back
    outside = torch.ones(49152, dtype=torch.bool)
    outside[v.ids] = False
    assert (v.t2d[outside] == -1).all()
    labels = data.response_labels()
    assert v.coverage(labels) < 1.0  # a random model's answers use more than 300 - |forced| tokens
    full = build_vocab(data, len(forced) + len(labels.unique()), 49152, forced)
    assert full.coverage(labels) == 1.0  # room for every answer token: all of them are kept
    assert build_vocab(data, 0, 49152) is None


def test_soft_targets_renormalise_over_the_draft_vocabulary() -> None:
    ids = torch.tensor([[5, 7, 9]])
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    v = DraftVocab(ids=torch.tensor([5, 9]), vocab_size=10)
    t = T.soft_targets(ids, probs, v.t2d, 2)
    assert torch.allclose(t, torch.tensor([[0.5 / 0.7, 0.2 / 0.7]]))


def test_training_lowers_validation_loss_and_beats_random_head(data: DistillData, engine: Engine, tmp_path) -> None:
    """A random target's text cannot be predicted from so little data, but it can be learnt: the head
    must then draft the target's answers, offline and inside the engine (which checks that training
    and drafting agree on which token and feature go where)."""
    tc = cfg_of("train.steps=60", "train.epochs=100", "train.checkpoint_every=1000", "train.eval_fraction=0").train
    vocab = build_vocab(data, 256, 49152, sorted(engine.eos))
    head, summary = T.train_head(data, engine.model, tc, vocab, tmp_path)
    hist = torch.load(tmp_path / T.CKPT, weights_only=False)["state"]["history"]
    assert summary["steps"] == 60 and sum(hist[-10:]) / 10 < 0.5 * sum(hist[:5]) / 5
    seqs = list(range(data.num_sequences))
    embed = engine.model.get_input_embeddings().weight
    lm = engine.model.lm_head.weight[vocab.ids]
    rand = T.init_head(engine.model.config, 1).eval()
    got = chain_acceptance(T.Eagle1Net(head, lm), embed, vocab.ids, data, seqs, tc.seq_len)
    base = chain_acceptance(T.Eagle1Net(rand, lm), embed, vocab.ids, data, seqs, tc.seq_len)
    assert got["acceptance_per_depth"][0] > base["acceptance_per_depth"][0] + 0.3
    assert got["acceptance_per_depth"][1] > base["acceptance_per_depth"][1] + 0.1  # unrolled steps learnt too
    # a tree's most: the target's path within the head's top-k at every level, never below the chain's
    wide = chain_acceptance(T.Eagle1Net(head, lm), embed, vocab.ids, data, seqs, tc.seq_len, topk=2)
    widest = chain_acceptance(T.Eagle1Net(head, lm), embed, vocab.ids, data, seqs, tc.seq_len, topk=256)
    assert wide["acceptance_per_depth"] == got["acceptance_per_depth"] and "acceptance_topk_per_depth" not in got
    for chain, k2, k256 in zip(got["acceptance_per_depth"], wide["acceptance_topk_per_depth"],
                               widest["acceptance_topk_per_depth"]):
        assert chain <= k2 <= k256
    assert widest["acceptance_topk_per_depth"] == sorted(widest["acceptance_topk_per_depth"], reverse=True)
    assert sum(widest["acceptance_topk_per_depth"]) > sum(got["acceptance_per_depth"]), "top-k read, not the argmax"
    tok, _, _, start = data.sequence(0)
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


def test_validation_loss_falls_and_early_stopping_keeps_the_best(data: DistillData, engine: Engine, tmp_path) -> None:
    tc = cfg_of("train.steps=40", "train.epochs=100", "train.eval_every=5", "train.patience=2",
                "train.checkpoint_every=1000", "train.eval_fraction=0.25").train
    head, s = T.train_head(data, engine.model, tc, None, tmp_path)
    vals = [v for _, v in s["val_loss"]]
    assert vals[0] > min(vals) and s["best_val_loss"] == pytest.approx(min(vals), abs=1e-4)
    train_seqs, val_seqs = S.split_prompts(data, tc.eval_fraction, tc.seed)
    assert val_seqs and not set(data.prompt_idx[train_seqs].tolist()) & set(data.prompt_idx[val_seqs].tolist())
    embed = engine.model.get_input_embeddings().weight.float()
    again = T.validation_loss(T.Eagle1Net(head, engine.model.lm_head.weight.float()), embed, None, data, val_seqs, tc, "cpu")
    assert again == pytest.approx(s["best_val_loss"], abs=1e-3)  # the kept weights are the best ones
    if s["stopped_early"]:
        assert s["steps"] < 40


def test_public_layout_roundtrip_and_engine_load(data: DistillData, engine: Engine, tmp_path) -> None:
    tc = cfg_of("train.steps=4").train
    vocab = build_vocab(data, 256, 49152, sorted(engine.eos))
    head, _ = T.train_head(data, engine.model, tc, vocab, tmp_path / "work")
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
    tc = cfg_of("train.steps=8", "train.epochs=100", "train.checkpoint_every=3").train
    full, s_full = T.train_head(data, engine.model, tc, None, tmp_path / "a")

    class Stop(Exception):
        pass

    def interrupt(phase, done, total, info):
        if done == 7:
            raise Stop

    with pytest.raises(Stop):
        T.train_head(data, engine.model, tc, None, tmp_path / "b", report=interrupt)
    assert torch.load(tmp_path / "b" / T.CKPT, weights_only=False)["state"]["step"] == 6
    resumed, s_res = T.train_head(data, engine.model, tc, None, tmp_path / "b")
    assert s_res["resumed_from"] == 6 and s_full["resumed_from"] == 0
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
    assert s_res["loss_last"] == pytest.approx(s_full["loss_last"], rel=1e-5)
    other = cfg_of("train.steps=8", "train.epochs=100", "train.checkpoint_every=3", "train.lr=1e-3").train
    _, s_other = T.train_head(data, engine.model, other, None, tmp_path / "b")
    assert s_other["resumed_from"] == 0  # a changed setting never resumes a foreign checkpoint


def test_cache_reused_retrain_and_keys_cover_training_settings(engine: Engine, tmp_path, monkeypatch) -> None:
    cfg = train_job(cfg_of("train.steps=3", "train.epochs=100", "train.prompts=3", tmp=tmp_path))
    calls = {"train": 0, "gen": 0}
    real_train, real_gen = P.train_head, P.generate_answers

    def counting_train(*a, **k):
        calls["train"] += 1
        return real_train(*a, **k)

    def counting_gen(*a, **k):
        calls["gen"] += 1
        return real_gen(*a, **k)

    monkeypatch.setattr(P, "train_head", counting_train)
    monkeypatch.setattr(P, "generate_answers", counting_gen)
    p1 = P.ensure_head(cfg, engine)
    meta = P.read_meta(p1)
    assert meta["steps"] == 3 and meta["workload"] == "code" and meta["target_hash"] == P.target_hash(cfg)
    assert "tau_chain_offline" in meta and meta["data"]["prompts"] == 3
    assert P.ensure_head(cfg, engine) == p1 and calls == {"train": 1, "gen": 1}
    assert P.ensure_head(cfg, engine, retrain=True) == p1 and calls == {"train": 2, "gen": 1}  # data reused
    # every training setting is part of the head's identity; data settings also of the data's
    for change in ("train.draft_vocab=128", "train.ce_weight=0.5", "train.unroll=1", "train.epochs=3",
                   "train.steps=4", "train.prompts=4", "train.noise=0.0"):
        other = train_job(cfg_of("train.steps=3", "train.epochs=100", "train.prompts=3", change, tmp=tmp_path))
        assert P.head_dir(other) != p1, change
    assert P.head_dir(cfg, "eagle3") != p1
    assert P.head_dir(train_job(cfg_of("train.steps=3", "train.epochs=100", "train.prompts=3", "train.fixed_text_tokens=0",
                                       tmp=tmp_path))) == p1  # off: the key of a head trained before the setting existed
    # fp32 training keeps the key heads had before train.precision existed; bf16 is another head
    fp32 = P.head_dir(train_job(cfg_of("train.steps=3", "train.epochs=100", "train.prompts=3", "train.precision=fp32",
                                       tmp=tmp_path)))
    bf16 = P.head_dir(train_job(cfg_of("train.steps=3", "train.epochs=100", "train.prompts=3", "train.precision=bf16",
                                       tmp=tmp_path)))
    assert bf16 != fp32 and p1 in (fp32, bf16)
    fixed = train_job(cfg_of("train.steps=3", "train.epochs=100", "train.prompts=3", "train.fixed_text_tokens=40",
                             tmp=tmp_path))
    assert P.head_dir(fixed) != p1
    pf = P.ensure_head(fixed, engine)
    assert calls["gen"] == 1 and P.read_meta(pf)["data"]["parts"][1]["fixed_tokens"] == 40
    assert P.head_dir(train_job(cfg_of("train.steps=3", "train.epochs=100", "train.prompts=3", "train.checkpoint_every=7",
                                       tmp=tmp_path))) == p1
    p2 = P.ensure_head(replace(cfg, workload=load_config(["+workload=math"]).workload), engine)
    assert p2 != p1 and p2.parent == p1.parent and calls["gen"] == 2


def test_unrolled_training_forward_is_what_the_drafter_computes(data: DistillData, engine: Engine) -> None:
    """Training-time test must see exactly what drafting sees: step 0 at index t = the drafter's
    catch-up output at t (token t+1, feature t, position t); step 1 at index t = a depth-1 tree node
    drafted after position t (its own token, the root's predicted feature, position t+1)."""
    from engine.drafters import EagleDrafter

    head = T.init_head(engine.model.config, 3).eval()
    tok, feat, _, start = data.sequence(0)
    feat = feat.float()
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


def test_eagle3_head_trains_saves_in_the_vllm_layout_and_serves(engine: Engine, prompts, tmp_path) -> None:
    """EAGLE-3 end to end on the tiny model: data with the target's low/mid/high layer inputs, CE
    training over the draft vocabulary (loss falls), the vLLM eagle3 layout, and the engine's eagle3
    drafter serving it with greedy output equal to AR."""
    from engine.models.eagle3_head import default_aux_layers, load_eagle3

    layers = default_aux_layers(engine.model.config.num_hidden_layers)
    data = generate_answers(engine.forward, prompts, 24, engine.eos, batch=4, topk=4, aux_layers=layers)
    h = engine.model.config.hidden_size
    assert data.aux.shape == (data.num_tokens, 3 * h)
    with torch.no_grad():
        out = engine.model.model(input_ids=data.sequence(0)[0][None], output_hidden_states=True)
    a, b = int(data.offsets[0]), int(data.offsets[1])
    ref = torch.cat([out.hidden_states[k][0] for k in layers], -1)
    assert torch.allclose(data.aux[a:b - 1].float(), ref[:-1], atol=3e-2, rtol=1e-2)
    vocab = build_vocab(data, 256, 49152, sorted(engine.eos))
    tc = cfg_of("train.steps=40", "train.epochs=100", "train.checkpoint_every=1000", "train.eval_fraction=0").train
    head, s = T.train_head(data, engine.model, tc, vocab, tmp_path / "w", method="eagle3")
    hist = torch.load(tmp_path / "w" / T.CKPT, weights_only=False)["state"]["history"]
    assert sum(hist[-5:]) / 5 < 0.7 * sum(hist[:3]) / 3
    assert torch.equal(head.target_ids(), vocab.ids)
    from engine.models.eagle3_head import save_eagle3

    out_dir = save_eagle3(head, tmp_path / "h")
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == len(vocab.ids)
    assert load_eagle3(out_dir, engine.model.config).draft_vocab_size == len(vocab.ids)
    p = prompts[0]
    params = SamplingParams(max_new_tokens=20)
    engine.set_spec(SpecConfig(method="off"))
    ref_tokens = engine.generate(p, params).tokens
    engine.set_spec(SpecConfig(method="eagle3", depth=3, topk=2, budget=6, head_path=str(out_dir)))
    res = engine.generate(p, params)
    engine.set_spec(SpecConfig(method="off"))
    assert res.tokens == ref_tokens and res.stats.accepted_tokens > 0


def test_progress_lines_when_not_a_terminal() -> None:
    """CI logs and files get periodic lines (each 10% of a phase), with tokens/s and the loss."""
    import io

    from tuner.study.progress import head_progress

    buf = io.StringIO()
    with head_progress(stream=buf) as report:
        for i in range(1, 101):
            report("generate", i, 100, {"tokens": 10 * i, "tok_s": 250.0})
        for i in range(1, 21):
            report("train", i, 20, {"loss": 1.0 / i, "acc": 0.5, "tok_s": 900.0})
    lines = buf.getvalue().splitlines()
    gen = [ln for ln in lines if ln.startswith("answering prompts")]
    train = [ln for ln in lines if ln.startswith("training head")]
    assert 10 <= len(gen) <= 12 and gen[-1].startswith("answering prompts 100/100") and "250 tok/s" in gen[-1]
    assert 10 <= len(train) <= 21 and "loss 0.050" in train[-1]
    quiet = io.StringIO()
    with head_progress(quiet=True, stream=quiet) as report:
        report("train", 1, 1, {"loss": 1.0})
    assert quiet.getvalue() == ""


def test_training_prompts_are_the_same_in_another_process() -> None:
    """The data cache key hashes the prompt texts: they must not depend on the process (a default
    value printed with its memory address, or with the process's environment: `cgi.parse`'s
    `environ=os.environ` once wrote every variable, secrets included, into a prompt)."""
    import os
    import subprocess
    import sys

    code = ("from tuner.schema.compose import load_config; from engine.heads.prompts import collect_prompts; import hashlib;"
            "w=load_config(['+workload=code']).workload; t='\\n'.join(p.text for p in collect_prompts(w, [], 2000, 0));"
            "print(hashlib.sha256(t.encode()).hexdigest(), 'leaked' if 'not-for-prompts' in t else 'clean')")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "SPECTUNE_TEST_SECRET": f"not-for-prompts-{i}"}).stdout.strip()
            for i in range(2)}
    assert len(runs) == 1, runs
    digest, leak = next(iter(runs)).split()
    assert len(digest) == 64 and leak == "clean"


def test_training_precision_auto_takes_the_precision_timed_fastest(monkeypatch, data: DistillData,
                                                                  engine: Engine, tmp_path) -> None:
    """auto on a CPU: the faster of fp32 and bf16 autocast by a timed training step (planted timings),
    not the CPU's flags: a CPU with avx512_bf16 where bf16 timed slower keeps fp32, an AVX2 one where it
    timed faster takes bf16 (fp32 unless bf16 is AUTO_MARGIN faster); timed once per machine (cached:
    another process reads it, no second timing); train_precision and the step's autocast follow it; a
    bf16 step trains (fp32 weights) and says so in the summary."""
    from engine.models import machine
    from tuner.schema.precision import AUTO_MARGIN

    timed: list[str] = []

    def planted(fp32: float, bf16: float):
        def measure() -> dict:
            timed.append(f"{fp32}/{bf16}")
            return {"fp32": {"128 rows": fp32}, "bf16": {"128 rows": bf16}}
        return measure

    monkeypatch.setattr(S, "_CHOSEN", {})
    monkeypatch.setattr(machine, "others_share", lambda mark: 0.0)  # timed on a quiet machine: cached
    monkeypatch.setattr(machine, "cpu_signature", lambda: "AMD EPYC|avx2,avx512f,avx512_bf16|2t")
    assert S.timed_train_precision(tmp_path / "a", planted(10.0, 30.0))[0] == "fp32"
    monkeypatch.setattr(machine, "cpu_signature", lambda: "AMD EPYC|avx2|2t")
    precision, why = S.timed_train_precision(tmp_path / "b", planted(30.0, 10.0))
    assert precision == "bf16" and "timed training step" in why and "3.00x" in why and "\n" not in why
    assert S.timed_train_precision(tmp_path / "c", planted(10.0, 10.0 * (1 - AUTO_MARGIN / 2)))[0] == "fp32"
    S._CHOSEN.clear()  # another process on this machine: the cached timing, not a new one
    assert S.timed_train_precision(tmp_path / "b", planted(10.0, 30.0))[0] == "bf16" and len(timed) == 3
    monkeypatch.setattr(S, "timed_train_precision", lambda *a, **k: ("bf16", "planted"))
    tc = cfg_of().train
    assert S.train_precision(tc) == "bf16" and isinstance(S.step_precision(tc), torch.autocast)
    assert S.train_precision(tc, "cpu") == "bf16"
    monkeypatch.setattr(S, "timed_train_precision", lambda *a, **k: ("fp32", "planted"))
    assert S.train_precision(tc) == "fp32" and not isinstance(S.step_precision(tc), torch.autocast)
    assert S.train_precision(tc.model_copy(update={"precision": "bf16"})) == "bf16"  # an explicit setting stands
    with torch.inference_mode():  # the real timing, from wherever it is first asked (an engine's inference mode)
        ms = S.time_train_steps(rounds=1)
    assert set(ms) == {"fp32", "bf16"} and all(t[f"{S.TIMED_ROWS} rows"] > 0 for t in ms.values())
    bf16 = tc.model_copy(update={"precision": "bf16", "steps": 3, "eval_every": 3})
    assert S.train_precision(bf16) == "bf16"
    head, summary = T.train_head(data, engine.model, bf16, None, tmp_path / "w")
    assert summary["precision"] == "bf16" and summary["steps"] == 3 and math.isfinite(summary["loss_last"])
    assert all(p.dtype == torch.float32 for p in head.parameters())
