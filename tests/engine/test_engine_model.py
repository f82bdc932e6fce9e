"""Model loading: checkpoint directories in the cache (atomic, reused), user errors."""

from __future__ import annotations

import shutil

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
