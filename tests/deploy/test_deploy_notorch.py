"""deploy works without ML packages: `tuner render` + validate in a subprocess where importing torch fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.render import render
from tuner.schema.compose import load_config

OVERRIDES = ["model=llama-3.1-8b-instruct", "hardware=h100x8", "deploy=sglang", "deploy.replicas=3"]

SCRIPT = r"""
import importlib.abc, sys
BLOCKED = ("torch", "transformers", "engine", "accelerate", "safetensors")

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked in this test: {name}")
        return None

sys.meta_path.insert(0, Block())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]

from pathlib import Path
import tuner.schema.flags, tuner.schema.fit, deploy.winner, deploy.manifests, deploy.render, deploy.validate, deploy.apply
from deploy.validate import check_dir
from tuner.cli import main  # the whole CLI, every subcommand module registered

out = Path(sys.argv[1])
assert main(["render", *sys.argv[2:], "--out", str(out)]) == 0
assert check_dir(out, "1.33") == [], check_dir(out, "1.33")
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print("ok", len(list(out.iterdir())))
"""


def test_deploy_renders_and_validates_without_torch(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    # A different hash seed too: the bytes must not depend on set/dict hashing of the process.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "k8s"), *OVERRIDES], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == f"ok {len(list((tmp_path / 'k8s').iterdir()))}"
    render(load_config(OVERRIDES), None, tmp_path / "here")
    for f in sorted((tmp_path / "here").iterdir()):
        assert (tmp_path / "k8s" / f.name).read_bytes() == f.read_bytes(), f.name


def test_block_hook_really_blocks_torch(tmp_path: Path) -> None:
    # The hook must be able to fail: importing torch under it raises.
    script = SCRIPT.split("from pathlib import Path")[0] + "import torch\n"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "blocked in this test: torch" in r.stderr


def test_an_interrupted_render_into_a_new_directory_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C after the first manifest was written: a new output directory is removed (a half-written
    set must not be applied); an existing one keeps what it held."""
    written = []
    real = Path.write_text

    def interrupted(self, text, *args, **kwargs):
        if written:
            raise KeyboardInterrupt
        written.append(self)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        render(load_config(OVERRIDES), None, tmp_path / "new" / "k8s")
    assert written and not (tmp_path / "new" / "k8s").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    real(kept / "notes.txt", "mine")
    written.clear()
    with pytest.raises(KeyboardInterrupt):
        render(load_config(OVERRIDES), None, kept)
    assert (kept / "notes.txt").read_text() == "mine"
