"""What differs between the held-out check's two sides, prompt by prompt, before any rule is applied?

The check (tuner.study.selection.heldout_check) compares the winner's speedup on the held-out prompts
with its speedup on as many tuning prompts. This benchmark plays each prompt of both sides alone
(one request in flight, greedy) through the one load generator, speculation off and one
configuration (--spec, default ngram d4), --rounds rounds, the first with off first and the prompts
in order, the next reversed, and so on. No prompt is played before round 1, as none of the held-out
prompts is before the check, so round 1's TTFTs show what the first pass over a set of prompts
costs (its whole prefill; later passes copy it from the prefix cache), except the first tuning
prompt's, which is played once before, unrecorded (the engine's first request).

Per prompt it prints its length, output tokens, off's TTFT in each round, off's and the spec's
seconds per step, the spec's tau and the prompt's speedup; per side and round: tau, the speedup as
a ratio of sums (as the check's tok/s is), decode only (TTFT taken out), speedup / tau, the share
of off's time in TTFT, and the mean of the prompts' ratios. The last line is one JSON object with
every record. Usage:

    python benchmarks/heldout_sides.py                  # code workload, SmolLM2, ngram d4, 2 rounds
    python benchmarks/heldout_sides.py --spec "ngram d2" --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics

from engine.measure.runner import InProcessTarget
from engine.measure.workloads import encode, sampling_params
from tuner.projection.profiling import CHECK
from tuner.schema.compose import load_config
from tuner.schema.config import SpecConfig
from tuner.study.measurer import open_engine, study_prompts

OFF = SpecConfig(method="off")


def parse_spec(text: str) -> SpecConfig:
    """'ngram d4' -> an n-gram chain of depth 4."""
    method, depth = text.split()
    d = int(depth.lstrip("d"))
    return SpecConfig(method=method, depth=d, topk=1, budget=d + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="code")
    ap.add_argument("--spec", default="ngram d4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    cfg = load_config([f"model={args.model}", f"+workload={args.workload}", f"engine.builtin.threads={args.threads}"])
    spec = parse_spec(args.spec)
    eng = open_engine(cfg)
    prompts = study_prompts(cfg, eng)
    sides = {"tuning": prompts[CHECK], "held-out": prompts["heldout"]}
    params = sampling_params(cfg.workload, seed=cfg.seed)
    target = InProcessTarget(eng, chat_template=cfg.workload.chat_template)
    played = [(s, p) for s in sides for p in sides[s]]
    target.run(sides["tuning"][:1], params, 1)  # the engine's first request (its first forwards), not recorded
    rows = []
    for r in range(args.rounds):
        for sp in ([OFF, spec] if r % 2 == 0 else [spec, OFF]):
            eng.set_spec(sp)
            for s, p in (played if r % 2 == 0 else played[::-1]):
                m = target.run([p], params, 1)
                rows.append({"round": r + 1, "spec": sp.key(), "side": s, "id": p.id,
                             "prompt_tokens": len(encode(eng, p, cfg.workload.chat_template)),
                             "tokens": m.output_tokens, "tau": m.tau, "ttft_s": m.ttft_p50_ms / 1e3, "e2e_s": m.wall_s})

    def get(side: str, pid: str, sp: SpecConfig, r: int) -> dict:
        return next(x for x in rows if x["side"] == side and x["id"] == pid and x["spec"] == sp.key() and x["round"] == r)

    def step_ms(x: dict) -> float:  # seconds per target forward after the prompt's
        return 1e3 * (x["e2e_s"] - x["ttft_s"]) / max(1.0, x["tokens"] / x["tau"] - 1)

    print(f"{args.workload}: {spec.key()} against off, one request in flight, {args.rounds} rounds")
    print("side      prompt          tokens in/out | off TTFT ms by round | step ms off / spec (last round) | tau | speedup")
    last = args.rounds
    for s, p in played:
        o = [get(s, p.id, OFF, r + 1) for r in range(args.rounds)]
        x = get(s, p.id, spec, last)
        print(f"{s:9s} {p.id:15s} {o[0]['prompt_tokens']:5d} {o[0]['tokens']:4d} | "
              + " ".join(f"{y['ttft_s'] * 1e3:5.0f}" for y in o)
              + f" | {step_ms(o[-1]):5.1f} / {step_ms(x):5.1f} | {x['tau']:.2f} | {o[-1]['e2e_s'] / x['e2e_s']:.2f}")
    summary = []
    for s in sides:
        for r in range(1, args.rounds + 1):
            o = [x for x in rows if x["side"] == s and x["round"] == r and x["spec"] == OFF.key()]
            x = [y for y in rows if y["side"] == s and y["round"] == r and y["spec"] == spec.key()]
            tau = sum(y["tokens"] for y in x) / sum(y["tokens"] / y["tau"] for y in x)
            sp = sum(y["e2e_s"] for y in o) / sum(y["e2e_s"] for y in x)
            dec = sum(y["e2e_s"] - y["ttft_s"] for y in o) / sum(y["e2e_s"] - y["ttft_s"] for y in x)
            row = {"side": s, "round": r, "tau": tau, "speedup": sp, "decode_speedup": dec, "speedup_per_tau": sp / tau,
                   "off_ttft_share": sum(y["ttft_s"] for y in o) / sum(y["e2e_s"] for y in o),
                   "mean_of_ratios": statistics.fmean(a["e2e_s"] / b["e2e_s"] for a, b in zip(o, x))}
            summary.append(row)
            print(f"{s:9s} round {r}: tau {tau:.2f}, speedup {sp:.3f}x (decode only {dec:.3f}x), speedup / tau "
                  f"{sp / tau:.3f}, off's time in TTFT {row['off_ttft_share']:.1%}, mean of the prompts' ratios "
                  f"{row['mean_of_ratios']:.3f}x")
    print(json.dumps({"spec": spec.key(), "summary": summary, "rows": rows}))


if __name__ == "__main__":
    main()
