"""How far does a head trained on the full budget get above the pilot (tuner.study.headbound)?

The head bound trains a pilot head on a share of the full training's prompts and takes the full
budget's head to accept at most `GROWTH` times the pilot's acceptance at every depth. This benchmark
measures that ratio: the full head of the config (trained, or taken from the cache) is evaluated on
its own validation prompts (answers it never saw), chains and the widest searched top-k's paths,
and the pilot is trained and evaluated as the study does (measure_pilot). It prints both per depth
and the ratio full / pilot per depth, and the bound the pilot gives against the full head's figure; for
trees, the sum of the n most accepted nodes' shares (what a tree of n + 1 nodes can accept at most).
The last line is one JSON object.

    python benchmarks/head_pilot.py --cache-dir DIR            # +workload=code, the default training
    python benchmarks/head_pilot.py --cache-dir DIR --set train.steps=40
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-dir", required=True, help="the cache (a full head already trained there is reused)")
    ap.add_argument("--workload", default="code")
    ap.add_argument("--method", default="eagle", choices=["eagle", "eagle3"])
    ap.add_argument("--set", action="append", default=[], help="a config override (repeatable)")
    args = ap.parse_args(argv)

    from engine.heads.drafts import ensure_draft
    from engine.heads.pipeline import build_data, evaluate_head, head_aux_layers
    from engine.heads.schedule import split_prompts
    from tuner.schema.compose import load_config, packaged_workloads
    from tuner.study.headbound import GROWTH, NODES, bounded_acceptance, measure_pilot, node_shares
    from tuner.study.measurer import open_engine, train_job

    cfg = load_config([f"+workload={args.workload}", f"cache_dir={args.cache_dir}", *args.set])
    engine = open_engine(cfg)
    job, topk = train_job(cfg), max(cfg.search.topk)
    t0 = time.monotonic()
    path = ensure_draft(job, args.method, engine, workloads=packaged_workloads(cfg))
    full_s = time.monotonic() - t0
    if args.method == "eagle3":
        from engine.models.eagle3_head import load_eagle3

        head, vocab = load_eagle3(path, engine.model.config), None
    else:
        from engine.models.eagle_head import load_head

        head = load_head(path, engine.model.config).eval()
        vocab = None if head.draft_ids is None else SimpleNamespace(ids=head.draft_ids)
    data = build_data(job, engine, packaged_workloads(cfg), None, head_aux_layers(engine, args.method))
    _, val = split_prompts(data, job.train.eval_fraction, job.train.seed)
    full = evaluate_head(head, engine.model, vocab, data, val, job.train.seq_len, topk, NODES)
    pilot = measure_pilot(cfg, engine, args.method, job)

    def row(name: str, acc: list[float]) -> None:
        print(f"{name:<36}" + " ".join(f"{x:7.4f}" for x in acc))

    print(f"full head: {full['eval_positions']} positions ({full_s:.0f} s, 0 when cached); pilot: {pilot['prompts']} "
          f"prompts, {pilot['steps']} steps, {pilot['eval_positions']} positions, {pilot['seconds']:.0f} s")
    n_full, n_pilot = full["eval_positions"], pilot["eval_positions"]
    out: dict = {"growth": GROWTH, "pilot_seconds": pilot["seconds"], "pilot_steps": pilot["steps"],
                 "pilot_prompts": pilot["prompts"], "positions": {"full": n_full, "pilot": n_pilot}}
    f, p = full["acceptance_per_depth"], pilot["acceptance_per_depth"]
    bound = bounded_acceptance(p, n_pilot, GROWTH)
    row("chain acceptance: full", f)
    row("chain acceptance: pilot", p)
    row("chain: full / pilot", [a / b if b > 0 else float("inf") for a, b in zip(f, p)])
    row(f"chain: bound (x{GROWTH:g}, upper conf.)", bound)
    out["chain"] = {"full": f, "pilot": p, "bound": bound, "bound_holds": all(b >= a for a, b in zip(f, bound))}
    # a tree of b nodes takes the b - 1 largest node shares: compare those sums, b - 1 = 1..budget_max - 1
    nodes = cfg.search.budget_max - 1
    fs = [c / n_full for _, c in full["tree_nodes"]]
    ps = sorted((x for _, x in node_shares(pilot["tree_nodes"], n_pilot, GROWTH, cfg.search.budget_max, 5, NODES)),
                reverse=True)
    sums_f = [sum(fs[:k]) for k in range(1, nodes + 1)]
    sums_b = [sum(ps[:k]) for k in range(1, nodes + 1)]
    sums_p = [sum(c / n_pilot for _, c in pilot["tree_nodes"][:k]) for k in range(1, nodes + 1)]
    shown = [0, 1, 2, 3, 6, 14, nodes - 1]
    print(f"top-{topk} tree, the n most accepted nodes' shares summed, n = " + " ".join(f"{k + 1:7d}" for k in shown))
    row("  full", [sums_f[k] for k in shown])
    row("  pilot", [sums_p[k] for k in shown])
    row(f"  bound (x{GROWTH:g}, upper conf.)", [sums_b[k] for k in shown])
    out["tree"] = {"full": [round(x, 4) for x in sums_f], "pilot": [round(x, 4) for x in sums_p],
                   "bound": [round(x, 4) for x in sums_b], "bound_holds": all(b >= a for a, b in zip(sums_f, sums_b)),
                   "worst_ratio_full_to_pilot": round(max(a / b for a, b in zip(sums_f, sums_p) if b > 0), 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
