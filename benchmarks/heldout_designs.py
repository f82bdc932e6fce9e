"""Which held-out check design brings held-out within 5% of tuning? Several designs on one measurement.

The check (tuner.study.selection.heldout_check) compares the winner's speedup on the held-out
prompts with its speedup on as many tuning prompts; issue 39's figure is |held-out / tuning - 1|.
This benchmark measures the first --pool prompts of the workload's seeded order (as
engine.measure.workloads deals them: the tuning split first, then the held-out one) one at a time,
speculation off and --spec each, --rounds interleaved rounds (round 1 off first and the prompts in
order, the next reversed, ...), every prompt's prefill warmed untimed first (as the study's
Measurer does). Each design is then a choice of which prompts form the two sides, read from the
same per-prompt (tokens, seconds): the composition of the sides is what differs, the timing is
shared, so the designs compare side by side without one run's load favouring another.

Per design it prints the gap per round (each round is one of the check's pairs), the gap over all
rounds, its 95% interval over prompts and rounds (tuner.study.selection.gap_interval, the check's
own) and its width, and the check's cost relative to today's (prompt-seconds per pair). The last
line is one JSON object. Designs (N tuning prompts, H held-out, P the pool's prompts in order):

- today: tuning P[0:6] against held-out P[12:18] (num_prompts 12, num_heldout 6);
- trial prompts: the trials' own tuning figure (P[0:2], search.trial_prompts) against held-out;
- whole tuning split: P[0:12] (what trials rotating through the split would cover) against held-out;
- 12 a side: P[0:12] against P[12:24] (num_heldout 12);
- check side nearest (length / repeats): the splits as today, the check's 6 tuning prompts those of
  P[0:12] nearest to each held-out prompt by the statistic;
- matched halves (length / repeats): P[0:18] or P[0:24] sorted by a statistic known before any
  measurement (the prompt's token length, the share of its token 2-grams that repeat), cut into
  strata, one prompt of each stratum to each side (benchmarks/split_gap.py's `stratified`, seeded
  by the workload's seed: fixed).

With --max-new-tokens 64 the same at half the tokens (more prompts at the same cost). Usage:

    python benchmarks/heldout_designs.py                  # code, ngram d4, 24 prompts, 3 rounds
    python benchmarks/heldout_designs.py --max-new-tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
from collections.abc import Callable

from engine.measure.runner import InProcessTarget
from engine.measure.workloads import encode, load_prompts, sampling_params
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig
from tuner.study.measurer import open_engine
from tuner.study.selection import gap_interval

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from split_gap import repeat_share, stratified  # noqa: E402  (a sibling benchmark: one stratification)

OFF = SpecConfig(method="off")


def parse_spec(text: str) -> SpecConfig:
    """'ngram d4' -> an n-gram chain of depth 4."""
    method, depth = text.split()
    d = int(depth.lstrip("d"))
    return SpecConfig(method=method, depth=d, topk=1, budget=d + 1)


def matched(idx: list[int], stat: dict[int, float], n_tune: int, n_held: int, seed: int) -> tuple[list[int], list[int]]:
    """The pool indices `idx` split into a tuning side of the check (n_held prompts, matched to the
    held-out ones) and n_held held-out prompts, stratified by `stat` (split_gap.stratified)."""
    recs = [{"i": i, "s": stat[i]} for i in idx]
    tune, held = stratified(recs, n_tune, n_held, lambda r: r["s"], random.Random(seed))  # type: ignore[arg-type,return-value]
    return [r["i"] for r in tune][:n_held], [r["i"] for r in held]  # type: ignore[misc]


def nearest(held: list[int], tune: list[int], stat: dict[int, float]) -> list[int]:
    """The splits kept as they are, the check's tuning side chosen among the tuning prompts: for each
    held-out prompt (shortest first by `stat`) the unused tuning prompt nearest to it by `stat`."""
    free, out = list(tune), []
    for h in sorted(held, key=lambda i: (stat[i], i)):
        j = min(free, key=lambda i: (abs(stat[i] - stat[h]), i))
        free.remove(j)
        out.append(j)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="code")
    ap.add_argument("--spec", default="ngram d4")
    ap.add_argument("--pool", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    over = [f"model={args.model}", f"+workload={args.workload}", f"engine.builtin.threads={args.threads}"]
    if args.max_new_tokens is not None:
        over.append(f"workload.max_new_tokens={args.max_new_tokens}")
    cfg = load_config(over)
    w = cfg.workload
    n_tune = w.num_prompts
    cfg.workload.num_heldout = args.pool - n_tune  # the pool in the workload's own order: tuning split first
    pool = load_prompts(cfg.workload, "tune") + load_prompts(cfg.workload, "heldout")
    spec = parse_spec(args.spec)
    eng = open_engine(cfg)
    params = sampling_params(cfg.workload, seed=cfg.seed)
    target = InProcessTarget(eng, chat_template=w.chat_template)
    ids = {i: encode(eng, p, w.chat_template) for i, p in enumerate(pool)}
    one = dataclasses.replace(params, max_new_tokens=1)
    for sp in (OFF, spec):  # every prefill warmed untimed (Measurer._warm_prefix)
        eng.set_spec(sp)
        target.run(pool, one, 1)
    # per round: spec's and off's per-prompt (tokens, seconds)
    got: list[dict[str, list[tuple[int, float]]]] = []
    taus: dict[int, list[float]] = {i: [] for i in range(len(pool))}
    for r in range(args.rounds):
        rec: dict[str, list[tuple[int, float]]] = {OFF.key(): [(0, 0.0)] * len(pool), spec.key(): [(0, 0.0)] * len(pool)}
        order = list(range(len(pool))) if r % 2 == 0 else list(range(len(pool)))[::-1]
        for sp in ([OFF, spec] if r % 2 == 0 else [spec, OFF]):
            eng.set_spec(sp)
            for i in order:
                m = target.run([pool[i]], params, 1)
                rec[sp.key()][i] = (m.output_tokens, m.wall_s)
                if sp is spec and m.tau is not None:
                    taus[i].append(m.tau)
        got.append(rec)
        print(f"round {r + 1} measured", flush=True)

    n_held = 6
    length = {i: float(len(ids[i])) for i in ids}
    repeats = {i: repeat_share(ids[i], 2) for i in ids}
    designs: dict[str, tuple[list[int], list[int]]] = {
        "today (6 / 6)": (list(range(6)), list(range(n_tune, n_tune + n_held))),
        "trial prompts (2) / 6": (list(range(2)), list(range(n_tune, n_tune + n_held))),
        "whole tuning split (12) / 6": (list(range(n_tune)), list(range(n_tune, n_tune + n_held))),
    }
    if args.pool >= 2 * n_tune:
        designs["12 a side"] = (list(range(n_tune)), list(range(n_tune, 2 * n_tune)))
    for name, stat in (("length", length), ("repeats", repeats)):
        held = list(range(n_tune, n_tune + n_held))
        designs[f"check side nearest by {name}, 6 of 12 / 6"] = (nearest(held, list(range(n_tune)), stat), held)
        designs[f"matched by {name}, 6 / 6 of 18"] = matched(list(range(n_tune + n_held)), stat, n_tune, n_held, w.seed)
        if args.pool >= 2 * n_tune:
            t, h = matched(list(range(2 * n_tune)), stat, n_tune, n_tune, w.seed)
            designs[f"matched by {name}, 12 / 12 of 24"] = (t, h)

    def side(prompts: list[int]) -> list[list[tuple[list[tuple[int, float]], list[tuple[int, float]]]]]:
        return [[([rec[spec.key()][i] for i in prompts], [rec[OFF.key()][i] for i in prompts])] for rec in got]

    def speedup(prompts: list[int], rounds: list[int]) -> float:
        logs = []
        for r in rounds:
            st = sum(got[r][spec.key()][i][0] for i in prompts) / sum(got[r][spec.key()][i][1] for i in prompts)
            bt = sum(got[r][OFF.key()][i][0] for i in prompts) / sum(got[r][OFF.key()][i][1] for i in prompts)
            logs.append(st / bt)
        return statistics.geometric_mean(logs)

    base_cost = n_held + n_held  # today's prompt plays per pair
    print(f"{args.workload}, {spec.key()} against off, {len(pool)} prompts x {w.max_new_tokens} tokens, "
          f"{args.rounds} rounds")
    rows = []
    for name, (t, h) in designs.items():
        per_round = [speedup(h, [r]) / speedup(t, [r]) - 1 for r in range(args.rounds)]
        gap = speedup(h, list(range(args.rounds))) / speedup(t, list(range(args.rounds))) - 1
        ci = gap_interval(side(t), side(h), gap, seed=cfg.seed)
        tau_t = statistics.fmean(statistics.fmean(taus[i]) for i in t)
        tau_h = statistics.fmean(statistics.fmean(taus[i]) for i in h)
        row = {"design": name, "tuning": t, "heldout": h, "gap_per_round": per_round, "gap": gap,
               "ci": ci, "width": (ci[1] - ci[0]) if ci else None, "tau_tuning": tau_t, "tau_heldout": tau_h,
               "cost_vs_today": (len(t) + len(h)) / base_cost * w.max_new_tokens / 128}
        rows.append(row)
        cis = f" [{ci[0]:+.1%}, {ci[1]:+.1%}] (width {ci[1] - ci[0]:.1%})" if ci else ""
        print(f"{name:34s} gap per round " + " ".join(f"{g:+.1%}" for g in per_round)
              + f"; all rounds {gap:+.1%}{cis}; mean prompt tau {tau_h:.2f} / {tau_t:.2f}; "
              f"check cost x{row['cost_vs_today']:.2f}", flush=True)
    print(json.dumps({"spec": spec.key(), "pool": len(pool), "max_new_tokens": w.max_new_tokens,
                      "rounds": args.rounds, "rows": rows,
                      "per_prompt": [{"i": i, "id": p.id, "prompt_tokens": len(ids[i]), "repeats": repeats[i],
                                      "tau": statistics.fmean(taus[i]) if taus[i] else None,
                                      "speedup": [got[r][OFF.key()][i][1] / got[r][spec.key()][i][1]
                                                  for r in range(args.rounds)]} for i, p in enumerate(pool)]}))


if __name__ == "__main__":
    main()
