"""How far can the held-out prompts' tau lie from the tuning prompts' before anything is timed?

The held-out check (tuner.study.selection.heldout_check) compares the winner's speedup on the
held-out prompts with its speedup on as many tuning prompts. A speedup follows tau, and tau is a
property of each prompt (how much of the greedy answer repeats what came before). This benchmark
measures that part alone, with no timing in it: every prompt of a pool's first --pool prompts (the
workload's seeded shuffle, as engine.measure.workloads deals them) is generated greedily with
n-gram chains, and each prompt's tau recorded (exact: T=0). It then draws --draws splits of
num_prompts + num_heldout prompts from them and reports the gap between the held-out side's tau and
the first num_heldout tuning prompts' tau (the check's two sides) for ways to split:

- random: as the workloads split today (a seeded shuffle);
- stratified by a cheap per-prompt predictor (prompt length, n-gram repeat share of the prompt, ...):
  the prompts sorted by it, cut into num_heldout strata, one held-out prompt and its tuning partner
  drawn from each stratum;
- more prompts on each side (--sides).

It prints each predictor's rank correlation with the prompts' tau, then per split the mean, median
and 90th percentile of |held-out tau / tuning tau - 1| and the share of draws within 5%; the last
line is one JSON object. Usage:

    python benchmarks/split_gap.py                     # code workload, 80 prompts, 2000 draws
    python benchmarks/split_gap.py --workload chat --pool 60
    python benchmarks/split_gap.py --max-new-tokens 32 --sides 6/6,24/24   # more prompts at fewer tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import statistics
from collections.abc import Callable

from engine.measure.workloads import _pool, encode, sampling_params
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig
from tuner.study.measurer import open_engine

Record = dict[str, object]


def per_prompt_tau(workload: str, n: int, depths: tuple[int, ...], max_new_tokens: int | None = None) -> list[Record]:
    """Each of the pool's first n prompts (the workload's seeded order) with its greedy tau per chain
    depth, over the workload's max_new_tokens or `max_new_tokens`."""
    cfg = load_config([f"+workload={workload}", "engine.builtin.threads=1"])
    eng = open_engine(cfg)
    pool = _pool(cfg.workload)
    random.Random(cfg.workload.seed).shuffle(pool)
    params = sampling_params(cfg.workload, seed=cfg.seed)
    if max_new_tokens is not None:
        params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
    out: list[Record] = []
    for p in pool[:n]:
        ids = encode(eng, p, cfg.workload.chat_template)
        rec: Record = {"id": p.id, "text": p.text, "prompt_ids": ids}
        for d in depths:
            eng.set_spec(SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1))
            s = eng.generate(ids, params).stats
            rec[f"d{d}"] = (s.new_tokens, s.target_forwards)
        out.append(rec)
    return out


def repeat_share(seq: list, n: int) -> float:
    """Share of positions whose preceding n items were last followed by the same item (what an
    n-gram drafter would have guessed right within the prompt itself)."""
    last: dict[tuple, object] = {}
    hit = 0
    for i in range(n, len(seq)):
        k = tuple(seq[i - n:i])
        hit += last.get(k) == seq[i]
        last[k] = seq[i]
    return hit / max(1, len(seq) - n)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text)


PREDICTORS: dict[str, Callable[[Record], float]] = {
    "length (characters)": lambda r: len(str(r["text"])),
    "length (tokens)": lambda r: len(r["prompt_ids"]),  # type: ignore[arg-type]
    "token 2-gram repeat share": lambda r: repeat_share(r["prompt_ids"], 2),  # type: ignore[arg-type]
    "word 2-gram repeat share": lambda r: repeat_share(_words(str(r["text"])), 2),
    "distinct word share": lambda r: len(set(_words(str(r["text"])))) / max(1, len(_words(str(r["text"])))),
    "doctest examples": lambda r: str(r["text"]).count(">>>"),
}


def tau(recs: list[Record], key: str) -> float:
    return sum(r[key][0] for r in recs) / sum(r[key][1] for r in recs)  # type: ignore[index]


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    a, b = ranks(x), ranks(y)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    num = sum((p - ma) * (q - mb) for p, q in zip(a, b))
    return num / math.sqrt(sum((p - ma) ** 2 for p in a) * sum((q - mb) ** 2 for q in b))


def stratified(recs: list[Record], n_tune: int, n_held: int, key: Callable[[Record], float],
               rng: random.Random) -> tuple[list[Record], list[Record]]:
    """Sorted by `key`, cut into min(n_tune, n_held) strata; from each a held-out prompt and its
    tuning partner (the check's first tuning prompts), the rest to the larger side."""
    order = sorted(range(len(recs)), key=lambda i: (key(recs[i]), i))
    k = min(n_tune, n_held)
    cuts = [round(j * len(order) / k) for j in range(k + 1)]
    tune, held, extra = [], [], []
    for j in range(k):
        s = order[cuts[j]:cuts[j + 1]]
        rng.shuffle(s)
        tune.append(s[0])
        held.append(s[1])
        extra += s[2:]
    (held if n_held > n_tune else tune).extend(extra)
    return [recs[i] for i in tune], [recs[i] for i in held]


def gaps(recs: list[Record], n_tune: int, n_held: int, draws: int, key: Callable[[Record], float] | None,
         tau_key: str) -> dict[str, float]:
    rng = random.Random(0)
    out = []
    for _ in range(draws):
        sub = rng.sample(recs, n_tune + n_held)
        tune, held = (sub[:n_tune], sub[n_tune:]) if key is None else stratified(sub, n_tune, n_held, key, rng)
        out.append(abs(tau(held, tau_key) / tau(tune[:n_held], tau_key) - 1))
    out.sort()
    return {"mean": statistics.fmean(out), "median": out[len(out) // 2], "p90": out[int(0.9 * len(out))],
            "within_5pct": sum(g <= 0.05 for g in out) / len(out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="code")
    ap.add_argument("--pool", type=int, default=80, help="prompts measured (the workload's seeded order)")
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--depth", type=int, default=4, help="the n-gram chain whose tau is compared")
    ap.add_argument("--sides", default="12/6,12/12,24/24", help="tuning/held-out prompts per draw")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens generated per prompt (default: the workload's); fewer tokens, more prompts a side")
    args = ap.parse_args()
    recs = per_prompt_tau(args.workload, args.pool, (args.depth,), args.max_new_tokens)
    key = f"d{args.depth}"
    taus = [r[key][0] / r[key][1] for r in recs]  # type: ignore[index]
    print(f"{args.workload}: {len(recs)} prompts, greedy tau of ngram d{args.depth}: {min(taus):.2f}-{max(taus):.2f}, "
          f"mean {statistics.fmean(taus):.2f}, sd {statistics.pstdev(taus):.2f}")
    corr = {name: spearman([f(r) for r in recs], taus) for name, f in PREDICTORS.items()}
    for name, c in corr.items():
        print(f"  rank correlation with tau: {name:28s} {c:+.2f}")
    best = max(corr, key=lambda n: abs(corr[n]))
    rows = []
    for side in args.sides.split(","):
        nt, nh = (int(x) for x in side.split("/"))
        if nt + nh > len(recs):
            continue
        for name, f in [("random", None), *((n, PREDICTORS[n]) for n in PREDICTORS)]:
            g = gaps(recs, nt, nh, args.draws, f, key)
            rows.append({"tune": nt, "heldout": nh, "split": name if f is None else f"stratified by {name}", **g})
            if f is None or name == best or side == args.sides.split(",")[0]:
                print(f"{nt:3d} tuning / {nh:2d} held-out, {rows[-1]['split']:40s} |tau gap| mean {g['mean']:.3f} "
                      f"median {g['median']:.3f} p90 {g['p90']:.3f}, within 5% in {g['within_5pct']:.0%} of draws")
    print(json.dumps({"workload": args.workload, "prompts": len(recs), "max_new_tokens": args.max_new_tokens,
                      "tau_sd": statistics.pstdev(taus),
                      "correlation": corr, "rows": rows}))


if __name__ == "__main__":
    main()
