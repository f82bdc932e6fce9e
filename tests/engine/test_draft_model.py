"""A draft model distilled from the tiny random Llama: built from the target's first layers, greedy
output token-identical to AR (chains and trees, over its draft vocabulary), the HF checkpoint
round-trips with the target's tokenizer, training lowers the validation loss, another tokenizer
is refused with one line and exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from engine.api import SamplingParams
from engine.drafters import DraftModelDrafter, load_draft_model
from engine.drafters.draft_model import read_draft_vocab
from engine.decode.loop import Engine
from engine.heads import draft_model_train as TD
from engine.heads.pipeline import build_data
from tuner.cli import main
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig, UserError
from tuner.study.measurer import train_job

from test_medusa import cycle_data

PROMPTS = ["def fib(n):", "Write a haiku about the sea.", "a b c d a b c d a b c d a b"]
N_NEW = 32
SMALL = ["model=tiny-random", "+workload=code", "train.prompts=8", "train.max_new_tokens=24", "train.gen_batch=8",
         "train.batch=4", "train.seq_len=64", "train.draft_vocab=512", "train.warmup=2", "train.eval_fraction=0.25",
         "train.lr=1e-2", "train.steps=24", "train.epochs=100", "train.eval_every=8", "train.draft_layers=1"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def data(engine: Engine, tmp_path_factory):
    return build_data(train_job(load_config(SMALL + [f"cache_dir={tmp_path_factory.mktemp('cache')}"])), engine)


@pytest.fixture(scope="module")
def trained(engine: Engine, data):
    return TD.train_draft_model(data, engine.model, load_config(SMALL).train, eos=sorted(engine.eos))


@pytest.fixture(scope="module")
def draft_dir(engine: Engine, trained, tmp_path_factory):
    model, ids, _ = trained
    return TD.save_draft_model(model, engine.tokenizer, tmp_path_factory.mktemp("draft"), ids)


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[list[int]]:
    engine.set_spec(SpecConfig(method="off"))
    return [engine.generate(engine.encode_prompt(p, True), SamplingParams(max_new_tokens=N_NEW)).tokens for p in PROMPTS]


def test_initialised_from_the_targets_first_layers(engine: Engine) -> None:
    draft = TD.init_draft_model(engine.model, 1)
    t, d = engine.model.state_dict(), draft.state_dict()
    assert draft.config.num_hidden_layers == 1 and draft.config.vocab_size == engine.model.config.vocab_size
    for k in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(d[k], t[k])
    assert not any(k.startswith("model.layers.1.") for k in d)
    with pytest.raises(UserError, match="draft_layers=3"):
        TD.init_draft_model(engine.model, 3)


@pytest.mark.parametrize("depth,topk,budget", [(3, 1, 4), (3, 2, 6), (2, 3, 7)])
def test_greedy_identical_to_autoregressive(engine: Engine, draft_dir, reference, depth, topk, budget) -> None:
    engine.set_spec(SpecConfig(method="draft_model", depth=depth, topk=topk, budget=budget, draft_model=str(draft_dir)))
    drafter = engine.drafter
    assert isinstance(drafter, DraftModelDrafter) and drafter.draft_ids is not None
    accepted = 0
    for p, ref in zip(PROMPTS, reference):
        res = engine.generate(engine.encode_prompt(p, True), SamplingParams(max_new_tokens=N_NEW))
        assert res.tokens == ref and res.stats.drafted_tokens > 0
        accepted += res.stats.accepted_tokens
    assert drafter.peak_tokens > N_NEW  # its own KV cache held the context
    engine.set_spec(SpecConfig(method="off"))


def test_drafts_only_draft_vocabulary_tokens(engine: Engine, draft_dir) -> None:
    engine.set_spec(SpecConfig(method="draft_model", depth=3, topk=3, budget=8, draft_model=str(draft_dir)))
    d = engine.drafter
    ids = engine.encode_prompt(PROMPTS[0], True)
    d.reset(ids)
    tree = d.draft(ids, SamplingParams())
    allowed = set(d.draft_ids.tolist())
    assert tree.size == 8 and set(tree.tokens[1:]) <= allowed
    engine.set_spec(SpecConfig(method="off"))


def test_checkpoint_round_trip(engine: Engine, trained, draft_dir) -> None:
    model, ids, _ = trained
    cfg = json.loads((draft_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert torch.equal(read_draft_vocab(draft_dir, cfg["vocab_size"]), ids)
    loaded = load_draft_model(str(draft_dir), engine.target, torch.float32, torch.device("cpu"))
    x = torch.tensor([engine.encode_prompt(PROMPTS[1], True)])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, model(input_ids=x).logits, atol=1e-4)


def test_training_lowers_validation_loss(engine: Engine, trained) -> None:
    """A random target's answers to unseen prompts cannot be predicted (on the real data only the
    training loss falls), so the validation check runs on synthetic data with a rule that held-out
    prompts share: token j+1 = perm[token j]."""
    _, _, s = trained
    assert s["val_sequences"] > 0 and s["loss_last"] < 0.5 * s["loss_first"]
    tc = load_config(SMALL + ["train.draft_vocab=64", "train.steps=40", "train.seq_len=32", "train.lr=1e-2"]).train
    _, _, s = TD.train_draft_model(cycle_data(), engine.model, tc)
    assert s["val_loss"] < 0.5 * s["val_loss_before"] and s["val_top1"] > 0.5


def test_other_tokenizer_is_refused_in_one_line(engine: Engine, draft_dir, tmp_path, capsys) -> None:
    import shutil

    from transformers import AutoTokenizer

    bad = tmp_path / "bad"
    shutil.copytree(draft_dir, bad)
    tok = AutoTokenizer.from_pretrained(str(draft_dir))
    tok.add_tokens(["<another-tokenizer>"])
    tok.save_pretrained(str(bad))
    rc = main(["bench", "model=tiny-random", "+workload=code", "workload.num_prompts=1", "workload.max_new_tokens=4",
               "bench.warmup=0", "bench.repeats=1", "spec.method=draft_model", "spec.depth=2", "spec.budget=3",
               f"spec.draft_model={bad}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "tokenizer differs" in err[0]


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


def test_train_draft_cli(cache, capsys) -> None:
    """`tuner train-draft spec.method=draft_model` needs no spec.draft_model and prints where the
    draft lies; bench then runs it."""
    assert main(["train-draft", *SMALL, "train.steps=2", "spec.method=draft_model", f"cache_dir={cache}"]) == 0
    out = capsys.readouterr().out
    use = next(line for line in out.splitlines() if "use it:" in line)
    path = use.split("spec.draft_model=")[1].strip()
    assert "/draft_model-code-" in path
    rc = main(["bench", "model=tiny-random", "+workload=code", "workload.num_prompts=1", "workload.max_new_tokens=8",
               "bench.warmup=0", "bench.repeats=1", "spec.method=draft_model", "spec.depth=2", "spec.budget=3",
               f"spec.draft_model={path}", f"cache_dir={cache}", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["spec"]["method"] == "draft_model" and res["output_tokens_per_s"] > 0


def test_draft_memory_of_each_drafter(engine: Engine, draft_dir, tmp_path) -> None:
    """Parameters measured on the drafter's own tensors (never the target's), KV from its cache
    geometry at the run's longest context; n-gram and speculation off cost nothing."""
    from engine.drafters.memory import draft_memory
    from engine.models.medusa_head import new_heads, save_heads

    cfg = engine.model.config
    engine.set_spec(SpecConfig(method="draft_model", depth=2, topk=1, budget=3, draft_model=str(draft_dir)))
    m = draft_memory(engine.drafter, engine.model, 100)
    dm = engine.drafter.model
    own = sum(p.numel() * 4 for p in dm.parameters()) + len(engine.drafter.draft_ids) * cfg.hidden_size * 4
    assert m["params_mb"] == pytest.approx(own / 1e6, rel=0.01)  # tied embedding counted once, plus its row slice
    kv = 2 * dm.config.num_hidden_layers * dm.config.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert m["kv_mb"] == pytest.approx(kv * 100 / 1e6, abs=2e-3) and m["kv_tokens"] == 100
    target_mb = sum(p.numel() * 4 for p in engine.model.parameters()) / 1e6
    assert m["target_params_mb"] == pytest.approx(target_mb, rel=0.01)
    save_heads(new_heads(engine.model, "tiny-random", 2), tmp_path / "medusa")
    engine.set_spec(SpecConfig(method="medusa", depth=2, topk=1, budget=3, head_path=str(tmp_path / "medusa")))
    med = draft_memory(engine.drafter, engine.model, 100)
    heads = engine.drafter.heads
    assert med["params_mb"] == pytest.approx(sum(p.numel() * 4 for p in heads.parameters()) / 1e6, rel=0.01)
    assert med["kv_mb"] == 0
    engine.set_spec(SpecConfig(method="eagle", depth=2, topk=1, budget=3))  # shares embedding and lm_head
    eagle = draft_memory(engine.drafter, engine.model, 100)
    assert 0 < eagle["params_mb"] < 0.5 * target_mb and eagle["kv_mb"] > 0
    for spec in (SpecConfig(method="ngram", depth=2, topk=1, budget=3), SpecConfig(method="off")):
        engine.set_spec(spec)
        assert draft_memory(engine.drafter, engine.model, 100)["total_mb"] == 0


def test_lean_draft_model_equals_transformers_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Llama draft runs on the lean blocks (LeanForward.run: tree levels see earlier levels'
    uncommitted slots); its trees and draft distributions equal those of transformers' forward over
    a DynamicCache, across catch-ups, tree levels and rollbacks."""
    import engine.drafters.draft_model as DM
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.kvpool import KVCache

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
    spec = SpecConfig(method="draft_model", depth=3, topk=2, budget=6, draft_model="x")
    lean = DraftModelDrafter(spec, model)
    monkeypatch.setattr(DM, "_lean", lambda m: None)
    plain = DraftModelDrafter(spec, model)
    assert isinstance(lean.cache, KVCache) and not isinstance(plain.cache, KVCache)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 64, (300,), generator=g).tolist()
    for d in (lean, plain):
        d.reset(seq[:5])
    params = SamplingParams(temperature=1.0)
    for end in (5, 9, 10, 270, 273):  # the last catch-ups pass the lean cache's first capacity (256)
        a = lean.draft(seq[:end], params, torch.Generator().manual_seed(end))
        b = plain.draft(seq[:end], params, torch.Generator().manual_seed(end))
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
        for k in b.q:
            torch.testing.assert_close(a.q[k], b.q[k], rtol=1e-4, atol=1e-5)
