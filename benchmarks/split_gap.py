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
- stratified by a statistic of the prompt alone (FEATURES: its length, the share of its own token
  or word n-grams that repeat, ...; never a measurement of it): the prompts sorted by it, cut into
  num_heldout strata, one held-out prompt and its tuning partner drawn from each stratum;
- alternating by such a statistic: the same strata, the held-out prompt and its partner the
  stratum's two lowest, which of them is held out alternating from stratum to stratum
  (deterministic);
- more prompts on each side (--sides), at fewer tokens each (--max-new-tokens) for the same cost.

It prints each statistic's rank correlation with the prompts' tau, then per split the mean, median,
95th percentile and maximum of |held-out tau / tuning tau - 1| over the draws, the share of draws
within 5%, and the gap of the workload's own seeded split (the first num_prompts + num_heldout
prompts of its order, as every study of the workload sees them). Then, for what would reach 5%, a
bootstrap of random splits of more prompts a side than the pool holds (--needed, drawn with
replacement). The last line is one JSON object. --save / --load keep the per-prompt figures (the
statistics and counts, no prompt text) so the analysis reruns without generating.

--matched compares the held-out check's two ways of choosing its tuning side: the first tuning
prompts (before) and the study's matched ones (tuner.projection.profiling.matched_check, on each
prompt's greedy answer replayed under n-gram chains). Each prompt's answer is generated once and its
decode timed under off, ngram d2 and d3; per random draw of a split, each side's tau (d1-d4), off's
tok/s and the d2 / d3 speedups are read as the check reads them (ratios of sums), and the gap of
held-out against the check's tuning side summarised. Usage:

    python benchmarks/split_gap.py                     # code workload, 80 prompts, 2000 draws
    python benchmarks/split_gap.py --workload chat --pool 60
    python benchmarks/split_gap.py --max-new-tokens 32 --sides 6/6,24/24   # more prompts at fewer tokens
    python benchmarks/split_gap.py --load figures.json --sides 12/6     # the analysis alone
    python benchmarks/split_gap.py --matched --pool 36 --sides 12/6 --time-limit-s 420   # the check side, timed
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


# Statistics of the prompt alone (its text and its token ids), known before anything is measured:
# what a split may be stratified or matched by without reading the held-out side's acceptance.
FEATURES: dict[str, Callable[[str, list[int]], float]] = {
    "length (characters)": lambda text, ids: len(text),
    "length (tokens)": lambda text, ids: len(ids),
    "token 2-gram repeat share": lambda text, ids: repeat_share(ids, 2),
    "token 3-gram repeat share": lambda text, ids: repeat_share(ids, 3),
    "token 4-gram repeat share": lambda text, ids: repeat_share(ids, 4),
    "word 2-gram repeat share": lambda text, ids: repeat_share(_words(text), 2),
    "distinct word share": lambda text, ids: len(set(_words(text))) / max(1, len(_words(text))),
    "doctest examples": lambda text, ids: text.count(">>>"),
    "code lines": lambda text, ids: sum(1 for ln in text.splitlines() if ln.strip()
                                        and not ln.strip().startswith(("#", '"', "'", ">>>"))),
}


def per_prompt_tau(workload: str, n: int, depths: tuple[int, ...], max_new_tokens: int | None = None) -> list[Record]:
    """Each of the pool's first n prompts (the workload's seeded order: the tuning split first, then
    the held-out one) with its FEATURES and its greedy (new tokens, target forwards) per chain depth,
    over the workload's max_new_tokens or `max_new_tokens`. No prompt text is kept."""
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
        rec: Record = {"id": p.id, "features": {k: f(p.text, ids) for k, f in FEATURES.items()}}
        for d in depths:
            eng.set_spec(SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1))
            s = eng.generate(ids, params).stats
            rec[f"d{d}"] = (s.new_tokens, s.target_forwards)
        out.append(rec)
    return out


def feature(name: str) -> Callable[[Record], float]:
    return lambda r: r["features"][name]  # type: ignore[index]


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


Design = Callable[[list[Record], int, int, random.Random], tuple[list[Record], list[Record]]]


def _by_strata(recs: list[Record], n_tune: int, n_held: int, key: Callable[[Record], float],
               pair: Callable[[int, list[int]], list[int]]) -> tuple[list[Record], list[Record]]:
    """Sorted by `key`, cut into min(n_tune, n_held) strata of neighbours; `pair(j, stratum)` orders
    stratum j: its tuning prompt (the check's partner), its held-out prompt, then the rest, which go
    to the larger side."""
    order = sorted(range(len(recs)), key=lambda i: (key(recs[i]), i))
    k = min(n_tune, n_held)
    cuts = [round(j * len(order) / k) for j in range(k + 1)]
    tune, held, extra = [], [], []
    for j in range(k):
        s = order[cuts[j]:cuts[j + 1]]
        a, b, *rest = pair(j, s)
        tune.append(a)
        held.append(b)
        extra += rest
    (held if n_held > n_tune else tune).extend(extra)
    return [recs[i] for i in tune], [recs[i] for i in held]


def stratified(recs: list[Record], n_tune: int, n_held: int, key: Callable[[Record], float],
               rng: random.Random) -> tuple[list[Record], list[Record]]:
    """Sorted by `key`, cut into min(n_tune, n_held) strata; from each a held-out prompt and its
    tuning partner (the check's first tuning prompts) drawn at random, the rest to the larger side."""
    def pair(j: int, s: list[int]) -> list[int]:
        rng.shuffle(s)
        return s
    return _by_strata(recs, n_tune, n_held, key, pair)


def alternating(recs: list[Record], n_tune: int, n_held: int, key: Callable[[Record], float],
                rng: random.Random) -> tuple[list[Record], list[Record]]:
    """Sorted by `key`, cut into min(n_tune, n_held) strata of neighbours; in stratum j the held-out
    prompt and its tuning partner (the check's) are its two lowest, which of them is held out
    alternating from stratum to stratum (so neither side is always the lower one); the rest to the
    larger side. Deterministic: `rng` is not read."""
    return _by_strata(recs, n_tune, n_held, key, lambda j, s: s if j % 2 == 0 else [s[1], s[0], *s[2:]])


def design_of(kind: str, name: str | None) -> Design:
    """'random' (the workloads' seeded shuffle: the first n_tune tuning, the next n_held held out) or
    `stratified` / `alternating` by FEATURES[name]."""
    if kind == "random":
        return lambda sub, nt, nh, rng: (sub[:nt], sub[nt:nt + nh])
    f = feature(str(name))
    fn = stratified if kind == "stratified" else alternating
    return lambda sub, nt, nh, rng: fn(sub, nt, nh, f, rng)


def gap(tune: list[Record], held: list[Record], n_held: int, tau_key: str) -> float:
    """|held-out tau / tau of the check's tuning side - 1| (the check's tuning side: the first
    n_held tuning prompts)."""
    return abs(tau(held, tau_key) / tau(tune[:n_held], tau_key) - 1)


def gaps(recs: list[Record], n_tune: int, n_held: int, draws: int, design: Design, tau_key: str,
         replace: bool = False) -> dict[str, float]:
    """The |tau gap| of `design` over `draws` random draws of n_tune + n_held prompts from `recs`
    (with replacement when `replace`: sides larger than the pool, a bootstrap of the prompts)."""
    rng = random.Random(0)
    out = []
    for _ in range(draws):
        n = n_tune + n_held
        sub = [rng.choice(recs) for _ in range(n)] if replace else rng.sample(recs, n)
        tune, held = design(sub, n_tune, n_held, rng)
        out.append(gap(tune, held, n_held, tau_key))
    out.sort()
    return {"mean": statistics.fmean(out), "median": out[len(out) // 2], "p90": out[int(0.9 * len(out))],
            "p95": out[int(0.95 * len(out))], "max": out[-1], "within_5pct": sum(g <= 0.05 for g in out) / len(out)}


def default_gap(recs: list[Record], n_tune: int, n_held: int, design: Design, tau_key: str, seed: int) -> float:
    """The |tau gap| `design` gives on the workload's own seeded first n_tune + n_held prompts (what
    every study of the workload sees: the split is fixed by workload.seed)."""
    tune, held = design(recs[:n_tune + n_held], n_tune, n_held, random.Random(seed))
    return gap(tune, held, n_held, tau_key)


# ---- the study's matched check side (tuner.projection.profiling.matched_check), timed ----------

TIMED = ("off", "d2", "d3")  # what each prompt's decode is timed under: off and the usual winners


def timed_records(workload: str, n: int, deadline: float | None = None) -> list[Record]:
    """Each of the pool's first n prompts (the workload's seeded order) with what the study's
    matching reads (its PromptProxy: prompt and answer tokens, replayed forwards at PROXY_DEPTHS),
    the replayed forwards of chains d1-d4 (exact under greedy: the answer is every configuration's),
    and its decode timed once under each of TIMED (tokens after the first, seconds after the first
    token: a study's passes find the prompt's prefill cached), the order rotating from prompt to
    prompt so drift spreads over all three. No prompt text is kept. Stops at `deadline` (time.time())."""
    import time

    from engine.drafters.ngram import replayed_forwards
    from tuner.projection.profiling import PROXY_DEPTHS

    cfg = load_config([f"+workload={workload}"])
    eng = open_engine(cfg)
    pool = _pool(cfg.workload)
    random.Random(cfg.workload.seed).shuffle(pool)
    params = sampling_params(cfg.workload, seed=cfg.seed)
    specs = {"off": SpecConfig(method="off"), "d2": SpecConfig(method="ngram", depth=2, topk=1, budget=3),
             "d3": SpecConfig(method="ngram", depth=3, topk=1, budget=4),
             "d8": SpecConfig(method="ngram", depth=8, topk=1, budget=9)}
    out: list[Record] = []
    for i, p in enumerate(pool[:n]):
        if deadline is not None and time.time() > deadline:
            break
        ids = encode(eng, p, cfg.workload.chat_template)
        eng.set_spec(specs["d8"])
        answer = list(eng.generate(ids, params).tokens)
        rec: Record = {"id": p.id, "prompt_tokens": len(ids), "answer_tokens": len(answer),
                       "proxy": [replayed_forwards(ids, answer, d) for d in PROXY_DEPTHS],
                       "forwards": {f"d{d}": replayed_forwards(ids, answer, d) for d in (1, 2, 3, 4)}}
        for k in TIMED[i % len(TIMED):] + TIMED[:i % len(TIMED)]:
            eng.set_spec(specs[k])
            s = eng.generate(ids, params).stats
            rec[k] = (s.new_tokens - 1, s.total_s - s.ttft_s)
        out.append(rec)
    return out


def _proxies(recs: list[Record]) -> list:
    from tuner.projection.profiling import PromptProxy

    return [PromptProxy(r["prompt_tokens"], r["answer_tokens"], tuple(r["proxy"])) for r in recs]  # type: ignore[arg-type]


def side_figures(side: list[Record]) -> dict[str, float]:
    """One side's figures as the check reads them: tau per chain (tokens over forwards), off's
    tok/s and each timed chain's speedup (ratios of sums over the side's prompts)."""
    tokens = sum(r["answer_tokens"] for r in side)  # type: ignore[misc]
    out = {f"tau {k}": tokens / sum(r["forwards"][k] for r in side) for k in ("d1", "d2", "d3", "d4")}  # type: ignore[index]
    secs = {k: sum(r[k][1] for r in side) for k in TIMED}  # type: ignore[index]
    toks = {k: sum(r[k][0] for r in side) for k in TIMED}  # type: ignore[index]
    out["off tok/s"] = toks["off"] / secs["off"]
    for k in TIMED[1:]:
        out[f"speedup {k}"] = (toks[k] / secs[k]) / out["off tok/s"]
    return out


def check_sides(recs: list[Record], n_tune: int, n_held: int, design: str) -> tuple[list[Record], list[Record]]:
    """The check's two sides of one split (the first n_tune tuning, the next n_held held out):
    'first' (before: the first n_held tuning prompts) or 'matched' (the study's rule now)."""
    from tuner.projection.profiling import matched_check

    tune, held = recs[:n_tune], recs[n_tune:n_tune + n_held]
    if design == "first":
        return tune[:n_held], held
    return [tune[i] for i in matched_check(_proxies(tune), _proxies(held), n_held)], held


def matched_rows(recs: list[Record], n_tune: int, n_held: int, draws: int) -> list[dict[str, object]]:
    """Per design, over `draws` random draws of n_tune + n_held prompts (and the workload's own
    seeded split, the first prompts): the mean, p90 and max of |held-out / check's tuning side - 1|
    for every figure of side_figures."""
    rng = random.Random(0)
    subs = [recs[:n_tune + n_held]] + [rng.sample(recs, n_tune + n_held) for _ in range(draws)]
    rows = []
    for design in ("first", "matched"):
        gaps: dict[str, list[float]] = {}
        for sub in subs:
            c, h = check_sides(sub, n_tune, n_held, design)
            fc, fh = side_figures(c), side_figures(h)
            for k in fc:
                gaps.setdefault(k, []).append(abs(fh[k] / fc[k] - 1))
        for k, g in gaps.items():
            rest = sorted(g[1:])
            rows.append({"design": design, "figure": k, "seeded_split": g[0], "mean": statistics.fmean(rest),
                         "p90": rest[int(0.9 * len(rest))], "max": rest[-1],
                         "within_5pct": sum(x <= 0.05 for x in rest) / len(rest)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="code")
    ap.add_argument("--pool", type=int, default=80, help="prompts measured (the workload's seeded order)")
    ap.add_argument("--draws", type=int, default=2000)
    ap.add_argument("--depth", type=int, default=4, help="the n-gram chain whose tau is compared")
    ap.add_argument("--sides", default="12/6,12/12,24/24", help="tuning/held-out prompts per draw")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens generated per prompt (default: the workload's); fewer tokens, more prompts a side")
    ap.add_argument("--save", default=None, help="write the per-prompt figures (features and counts, no text) here")
    ap.add_argument("--load", default=None, help="read the per-prompt figures from a --save file instead of generating")
    ap.add_argument("--needed", default="6,12,24,48,96,192,384",
                    help="prompts a side for the bootstrap of what would reach 5%% (random split, with replacement)")
    ap.add_argument("--matched", action="store_true",
                    help="the study's matched check side against the first tuning prompts: each prompt's answer "
                         "replayed and its decode timed under off, d2 and d3 (--pool prompts; --sides' first entry)")
    ap.add_argument("--time-limit-s", type=float, default=None, help="--matched: stop measuring prompts after this")
    args = ap.parse_args()
    if args.matched:
        import time

        deadline = time.time() + args.time_limit_s if args.time_limit_s else None
        if args.load:
            with open(args.load) as f:
                recs = json.load(f)
        else:
            recs = timed_records(args.workload, args.pool, deadline)
        if args.save:
            with open(args.save, "w") as f:
                json.dump(recs, f)
        nt, nh = (int(x) for x in args.sides.split(",")[0].split("/"))
        if len(recs) < nt + nh:
            raise SystemExit(f"{len(recs)} prompts measured before the time limit: a split needs {nt + nh}")
        rows = matched_rows(recs, nt, nh, args.draws)
        print(f"{args.workload}: {len(recs)} prompts measured; {nt} tuning / {nh} held-out a draw, {args.draws} draws")
        for r in rows:
            print(f"  {r['design']:8s} {r['figure']:12s} |gap| seeded split {r['seeded_split']:.3f}, draws mean "
                  f"{r['mean']:.3f} p90 {r['p90']:.3f} max {r['max']:.3f}, within 5% in {r['within_5pct']:.0%}")
        print(json.dumps({"workload": args.workload, "prompts": len(recs), "tune": nt, "heldout": nh, "rows": rows}))
        return
    if args.load:
        with open(args.load) as f:
            recs = json.load(f)
    else:
        recs = per_prompt_tau(args.workload, args.pool, (args.depth,), args.max_new_tokens)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(recs, f)
    key = f"d{args.depth}"
    seed = load_config([f"+workload={args.workload}"]).workload.seed
    taus = [r[key][0] / r[key][1] for r in recs]  # type: ignore[index]
    print(f"{args.workload}: {len(recs)} prompts, greedy tau of ngram d{args.depth}: {min(taus):.2f}-{max(taus):.2f}, "
          f"mean {statistics.fmean(taus):.2f}, sd {statistics.pstdev(taus):.2f}")
    corr = {name: spearman([feature(name)(r) for r in recs], taus) for name in FEATURES}
    for name, c in corr.items():
        print(f"  rank correlation with tau: {name:28s} {c:+.2f}")
    designs = [("random", None)] + [(kind, n) for n in FEATURES for kind in ("stratified", "alternating")]
    rows = []
    for side in args.sides.split(","):
        nt, nh = (int(x) for x in side.split("/"))
        if nt + nh > len(recs):
            continue
        for kind, name in designs:
            d = design_of(kind, name)
            g = gaps(recs, nt, nh, args.draws, d, key)
            label = kind if name is None else f"{kind} by {name}"
            rows.append({"tune": nt, "heldout": nh, "split": label, **g,
                         "default_split": default_gap(recs, nt, nh, d, key, seed)})
            print(f"{nt:3d} tuning / {nh:2d} held-out, {label:42s} |tau gap| mean {g['mean']:.3f} "
                  f"median {g['median']:.3f} p95 {g['p95']:.3f} max {g['max']:.3f}, within 5% in "
                  f"{g['within_5pct']:.0%} of draws; the seeded split {rows[-1]['default_split']:.3f}")
    # what would reach 5%: random halves of n a side drawn with replacement from the measured prompts
    needed = []
    for n in (int(x) for x in args.needed.split(",")):
        g = gaps(recs, n, n, args.draws, design_of("random", None), key, replace=True)
        needed.append({"per_side": n, **g})
        print(f"bootstrap {n:3d} a side (random): |tau gap| mean {g['mean']:.3f} p95 {g['p95']:.3f}, "
              f"within 5% in {g['within_5pct']:.0%} of draws")
    print(json.dumps({"workload": args.workload, "prompts": len(recs), "max_new_tokens": args.max_new_tokens,
                      "tau_sd": statistics.pstdev(taus), "correlation": corr, "rows": rows, "needed": needed}))


if __name__ == "__main__":
    main()
