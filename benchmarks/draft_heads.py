"""EAGLE heads on the packaged SmolLM2: data rate, tau against training data, draft vocabulary, and
held-out speed against AR and n-gram, in one run.

    python benchmarks/draft_heads.py [--prompts 640] [--sizes 0.125,0.25,0.5,1] [--vocabs 4096,8192,16384,0]
                                     [--trees 4x4x16,5x4x16,6x2x12,3x4x12,6x8x16] [--heldout code,chat,math]
                                     [--save-heads DIR]
    python benchmarks/draft_heads.py --rows-only --head DIR [--trees 3x1x4,4x4x16] [--ngram-depths 4]

With --rows-only (a head trained elsewhere, e.g. on a GPU: no data, no training): step 3 alone, AR,
n-gram and EAGLE rows on the held-out code prompts, interleaved (prompts outer, rows inner, so a load
drifting on a shared machine hits every row alike).

1. Data: the target answers the training prompts with engine.heads (batched, on-policy, greedy); its
   tokens/s against the engine's batch-1 greedy rate measured in the same process.
2. Heads trained on 4 nested shares of the data (whole prompts), each evaluated on the code
   workload's held-out prompts (never trained on) at the first tree: tau against training tokens (PNG).
3. The head trained on all data: held-out code prompts at T=0, AR, n-gram chains and each EAGLE tree
   (depth x topk x budget): tok/s, tau, speedup over AR, draft ms per step; every row token-identical
   to AR. Held-out tau of the best tree on the other workloads.
4. Draft vocabulary: the same head drafting over nested top-N subsets (the head's features do not
   depend on N: EAGLE-1 scores them with the target's own lm_head rows): coverage, tau, tok/s.
The last output line is one JSON object. Timings are those of the machine at the time: ratios in one
run are what to compare.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from engine.api import SamplingParams  # noqa: E402
from engine.drafters import EagleDrafter  # noqa: E402
from engine.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from engine.models.eagle3_head import Eagle3Head, default_aux_layers  # noqa: E402
from engine.heads.pipeline import build_data  # noqa: E402
from engine.heads.schedule import split_prompts  # noqa: E402
from engine.heads.trainer import train_head  # noqa: E402
from engine.heads.vocab import always_kept, build_vocab  # noqa: E402
from engine.decode.loop import Engine  # noqa: E402
from engine.measure.workloads import load_prompts  # noqa: E402
from tuner.schema.compose import load_config, packaged_workloads  # noqa: E402
from tuner.schema.config import SpecConfig, UserError  # noqa: E402
from tuner.study.measurer import open_engine, train_job  # noqa: E402


def parse_tree(text: str, method: str = "eagle") -> SpecConfig:
    d, k, b = (int(x) for x in text.split("x"))
    return SpecConfig(method=method, depth=d, topk=k, budget=b)


def run_rows(engine: Engine, prompts: list[list[int]], max_new: int, spec: SpecConfig, head=None,
             ref: list[list[int]] | None = None) -> dict:
    """Greedy over the prompts: tok/s, tau, draft ms per step, and agreement with `ref`."""
    if head is not None:
        drafter = Eagle3Drafter if isinstance(head, Eagle3Head) else EagleDrafter
        engine.set_drafter(drafter(spec, head, engine.model), spec)
    else:
        engine.set_spec(spec)
    toks, secs, fwd, draft_s, verify_s, steps, same, outs = 0, 0.0, 0, 0.0, 0.0, 0, 0, []
    for i, p in enumerate(prompts):
        r = engine.generate(p, SamplingParams(max_new_tokens=max_new))
        toks += len(r.tokens)
        secs += r.stats.total_s
        fwd += r.stats.target_forwards
        draft_s += r.stats.draft_s
        verify_s += r.stats.verify_s
        steps += max(r.stats.draft_steps, 1)
        outs.append(r.tokens)
        same += ref is None or r.tokens == ref[i]
    engine.set_spec(SpecConfig(method="off"))
    depth = max(spec.depth, 1) if spec.method != "off" else 1
    return {"tok_s": toks / secs, "tau": toks / max(fwd, 1), "draft_ms": 1000 * draft_s / steps,
            "draft_ms_per_depth": 1000 * draft_s / steps / depth, "verify_ms": 1000 * verify_s / max(fwd, 1),
            "same": same, "n": len(prompts), "tokens": outs,
            "sums": {"tokens": toks, "seconds": secs, "forwards": fwd, "draft_s": draft_s, "verify_s": verify_s, "steps": steps}}


def interleaved_rows(engine: Engine, prompts: list[list[int]], max_new: int,
                     configs: list[tuple[str, SpecConfig, object]]) -> list[dict]:
    """`run_rows` of every (name, spec, head) one prompt at a time, rows inner, after one untimed
    warm-up generation each; every row's output compared with the first config's (AR)."""
    for _, spec, head in configs:
        run_rows(engine, prompts[:1], 8, spec, head)
    acc: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    for p in prompts:
        for name, spec, head in configs:
            acc[name].append(run_rows(engine, [p], max_new, spec, head))
    ref = [r["tokens"][0] for r in acc[configs[0][0]]]
    rows = []
    for name, _, _ in configs:
        t = {k: sum(r["sums"][k] for r in acc[name]) for k in acc[name][0]["sums"]}
        rows.append({"config": name, "tok_s": t["tokens"] / t["seconds"], "tau": t["tokens"] / max(t["forwards"], 1),
                     "draft_ms": 1000 * t["draft_s"] / t["steps"], "verify_ms": 1000 * t["verify_s"] / max(t["forwards"], 1),
                     "same": sum(r["tokens"][0] == x for r, x in zip(acc[name], ref)), "n": len(prompts),
                     "tokens": t["tokens"], "seconds": round(t["seconds"], 2)})
    return rows


def rows_only(args: argparse.Namespace, con: Console) -> int:
    """Step 3 alone for a head trained elsewhere: held-out code rows, interleaved; the last line is JSON.
    The engine loads the head itself (spec.head_path: on its device, in its weights' format)."""
    if not args.head:
        raise UserError("--rows-only measures a trained head: give --head DIR")
    cfg = load_config(["+workload=code", *args.overrides])
    engine = open_engine(cfg)
    prompts = [engine.encode_prompt(p.text, True) for p in load_prompts(cfg.workload, "heldout")]
    configs: list[tuple[str, SpecConfig, object]] = [("AR", SpecConfig(method="off"), None)]
    configs += [(f"ngram d{d}", SpecConfig(method="ngram", depth=d, budget=d + 1), None)
                for d in (int(x) for x in args.ngram_depths.split(","))]
    configs += [(f"{args.method} d{t.depth} k{t.topk} b{t.budget}", t.model_copy(update={"head_path": args.head}), None)
                for t in (parse_tree(x, args.method) for x in args.trees.split(","))]
    t0 = time.perf_counter()
    rows = interleaved_rows(engine, prompts, args.max_new_tokens, configs)
    ar = rows[0]["tok_s"]
    t = Table(title=f"held-out code ({len(prompts)} prompts, T=0, {args.max_new_tokens} tokens, batch 1, "
                    f"{engine.device}, weights {cfg.engine.builtin.weights}, interleaved)")
    for c in ("config", "tok/s", "tau", "vs AR", "draft ms/step", "verify ms/forward", "same as AR"):
        t.add_column(c)
    for r in rows:
        r["speedup"] = r["tok_s"] / ar
        t.add_row(r["config"], f"{r['tok_s']:.2f}", f"{r['tau']:.2f}", f"{r['speedup']:.2f}x", f"{r['draft_ms']:.1f}",
                  f"{r['verify_ms']:.1f}", f"{r['same']}/{r['n']}")
    Console().print(t)
    con.print(f"measured in {time.perf_counter() - t0:.0f} s")
    print(json.dumps({"head": args.head, "device": str(engine.device), "weights": cfg.engine.builtin.weights,
                      "max_new_tokens": args.max_new_tokens, "rows": rows}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=None, help="training prompts (default: train.prompts)")
    ap.add_argument("--sizes", default="0.125,0.25,0.5,1")
    ap.add_argument("--vocabs", default="4096,8192,16384,0")
    ap.add_argument("--trees", default="4x4x16,5x4x16,6x2x12,3x4x12,8x2x16")
    ap.add_argument("--ngram-depths", default="4,8")
    ap.add_argument("--heldout", default="code,chat,math")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="docs/figures/draft_heads.png")
    ap.add_argument("--head", default=None, help="a head trained on all the data (tuner train-draft): used for share 1 instead of training again")
    ap.add_argument("--method", default="eagle", choices=["eagle", "eagle3"], help="the head to train and measure")
    ap.add_argument("--save-heads", default=None, help="save each share's head there (share-<fraction>/, the public layout)")
    ap.add_argument("--rows-only", action="store_true",
                    help="only the held-out code rows of --head (trained elsewhere), interleaved: no data, no training")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (train.*, engine.builtin.*)")
    args = ap.parse_args()
    con = Console(stderr=True)
    torch.set_num_threads(args.threads)
    if args.rows_only:
        return rows_only(args, con)
    over = ["+workload=code", *args.overrides] + ([f"train.prompts={args.prompts}"] if args.prompts else [])
    cfg = load_config(over)
    engine = open_engine(cfg)
    tc = cfg.train
    trees = [parse_tree(t, args.method) for t in args.trees.split(",")]
    aux = default_aux_layers(engine.model.config.num_hidden_layers) if args.method == "eagle3" else None

    # 1. data, and the batch-1 rate in the same process
    heldout = {w: [engine.encode_prompt(p.text, True) for p in load_prompts(load_config([f"+workload={w}"]).workload, "heldout")]
               for w in args.heldout.split(",")}
    b1 = run_rows(engine, heldout["code"][:2], 64, SpecConfig(method="off"))
    t0 = time.perf_counter()
    data = build_data(train_job(cfg), engine, packaged_workloads(cfg),
                      lambda ph, d, n, info: con.print(f"  answers {d}/{n}  {info.get('tok_s', 0):.0f} tok/s") if d % 128 == 0 or d == n else None,
                      aux_layers=aux)
    gen = {"answer_tokens": data.meta["answer_tokens"], "tokens": data.num_tokens, "prompts": data.meta["prompts"],
           "batched_tok_s": data.meta["generate_tok_s"], "generate_s": data.meta["generate_seconds"],
           "batch1_tok_s": round(b1["tok_s"], 1), "cached": time.perf_counter() - t0 < 0.5 * data.meta["generate_seconds"]}
    gen["ratio"] = round(gen["batched_tok_s"] / gen["batch1_tok_s"], 2)
    con.print(f"data: {gen}")

    vocab_size = engine.model.get_output_embeddings().weight.shape[0]
    forced = always_kept(engine.tokenizer, vocab_size, sorted(engine.eos))
    vocab = build_vocab(data, tc.draft_vocab, vocab_size, forced)
    train_seqs, val_seqs = split_prompts(data, tc.eval_fraction, tc.seed)
    ref_code = run_rows(engine, heldout["code"], args.max_new_tokens, SpecConfig(method="off"))
    ar = ref_code["tok_s"]

    # 2. tau against training tokens (nested shares of the training prompts)
    by_prompt: dict[int, list[int]] = {}
    for s in train_seqs:
        by_prompt.setdefault(int(data.prompt_idx[s]), []).append(s)
    order = list(by_prompt)
    sizes = []
    heads = {}
    train_total_s = 0.0
    for frac in (float(x) for x in args.sizes.split(",")):
        keep = [s for p in order[: max(1, int(round(frac * len(order))))] for s in by_prompt[p]]
        sub = data.subset(keep + val_seqs)
        if frac >= 1 and args.head:
            from engine.drafters import load_eagle3_head, load_eagle_head
            from engine.heads.pipeline import read_meta

            # the engine's own loader: the head on the target's device, in its weights' format
            head = (load_eagle3_head if args.method == "eagle3" else load_eagle_head)(
                SpecConfig(method=args.method, head_path=args.head), engine.target)
            meta = read_meta(args.head)
            summ, train_s = {"steps": meta["steps"]}, meta["train_seconds"]
        else:
            with tempfile.TemporaryDirectory() as work:
                t = time.perf_counter()
                head, summ = train_head(sub, engine.model, tc, vocab, Path(work),
                                        lambda ph, d, n, info: con.print(f"  train {frac}: {d}/{n} loss {info['loss']:.3f} {info.get('tok_s', 0):.0f} tok/s") if d % 100 == 0 else None,
                                        method=args.method)
                train_s = time.perf_counter() - t
        train_total_s = max(train_total_s, train_s) if frac < 1 else train_s
        row = run_rows(engine, heldout["code"], args.max_new_tokens, trees[0], head, ref_code["tokens"])
        n_tok = int(sum(int(sub.offsets[i + 1] - sub.offsets[i]) for i in range(len(keep))))
        n_ans = n_tok - int(sum(int(sub.starts[i]) for i in range(len(keep))))
        sizes.append({"share": frac, "train_tokens": n_tok, "answer_tokens": n_ans, "sequences": len(keep),
                      "steps": summ["steps"], "train_s": round(train_s, 1),
                      "tau": round(row["tau"], 3), "speedup": round(row["tok_s"] / ar, 3), "same": row["same"]})
        heads[frac] = head
        if args.save_heads and not (frac >= 1 and args.head) and args.method == "eagle":
            from engine.models.eagle_head import save_head

            out_dir = Path(args.save_heads) / f"share-{frac:g}"
            save_head(head, out_dir)
            (out_dir / "size.json").write_text(json.dumps(sizes[-1]) + "\n")
        con.print(f"size {sizes[-1]}")
    head = heads[max(heads)]

    # 3. held-out code rows
    keys = ("tok_s", "tau", "draft_ms", "draft_ms_per_depth", "verify_ms", "same")
    rows = [{"config": "AR", **{k: ref_code[k] for k in keys}}]
    for d in (int(x) for x in args.ngram_depths.split(",")):
        r = run_rows(engine, heldout["code"], args.max_new_tokens, SpecConfig(method="ngram", depth=d, budget=d + 1), None, ref_code["tokens"])
        rows.append({"config": f"ngram d{d}", **{k: r[k] for k in keys}})
    for spec in trees:
        r = run_rows(engine, heldout["code"], args.max_new_tokens, spec, head, ref_code["tokens"])
        rows.append({"config": f"{args.method} d{spec.depth} k{spec.topk} b{spec.budget}", **{k: r[k] for k in keys}})
    for r in rows:
        r["speedup"] = r["tok_s"] / ar
    eagle_rows = [r for r in rows if r["config"].startswith(args.method + " ")]
    best = max(eagle_rows, key=lambda r: r["tok_s"])
    best_ngram = max((r for r in rows if r["config"].startswith("ngram")), key=lambda r: r["tok_s"])
    best_spec = trees[eagle_rows.index(best)]
    other = {}
    for w, ps in heldout.items():
        if w == "code":
            continue
        ref = run_rows(engine, ps, args.max_new_tokens, SpecConfig(method="off"))
        r = run_rows(engine, ps, args.max_new_tokens, best_spec, head, ref["tokens"])
        other[w] = {"tau": round(r["tau"], 3), "speedup": round(r["tok_s"] / ref["tok_s"], 3), "same": r["same"], "n": r["n"]}

    # 4. draft vocabulary: nested top-N subsets of the same head (EAGLE-1 only: an EAGLE-3 head owns
    # an lm_head over the vocabulary it was trained with)
    vocab_rows = []
    full_ids = getattr(head, "draft_ids", None)
    labels = data.subset(val_seqs).response_labels()
    for n in (int(x) for x in args.vocabs.split(",")) if args.method == "eagle" else ():
        v = build_vocab(data, n, vocab_size, forced)
        head.draft_ids = None if v is None else v.ids
        r = run_rows(engine, heldout["code"], args.max_new_tokens, best_spec, head, ref_code["tokens"])
        vocab_rows.append({"vocab": n or vocab_size, "coverage": 1.0 if v is None else round(v.coverage(labels), 4),
                           "tau": round(r["tau"], 3), "tok_s": round(r["tok_s"], 2), "speedup": round(r["tok_s"] / ar, 3),
                           "draft_ms": round(r["draft_ms"], 2), "same": r["same"]})
    if args.method == "eagle":
        head.draft_ids = full_ids

    out = Console()
    t = Table(title=f"held-out code ({len(heldout['code'])} prompts, T=0, {args.max_new_tokens} tokens)")
    for c in ("config", "tok/s", "tau", "vs AR", "draft ms/step", "draft ms/depth", "verify ms/forward", "same as AR"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["config"], f"{r['tok_s']:.2f}", f"{r['tau']:.2f}", f"{r['speedup']:.2f}x", f"{r['draft_ms']:.1f}",
                  f"{r['draft_ms_per_depth']:.1f}", f"{r['verify_ms']:.1f}", f"{r['same']}/{len(heldout['code'])}")
    out.print(t)
    t = Table(title="held-out tau against training tokens (tree " + args.trees.split(",")[0] + ")")
    for c in ("share", "train tokens", "steps", "train s", "tau", "vs AR"):
        t.add_column(c)
    for s in sizes:
        t.add_row(str(s["share"]), str(s["train_tokens"]), str(s["steps"]), str(s["train_s"]), f"{s['tau']:.2f}", f"{s['speedup']:.2f}x")
    out.print(t)
    t = Table(title=f"draft vocabulary ({best['config']})")
    for c in ("N", "held-out coverage", "tau", "tok/s", "vs AR", "draft ms/step"):
        t.add_column(c)
    for v in vocab_rows:
        t.add_row(str(v["vocab"]), f"{v['coverage']:.3f}", f"{v['tau']:.2f}", f"{v['tok_s']:.2f}", f"{v['speedup']:.2f}x", f"{v['draft_ms']:.1f}")
    out.print(t)
    ratios = {"best_eagle_vs_ar": round(best["speedup"], 3), "best_eagle_vs_best_ngram": round(best["tok_s"] / best_ngram["tok_s"], 3),
              "best_eagle": best["config"], "best_eagle_tau": round(best["tau"], 3),
              "data_plus_train_s": round(gen["generate_s"] + train_total_s, 1), "gen_batched_vs_batch1": gen["ratio"]}
    out.print(f"ratios: {ratios}   other workloads: {other}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ax[0].plot([s["train_tokens"] for s in sizes], [s["tau"] for s in sizes], "o-")
        ax[0].set_xscale("log")
        ax[0].set_xlabel("training tokens")
        ax[0].set_ylabel("held-out tau (code)")
        ax[0].set_title(f"tau vs data ({args.trees.split(',')[0]})")
        ax[1].plot([v["vocab"] for v in vocab_rows], [v["tau"] for v in vocab_rows], "o-", label="tau")
        ax[1].plot([v["vocab"] for v in vocab_rows], [v["speedup"] for v in vocab_rows], "s-", label="speedup vs AR")
        ax[1].set_xscale("log")
        ax[1].set_xlabel("draft vocabulary")
        ax[1].legend()
        ax[1].set_title(best["config"])
        fig.tight_layout()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=110)
        out.print(f"plot: {args.out}")
    except Exception as exc:  # noqa: BLE001 - the figures above are the result; the plot is extra
        con.print(f"no plot: {exc}")
    for r in rows:
        r.pop("tokens", None)
    print(json.dumps({"data": gen, "rows": rows, "sizes": sizes, "vocab": vocab_rows, "other": other, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
