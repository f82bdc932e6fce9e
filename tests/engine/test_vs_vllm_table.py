"""benchmarks/vs_vllm.py's printed table: the built-in rows name the weights' format they ran, not the activations'
dtype (a bf16-weights run once printed "float32" beside rows twice as fast as fp32 weights)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _vs_vllm():  # benchmarks/ is no package: loaded by its path, with its sibling imports
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("vs_vllm_benchmark", BENCH / "vs_vllm.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        return bench
    finally:
        sys.path.remove(str(BENCH))


def _row(engine: str, dtype: str, config: str, tok_s: float, **extra: Any) -> dict[str, Any]:
    return {"engine": engine, "dtype": dtype, "config": config, "tok_s": tok_s, "tau": None, "startup_s": None,
            "error": None, **extra}


def test_builtin_rows_name_their_weights_and_ratios_use_the_right_ar() -> None:
    vs = _vs_vllm()
    b_ar = _row("builtin", "float32", "off", 150.0, weights="bf16")
    b_sp = _row("builtin", "float32", "ngram d4 k1 b5", 225.0, weights="bf16")
    v_ar = _row("vllm", "bfloat16", "off", 30.0, startup_s=100.0)
    lines = vs.table([b_ar, b_sp, v_ar], b_ar, v_ar)
    assert lines[0].split()[:3] == ["engine", "dtype", "config"]
    first, second, third = (line.split() for line in lines[1:])
    assert first[:2] == ["builtin", "bf16"] and "float32" not in lines[1]
    assert second[-2:] == ["1.50x", "7.50x"]  # against its own AR, then against vLLM's AR
    assert third[:2] == ["vllm", "bfloat16"] and third[-2:] == ["100", "s"]
    failed = vs.table([_row("builtin", "float32", "off", 0.0, weights="fp8", error="boom")], None, None)
    assert failed[1].split()[:2] == ["builtin", "fp8"] and failed[1].endswith("failed: boom")
