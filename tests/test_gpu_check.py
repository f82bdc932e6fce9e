"""scripts/gpu_check.py (`make gpu-check`): refuses without CUDA in one line, and its steps run
end to end on the CPU with the tiny model (`--device cpu`), so the script a GPU machine runs is
the script tested here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_it_is_one_line_and_exit_2() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: make gpu-check needs a CUDA GPU (torch.cuda.is_available() is False here)"]


def _gpu_check():
    """scripts/gpu_check.py as a module (scripts/ is no package)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


@pytest.mark.slow  # a real vLLM server (the vllm-head step)
def test_the_lossless_step_and_the_table_on_cpu(monkeypatch, capsys, one_torch_thread) -> None:
    """The script's main() with every step the CPU can run, each command a step starts run by that
    command's own main() in this process: its argv through the real parser, its stdout parsed by the
    step. A fresh interpreter per command (the script's --lossless-only pass, `tuner train-draft`,
    `tuner bench`) only imported torch and the engine again; the script's own subprocess call, time
    limit and log are test_log_keeps_each_commands_whole_output's, its console-script start
    test_without_cuda_it_is_one_line_and_exit_2's. vLLM still runs as its own server, loading the head
    trained here."""
    import contextlib
    import io

    from tuner.cli import main as tuner_main

    gpu_check = _gpu_check()
    tuner = Path(sys.executable).parent / "tuner"
    commands: list[tuple[list[str], str]] = []  # each command and its stdout

    def in_process(argv: list[str], timeout_s: float) -> tuple[int, str, str]:
        assert timeout_s > 0
        if argv[:2] == [sys.executable, str(SCRIPT)]:
            fn, args = gpu_check.main, argv[2:]
        else:
            assert argv[0] == str(tuner) and tuner.is_file(), argv
            fn, args = tuner_main, argv[1:]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = fn(args)
        commands.append((argv, out.getvalue()))
        return rc, out.getvalue(), err.getvalue()

    monkeypatch.setattr(gpu_check, "run", in_process)
    monkeypatch.chdir(ROOT)  # where run() starts every command
    monkeypatch.setattr(gpu_check, "TIME_SCALE", [1.0])  # main() sets it: the module's own stays for the next test
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # main() sets it by default: not left in this process
    # vLLM's model in its engine core's process: one process fewer to start. One unpinned compute
    # thread in vLLM's engine core, as under tests/conftest.py's xdist workers, also when this file
    # runs alone: with two OpenMP threads, while another process holds a core, each parallel op waits
    # for the preempted thread.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    rc = gpu_check.main(["--device", "cpu", "--model", "tiny-random", "--prompts", "2", "--tokens", "16",
                         "--steps", "lossless,vllm-head", "--time-scale", "4",
                         # the head only has to load into vLLM and draft: a short training on little data
                         # (the default 160 answers of 128 tokens and 8 x 256-token steps cost most of the CPU
                         # for a head nobody measures; the head's layout, draft vocabulary included, is kept)
                         "--train-steps", "20", "--override", "train.prompts=16", "--override", "train.max_new_tokens=32",
                         "--override", "train.batch=2", "--override", "train.seq_len=64",
                         # vLLM's CPU attention has no head size 16 (tiny-random's): 32 is its smallest
                         "--override", "model.head_dim=32", "--override", "model.hidden_size=128"])
    out = capsys.readouterr().out
    vllm_env = (ROOT / ".venv-vllm" / "bin" / "vllm").is_file()  # `make test` builds it, so CI runs this step
    assert rc == 0, out
    assert "spectune gpu-check (cpu, model tiny-random)" in out
    # the commands the steps started, in order: the lossless pass, then training and bench with the head
    names = ["--lossless-only" if argv[0] == sys.executable else argv[1] for argv, _ in commands]
    assert names == ["--lossless-only", *(["train-draft", "bench"] if vllm_env else [])], names
    row = next(line for line in out.splitlines() if "lossless" in line)
    assert " ok " in row and "4/4 generations token-identical" in row  # 2 prompts x (chain, tree)
    head_row = next(line for line in out.splitlines() if "vllm-head" in line)
    if vllm_env:
        assert " ok " in head_row and "0 failed requests" in head_row, head_row
        (train, trained), (bench, _) = commands[1:]
        assert "train.steps=20" in train  # --train-steps reached the training
        assert f"spec.head_path={gpu_check.last_json(trained)['head_path']}" in bench  # vLLM ran the head trained here
    else:
        assert " skipped " in head_row


def test_helpers_read_the_tools_output() -> None:
    gpu_check = _gpu_check()
    assert gpu_check.pytest_summary("....\n3 passed, 1 skipped in 2.0s\n") == "3 passed, 1 skipped"
    assert gpu_check.last_json('table\n{"a": 1}\n') == {"a": 1} and gpu_check.last_json("no json") is None
    summary = {"prompts": 4, "builtin_ar_vs_hf_ar": 1.21, "best_spec_vs_hf_ar": 1.9,
               "rows": [{"same_as_hf_ar": 4}, {"same_as_hf_ar": 4}, {"same_as_hf_ar": 3}]}
    status, line = gpu_check.speed_result(summary)
    assert status == "FAIL" and "2/3" in line and "1.90x" in line  # one row differs from AR on one prompt
    summary["rows"][2]["same_as_hf_ar"] = 4
    assert gpu_check.speed_result(summary)[0] == "ok"
    # engine_speed's HF bf16 reference row compares with the fp32 AR and may differ by rounding: not
    # a losslessness row; a native bf16 row is held to its own AR row
    summary["rows"] += [{"same_as_hf_ar": 0, "weights": "bf16"}, {"same_as_own_ar": 4, "weights": "bf16"}]
    status, line = gpu_check.speed_result(summary)
    assert status == "ok" and "4/4" in line
    summary["rows"][-1]["same_as_own_ar"] = 2
    status, line = gpu_check.speed_result(summary)
    assert status == "FAIL" and "3/4" in line


def test_log_keeps_each_commands_whole_output(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    log = tmp_path / "steps.log"
    gpu_check.LOG[:] = [log]
    try:
        fail = [sys.executable, "-c", "import sys; print('first'); print('why it failed', file=sys.stderr); sys.exit(3)"]
        assert gpu_check.run(fail, 60) == (3, "first\n", "why it failed\n")
        assert gpu_check.run([sys.executable, "-c", "print('second')"], 60)[0] == 0
    finally:
        gpu_check.LOG.clear()
    text = log.read_text()
    # both commands appended in order, each with its status, stdout and stderr
    assert (text.index("# rc 3,") < text.index("# stdout\nfirst\n") < text.index("# stderr\nwhy it failed\n")
            < text.index("# rc 0,") < text.index("# stdout\nsecond\n"))
    assert gpu_check.run([sys.executable, "-c", "print('third')"], 60)[1] == "third\n" and "third" not in log.read_text()
    gpu_check.LOG[:] = [log]
    try:  # a step stopped at its limit: what it had written so far, for where it hung
        stuck = [sys.executable, "-c", "import sys, time; print('loading', file=sys.stderr, flush=True); time.sleep(30)"]
        rc, _, err = gpu_check.run(stuck, 3)
    finally:
        gpu_check.LOG.clear()
    assert rc == 124 and err == "timed out after 3 s" and "# stderr\nloading\ntimed out after 3 s\n" in log.read_text()
