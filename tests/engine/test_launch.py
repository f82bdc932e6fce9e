"""engine.launch.launcher: command construction for vLLM / SGLang, and the server lifecycle against a fake
executable (failed start with the server's own error line, health timeout, busy port, reuse,
process-group cleanup, SIGTERM escalation, no orphan when the tuner is interrupted)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import fake_engine_exe, free_port
from engine.launch.launcher import (EngineStartError, Launcher, error_line, last_line, model_ref, server_command,
                                    server_env)
from tuner.schema.compose import load_config
from tuner.schema.config import LaunchedEngineConfig, SpecConfig, UserError


def _opt(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} must appear once in {argv}"
    return argv[argv.index(flag) + 1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (only its parent can reap it).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def fake(tmp_path: Path):
    """make(mode, **ecfg overrides) -> (Launcher over the fake `vllm`, record file)."""
    made: list[Launcher] = []
    record = tmp_path / "record.jsonl"

    def make(mode: str = "ok", kind: str = "vllm", **over) -> Launcher:
        exe = fake_engine_exe(tmp_path, "vllm" if kind == "vllm" else "python")
        ecfg = LaunchedEngineConfig(executable=exe, port=free_port(), startup_timeout_s=over.pop("startup_timeout_s", 20),
                                    env={"FAKE_MODE": mode, "FAKE_RECORD": str(record)}, **over)
        launcher = Launcher(kind, ecfg, "/models/m", served_model_name="m", log_dir=tmp_path / "logs",
                            stop_timeout_s=3.0, poll_s=0.05)
        made.append(launcher)
        return launcher

    make.record = record
    yield make
    for launcher in made:
        launcher.stop()
    leftovers = [p for r in _records(record) for p in (r["pid"], r["child"]) if _alive(p)]
    for p in leftovers:
        os.kill(p, signal.SIGKILL)
    assert not leftovers, f"fake server processes survived the test: {leftovers}"


# ---- command construction -------------------------------------------------------------------

VLLM_CASES = [
    (SpecConfig(method="off"), None),
    (SpecConfig(method="ngram", depth=3, budget=4, ngram_min=1, ngram_max=3),
     {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    (SpecConfig(method="draft_model", depth=2, budget=3, draft_model="/d"),
     {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}),
    (SpecConfig(method="eagle", depth=5, budget=6, head_path="/h1"), {"method": "eagle", "model": "/h1", "num_speculative_tokens": 5}),
    (SpecConfig(method="eagle3", depth=4, budget=5, head_path="/h3"), {"method": "eagle3", "model": "/h3", "num_speculative_tokens": 4}),
    (SpecConfig(method="medusa", depth=3, budget=4, head_path="/m"), {"method": "medusa", "model": "/m", "num_speculative_tokens": 3}),
    (SpecConfig(method="ngram", depth=4, budget=5, k_per_batch_size=[(1, 4, 4), (5, 32, 1)]),
     {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
      "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 32, 1]]}),
]


@pytest.mark.parametrize("spec,expected", VLLM_CASES, ids=[c[0].key() for c in VLLM_CASES])
def test_vllm_command_for_every_method(tmp_path: Path, spec: SpecConfig, expected: dict | None) -> None:
    exe = fake_engine_exe(tmp_path, "vllm")
    ecfg = LaunchedEngineConfig(executable=exe, host="127.0.0.1", port=8123, dtype="bfloat16", max_model_len=1024,
                                enforce_eager=True, extra_args=["--seed", "7"])
    argv = server_command("vllm", ecfg, "/models/smol", spec, served_model_name="smol")
    assert argv[:3] == [exe, "serve", "/models/smol"]
    assert (_opt(argv, "--host"), _opt(argv, "--port"), _opt(argv, "--dtype")) == ("127.0.0.1", "8123", "bfloat16")
    assert _opt(argv, "--max-model-len") == "1024" and _opt(argv, "--served-model-name") == "smol"
    assert "--enforce-eager" in argv and argv[-2:] == ["--seed", "7"]
    assert "--quantization" not in argv  # CPU trials: no FP8 flags
    if expected is None:
        assert "--speculative-config" not in argv
    else:
        assert json.loads(_opt(argv, "--speculative-config")) == expected


def test_vllm_command_through_a_python_interpreter(tmp_path: Path) -> None:
    exe = fake_engine_exe(tmp_path, "python3")
    argv = server_command("vllm", LaunchedEngineConfig(executable=exe), "m", SpecConfig(method="off"))
    assert argv[:5] == [exe, "-m", "vllm.entrypoints.cli.main", "serve", "m"]


def test_vllm_refuses_trees(tmp_path: Path) -> None:
    ecfg = LaunchedEngineConfig(executable=fake_engine_exe(tmp_path, "vllm"))
    with pytest.raises(UserError, match="chains only"):
        server_command("vllm", ecfg, "m", SpecConfig(method="eagle", depth=3, topk=2, budget=6, head_path="/h"))


def test_sglang_command(tmp_path: Path) -> None:
    exe = fake_engine_exe(tmp_path, "python")
    ecfg = LaunchedEngineConfig(executable=exe, port=8200, max_model_len=4096, enforce_eager=True)
    tree = SpecConfig(method="eagle3", depth=5, topk=4, budget=8, head_path="/h3")
    argv = server_command("sglang", ecfg, "org/model", tree, served_model_name="mm", quantization="fp8",
                          kv_cache_dtype="fp8", tensor_parallel_size=2, gpu_memory_utilization=0.85)
    assert argv[:3] == [exe, "-m", "sglang.launch_server"]
    assert _opt(argv, "--model-path") == "org/model" and _opt(argv, "--port") == "8200"
    assert _opt(argv, "--speculative-algorithm") == "EAGLE3"
    assert _opt(argv, "--speculative-draft-model-path") == "/h3"
    assert (_opt(argv, "--speculative-num-steps"), _opt(argv, "--speculative-eagle-topk"),
            _opt(argv, "--speculative-num-draft-tokens")) == ("5", "4", "8")
    assert _opt(argv, "--tp-size") == "2" and _opt(argv, "--quantization") == "fp8"
    assert _opt(argv, "--kv-cache-dtype") == "fp8_e4m3" and _opt(argv, "--context-length") == "4096"
    assert _opt(argv, "--mem-fraction-static") == "0.85" and "--disable-cuda-graph" in argv
    # topk=1: SGLang's rule draft tokens = steps + 1.
    chain = server_command("sglang", ecfg, "m", SpecConfig(method="eagle", depth=3, budget=4, head_path="/h"))
    assert (_opt(chain, "--speculative-num-steps"), _opt(chain, "--speculative-num-draft-tokens")) == ("3", "4")
    off = server_command("sglang", LaunchedEngineConfig(executable=exe), "m", SpecConfig(method="off"))
    assert not any(a.startswith("--speculative") for a in off) and "--disable-cuda-graph" not in off
    with pytest.raises(UserError, match="engine=sglang: sglang runs ngram as a tree only"):
        server_command("sglang", ecfg, "m", SpecConfig(method="ngram", depth=3, budget=4))


def test_missing_executable_names_the_setup_command() -> None:
    ecfg = LaunchedEngineConfig(executable="/nonexistent/.venv-vllm/bin/vllm")
    with pytest.raises(UserError, match="make vllm"):
        server_command("vllm", ecfg, "m", SpecConfig(method="off"))


def test_server_env(tmp_path: Path) -> None:
    ecfg = LaunchedEngineConfig(executable="x", env={"VLLM_CPU_KVCACHE_SPACE": "4"})
    local = server_env("vllm", ecfg, str(tmp_path), "cpu")
    assert local["HF_HUB_OFFLINE"] == "1" and local["VLLM_CPU_KVCACHE_SPACE"] == "4"  # the config wins
    hub = server_env("vllm", LaunchedEngineConfig(executable="x"), "org/model", "cuda")
    assert "HF_HUB_OFFLINE" not in hub and "VLLM_CPU_KVCACHE_SPACE" not in hub
    assert server_env("vllm", LaunchedEngineConfig(executable="x"), "org/model", "cpu")["VLLM_CPU_KVCACHE_SPACE"] == "2"
    # a size in the server's own arguments is not overridden (vLLM-cpu lets the variable win over the flag)
    for sized in (["--kv-cache-memory-bytes", "64M"], ["--kv-cache-memory-bytes=64M"]):
        env = server_env("vllm", LaunchedEngineConfig(executable="x", extra_args=sized), str(tmp_path), "cpu")
        assert "VLLM_CPU_KVCACHE_SPACE" not in env and env["HF_HUB_OFFLINE"] == "1"


def test_model_ref_is_the_local_checkpoint_or_the_hub_id(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    hub = load_config([]).model.model_copy(update={"gguf": None, "local_path": None, "random_init": False})
    assert model_ref(hub.model_copy(update={"local_path": str(ckpt)})) == str(ckpt)
    assert model_ref(hub) == hub.hf_id  # nothing local: the server fetches the hub id itself


# ---- the server's own error line ------------------------------------------------------------

def test_error_line_skips_wrappers_and_prefixes() -> None:
    log = textwrap.dedent("""\
        (EngineCore pid=12) INFO 11-29 10:14:28 [core.py:1] starting
        (EngineCore pid=12) ERROR 11-29 10:14:29 [core.py:708] torch.OutOfMemoryError: could not allocate 2.0 GiB
        Traceback (most recent call last):
          File "/x/api.py", line 3, in run
            raise RuntimeError(msg)
            ^^^^^^^^^^^^^^^^^^^^^^^
        RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
        """)
    assert error_line(log) == "torch.OutOfMemoryError: could not allocate 2.0 GiB"
    # A warning that merely says "not found" is not the error; the wrapper is the best there is.
    killed = ("(Worker pid=3) WARNING 11-29 10:22:16 [cpu_worker.py:114] libiomp is not found in LD_PRELOAD.\n"
              "RuntimeError: Engine core initialization failed. See root cause above. "
              "Failed core proc(s): {'EngineCore': -9}\n")
    assert error_line(killed).startswith("RuntimeError: Engine core initialization failed")
    assert last_line(killed + "\n\n") == error_line(killed)
    assert last_line("INFO 11-29 10:14:28 [core.py:1] loading weights\n") == "loading weights"
    argparse_log = "usage: vllm [-h]\nvllm: error: unrecognized arguments: --no-such-flag\n"
    assert error_line(argparse_log) == "vllm: error: unrecognized arguments: --no-such-flag"
    pyd = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig\n"
           "  Value error, Invalid repository ID or local directory specified: '/d'.\n")
    assert "Invalid repository ID" in error_line(pyd)
    assert error_line("\x1b[32mINFO\x1b[0m all good\n") == "INFO all good"
    assert error_line("") == "(the server wrote no log)"


# ---- lifecycle against the fake server ------------------------------------------------------

def test_failed_start_raises_with_the_servers_error_line(fake) -> None:
    launcher = fake("fail")
    with pytest.raises(EngineStartError) as err:
        launcher.ensure(SpecConfig(method="ngram", depth=3, budget=4))
    msg = str(err.value)
    assert "exited with code 1" in msg
    assert "ValueError: speculative config rejected: num_speculative_tokens must be > 0" in msg
    assert "\n" not in msg and err.value.returncode == 1
    assert err.value.log_path is not None and "Traceback" in err.value.log_path.read_text()
    assert not launcher.running


def test_server_killed_during_start_up(fake) -> None:
    launcher = fake("oom")
    with pytest.raises(EngineStartError, match="killed by signal 9") as err:
        launcher.ensure(SpecConfig(method="off"))
    assert err.value.returncode == -9 and not launcher.running


def test_unrunnable_executable_is_a_failed_start(tmp_path: Path) -> None:
    exe = tmp_path / "vllm"
    exe.write_text("#!/nonexistent/python\n")
    exe.chmod(0o755)
    launcher = Launcher("vllm", LaunchedEngineConfig(executable=str(exe), port=free_port()), "m", log_dir=tmp_path)
    with pytest.raises(EngineStartError, match="could not be executed"):
        launcher.ensure(SpecConfig(method="off"))
    assert not launcher.running


def test_health_timeout_kills_the_whole_group(fake) -> None:
    launcher = fake("hang", startup_timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(EngineStartError, match=r"not healthy after 1.5 s .*startup_timeout_s.*starting fake engine"):
        launcher.ensure(SpecConfig(method="off"))
    assert time.monotonic() - t0 < 10
    rec = _records(fake.record)[-1]
    assert _wait_gone([rec["pid"], rec["child"]]) == []
    assert not launcher.running


def test_busy_port_is_a_failed_start(fake) -> None:
    launcher = fake("ok")
    with socket.socket() as s:
        s.bind(("127.0.0.1", launcher.ecfg.port))
        s.listen(1)
        with pytest.raises(EngineStartError, match="already in use"):
            launcher.ensure(SpecConfig(method="off"))
    assert _records(fake.record) == []  # nothing was started


def test_reuse_when_flags_equal_restart_when_they_differ(fake) -> None:
    launcher = fake("ok")
    off, ngram = SpecConfig(method="off"), SpecConfig(method="ngram", depth=3, budget=4)
    url = launcher.ensure(off)
    assert url == launcher.base_url and launcher.startup_s > 0 and not launcher.reused
    first = launcher.pid
    assert launcher.ensure(SpecConfig(method="off")) == url
    assert launcher.reused and launcher.startup_s == 0.0 and launcher.pid == first
    launcher.ensure(ngram)
    assert not launcher.reused and launcher.pid != first and launcher.starts == 2
    recs = _records(fake.record)
    assert len(recs) == 2
    assert _wait_gone([recs[0]["pid"], recs[0]["child"]]) == []  # the old server, child included
    assert "--speculative-config" not in recs[0]["argv"] and "--speculative-config" in recs[1]["argv"]
    assert recs[1]["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert launcher.total_startup_s >= launcher.startup_s > 0
    with launcher:
        pass  # the context manager stops it
    assert not launcher.running and _wait_gone([recs[1]["pid"], recs[1]["child"]]) == []


def test_a_dead_server_is_restarted(fake) -> None:
    launcher = fake("ok")
    launcher.ensure(SpecConfig(method="off"))
    os.killpg(launcher.pid, signal.SIGKILL)
    _wait_gone([launcher.pid])
    launcher.ensure(SpecConfig(method="off"))
    assert not launcher.reused and launcher.starts == 2 and launcher.running


def test_sigterm_ignored_escalates_to_sigkill(fake) -> None:
    launcher = fake("stubborn")
    launcher.ensure(SpecConfig(method="off"))
    t0 = time.monotonic()
    launcher.stop()
    assert time.monotonic() - t0 < 15
    rec = _records(fake.record)[-1]
    assert _wait_gone([rec["pid"], rec["child"]]) == []


_DRIVER = """
import signal, sys, time
# Ctrl-C and a hang-up as a terminal delivers them, also when the suite runs as a background job
# (SIGINT ignored) or under nohup (SIGHUP ignored, which the launcher then leaves alone)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
from engine.launch.launcher import Launcher
from tuner.schema.config import LaunchedEngineConfig, SpecConfig
ecfg = LaunchedEngineConfig(executable=sys.argv[1], port=int(sys.argv[2]), startup_timeout_s=60,
                            env={{"FAKE_MODE": sys.argv[3], "FAKE_RECORD": sys.argv[4]}})
launcher = Launcher("vllm", ecfg, "/models/m", log_dir=sys.argv[5], poll_s=0.05, stop_timeout_s=3)
{body}
"""


@pytest.mark.parametrize("mode,sig", [("ok", signal.SIGTERM), ("ok", signal.SIGINT), ("hang", signal.SIGINT),
                                      ("ok", signal.SIGHUP), ("ok", signal.SIGKILL)])
def test_interrupted_tuner_leaves_no_orphan(fake, tmp_path: Path, mode: str, sig: int) -> None:
    """The tuner is stopped (Ctrl-C while waiting for health or while measuring, SIGTERM, SIGHUP,
    SIGKILL): the server's whole process group goes with it."""
    body = "launcher.ensure(SpecConfig(method='off')); print('healthy', flush=True); time.sleep(600)" if mode == "ok" \
        else "launcher.ensure(SpecConfig(method='off'))"
    exe = fake_engine_exe(tmp_path, "vllm")
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER.format(body=body), exe, str(free_port()), mode, str(fake.record), str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 30
        while not _records(fake.record) and time.monotonic() < deadline:
            time.sleep(0.05)
        if mode == "ok":
            assert driver.stdout.readline().strip() == "healthy"
        else:
            time.sleep(0.5)  # inside the health wait
        rec = _records(fake.record)[-1]
        driver.send_signal(sig)
        driver.wait(timeout=20)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert _wait_gone([rec["pid"], rec["child"]]) == [], driver.stderr.read()[-2000:]


def test_the_project_root_is_the_checkout() -> None:
    """Relative executables (.venv-vllm/bin/vllm) resolve against the checkout, wherever the module lives."""
    from engine.launch.command import PROJECT_ROOT

    assert (PROJECT_ROOT / "pyproject.toml").is_file() and (PROJECT_ROOT / "engine").is_dir()
