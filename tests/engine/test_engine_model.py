"""Model loading: checkpoint directories in the cache (atomic, reused), user errors."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from engine.models import target as M
from tuner.schema.compose import load_config
from tuner.schema.config import UserError


def test_random_checkpoint_dir_matches_the_in_code_model(tmp_path) -> None:
    cfg = load_config(["model=tiny-random"]).model
    # seed the temp cache with the already-extracted tokenizer (extraction from the GGUF takes ~17 s)
    src = M.gguf_path(*M.SMOLLM2_GGUF)
    shutil.copytree(M.smollm2_tokenizer_dir(), tmp_path / "tokenizers" / M.file_digest(src, tmp_path))
    path = M.hf_checkpoint_dir(cfg, str(tmp_path))
    assert (path / "config.json").is_file() and (path / ".complete").is_file()
    assert (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []  # no temp dir left behind
    stamp = (path / ".complete").stat().st_mtime_ns
    assert M.hf_checkpoint_dir(cfg, str(tmp_path)) == path and (path / ".complete").stat().st_mtime_ns == stamp
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ref = M.random_llama(cfg).eval()
    ids = torch.tensor([[1, 2, 3, 400, 5000]])
    with torch.inference_mode():
        assert torch.allclose(loaded(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5)


def test_user_errors(tmp_path) -> None:
    cfg = load_config(["model=tiny-random"]).model
    with pytest.raises(UserError, match="model.local_path"):
        M.hf_checkpoint_dir(cfg.model_copy(update={"local_path": str(tmp_path), "random_init": False}))
    with pytest.raises(UserError, match="model.gguf.package"):
        M.gguf_path("no_such_package_xyz", "x.gguf")
    with pytest.raises(UserError, match="float16"):
        M.resolve_dtype("float16", torch.device("cpu"))


def _checkpoint_config(path, model_cfg, **changes) -> None:
    """Only the config.json of a checkpoint with model_cfg's dimensions (the check reads no weights)."""
    from transformers import LlamaConfig

    m = model_cfg
    dims = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=4 * m.hidden_size,
                num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, max_position_embeddings=m.max_context)
    dims.update(changes)
    LlamaConfig(**dims).save_pretrained(str(path))


@pytest.mark.parametrize("hf_key,value,key", [
    ("num_hidden_layers", 3, "num_layers"), ("hidden_size", 96, "hidden_size"),
    ("num_attention_heads", 8, "num_attention_heads"), ("num_key_value_heads", 4, "num_kv_heads"),
    ("head_dim", 8, "head_dim"), ("vocab_size", 32000, "vocab_size"), ("max_position_embeddings", 1024, "max_context"),
])
def test_the_model_configs_dimensions_must_be_the_loaded_checkpoints(tmp_path, hf_key, value, key) -> None:
    """Issue 24.3b: conf/model's dimensions (fit check, cost model) against the checkpoint load_target loads."""
    from tuner.schema.config import BuiltinEngineConfig

    cfg = load_config(["model=tiny-random"]).model.model_copy(update={"random_init": False, "local_path": str(tmp_path)})
    _checkpoint_config(tmp_path, cfg, **{hf_key: value})
    with pytest.raises(UserError) as err:
        M.load_target(cfg, BuiltinEngineConfig(device="cpu"), cache_dir=str(tmp_path / "cache"))
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"model.{key}={getattr(cfg, key)}: ") and f"{hf_key}={value}" in line


def test_matching_dimensions_pass_and_a_shorter_context_is_allowed(tmp_path) -> None:
    cfg = load_config(["model=tiny-random"]).model.model_copy(update={"random_init": False, "local_path": str(tmp_path)})
    _checkpoint_config(tmp_path, cfg, max_position_embeddings=4 * cfg.max_context)
    M.check_dimensions(cfg, tmp_path)  # no error: model.max_context may serve less than the weights allow
    _checkpoint_config(tmp_path, cfg, head_dim=None)  # no head_dim: hidden_size / heads
    M.check_dimensions(cfg, tmp_path)


def _publish_in_child(final: str, record: str) -> None:
    def build(tmp) -> None:
        with open(record, "a") as f:
            f.write("built\n")
        time.sleep(0.5)  # long enough that the other process asks while this one builds
        (tmp / "weights").write_text("w")

    M._publish(Path(final), build)


def test_processes_that_need_one_entry_at_once_build_it_once(tmp_path) -> None:
    """Two processes asking for the same cache entry together: one builds, the other waits for its
    copy (without the lock file both would convert the GGUF); no lock or temp file is left."""
    import multiprocessing

    final, record = tmp_path / "models" / "m", tmp_path / "record"
    ctx = multiprocessing.get_context("fork")  # _publish uses no torch: forking the test process is safe
    procs = [ctx.Process(target=_publish_in_child, args=(str(final), str(record))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert record.read_text() == "built\n"
    assert (final / "weights").read_text() == "w" and (final / ".complete").is_file()
    assert sorted(p.name for p in final.parent.iterdir()) == ["m"]


def test_a_gguf_file_is_parsed_once_within_the_conversion(tmp_path, monkeypatch) -> None:
    """transformers parses the GGUF again for the tokenizer, the config and the tensors (three parses
    of ~15 s on a loaded 2-core machine): within the conversion's scope one reader per file serves
    them all; a changed file, another file and a writer are built anew; leaving restores gguf's class."""
    import os

    import gguf

    from engine.models.target import _read_once

    built: list[str] = []

    class Fake:
        def __init__(self, path: str, mode: str = "r") -> None:
            built.append(f"{os.path.basename(path)} {mode}")

    monkeypatch.setattr(gguf, "GGUFReader", Fake)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"x")
    b.write_bytes(b"y")
    with _read_once:
        first = gguf.GGUFReader(str(a))
        with _read_once:  # nested (the tokenizer's extraction inside the conversion)
            assert gguf.GGUFReader(str(a)) is first
        assert gguf.GGUFReader(str(a)) is first, "the inner scope's end keeps the outer one's readers"
        assert gguf.GGUFReader(str(b)) is not first
        gguf.GGUFReader(str(a), "r+")
        a.write_bytes(b"xx")  # another size: read again
        assert gguf.GGUFReader(str(a)) is not first
    assert built == ["a.gguf r", "b.gguf r", "a.gguf r+", "a.gguf r"]
    assert gguf.GGUFReader is Fake, "gguf's own class again after the scope"
    gguf.GGUFReader(str(a))
    assert len(built) == 5, "outside the scope every read parses"


def test_the_tensor_name_map_is_built_once_within_the_conversion(monkeypatch) -> None:
    """transformers maps the GGUF's tensor names with gguf's name map of the architecture, built again for
    every module of the model: within the conversion's scope the first map of an (architecture, block
    count) serves every module, the names it gives are the same, and leaving restores gguf's function."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from engine.models.target import _read_once

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    real, built = gguf.get_tensor_name_map, []

    def counted(arch, n_blocks):
        built.append((arch, n_blocks))
        return real(arch, n_blocks)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counted)
    plain = get_gguf_hf_weights_map(model, TensorProcessor())
    modules = len(built)
    assert modules > 10 and len(plain) == len(model.state_dict()), "one map per module without the scope"
    built.clear()
    with _read_once:
        assert get_gguf_hf_weights_map(model, TensorProcessor()) == plain, "the same names"
        with _read_once:  # nested: the outer scope's maps
            assert get_gguf_hf_weights_map(model, TensorProcessor()) == plain
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert built == [(gguf.MODEL_ARCH.LLAMA, 2), (gguf.MODEL_ARCH.LLAMA, 3)], "one map per architecture and depth"
    assert gguf.get_tensor_name_map is counted, "gguf's own function again after the scope"


def test_the_checkpoint_converts_while_the_kernels_build(tmp_path, monkeypatch) -> None:
    """A cold engine load starts the native kernels' build on its threads and converts the GGUF while they
    build; the target's load (whose weights: auto waits for the built kernels) comes after. Before, the
    conversion waited behind the build. A random_init target has nothing to convert."""
    from engine.decode import loop

    order: list[str] = []

    class Stop(Exception):
        pass

    def load(*a, **k):
        order.append("load")
        raise Stop

    monkeypatch.setattr(loop, "prebuild_kernels", lambda: order.append("build"))
    monkeypatch.setattr(loop, "hf_checkpoint_dir", lambda model, cache: order.append(f"convert {model.name}"))
    monkeypatch.setattr(loop, "load_target", load)
    for overrides, want in ((["model=smollm2-135m"], ["build", "convert smollm2-135m", "load"]),
                            (["model=tiny-random"], ["build", "load"])):
        order.clear()
        cfg = load_config([*overrides, f"cache_dir={tmp_path}", "engine.builtin.device=cpu"])
        with pytest.raises(Stop):
            loop.Engine.from_config(cfg.model, cfg.engine.builtin, cache_dir=cfg.cache_dir)
        assert order == want
