"""engine.builtin.weights where the native step cannot read the format: the kernels still build (fp32)
on a CPU without the widening instructions, and bf16 / fp8 are refused in one line (exit 2 from the
CLI) instead of measuring the rounded values at fp32 speed."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models import decode_step, native, smallm
from tests.conftest import TINY
from tuner.schema.compose import load_config
from tuner.schema.config import UserError
from tuner.study.measurer import open_engine

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(smallm.library() is None, reason=f"no C++ compiler: {smallm.error()}")


def _formats_only(extra: list[str]) -> native.Native:
    """The shared block source alone (its weight_formats), built for 8 lanes with `extra` flags."""
    def bind(lib: ctypes.CDLL) -> None:
        lib.weight_formats.restype = ctypes.c_int

    return native.Native("formats", native.VECTORS + smallm.BLOCK_SOURCE, ["-DVW=8", "-DNB=1", *extra], bind)


@pytest.mark.parametrize("extra, formats", [([], {"fp32", "bf16", "fp8"}),
                                            (["-mno-f16c"], {"fp32", "bf16", "fp8"}),
                                            (["-mno-avx2", "-mno-f16c"], {"fp32"})])
def test_kernel_builds_the_formats_the_cpu_has(extra: list[str], formats: set[str]) -> None:
    """Built as for an AVX2 CPU without F16C (8 lanes widen e4m3 by integer operations alone), or without
    AVX2 at all, the few-row kernel still builds and computes fp32 exactly; it reports only the formats
    it built and refuses the others' fmt codes (a CPU lacking the instructions lost the fp32 kernel too
    when the widenings were unconditional)."""
    lib = native.Native("smallm", smallm._SOURCE, ["-DVW=8", "-DNB=1", *extra], smallm._bind).library()
    assert lib is not None
    assert smallm.built_formats(lib) == formats
    g = torch.Generator().manual_seed(0)
    k, n = 19, 16
    w, x = torch.randn(n, k, generator=g), torch.randn(3, k, generator=g)
    packed = w.reshape(-1, 8, k).transpose(1, 2).contiguous()
    y = torch.empty(3, n)
    assert lib.smallm_linear(x.data_ptr(), packed.data_ptr(), y.data_ptr(), 3, n, k, 0, 1.0, 1) == 0
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    for name, fmt in (("bf16", 1), ("fp8", 2)):
        rc = lib.smallm_linear(x.data_ptr(), packed.data_ptr(), y.data_ptr(), 3, n, k, fmt, 1.0, 1)
        assert (rc == 0) == (name in formats)


def test_a_cpu_without_avx2_refuses_fp8_and_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the native step built as on a CPU without AVX2, fp8 and bf16 are refused in one line naming
    the key, the missing instructions and what is allowed; fp32 is not refused."""
    from engine.models.decode_step import weights_refusal

    monkeypatch.setattr(decode_step, "_NATIVE", _formats_only(["-mno-avx2", "-mno-f16c"]))
    for weights in ("fp8", "bf16"):
        with pytest.raises(UserError) as e:
            open_engine(load_config([*TINY, f"engine.builtin.weights={weights}"]))
        msg = str(e.value)
        assert msg.startswith(f"engine.builtin.weights={weights}") and "\n" not in msg
        assert "AVX2" in msg and msg.endswith("allowed here: fp32"), msg
    assert weights_refusal("fp32", torch.device("cpu"), torch.float32) is None


def test_fp8_where_the_step_cannot_run_for_the_model() -> None:
    """A head size the native step is not built for, at fp8: refused (the torch path would read the
    rounded values at 4 bytes); native_step=false, the user's explicit choice of that path, loads."""
    odd = [*TINY, "model.hidden_size=96", "model.head_dim=24", "engine.builtin.weights=fp8"]
    with pytest.raises(UserError) as e:
        open_engine(load_config(odd))
    msg = str(e.value)
    assert msg.startswith("engine.builtin.weights=fp8") and "head size 24" in msg and "\n" not in msg
    assert open_engine(load_config([*odd, "engine.builtin.native_step=false"])).lean.native is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_compiler_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """`tuner serve` with bf16 weights on a machine without g++ (PATH without it): exit 2, one line on
    stderr naming engine.builtin.weights, the reason and fp32 as what is allowed; no traceback."""
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(ROOT), "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "tuner.cli", "serve", "model=tiny-random", "engine.builtin.weights=bf16",
                        f"serve.port={_free_port()}", f"cache_dir={tmp_path / 'c'}"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: engine.builtin.weights=bf16: "), lines
    assert "could not be built" in lines[0] and lines[0].endswith("allowed here: fp32"), lines


@pytest.mark.parametrize("weights", ["fp32", "bf16", "fp8"])
def test_memory_estimate_is_what_the_engine_holds(weights: str) -> None:
    """tuner.schema.fit.builtin_weight_bytes on CPU float32 against the bytes a loaded engine really holds
    at each format: the model's values at float32, oneDNN's packed copy and the native step's packed
    copy (1 byte a weight under fp8, the lm_head's 2): equal to 1% (block padding). The pod's memory
    request is built on it."""
    from tuner.schema.fit import builtin_memory_gib, builtin_weight_bytes

    cfg = load_config([*TINY, f"engine.builtin.weights={weights}"])
    engine = open_engine(cfg)
    m = engine.lean.model
    assert m.packed and engine.lean.native is not None
    linears = [m.lm_head] + [t for b in m.blocks for t in (b.wqkv, b.wo, b.w13, b.w2)]
    held = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    held += sum(t.numel() * t.element_size() for w in linears for t in (w._onednn_packed, w._smallm_packed))
    params = sum(p.numel() for p in engine.model.parameters())
    model = cfg.model.model_copy(update={"params_b": params / 1e9})
    memory_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30  # what pack_weights sees
    estimate, words = builtin_weight_bytes(model, "float32", weights, cpu=True, memory_gib=memory_gib)
    assert estimate == pytest.approx(held, rel=0.01), (estimate, held)
    assert f"native step's {weights} copy" in words
    gib, how = builtin_memory_gib(model, cfg.hardware, "float32", weights)
    assert gib >= cfg.hardware.memory_gib / 2 and how.startswith(words)


def test_memory_estimate_follows_the_packing_rule() -> None:
    """The copies are counted only where pack_weights makes them: an 8B model on a 40 GiB host gets
    none (its 32 GB of fp32 weights exceed a quarter), on a 1 TiB host both; fp8's copy is a quarter
    of fp32's (with the lm_head at 2 bytes)."""
    from tuner.schema.fit import builtin_weight_bytes

    m = load_config(["model=llama-3.1-8b-instruct", "hardware.memory_gib=1024"]).model
    p = m.params_b * 1e9
    assert builtin_weight_bytes(m, "float32", "fp8", cpu=True, memory_gib=40)[0] == p * 4
    assert builtin_weight_bytes(m, "float32", "fp32", cpu=True, memory_gib=1024)[0] == p * 12
    fp8, words = builtin_weight_bytes(m, "float32", "fp8", cpu=True, memory_gib=1024)
    assert fp8 == p * 9 + m.vocab_size * m.hidden_size and "native step's fp8 copy" in words
    # auto left to the node: bf16 there on a CPU with native bf16, fp32 elsewhere; the request holds the larger
    auto, words = builtin_weight_bytes(m, "float32", "auto", cpu=True, memory_gib=1024)
    assert auto == p * 12 > builtin_weight_bytes(m, "float32", "bf16", cpu=True, memory_gib=1024)[0]
    assert "auto, resolved on the node: counted at fp32" in words


def test_gpu_estimate_holds_the_values_at_dtype() -> None:
    """On CUDA the engine holds the rounded values at dtype, no packed copies: fp8 weights at bfloat16
    take 2 bytes a parameter, not 1; the refusal says so."""
    from tuner.schema.fit import builtin_fit_problem, builtin_weight_bytes

    cfg = load_config(TINY)
    big = cfg.model.model_copy(update={"params_b": 50.0})
    assert builtin_weight_bytes(big, "bfloat16", "fp8", cpu=False)[0] == 50e9 * 2
    hw = cfg.hardware.model_copy(update={"accelerator": "cuda", "gpu_memory_gib": 80.0, "memory_gib": 1024.0})
    b = cfg.engine.builtin.model_copy(update={"device": "cuda", "dtype": "bfloat16", "weights": "fp8"})
    problem = builtin_fit_problem(big, hw, b)  # 47 GiB at 1 byte would fit one 80 GiB GPU; 93 do not
    assert problem is not None and "50B params x 2 bytes at bfloat16" in problem[1]


def test_auto_weights_resolve_where_the_engine_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """engine.builtin.weights=auto stays in the config (a manifest's pod resolves it on its node) and
    the engine resolves it on the machine it loads on: where the native step runs a model of at least
    0.1B parameters, fp32 and bf16 are each timed through the native step (real timings here, then
    cached: a second resolution times nothing, and best.yaml reads the same choice back) and the
    engine loads the faster; planted timings move
    the choice both ways; CUDA and the tiny test model keep fp32 by rule, without a timing."""
    from engine.models import autoweights, machine
    from engine.models.target import auto_choice, resolve_weights
    from tuner.schema.precision import timed_choice
    from engine.heads.pipeline import target_hash
    from tuner.study.measurer import auto_weights_timed, train_job

    # the tiny random Llama said to be 0.2B: its steps are timed (quickly) like the packaged model's
    over = [*TINY, "model.params_b=0.2", "engine.builtin.max_batch=3"]
    cfg = load_config(over)
    monkeypatch.setattr(autoweights, "cache_root", lambda _dir: tmp_path)  # <cache>/weights_auto.json
    monkeypatch.setattr(machine, "others_share", lambda mark: 0.0)  # timed on a quiet machine: cached
    assert cfg.engine.builtin.weights == "auto"
    cpu = torch.device("cpu")
    assert auto_weights_timed(cfg) is None  # best.yaml's reading times nothing: no engine timed it here yet
    fmt, why = auto_choice(cfg.engine.builtin, cfg.model, cpu, cfg.cache_dir)
    timed = json.loads((tmp_path / "weights_auto.json").read_text())
    (entry,) = timed.values()
    ms = entry["ms"]
    assert entry["others"] == 0.0
    assert set(ms) == {"fp32", "bf16"} and all(set(t) == {"1 seq", "3 seqs"} and min(t.values()) > 0 for t in ms.values())
    assert (fmt, why) == timed_choice(ms) and "\n" not in why and auto_weights_timed(cfg) == (fmt, why)

    def planted(fp32: float, bf16: float):
        def time_format(model: torch.nn.Module, weights: str, max_batch: int) -> dict[str, float]:
            t = fp32 if weights == "fp32" else bf16
            return {"1 seq": t, f"{max_batch} seqs": 2 * t}
        return time_format

    monkeypatch.setattr(autoweights, "time_format", lambda *a: pytest.fail("timed again: the cache was not read"))
    assert resolve_weights(cfg.engine.builtin, cfg.model, cpu, cfg.cache_dir) == fmt
    for fp32, bf16, want in ((20.0, 12.0, "bf16"), (10.0, 11.0, "fp32")):
        monkeypatch.setattr(autoweights, "time_format", planted(fp32, bf16))
        monkeypatch.setattr(autoweights, "cache_root", lambda _dir, want=want: tmp_path / want)
        c = load_config(over)
        assert resolve_weights(c.engine.builtin, c.model, cpu, c.cache_dir) == want
        assert open_engine(c).lean.model.weights == want
        assert auto_weights_timed(c)[1].startswith("a timed decode step measured it fastest here")
        # a head's answers are keyed by the format the target computes in, auto resolved
        pinned = load_config([*over, "+workload=code", f"engine.builtin.weights={want}"])
        assert target_hash(train_job(load_config([*over, "+workload=code"]))) == target_hash(train_job(pinned))
    assert resolve_weights(cfg.engine.builtin, cfg.model, torch.device("cuda")) == "fp32"
    tiny = open_engine(load_config(TINY))
    assert tiny.lean.model.weights == "fp32"


def test_auto_weights_timed_under_load_choose_here_and_are_never_cached(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    """A decode-step timing taken while other processes kept the CPUs busy (over machine.LOADED) chooses
    for the process that took it, once (a second resolution times nothing), and best.yaml's reading in
    that process sees it; the cache keeps none, so the next process times its own (a loaded run once
    cached fp32 312 / bf16 1412 ms a step at max_batch 4, which would have chosen for every later run)."""
    from engine.models import autoweights, machine
    from engine.models.target import resolve_weights
    from tuner.study.measurer import auto_weights_timed

    cfg = load_config([*TINY, "model.params_b=0.2", "engine.builtin.max_batch=3"])
    cpu = torch.device("cpu")
    monkeypatch.setattr(autoweights, "cache_root", lambda _dir: tmp_path)
    monkeypatch.setattr(machine, "_LOADED_HERE", {})
    timed: list[str] = []

    def planted(model: torch.nn.Module, weights: str, max_batch: int) -> dict[str, float]:
        timed.append(weights)
        t = 30.0 if weights == "fp32" else 10.0
        return {"1 seq": t, f"{max_batch} seqs": 2 * t}

    monkeypatch.setattr(autoweights, "time_format", planted)
    monkeypatch.setattr(machine, "others_share", lambda mark: 0.5)
    assert resolve_weights(cfg.engine.builtin, cfg.model, cpu, cfg.cache_dir) == "bf16"
    assert not (tmp_path / "weights_auto.json").exists()
    assert resolve_weights(cfg.engine.builtin, cfg.model, cpu, cfg.cache_dir) == "bf16"
    assert timed == ["fp32", "bf16"]  # used again, not timed again
    assert auto_weights_timed(cfg)[0] == "bf16"
    monkeypatch.setattr(machine, "_LOADED_HERE", {})  # the next process: nothing cached to read back
    assert auto_weights_timed(cfg) is None
    monkeypatch.setattr(machine, "others_share", lambda mark: 0.0)  # a quiet one times and caches
    assert resolve_weights(cfg.engine.builtin, cfg.model, cpu, cfg.cache_dir) == "bf16"
    assert timed == ["fp32", "bf16", "fp32", "bf16"]
    (entry,) = json.loads((tmp_path / "weights_auto.json").read_text()).values()
    assert entry["ms"]["bf16"]["1 seq"] == 10.0 and entry["others"] == 0.0
