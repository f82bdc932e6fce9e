"""Adaptive speculation in the built-in engine, in process: speculation off, a static spec and the
same spec adaptive (`spec.adaptive`: its depth the bound) at each concurrency level, through the one
load generator (engine.measure.runner, InProcessTarget) on the workload's prompts.

    python benchmarks/adaptive_engine.py                                  # code, levels 1 and 8
    python benchmarks/adaptive_engine.py --levels 1,8 --prompts 8 --max-new-tokens 128 --rounds 2
    python benchmarks/adaptive_engine.py --workload chat --static ngram:4 --adaptive ngram:8

One engine (the packaged SmolLM2, engine.builtin.max_batch = the highest level) plays every row;
the step-cost curve is timed (or read from its cache) before anything is measured. Rows take turns
within each round, their order rotating from round to round, so drift on a shared machine falls on
all of them. A level of N plays max(prompts, N) requests with N clients in flight. Prints tok/s
and tau per level; `greedy_identical` says whether every row's
texts equal speculation off's; the last line is one JSON object with adaptive/off and
adaptive/static per level. `--trace N` prints, every N steps of the adaptive row, per batch size
what the controller weighed and chose (engine.decode.batch.BatchEngine.trace): the nodes allowed,
drafted and kept per request, the probes, the steps screened out below the pay floor without
pricing (engine.decode.control.pay_floor), the price of the first rows and the step (with its
overhead, and what drafting at all adds to a step: the setup) it read, the forward's measured
seconds per count of rows (the real marginal cost of a row at that batch), the controller's own and the drafting's seconds per step, and the mean
estimates at draft positions 1-3. Over HTTP at levels 1-32, with a grid of static specs, is the
study arm's benchmark (issue 36).

    python benchmarks/adaptive_engine.py --workload chat --side-by-side 8,32 --steps 120 [--profile]

`--side-by-side` instead keeps two schedulers of the one engine full at each level (off and the
adaptive row; a finished request is replaced at once) and steps them in turn, one step each, so
that both meet the same load; per decode step it reads the wall seconds, the forward's and the
drafting's, and prints per level the median seconds of a step outside the forward for off and for
adaptive's steps that drafted nothing (what adaptive control costs when it drafts nothing), for
adaptive's steps that drafted, and for each one's steps that admitted a prompt; over all steps,
admissions included, each one's seconds per streamed token (with `--max-new-tokens` short enough
that requests end within the steps, the staggered admissions of a drafting scheduler against off's
all at once). `--profile` adds cProfile's costliest calls over each
scheduler's steps; `--nothing-pays` prices every row at a whole step, so that adaptive never
drafts and its steps' own time is all the controller costs where nothing pays.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.decode.stepcost import StepCost, batch_levels  # noqa: E402
from engine.measure.runner import InProcessTarget, measure  # noqa: E402
from engine.measure.workloads import encode, load_prompts, sampling_params  # noqa: E402
from tuner.schema.compose import load_config  # noqa: E402
from tuner.schema.config import SpecConfig  # noqa: E402
from tuner.study.measurer import open_engine  # noqa: E402


def _spec(text: str, adaptive: bool = False) -> SpecConfig:
    """'ngram:4' -> an n-gram chain of depth 4."""
    method, _, depth = text.partition(":")
    d = int(depth or 4)
    return SpecConfig(method=method, depth=d, topk=1, budget=d + 1, adaptive=adaptive)


class Trace:
    """The adaptive row's step records, summarised per batch size every `every` steps."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.recs: list[dict] = []

    def __call__(self, rec: dict) -> None:
        self.recs.append(rec)
        if len(self.recs) >= self.every:
            self.flush()

    def flush(self) -> None:
        by: dict[int, list[dict]] = {}
        for r in self.recs:
            by.setdefault(r["batch"], []).append(r)
        self.recs = []
        for b, rs in sorted(by.items()):
            n = sum(len(r["allowed"]) for r in rs)
            mean = lambda key: sum(sum(r.get(key, [])) for r in rs) / max(n, 1)  # noqa: E731
            price = [statistics.mean(r["table"][k] - r["table"][0] for r in rs if len(r["table"]) > k) * 1e3
                     if any(len(r["table"]) > k for r in rs) else float("nan") for k in (1, 2, 4)]
            decode = [r for r in rs if not r["prefill"]]
            fwd: dict[int, list[float]] = {}
            for r in decode:
                fwd.setdefault(r["rows"] - r["extra"], []).append(r["forward_s"])
            f0 = statistics.median(fwd[0]) if 0 in fwd else None
            marg = " ".join(f"{x}:{(statistics.median(v) - f0) * 1e3 / x:+.2f}({len(v)})"
                            for x, v in sorted(fwd.items())[:6] if x and f0 is not None)
            est = [statistics.mean(g[k] for r in rs for g in r["gains"] if len(g) > k) for k in range(3)
                   if any(len(g) > k for r in rs for g in r["gains"])]
            # the kept nodes' expected accepted tokens (the controller's gains) against the accepted
            expected, accepted = sum(r.get("expected", 0.0) for r in rs), sum(r.get("accepted", 0) for r in rs)
            print(f"  trace b={b:<3} steps {len(rs):>4} probes {sum(r['probe'] for r in rs):>3} "
                  f"screened {sum(r.get('screened', False) for r in rs):>3}  per request: "
                  f"allowed {mean('allowed'):.2f} drafted {mean('sizes'):.2f} kept {mean('kept'):.2f} "
                  f"(expected {expected / max(n, 1):.2f} accepted {accepted / max(n, 1):.2f})  "
                  f"price ms row1 {price[0]:.2f} rows2 {price[1]:.2f} rows4 {price[2]:.2f} "
                  f"step {statistics.mean(r['table'][0] for r in rs) * 1e3:.1f} (overhead "
                  f"{statistics.mean(r['overhead'] for r in rs) * 1e3:.1f}, setup "
                  f"{statistics.mean(r['setup'] for r in rs) * 1e3:.1f})  forward ms rows0 "
                  f"{'-' if f0 is None else f'{f0 * 1e3:.1f}'}({len(fwd.get(0, []))}) per row [{marg}]  "
                  f"control {statistics.mean(r['control_s'] for r in rs) * 1e3:.2f} ms drafting "
                  f"{statistics.mean(r['drafting_s'] for r in rs) * 1e3:.2f} ms  "
                  f"est {' '.join(f'{e:.2f}' for e in est)}", flush=True)


def side_by_side(engine, encoded: list[list[int]], params, level: int, spec: SpecConfig, steps: int,
                 profile: bool = False, nothing_pays: bool = False) -> dict:
    """Off and `spec` (adaptive) each in a scheduler of `level` places kept full (a finished request
    replaced by the next prompt at once), stepped in turn for `steps` steps each after a warm-up of
    a quarter as many; per scheduler and step: wall, forward and drafting seconds, the drafted rows,
    the prompts admitted and the tokens streamed. Returns the medians (ms) by kind of step (decode
    steps, and steps that admitted a prompt), and per scheduler over every step its seconds per
    token streamed and the share of its seconds in admitting steps. `nothing_pays`: the
    adaptive scheduler prices every row at a whole step (its curve's step without rows), so every
    one of its steps drafts nothing: what adaptive control costs a step where nothing pays."""
    if nothing_pays:  # (the live figures rescale the curve; a row still costs what the step does)
        dear = StepCost({b: [(0, 1.0), (64, 65.0)] for b in batch_levels(engine.max_batch)}, spec.budget)
        real_costs, engine.step_costs = engine.step_costs, lambda *a: dear
    forward = engine.forward
    inner = forward.step_batch
    last: dict = {}

    def timed(caches, tokens, depths, ancestors, last_only, aux):  # the step's forward, as it ran
        t = time.perf_counter()
        out = inner(caches, tokens, depths, ancestors, last_only, aux)
        last.update(s=time.perf_counter() - t, rows=sum(len(x) for x in tokens) - len(tokens),
                    admitted=sum(last_only))
        return out

    def feeder(b, made: list[int]) -> Callable[[Any], None]:
        """Submits the next prompt to scheduler `b` (and again when that one is done, to `b`): one
        closure per scheduler (a refill defined in the loop below would resolve to the last one
        defined, and send off's later requests to the adaptive scheduler)."""
        nxt = [0]

        def count(toks: list[int]) -> None:
            made[0] += len(toks)

        def refill(_r: Any) -> None:
            b.submit(encoded[nxt[0] % len(encoded)], params, count, refill)
            nxt[0] += 1
        return refill

    scheds = {}
    made: dict[str, list[int]] = {}  # per scheduler: tokens streamed in the step being stepped
    for name, s in (("off", SpecConfig(method="off")), ("adaptive", spec)):
        engine.set_spec(s)
        b = engine.batcher()
        made[name] = [0]
        refill = feeder(b, made[name])
        for _ in range(level):
            refill(None)
        scheds[name] = b
    if nothing_pays:
        engine.step_costs = real_costs
    prof = {n: cProfile.Profile() for n in scheds} if profile else {}
    # per scheduler and step: wall, forward, drafting seconds, draft rows, prompts admitted, tokens
    got: dict[str, list[tuple[float, float, float, int, int, int]]] = {n: [] for n in scheds}
    forward.step_batch = timed
    try:
        for i in range(steps + steps // 4):
            for n, b in (list(scheds.items()) if i % 2 == 0 else list(scheds.items())[::-1]):  # each goes first by turns
                last.clear()
                made[n][0] = 0
                t = time.perf_counter()
                if n in prof:
                    prof[n].enable()
                b.step()
                if n in prof:
                    prof[n].disable()
                wall = time.perf_counter() - t
                if i >= steps // 4 and last:
                    got[n].append((wall, last["s"], b._busy - last["s"], last["rows"], last["admitted"], made[n][0]))
    finally:
        forward.step_batch = inner
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3) if xs else None  # noqa: E731
    out = {"level": level, "steps": steps}
    kinds = {"off": [g for g in got["off"] if not g[4]],
             "adaptive, nothing drafted": [g for g in got["adaptive"] if g[3] == 0 and not g[4]],
             "adaptive, drafted": [g for g in got["adaptive"] if g[3] > 0 and not g[4]],
             "off, admitting": [g for g in got["off"] if g[4]], "adaptive, admitting": [g for g in got["adaptive"] if g[4]]}
    for k, rows in kinds.items():
        out[k] = {"steps": len(rows), "wall_ms": ms([g[0] for g in rows]),
                  "wall_mean_ms": round(statistics.mean(g[0] for g in rows) * 1e3, 3) if rows else None,
                  "outside_mean_ms": round(statistics.mean(g[0] - g[1] - g[2] for g in rows) * 1e3, 3) if rows else None,
                  "forward_ms": ms([g[1] for g in rows]),
                  "outside_forward_ms": ms([g[0] - g[1] - g[2] for g in rows]), "drafting_ms": ms([g[2] for g in rows]),
                  "rows": round(statistics.mean([g[3] for g in rows]), 2) if rows else None,
                  "admitted": round(statistics.mean([g[4] for g in rows]), 2) if rows else None}
    # every step, admissions included: the seconds per token each scheduler streamed, and the share
    # of its seconds in steps that admitted a prompt (what the decode-only medians above leave out)
    for n, rows in got.items():
        wall, toks = sum(g[0] for g in rows), sum(g[5] for g in rows)
        out[f"{n}, all steps"] = {"steps": len(rows), "ms_per_token": round(wall / max(toks, 1) * 1e3, 3),
                                  "admitting_share": round(sum(g[0] for g in rows if g[4]) / max(wall, 1e-9), 3),
                                  "admitting_steps": sum(1 for g in rows if g[4])}
    for n, p in prof.items():
        buf = io.StringIO()
        pstats.Stats(p, stream=buf).sort_stats("tottime").print_stats(24)
        out[f"profile {n}"] = buf.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="code")
    ap.add_argument("--weights", default="fp32", help="engine.builtin.weights (fp32 as benchmarks/adaptive.py serves)")
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--static", default="ngram:4", help="the static row, METHOD:DEPTH (a chain)")
    ap.add_argument("--adaptive", default="ngram:8", help="the adaptive row, METHOD:MAX_DEPTH")
    ap.add_argument("--trace", type=int, default=0, metavar="N",
                    help="print what the controller weighed and chose every N steps of the adaptive row (0: never)")
    ap.add_argument("--side-by-side", default="", metavar="LEVELS",
                    help="off and the adaptive row stepped in turn at each level, their steps' own time compared")
    ap.add_argument("--steps", type=int, default=120, help="--side-by-side: measured steps per scheduler and level")
    ap.add_argument("--profile", action="store_true", help="--side-by-side: cProfile's costliest calls per scheduler")
    ap.add_argument("--nothing-pays", action="store_true",
                    help="--side-by-side: adaptive prices every row at a whole step, so it never drafts")
    args = ap.parse_args(argv)
    if args.side_by_side:
        return _side_by_side_main(args)
    levels = [int(x) for x in args.levels.split(",")]
    rows = {"off": SpecConfig(method="off"), f"static {args.static}": _spec(args.static),
            f"adaptive {args.adaptive}": _spec(args.adaptive, adaptive=True)}
    cfg = load_config([f"model={args.model}", "spec.method=off", f"+workload={args.workload}",
                       f"workload.max_new_tokens={args.max_new_tokens}", f"engine.builtin.max_batch={max(levels)}",
                       f"engine.builtin.weights={args.weights}"])
    engine = open_engine(cfg)
    prompts = load_prompts(cfg.workload)[:args.prompts]
    params = sampling_params(cfg.workload)
    target = InProcessTarget(engine, cfg.workload.chat_template)
    t = time.perf_counter()
    for spec in rows.values():
        engine.set_spec(spec)  # the adaptive one times its step-cost curve here (or reads its cache)
    setup_s = time.perf_counter() - t

    tps: dict[tuple[str, int], list[float]] = {}
    tau: dict[tuple[str, int], list[float]] = {}
    texts: dict[tuple[str, int], list[str]] = {}
    names = list(rows)
    for c in levels:
        ps = [prompts[i % len(prompts)] for i in range(max(len(prompts), c))]
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                engine.set_spec(rows[name])
                trace = Trace(args.trace) if args.trace > 0 and rows[name].adaptive else None
                engine.trace = trace
                if trace is not None:
                    print(f"adaptive at concurrency {c}, round {r}:", flush=True)
                s = measure(target, ps, params, c, warmup=1, repeats=1)
                if s.errors:
                    raise SystemExit(f"{name} at concurrency {c}: {s.errors[0]}")
                if trace is not None:
                    trace.flush()
                m = s.runs[0]
                tps.setdefault((name, c), []).append(m.output_tokens_per_s)
                tau.setdefault((name, c), []).append(m.tau or 1.0)
                texts[(name, c)] = m.texts

    off, static, adaptive = names
    print(f"{args.model}, {args.workload} prompts x{args.prompts}, {args.max_new_tokens} new tokens, T=0, "
          f"{args.rounds} rounds (median); set-up {setup_s:.1f} s")
    print(f"{'c':>3} " + " ".join(f"{n:>22}" for n in names) + "   adaptive/off  adaptive/static")
    out = {"levels": {}}
    identical = True
    for c in levels:
        med = {n: statistics.median(tps[(n, c)]) for n in names}
        taus = {n: statistics.median(tau[(n, c)]) for n in names}
        identical &= all(texts[(n, c)] == texts[(off, c)] for n in names)
        print(f"{c:>3} " + " ".join(f"{med[n]:>12.1f} (t {taus[n]:.2f})" for n in names)
              + f"   {med[adaptive] / med[off]:>12.3f}  {med[adaptive] / med[static]:>15.3f}")
        out["levels"][c] = {"tok_s": {n: round(med[n], 2) for n in names}, "tau": {n: round(taus[n], 3) for n in names},
                            "adaptive_vs_off": round(med[adaptive] / med[off], 3),
                            "adaptive_vs_static": round(med[adaptive] / med[static], 3)}
    out["greedy_identical"] = identical
    out["min_adaptive_vs_off"] = min(v["adaptive_vs_off"] for v in out["levels"].values())
    out["min_adaptive_vs_static"] = min(v["adaptive_vs_static"] for v in out["levels"].values())
    print(f"greedy_identical: {identical}")
    print(json.dumps(out))
    return 0


def _side_by_side_main(args: argparse.Namespace) -> int:
    levels = [int(x) for x in args.side_by_side.split(",")]
    cfg = load_config([f"model={args.model}", "spec.method=off", f"+workload={args.workload}",
                       f"workload.max_new_tokens={args.max_new_tokens}", f"engine.builtin.max_batch={max(levels)}",
                       f"engine.builtin.weights={args.weights}"])
    engine = open_engine(cfg)
    encoded = [encode(engine, p, cfg.workload.chat_template) for p in load_prompts(cfg.workload)[:args.prompts]]
    params = sampling_params(cfg.workload)
    spec = _spec(args.adaptive, adaptive=True)
    for c in levels:
        got = side_by_side(engine, encoded, params, c, spec, args.steps, args.profile, args.nothing_pays)
        for k, v in got.items():
            if k.startswith("profile"):
                print(f"--- {k} at {c}\n{v}")
        print(json.dumps({k: v for k, v in got.items() if not k.startswith("profile")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
