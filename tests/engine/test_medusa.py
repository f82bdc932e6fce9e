"""Medusa heads on the tiny random Llama: greedy output token-identical to AR (chains and trees),
the vLLM layout round-trips, training lowers the validation loss, heads for another target and a
depth beyond the heads are refused with one line and exit 2, trees draft each head's top-k."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from engine.api import SamplingParams
from engine.drafters.medusa import MedusaDrafter
from engine.decode.loop import Engine
from tuner.study.measurer import open_engine
from engine.models.medusa_head import load_heads, new_heads, save_heads
from engine.models.target import random_llama
from engine.heads import medusa_train as TM
from engine.heads.pipeline import build_data
from tuner.cli import main
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig, UserError
from tuner.study.measurer import train_job

PROMPTS = ["def fib(n):", "Write a haiku about the sea.", "a b c d a b c d a b c d a b"]
N_NEW = 40
SMALL = ["model=tiny-random", "+workload=code", "train.prompts=6", "train.max_new_tokens=24", "train.gen_batch=6",
         "train.batch=4", "train.seq_len=64", "train.draft_vocab=512", "train.warmup=2", "train.eval_fraction=0.34",
         "train.lr=1e-2", "train.steps=30", "train.epochs=100", "train.eval_every=10", "train.medusa_heads=3"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def data(engine: Engine, tmp_path_factory):
    return build_data(train_job(load_config(SMALL + [f"cache_dir={tmp_path_factory.mktemp('cache')}"])), engine)


@pytest.fixture(scope="module")
def trained(engine: Engine, data):
    cfg = load_config(SMALL)
    return TM.train_medusa(data, engine.model, "tiny-random", cfg.train, eos=sorted(engine.eos))


@pytest.fixture(scope="module")
def head_dir(trained, tmp_path_factory):
    return save_heads(trained[0], tmp_path_factory.mktemp("medusa"))


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[list[int]]:
    engine.set_spec(SpecConfig(method="off"))
    return [engine.generate(engine.encode_prompt(p, True), SamplingParams(max_new_tokens=N_NEW)).tokens for p in PROMPTS]


@pytest.mark.parametrize("depth,topk,budget", [(3, 1, 4), (3, 3, 8), (2, 4, 9)])
def test_greedy_identical_to_autoregressive(engine: Engine, head_dir, reference, depth, topk, budget) -> None:
    ref = reference
    engine.set_spec(SpecConfig(method="medusa", depth=depth, topk=topk, budget=budget, head_path=str(head_dir)))
    drafted = accepted = 0
    for p, r in zip(PROMPTS, ref):
        res = engine.generate(engine.encode_prompt(p, True), SamplingParams(max_new_tokens=N_NEW))
        assert res.tokens == r
        assert sum(res.stats.accepted_per_pos) == res.stats.accepted_tokens
        drafted += res.stats.drafted_tokens
        accepted += res.stats.accepted_tokens
    assert drafted > 0
    engine.set_spec(SpecConfig(method="off"))


def test_tree_is_the_heads_top_k(engine: Engine, head_dir) -> None:
    """Depth-d nodes are head d-1's top-k tokens, the budget cut keeps the best cumulative scores."""
    heads = load_heads(head_dir, engine.model, "tiny-random")
    spec = SpecConfig(method="medusa", depth=2, topk=3, budget=6, head_path=str(head_dir))
    d = MedusaDrafter(spec, heads)
    feat = torch.randn(5, engine.model.config.hidden_size)
    d.observe(feat)
    tree = d.draft([1, 2, 3], SamplingParams())
    logits = heads.full_logits(feat[-1])
    top0 = torch.topk(logits[0], 3).indices.tolist()
    top1 = set(torch.topk(logits[1], 3).indices.tolist())
    assert tree.tokens[0] == 3 and tree.size == 6
    assert [t for t, dd in zip(tree.tokens, tree.depths) if dd == 1] == top0
    assert {t for t, dd in zip(tree.tokens, tree.depths) if dd == 2} <= top1
    assert all(tree.depths[p] == dd - 1 for p, dd in zip(tree.parents[1:], tree.depths[1:]))


def test_layout_round_trip(trained, head_dir, engine: Engine) -> None:
    heads = trained[0]
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert cfg["num_heads"] == 3 and cfg["truncated_vocab_size"] == 512 and cfg["medusa_fc_bias"] is True
    names = set(load_file(str(head_dir / "model.safetensors")))
    assert names == {f"blocks.{k}.layers.0.{w}" for k in range(3) for w in ("weight", "bias")} | {
        f"lm_heads.{k}.weight" for k in range(3)} | {"token_map"}
    again = load_heads(head_dir, engine.model, "tiny-random")
    x = torch.randn(7, engine.model.config.hidden_size)
    assert torch.equal(again.full_logits(x), heads.full_logits(x))
    assert torch.equal(again.token_map, heads.token_map)


def test_trained_heads_draft_the_targets_answers(engine: Engine, data, trained, head_dir) -> None:
    """On a training prompt the heads drafts what the target says (a random target's text is learnt,
    not predicted): far more accepted tokens than untrained heads, the same output. This also
    checks that training and drafting agree on which feature predicts which token."""
    tok, _, _, start = data.sequence(int(data.sampled.tolist().index(0)))
    prompt = tok[:start].tolist()
    params = SamplingParams(max_new_tokens=20)
    engine.set_spec(SpecConfig(method="off"))
    ref = engine.generate(prompt, params).tokens
    spec = SpecConfig(method="medusa", depth=3, topk=2, budget=6, head_path=str(head_dir))
    accepted = {}
    fresh = new_heads(engine.model, "tiny-random", 3, token_map=trained[0].token_map)
    for name, heads in (("trained", trained[0]), ("fresh", fresh)):
        engine.set_drafter(MedusaDrafter(spec, heads.eval()), spec)
        out = engine.generate(prompt, params)
        assert out.tokens == ref
        accepted[name] = out.stats.accepted_tokens
    engine.set_spec(SpecConfig(method="off"))
    assert accepted["trained"] >= accepted["fresh"] + 5


def cycle_data(n_seq: int = 24, length: int = 40, ids: int = 40, h: int = 64, seed: int = 0) -> SimpleNamespace:
    """Synthetic distillation data with a learnable rule: token j+1 = perm[token j], and the
    feature at j points at token j+1 through the tiny target's lm_head (as a real target's does).
    Only the fields the trainer may read."""
    g = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(1000, generator=g)[:ids] + 100
    perm = torch.randperm(ids, generator=g)
    lm = open_engine(load_config(["model=tiny-random"])).model.lm_head.weight.detach()
    toks, feats, labels, offs, starts = [], [], [], [0], []
    for _ in range(n_seq):
        j = int(torch.randint(ids, (1,), generator=g))
        seq = []
        for _ in range(length):
            seq.append(j)
            j = int(perm[j])
        t = vocab[torch.tensor(seq)]
        nxt = torch.cat([t[1:], t[:1]])
        toks.append(t)
        feats.append(lm[nxt] * 3 + 0.05 * torch.randn(length, h, generator=g))
        labels.append(nxt)
        offs.append(offs[-1] + length)
        starts.append(4)
    return SimpleNamespace(tokens=torch.cat(toks), features=torch.cat(feats), labels=torch.cat(labels),
                           offsets=torch.tensor(offs), starts=torch.tensor(starts), prompt_idx=torch.arange(n_seq),
                           sampled=torch.zeros(n_seq, dtype=torch.long))


def test_training_lowers_validation_loss(engine: Engine) -> None:
    """Held-out prompts follow the same rule: the validation loss falls and the heads draft them."""
    tc = load_config(SMALL + ["train.draft_vocab=64", "train.steps=40", "train.eval_fraction=0.25", "train.lr=1e-2",
                              "train.seq_len=32"]).train
    heads, s = TM.train_medusa(cycle_data(), engine.model, "tiny-random", tc)
    assert s["eval_positions"] > 100
    assert s["val_loss"] < 0.5 * s["val_loss_before"]
    assert s["acceptance_per_depth"][0] > 0.5 and s["tau_chain_offline"] > 2.0


def test_answer_positions_pair_each_feature_with_later_tokens() -> None:
    """Head k at position t learns the target's greedy token t+2+k (labels[t+1+k]); nothing past
    the sequence's last token, nothing before the last prompt token."""
    d = cycle_data(n_seq=2, length=10)
    pos, lab = TM.answer_positions(d, [1], 3)
    assert pos.tolist() == list(range(13, 19))  # sequence 1 = [10, 20), answer starts at 14
    for t, row in zip(pos.tolist(), lab.tolist()):
        want = [int(d.tokens[t + 2 + k]) if t + 2 + k < 20 else -100 for k in range(3)]
        assert row == want


def test_heads_for_another_target_are_refused(engine: Engine, tmp_path, capsys) -> None:
    other = random_llama(load_config(["model=tiny-random"]).model, seed=5)
    save_heads(new_heads(other, "tiny-random", 2), tmp_path)
    with pytest.raises(UserError, match="another target"):
        load_heads(tmp_path, engine.model, "tiny-random")
    rc = main(["bench", "model=tiny-random", "+workload=code", "workload.num_prompts=1", "workload.max_new_tokens=4",
               "bench.warmup=0", "bench.repeats=1", "spec.method=medusa", "spec.depth=2", "spec.budget=3",
               f"spec.head_path={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "another target" in err[0]


def test_depth_beyond_heads_is_refused(engine: Engine, head_dir) -> None:
    with pytest.raises(UserError, match="3 heads"):
        engine.set_spec(SpecConfig(method="medusa", depth=4, topk=1, budget=5, head_path=str(head_dir)))
    with pytest.raises(UserError, match="spec.head_path is required"):
        engine.set_spec(SpecConfig(method="medusa", depth=2, topk=1, budget=3))


@pytest.fixture
def cache(tmp_path):
    """An empty cache directory that shares the extracted tokenizer of the default cache (building
    it from the GGUF again would cost ~20 s)."""
    import shutil

    from engine.models.machine import cache_root

    from engine.models.target import smollm2_tokenizer_dir

    tok = smollm2_tokenizer_dir()
    (tmp_path / "tokenizers").mkdir()
    (tmp_path / "tokenizers" / tok.name).symlink_to(tok)
    shutil.copy(cache_root(None) / "digests.json", tmp_path / "digests.json")
    return tmp_path


def test_train_draft_cli_trains_then_reuses(cache, capsys) -> None:
    args = ["train-draft", *SMALL, "train.steps=3", "spec.method=medusa", f"cache_dir={cache}", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    path = first["head_path"]
    assert first["method"] == "medusa" and first["heads"] == 3 and "/medusa-code-" in path
    assert json.loads((cache / path / "config.json").read_text())["model_type"] == "medusa"
    assert main(args) == 0  # cached: the same directory, not trained again
    again = json.loads(capsys.readouterr().out)
    assert again["head_path"] == path and again["train_seconds"] == first["train_seconds"]


def test_medusa_renders_for_vllm_and_builtin_and_is_refused_by_sglang() -> None:
    from tuner.schema.flags import builtin_args, sglang_args, vllm_speculative_config

    spec = SpecConfig(method="medusa", depth=3, topk=1, budget=4, head_path="org/medusa")
    assert vllm_speculative_config(spec) == {"method": "medusa", "model": "org/medusa", "num_speculative_tokens": 3}
    assert "spec.method=medusa" in builtin_args("smollm2-135m", spec)
    with pytest.raises(UserError, match="spec.method=medusa cannot be served by SGLang"):
        sglang_args("m", spec)
