"""Heads in a layout the pinned SGLang loads as EAGLE / EAGLE-3 drafts (its model registry read from
the pinned wheel, no GPU), beside the layout vLLM loads, from the same training."""

from __future__ import annotations

import ast
import json
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from helpers import sglang_wheel
from engine.models.eagle3_head import AUX_KEY, init_eagle3, save_eagle3
from engine.models.eagle_head import random_head, save_head
from engine.models.target import random_llama
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig
from tuner.schema.engine_command import Place, engine_command, pinned_version, server_settings


@pytest.fixture(scope="module")
def sglang_models(tmp_path_factory) -> dict[str, str]:
    """{architecture: module} of the pinned SGLang's Llama EAGLE drafts (EntryClass of its model files)."""
    version = pinned_version(load_config(["deploy=sglang", "hardware=h200x1"]).deploy.image_tag)
    out = {}
    with zipfile.ZipFile(sglang_wheel(tmp_path_factory.getbasetemp().parent / "sglang-wheel", version)) as whl:
        for module in ("llama_eagle", "llama_eagle3"):
            tree = ast.parse(whl.read(f"sglang/srt/models/{module}.py").decode())
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EntryClass" for t in node.targets):
                    out.update({e.id: module for e in node.value.elts})
    return out


@pytest.fixture(scope="module")
def target():
    return random_llama(load_config(["model=tiny-random", "model.num_layers=6"]).model)


def test_an_eagle_head_has_an_sglang_view_beside_the_vllm_layout(target, sglang_models, tmp_path) -> None:
    head = random_head(target.config)
    out = save_head(head, tmp_path / "head")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]  # vLLM's
    view = out / "sglang"
    arch = json.loads((view / "config.json").read_text())["architectures"]
    assert arch == ["LlamaForCausalLMEagle"] and sglang_models[arch[0]] == "llama_eagle"
    weights = {**load_file(str(view / "model.safetensors")), **load_file(str(view / "fc_bias.safetensors"))}
    assert torch.equal(weights["fc.weight"], head.fc.weight.detach())
    assert not weights["fc.bias"].any() and weights["fc.bias"].shape == (head.fc.weight.shape[0],)
    assert not [k for k in weights if "input_layernorm" in k or k.startswith("model.")]  # SGLang adds the prefix
    cfg = load_config(["model=llama-3.1-8b-instruct", "hardware=h200x1", "engine=sglang", "deploy=sglang"])
    argv, _ = engine_command(server_settings(cfg, "sglang"), SpecConfig(method="eagle", depth=3, head_path=str(out)),
                             Place(host="127.0.0.1", port=8200, model=cfg.model.hf_id))
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(view)


def test_an_eagle3_head_names_its_layers_as_sglang_reads_them(target, sglang_models, tmp_path) -> None:
    aux = (1, 2, 3)
    head = init_eagle3(target, torch.arange(64), aux)
    conf = json.loads((save_eagle3(head, tmp_path / "h3") / "config.json").read_text())
    assert sglang_models[conf["architectures"][0]] == "llama_eagle3"
    assert conf[AUX_KEY] == list(aux)  # vLLM: the input of layer k (its top-level key wins)
    # SGLang captures the input of layer id + 1: the same states
    assert conf["eagle_config"][AUX_KEY] == [k - 1 for k in aux] and conf["eagle_config"]["use_aux_hidden_state"]
