"""Models from a Hugging Face hub (engine.models.target.hub_checkpoint_dir), tested with huggingface_hub's
real client against a loopback hub (tests/hub_server.py, HF_ENDPOINT) serving the tiny random
model: download with the token from HF_TOKEN, the cached copy when the hub is gone (a model volume
filled once), and one line with exit 2 when offline without a copy."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import Hub
from tuner.schema.compose import load_config

ROOT = Path(__file__).resolve().parents[2]
REPO = "spectune/tiny-random-llama"  # conf/model/tiny-random.yaml's hf_id
HUB_MODEL = ["model=tiny-random", "model.random_init=false"]  # the same model, by hf_id only

# Loads the model by hf_id, prints its greedy tokens, waits for the test to stop the hub, then loads
# it again from the HF cache alone (a fresh load: the per-process cache is cleared).
_LOADER = """
import json, sys
import torch
from engine.models import target as m
from tuner.schema.compose import load_config

cfg = load_config(sys.argv[1:])

def greedy():
    t = m.load_target(cfg.model, cfg.engine.builtin, cfg.cache_dir)
    ids = torch.tensor([[1, 520, 3300, 42, 7]])
    out = t.model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2)
    return out[0, 5:].tolist(), str(m.hf_checkpoint_dir(cfg.model, cfg.cache_dir))

print(json.dumps(greedy()), flush=True)
sys.stdin.readline()  # the hub is gone now
m._TARGETS.clear()
print(json.dumps(greedy()), flush=True)
"""


def _env(tmp_path: Path, hub: Hub, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT), **extra)
    return env


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    """The tiny random model saved as an HF checkpoint (with the SmolLM2 tokenizer): what the hub serves."""
    from engine.models.target import hf_checkpoint_dir

    return hf_checkpoint_dir(load_config(["model=tiny-random"]).model)


def _expected_greedy(tiny_dir: Path) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    out = model.generate(torch.tensor([[1, 520, 3300, 42, 7]]), max_new_tokens=8, do_sample=False, pad_token_id=2)
    return out[0, 5:].tolist()


def test_download_with_token_then_load_from_the_cache_offline(tmp_path: Path, tiny_dir: Path) -> None:
    hub = Hub(require_token="hf_test_token")
    with hub:
        hub.add_dir(REPO, tiny_dir)
        proc = subprocess.Popen([sys.executable, "-c", _LOADER, *HUB_MODEL, f"cache_dir={tmp_path / 'c'}"],
                                env=_env(tmp_path, hub, HF_TOKEN="hf_test_token"), cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-3000:]
            online, path = json.loads(line)
        except BaseException:
            proc.kill()
            raise
    # the hub is shut down: the second load has only the HF cache
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0, err[-3000:]
    offline, path2 = json.loads(out.strip().splitlines()[-1])
    assert "Bearer hf_test_token" in hub.auth  # the token came from HF_TOKEN
    assert path.startswith(str(tmp_path / "hf")) and path2 == path  # HF_HOME holds the snapshot
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    expected = _expected_greedy(tiny_dir)
    assert online == expected and offline == expected  # the very weights that were published


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_without_a_copy_is_one_line_and_exit_2(tmp_path: Path, tiny_dir: Path) -> None:
    hub = Hub()
    with hub:
        hub.add_dir(REPO, tiny_dir)  # the hub has it, but HF_HUB_OFFLINE forbids asking
        r = subprocess.run([sys.executable, "-m", "tuner.cli", "serve", *HUB_MODEL, f"serve.port={_free_port()}",
                            f"cache_dir={tmp_path / 'c'}"], env=_env(tmp_path, hub, HF_HUB_OFFLINE="1"), cwd=ROOT,
                           capture_output=True, text=True, timeout=180)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: model.hf_id={REPO}: no local copy"), lines
    assert "model.local_path=DIR" in lines[0] and f"hf download {REPO}" in lines[0]
    assert hub.auth == []  # offline means offline
