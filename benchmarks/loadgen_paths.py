"""One load generator, two paths: the built-in engine measured in-process and through its own
OpenAI-compatible server (real uvicorn on 127.0.0.1), same prompts, same parameters.

    .venv/bin/python benchmarks/loadgen_paths.py [overrides...]
    .venv/bin/python benchmarks/loadgen_paths.py spec.method=off workload.max_new_tokens=64

Defaults: the packaged SmolLM2-135M, +workload=code (4 prompts, 64 new tokens), ngram d4, concurrency
1 and 4, one warm-up request, 2 repeats. Prints one JSON line per (path, concurrency) and a table.
The HTTP path costs the server's own work (detokenising, SSE); tau must agree exactly.
"""

from __future__ import annotations

import json
import sys

from engine.measure.runner import HttpTarget, InProcessTarget, measure
from engine.serving.server import serve_in_thread
from engine.measure.workloads import load_prompts, sampling_params
from tuner.schema.compose import load_config
from tuner.study.measurer import open_engine

DEFAULTS = ["+workload=code", "workload.num_prompts=4", "workload.max_new_tokens=64", "spec.method=ngram"]


def main(overrides: list[str]) -> None:
    cfg = load_config(DEFAULTS + overrides)
    assert cfg.workload is not None
    prompts = load_prompts(cfg.workload, "tune")
    params = sampling_params(cfg.workload)
    engine = open_engine(cfg)
    engine.set_spec(cfg.spec)
    url, stop = serve_in_thread(engine, cfg.model, cfg.serve)
    rows = []
    try:
        for name, target in (("in-process", InProcessTarget(engine, cfg.workload.chat_template)),
                             ("http", HttpTarget(url, cfg.model.name, cfg.workload.chat_template))):
            for c in (1, 4):
                s = measure(target, prompts, params, concurrency=c, warmup=1, repeats=2)
                row = {"path": name, "concurrency": c, "spec": cfg.spec.key(), "model": cfg.model.name,
                       "tok_s": round(s.output_tokens_per_s, 2), "tau": s.tau and round(s.tau, 3),
                       "ttft_p50_ms": s.ttft_p50_ms and round(s.ttft_p50_ms, 1),
                       "ttft_p99_ms": s.ttft_p99_ms and round(s.ttft_p99_ms, 1),
                       "tpot_p50_ms": s.tpot_p50_ms and round(s.tpot_p50_ms, 1),
                       "tpot_p99_ms": s.tpot_p99_ms and round(s.tpot_p99_ms, 1), "errors": len(s.errors)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        stop()
    print(f"\n{'path':<11} {'conc':>4} {'tok/s':>7} {'tau':>6} {'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>17}")
    for r in rows:
        print(f"{r['path']:<11} {r['concurrency']:>4} {r['tok_s']:>7} {r['tau']!s:>6} "
              f"{r['ttft_p50_ms']!s:>8}/{r['ttft_p99_ms']!s:<8} {r['tpot_p50_ms']!s:>8}/{r['tpot_p99_ms']!s:<8}")


if __name__ == "__main__":
    main(sys.argv[1:])
