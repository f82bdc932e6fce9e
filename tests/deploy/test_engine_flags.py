"""Every flag the engine command emits exists in the pinned engine version: SGLang's flags against
the pinned wheel's `server_args.py` (downloaded, parsed with ast: no GPU, no install), vLLM's against
the installed vLLM's own argument parser (.venv-vllm, `make vllm`)."""

from __future__ import annotations

import ast
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from helpers import sglang_wheel
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig
from tuner.schema.engine_command import PROGRAMS, Place, engine_command, pinned_version, server_settings
from tuner.schema.flags import (SGLANG_ADAPTIVE, SGLANG_ADAPTIVE_METHODS, sglang_adaptive, sglang_adaptive_config,
                                sglang_args, vllm_adaptive_methods)
from tuner.schema.methods import METHODS

ROOT = Path(__file__).resolve().parents[2]
HEAD = "org/head"
SPECS = {
    "vllm": [SpecConfig(method="off"), SpecConfig(method="ngram", depth=3), SpecConfig(method="suffix", depth=3),
             SpecConfig(method="draft_model", depth=3, draft_model="org/draft"),
             SpecConfig(method="eagle", depth=3, head_path=HEAD), SpecConfig(method="eagle3", depth=3, head_path=HEAD),
             SpecConfig(method="medusa", depth=3, head_path=HEAD),
             SpecConfig(method="ngram", depth=4, k_per_batch_size=[(1, 4, 4), (5, 64, 1)])],
    "sglang": [SpecConfig(method="off"), SpecConfig(method="ngram", depth=3, topk=4, budget=8),
               SpecConfig(method="ngram", depth=3, topk=2, budget=6, ngram_match="prob"),
               SpecConfig(method="eagle", depth=3, topk=4, budget=8, head_path=HEAD),
               SpecConfig(method="eagle3", depth=3, head_path=HEAD)],
}


def emitted(kind: str) -> list[list[str]]:
    """The argv (after the program) of every spec on a one-GPU and a tensor-parallel profile, with the
    optional flags on."""
    out = []
    for hw, extra in (("h200x1", []), ("h100x8", [f"engine.{kind}.enforce_eager=true", "deploy.mem_fraction_static=0.8"])):
        cfg = load_config(["model=llama-3.3-70b-instruct", f"hardware={hw}", f"engine={kind}", f"deploy={kind}", *extra])
        s = server_settings(cfg, kind)  # type: ignore[arg-type]
        for spec in SPECS[kind]:
            argv, _ = engine_command(s, spec, Place(host="0.0.0.0", port=8000, model=cfg.model.hf_id))
            out.append(argv[len(PROGRAMS[kind]):])
    assert any("--tp-size" in a or "--tensor-parallel-size" in a for a in out)  # TP is among what is checked
    return out


def _sglang_server_args(tmp_dir: Path, version: str | None = None,
                        member: str = "sglang/srt/server_args.py") -> str:
    """A file of an SGLang wheel, server_args.py of the pinned one by default (pip download --no-deps,
    cached beside the tests' tmp)."""
    version = version or pinned_version(load_config(["deploy=sglang", "hardware=h200x1"]).deploy.image_tag)
    with zipfile.ZipFile(sglang_wheel(tmp_dir, version)) as whl:
        return whl.read(member).decode() if member in whl.namelist() else ""


def _add_argument_calls(source: str) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "add_argument"]


def test_every_sglang_flag_exists_in_the_pinned_sglang(tmp_path_factory) -> None:
    source = _sglang_server_args(tmp_path_factory.getbasetemp().parent / "sglang-wheel")
    flags: set[str] = set()
    choices: dict[str, list[str]] = {}
    for call in _add_argument_calls(source):
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        flags.update(names)
        for kw in call.keywords:
            if kw.arg == "choices" and isinstance(kw.value, ast.List):
                for n in names:
                    choices[n] = [e.value for e in kw.value.elts if isinstance(e, ast.Constant)]
    assert "--speculative-ngram-branch-length" in flags and "--speculative-ngram-max-trie-depth" not in flags
    for argv in emitted("sglang"):
        for i, a in enumerate(argv):
            if a.startswith("--"):
                assert a in flags, f"{a}: not a flag of the pinned SGLang ({argv})"
                if a in choices:
                    assert argv[i + 1] in choices[a], f"{a} {argv[i + 1]}: allowed {choices[a]}"


def _flags(source: str) -> set[str]:
    """The flags of a server_args.py: its add_argument calls and, from 0.5.14, the ServerArgs fields
    annotated `A[type, help]`, from which SGLang makes `--field-name` flags."""
    tree = ast.parse(source)
    fields = {f"--{n.target.id.replace('_', '-')}" for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
              and c.name == "ServerArgs" for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
              and isinstance(n.annotation, ast.Subscript) and getattr(n.annotation.value, "id", None) == "A"}
    return fields | {a.value for call in _add_argument_calls(source) for a in call.args
                     if isinstance(a, ast.Constant) and str(a.value).startswith("--")}


@pytest.mark.parametrize("version", ["0.5.10", *(".".join(map(str, v)) for v, _ in SGLANG_ADAPTIVE)])
def test_sglang_adaptive_table_matches_each_release(version: str, tmp_path_factory) -> None:
    """tuner.schema.flags.SGLANG_ADAPTIVE against each release's own sources: where the flag is, what
    it needs (the overlap scheduler off), how its knobs file is keyed, whether 0 steps are allowed,
    and that every flag an adaptive spec renders exists there."""
    cache = tmp_path_factory.getbasetemp().parent / "sglang-wheel"
    flags = _flags(_sglang_server_args(cache, version))
    params = _sglang_server_args(cache, version, "sglang/srt/speculative/adaptive_spec_params.py")
    how = sglang_adaptive(version)
    assert (how is not None) == ("--speculative-adaptive" in flags)
    if how is None:
        return
    assert how.overlap_off == ("disable_overlap_schedule" in params)
    assert how.by_batch_size == ("isdigit()" in params) and how.zero_steps == ("non-negative" in params)
    assert '("EAGLE", "EAGLE3")' in params and {METHODS[m].sglang for m in SGLANG_ADAPTIVE_METHODS} == {"EAGLE", "EAGLE3"}
    spec = SpecConfig(method="eagle3", depth=5, head_path=HEAD, adaptive=True)
    argv = sglang_args("m", spec, version=version, adaptive_config="/etc/spectune/a.json")
    assert {a for a in argv if a.startswith("--")} <= flags
    knobs = sglang_adaptive_config(spec, how)
    assert all(f'"{k}"' in params for entry in ([knobs] if "candidate_steps" in knobs else knobs.values()) for k in entry)


VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PARSE = """
import dataclasses, json, sys
from vllm.config import SpeculativeConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = make_arg_parser(FlexibleArgumentParser())
fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
for argv in json.loads(sys.stdin.read()):
    AsyncEngineArgs.from_cli_args(parser.parse_args(argv))  # an unknown flag or a bad value exits 2
    if "--speculative-config" in argv:
        unknown = set(json.loads(argv[argv.index("--speculative-config") + 1])) - fields
        assert not unknown, f"speculative-config keys {unknown} not in vLLM's SpeculativeConfig"
print("parsed", len(json.loads(sys.argv[1])))
"""


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm (make vllm)")
def test_every_vllm_flag_parses_with_the_installed_vllm() -> None:
    version = subprocess.run([str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version.split("+")[0] == pinned_version(load_config(["deploy=vllm", "hardware=h200x1"]).deploy.image_tag)
    argvs = emitted("vllm")
    r = subprocess.run([str(VLLM_PYTHON), "-c", PARSE, json.dumps(argvs)], input=json.dumps(argvs), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and f"parsed {len(argvs)}" in r.stdout, r.stderr[-3000:]


def test_vllm_adaptive_table_matches_the_installed_vllm() -> None:
    """VLLM_ADAPTIVE_METHODS for the pinned release says what the installed vLLM's config documents."""
    version = pinned_version(load_config(["deploy=vllm", "hardware=h200x1"]).deploy.image_tag)
    found = list(VLLM_PYTHON.parents[1].glob("lib/python3*/site-packages/vllm/config/speculative.py"))
    if not found:
        pytest.skip("needs .venv-vllm (make vllm)")
    source = found[0].read_text()
    assert "enable_adaptive_verification: bool" in source
    assert vllm_adaptive_methods(version) == {"dspark"} and 'only supported for method="dspark"' in source
