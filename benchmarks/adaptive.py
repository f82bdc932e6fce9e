"""Adaptive speculation against the best static spec and off, per workload and concurrency, over HTTP.

    .venv/bin/python benchmarks/adaptive.py                                   # code and chat, c = 1..32
    .venv/bin/python benchmarks/adaptive.py --levels 1,4 --prompts 2 --max-new-tokens 16 --depths 2 --rounds 2 --waves 1  # a smoke run
    .venv/bin/python benchmarks/adaptive.py --prompts 12 --max-new-tokens 128 --depths 1,2,3,4,6,8 --rounds 6

Every configuration runs as `tuner serve` in a process of its own, all of them up together
(max_batch = the highest level; benchmarks/concurrency.py starts each, with the same
SpecConfig-to-`tuner serve` mapping the manifests use; `--weights`, fp32 unless told: `auto` resolves
per max_batch, so runs of other levels could serve other formats): speculation off, a small grid of static
n-gram chains (`--depths`; the best of them at each level is that level's "best static") and the
adaptive engine bounded by the grid's deepest chain (`spec.adaptive=true`). The one load generator
plays HumanEval (code) and MT-bench (chat) prompts, T=0: a level of N plays max(prompts, waves x N)
requests through N closed-loop clients, each sending its next request when its last one finished,
so N stay in flight until the last wave drains (a pass of only N requests sent together would
measure mostly its own drain: fewer than N in flight once the first finished). Every configuration
of a cell plays the same requests in the same order.

Noise on a shared machine comes in bursts of seconds to minutes, so each cell (workload, level) is
measured in short interleaved rounds: every configuration once per round, in the order A B C ...
then ... C B A, so that the configurations of a cell are measured within seconds of each other and
linear drift cancels over each pair of rounds. Adaptive plays between off and the deepest chain
(`round_order`), so each of its ratios pairs passes played back to back. A pass lasts at least
`--pass-s` seconds (whole waves more, sized from the cell's warm-up: `lasting`): on a fast host a
pass of a few requests at 1 or 2 in flight lasts a second, and one burst moves it 10-20%. `--split K`
plays passes of pass-s / K in as many more rounds as keep each cell's requests (`rounds_at`): the
host's speed changes in steps that last seconds, and a ratio of two passes moves by a whole step
when one falls between them, so shorter pairs, more of them, read steadier in the same time (at 1
or 2 in flight, where a pass is memory-bound, most of all). Before its first round each configuration plays one
wave of the level, and every prompt at least once (not measured: the adaptive engine's estimates
and step cost settle at each batch size as a server's would, and every prompt's prefix is cached,
as every later round finds it). Each pass also reports its mean requests in flight over N (the
requests' seconds over the pass's, Little's law): how much of the pass ran at the level; and,
from the server's own count (spectune:steps_total, scraped before and after the pass), its engine
steps by the sequences they ran: the steps below N and the places they left empty (a client's
next request arriving while a step runs joins the step after it, so each request that ends apart
from the others leaves its place empty for a step; a wave that ends together starts its next with
the first request to arrive alone).

The figures are the tok/s while the level was held (`steady_tok_s`): the tokens streamed until the
first client had no request left to send, over that span; the whole pass's tok/s, drain included,
is reported beside them (`whole_pass`). Why not the whole pass: a pass is finite, and its last
requests end one by one, the clients running dry (the drain). Requests of a speculative pass end at
different steps (their acceptance differs), so by its last wave their ends are spread over about one
request's time and the pass loses about (N - 1) / (2 R) of its client-time to the drain (R
requests), with nothing lost in any step: every drafting configuration alike, adaptive or static.
Speculation off's requests, all of one
length (every answer runs to max-new-tokens) and sent together, end on the same step in every wave
and never drain: an artefact of the pass, not of the engine (traffic of mixed lengths staggers off
too, and a server under sustained load at N has no end of pass). The drain's share falls only as
1 / waves: the whole pass converges on the held figure only over many more waves, and the held
figure estimates that limit from a few. The planted closed loop in tests/engine/test_adaptive.py
holds both: a server that loses nothing drains by the formula and reads its true rate while held.

A cell's tok/s is the geometric mean over rounds; its ratios pool the per-round ratios (adaptive
against off, against the best static, both measured in the same round) as the study's confirmation
round pools a configuration's pairs (`pool`: each round's log held within CLIP_BANDS noise bands of
the cell's median, the noise from every cell's rounds), with a 95% t-interval on the held logs; the
plain geometric mean of every round as it read stands beside them (`..._plain`). On a shared host
the speed steps between passes seconds apart now and then, and a round whose two passes fall on
either side of a step reads 0.7 among rounds of 1.0: the plain mean lets it move the cell by
several percent, the held one by the band. Each round's best static is the chain the other rounds chose (`held_out_best`:
the highest geometric mean over every round but that one), never the round itself: the largest of
several noisy figures is biased upward, so a best static chosen on the very rounds it is then judged
on reads high, and adaptive against it reads low, even where adaptive and the chains are equal (by
about half a pass's noise over the square root of the rounds, with two chains of equal speed). A
round's ratio then divides two figures that its choice never saw; the ratios of a cell share data
only through the choices, so their interval is the t-interval of the rounds' ratios as before. A
cell needs two rounds to choose this way (`--rounds` >= 2). The last line is one JSON
object with `min_adaptive_vs_best_static` and `min_adaptive_vs_off`, the minima over every level of
both workloads while the level was held (pooled as the study pools; `..._plain` beside them),
each with the interval of the cell where it falls (`min_whole_pass_...`: the same over whole passes, drain included), and `greedy_identical`: whether every
pass answered as speculation off did in the same cell and round (`greedy_differences` lists the
passes that did not, with how many requests differ). After each cell's rounds the adaptive
server's /metrics gives its controller's state at that batch size (`controller`: a step's ms as
the curve timed it, as the controller prices it and as the live forwards ran, per count of draft
rows; the overhead, the live level, the acceptance estimate), printed as it goes and kept in the
JSON: what tells a mispriced row from a misestimated node in the served run itself.

The minimum of 12 cells' point figures falls below its goal by noise alone now and then (the lowest
of a dozen cells whose rounds spread a few percent reads a few percent under their typical value):
`below_goal` lists, per goal, the cells whose whole 95% interval lies below it, a shortfall the
rounds do not explain. `--pool OUTPUT...` measures nothing: it reads the saved outputs of earlier
runs of one command (each output's last JSON line; the settings that shape a pass must agree) and
prints the table and JSON of their rounds pooled, each run's rounds numbered after the last's (a
round is the same pairs of passes played back to back in whichever run), as one run of more rounds:

    .venv/bin/python benchmarks/adaptive.py --pool run1.out run2.out
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from concurrency import _tuner_serve  # noqa: E402

from engine.measure.runner import HttpTarget, Measurement, measure  # noqa: E402
from engine.measure.stats import log_interval  # noqa: E402
from engine.api import SamplingParams  # noqa: E402
from engine.measure.workloads import Prompt, load_prompts, sampling_params  # noqa: E402
from tuner.schema.compose import load_config  # noqa: E402
from tuner.schema.config import SpecConfig  # noqa: E402
from tuner.study.selection import CLIP_BANDS, held_in, spread_without_furthest  # noqa: E402

WORKLOADS = ("code", "chat")


def specs(method: str, depths: list[int]) -> list[SpecConfig]:
    """Off, the static grid (chains of each depth) and the adaptive engine within the deepest chain."""
    bound = max(depths)
    return ([SpecConfig(method="off")] + [SpecConfig(method=method, depth=d, topk=1, budget=d + 1) for d in depths]
            + [SpecConfig(method=method, depth=bound, topk=1, budget=bound + 1, adaptive=True)])


def round_order(specs_: list[SpecConfig], r: int) -> list[str]:
    """The configurations' keys in the order round `r` plays them: adaptive between off and the
    deepest static chain (the shallower chains before off), reversed every other round. Each of
    adaptive's two ratios then compares passes played back to back, and the order between them
    alternates, so a burst of another process's work or a drift over the round weighs on both
    sides of each ratio: where adaptive drafts nothing (off in effect), off against it compares
    the same steps seconds apart rather than a round apart."""
    static = [s.key() for s in specs_ if s.method != "off" and not s.adaptive]
    adaptive = next(s.key() for s in specs_ if s.adaptive)
    order = [*static[:-1], "off", adaptive, static[-1]]
    return order if r % 2 == 0 else order[::-1]


def requests_at(prompts: int, waves: int, level: int) -> int:
    """Requests a pass plays at `level` in flight: at least `waves` waves of the level."""
    return max(prompts, waves * level)


def lasting(requests: int, level: int, warmups: list[tuple[int, float]], pass_s: float) -> int:
    """Requests a round's pass plays: `requests` (requests_at), grown by whole waves of the level
    until the fastest configuration's warm-up pass (its requests and wall seconds, `warmups`)
    says its pass lasts at least `pass_s` seconds. A pass of a second or two (a few requests at 1
    or 2 in flight on a fast host) is moved 10-20% by one burst of another process's work, where
    the same burst is a few percent of a longer pass."""
    wave_s = min((wall * level / n for n, wall in warmups if n > 0 and wall > 0), default=0.0)
    if wave_s <= 0 or requests * wave_s / level >= pass_s:
        return requests
    return max(requests, level * math.ceil(pass_s / wave_s))


SPREAD = (0.5, 0.75, 1.0, 1.25, 1.5)  # --mixed-lengths: the answers' budgets over max-new-tokens, in turn


def requests_of(ps: list[Prompt], n: int, params: SamplingParams, mixed: bool) -> list[Prompt]:
    """A pass's `n` requests: the prompts in turn, each with the workload's sampling; `mixed`: the
    i-th request's answer budget max-new-tokens x SPREAD[i % 5] (the same for every configuration,
    a mean of max-new-tokens). With one budget for all, speculation off's requests of a wave end on
    one step and the next wave's arrive together, while a drafting configuration's end apart and
    each leaves its place empty until its client's next request joins (several steps where the
    clients share the host's cores): a lockstep that served traffic of mixed lengths does not have."""
    out = [ps[i % len(ps)] for i in range(n)]
    if not mixed:
        return out
    return [replace(p, params=replace(params, max_new_tokens=max(1, round(params.max_new_tokens * SPREAD[i % len(SPREAD)]))))
            for i, p in enumerate(out)]


def rounds_at(rounds: int, full: int, split: int) -> int:
    """Rounds a cell plays when its passes are `split` requests instead of `full` (both from
    `lasting`, for pass_s and pass_s over --split): as many as keep its requests, at least `rounds`.
    The host's speed changes in steps that last seconds (docs/results.md: passes of off at 1 in
    flight a third apart within one cell on an idle machine), so a ratio of two passes moves by a
    whole step when one falls between them; shorter passes in more rounds put each pair closer together and average
    more of them in the same time, the same for every configuration. Where the passes cannot be
    shorter (their waves already last pass_s over split or more), the cell keeps `rounds`."""
    return max(rounds, rounds * full // max(split, 1))


def warm_walls(keys: list[str], play: Callable[[str], float], cold: bool) -> dict[str, float]:
    """Each configuration's warm-up wave (`play(key)`: its wall seconds), not measured: what `lasting`
    sizes the passes from. At a workload's first level (`cold`) every server meets its prompts
    uncached, so the wave is played twice and sized from the second: sized from prefills that the
    rounds never pay (their prefixes cached), the passes at that level lasted a fraction of pass_s."""
    return {k: [play(k) for _ in range(2 if cold else 1)][-1] for k in keys}


def in_flight(m: Measurement, level: int) -> float:
    """A pass's mean requests in flight over `level` (Little's law: the requests' end-to-end seconds
    over the pass's wall seconds): 1.0 when every client always had a request in flight."""
    return sum(s for _, s in m.requests) / (level * m.wall_s) if m.wall_s > 0 else 0.0


def steady_tok_s(m: Measurement, level: int) -> float | None:
    """Output tok/s while every one of the `level` clients held a request: the tokens streamed from the
    pass's start until the first client had none left to send (of R requests, the R - level + 1-th to
    end: each earlier end sent the next request; after it the clients run dry one by one, the drain),
    over that span. A request's tokens count by the share of its streamed chunks within the span.
    Until the last request was sent, as this span ended before, cut off the last wave of a pass
    whose requests end together (off's): its span held the first waves alone, their prompts' prefill
    a larger share. None where no request streamed."""
    ends = sorted(chunks[-1] for _, _, chunks in m.timeline if chunks)
    k = len(m.timeline) - level
    if k < 0 or k >= len(ends) or ends[k] <= 0:
        return None
    end = ends[k]
    got = sum(tokens * sum(t <= end for t in chunks) / len(chunks) for _, tokens, chunks in m.timeline if chunks)
    return got / end


def _scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as resp:
        return resp.read().decode()


def engine_steps(url: str) -> dict[int, int]:
    """The server's steps so far by the sequences their forwards ran (spectune:steps_total)."""
    out = {}
    for line in _scrape(url).splitlines():
        if line.startswith("spectune:steps_total{"):
            head, value = line.rsplit(" ", 1)
            out[int(head.split('sequences="')[1].split('"')[0])] = int(float(value))
    return out


def pass_steps(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    """A pass's engine steps by the sequences they ran (`engine_steps` scraped before and after it)."""
    return {n: k - before.get(n, 0) for n, k in sorted(after.items()) if k > before.get(n, 0)}


def short_steps(steps: dict[int, int], level: int) -> tuple[int, int, int]:
    """(A pass's steps, those that ran fewer sequences than `level`, the places those left empty),
    from `pass_steps`. A pass that loses nothing to admission runs below the level only while its
    first requests join and its last ones drain."""
    short = {n: k for n, k in steps.items() if n < level}
    return sum(steps.values()), sum(short.values()), sum((level - n) * k for n, k in short.items())


def controller_state(url: str, batch: int) -> dict[str, Any]:
    """The adaptive server's controller as its /metrics shows it (engine.serving.metrics,
    spectune:adaptive_*) at one batch size: ms of a step with n draft rows as the curve timed it,
    as the controller prices it (overhead included) and as the live forwards ran (with their
    counts), the overhead (in all, and of priced steps without and with draft rows), the
    controller's own pricing, what drafting at all adds to a step (setup, the pricing included),
    the live level, the drafting's ms per node and the acceptance estimate."""
    text = _scrape(url)
    out: dict[str, Any] = {"curve_ms": {}, "price_ms": {}, "forward_ms": {}, "forward_steps": {}, "acceptance": {}}
    for line in text.splitlines():
        if not line.startswith("spectune:adaptive_"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head[len("spectune:adaptive_"):].partition("{")
        lab = dict(kv.split("=", 1) for kv in labels.rstrip("}").split(",") if kv)
        lab = {k: v.strip('"') for k, v in lab.items()}
        v = float(value)
        if name == "level":
            out["level"] = round(v, 3)
        elif name == "draft_seconds_per_node":
            out["draft_ms_per_node"] = round(v * 1e3, 3)
        elif name == "acceptance":
            out["acceptance"][lab["position"]] = round(v, 3)
        elif lab.get("batch") != str(batch):
            continue
        elif name == "overhead_seconds":
            out["overhead_ms"] = round(v * 1e3, 2)
        elif name == "setup_seconds":
            out["setup_ms"] = round(v * 1e3, 2)
        elif name == "kind_overhead_seconds":
            out.setdefault("overhead_by_kind_ms", {})[lab["kind"]] = round(v * 1e3, 2)
        elif name == "kind_work_seconds":
            out.setdefault("work_by_kind_ms", {})[lab["kind"]] = round(v * 1e3, 3)
        elif name == "pricing_seconds":
            out["pricing_ms"] = round(v * 1e3, 3)
        elif name == "forward_steps":
            out["forward_steps"][lab["rows"]] = int(v)
        elif name in ("curve_seconds", "price_seconds", "forward_seconds"):
            out[name.replace("_seconds", "_ms")][lab["rows"]] = round(v * 1e3, 2)
    return out


def run(specs_: list[SpecConfig], workloads: list[str], levels: list[int], prompts: int, max_new_tokens: int,
        rounds: int, waves: int = 2, texts: dict[tuple[str, str, int, int], list[str]] | None = None,
        states: dict[tuple[str, int], dict[str, Any]] | None = None,
        rows: list[dict[str, Any]] | None = None, weights: str = "fp32", pass_s: float = 0.0,
        split: int = 1, mixed: bool = False, nice: int = 0) -> list[dict[str, Any]]:
    """Rows (workload, config, level, round, tok/s, tau, requests, in flight): every configuration's
    server up at once, each cell measured in `rounds` interleaved rounds of `requests_at` requests
    (grown to last `pass_s`: `lasting`)
    (see the module's docstring). `texts`, when given, receives each pass's answers by (workload,
    config, level, round), to compare, never to print; `states` the adaptive server's controller
    after each cell's rounds (`controller_state`), by (workload, level); `rows`, when given, receives
    each row as it is measured (a run stopped early keeps them); `weights`: every server's
    engine.builtin.weights; `pass_s`: each round's passes last at least about this long (`lasting`);
    `split`: passes of pass_s / split instead, in as many more rounds as keep each cell's requests
    (`rounds_at`); `mixed`: each request's answer budget from SPREAD in turn (`requests_of`); `nice`:
    every server that much below this load generator's CPU priority (concurrency._tuner_serve)."""
    over = [f"engine.builtin.max_batch={max(levels)}", f"serve.queue_size={4 * max(levels)}",
            f"engine.builtin.weights={weights}"]
    loads = {}
    for w in workloads:
        cfg = load_config([f"+workload={w}", f"workload.num_prompts={prompts}", f"workload.max_new_tokens={max_new_tokens}"])
        loads[w] = (load_prompts(cfg.workload), sampling_params(cfg.workload), cfg.workload.chat_template)
    model = load_config([]).model.name
    log_dir = tempfile.mkdtemp(prefix="spectune-adaptive-")
    rows = [] if rows is None else rows
    with contextlib.ExitStack() as stack:
        urls = {s.key(): stack.enter_context(_tuner_serve(over, model, s, log_dir, nice)) for s in specs_}
        keys = list(urls)
        for w, (ps, params, chat) in loads.items():
            targets = {k: HttpTarget(u, model, chat) for k, u in urls.items()}
            for c in levels:
                first = requests_of(ps, max(c, len(ps)), params, mixed)
                # one wave at this level first, not measured, and every prompt at least once: a prompt
                # first met in the first round was prefilled there and cached for the later rounds,
                # so the first round ran slower for every configuration (code at 2 in flight, the first
                # level of the workload: 24.6-35.9 tok/s against 62.3-94.3 in the next rounds)
                walls = warm_walls(keys, lambda k: measure(targets[k], first, params, c, warmup=0, repeats=1).runs[0].wall_s,
                                   cold=c == levels[0])
                timed = [(len(first), walls[k]) for k in keys]
                full = lasting(requests_at(len(ps), waves, c), c, timed, pass_s)
                n = lasting(requests_at(len(ps), waves, c), c, timed, pass_s / split)
                planned = rounds_at(rounds, full, n)
                wave = requests_of(ps, n, params, mixed)
                for r in range(planned):
                    for k in round_order(specs_, r):
                        before = engine_steps(urls[k])
                        s = measure(targets[k], wave, params, c, warmup=0, repeats=1)
                        if s.errors:
                            raise RuntimeError(f"{k}, {w} at concurrency {c}: {s.errors[0]}")
                        by_size = pass_steps(before, engine_steps(urls[k]))
                        steps, short, empty = short_steps(by_size, c)
                        occupied = in_flight(s.runs[0], c)
                        steady = steady_tok_s(s.runs[0], c)
                        rows.append({"workload": w, "config": k, "concurrency": c, "round": r, "planned_rounds": planned,
                                     "tok_s": s.output_tokens_per_s, "steady_tok_s": steady, "tau": s.tau,
                                     "requests": len(wave),
                                     "wall_s": round(s.runs[0].wall_s, 2), "in_flight": round(occupied, 3),
                                     "steps": steps, "short_steps": short, "empty_places": empty,
                                     "steps_by_sequences": by_size})
                        if texts is not None:
                            texts[(w, k, c, r)] = s.runs[0].texts
                        print(f"  {w:<5} {k:<24} c={c:<3} r{r} {s.output_tokens_per_s:7.1f} tok/s  tau "
                              f"{s.tau or 0:.2f}  {len(wave)} requests, {s.runs[0].wall_s:.1f} s, in flight "
                              f"{occupied:.2f}, steady {steady or 0:.1f} tok/s; steps {steps}, {short} below the level "
                              f"({empty} places empty; at {c - 1}: {by_size.get(c - 1, 0)}, at {c - 2}: {by_size.get(c - 2, 0)})",
                              file=sys.stderr)
                if states is not None:
                    adaptive = next(x.key() for x in specs_ if x.adaptive)
                    try:
                        got = controller_state(urls[adaptive], c)
                    except (OSError, ValueError) as exc:  # a diagnostic: the measured rows stand without it
                        got = {"error": f"{type(exc).__name__}: {exc}"}
                    states[(w, c)] = got
                    print(f"  {w:<5} controller at batch {c}: {json.dumps(got)}", file=sys.stderr)
    return rows


def _by_round(rows: list[dict[str, Any]], w: str, k: str, c: int, field: str = "tok_s") -> dict[int, float | None]:
    return {r["round"]: r[field] for r in rows if (r["workload"], r["config"], r["concurrency"]) == (w, k, c)}


def _ratio(num: dict[int, float], den: dict[int, float]) -> list[float]:
    """The per-round ratios num/den, in round order."""
    return [num[r] / den[r] for r in sorted(num) if r in den]


def _interval(ratios: list[float]) -> tuple[float, list[float | None]]:
    """The geometric mean of `ratios`, rounded, with its 95% interval (None: one round)."""
    center, lo, hi, _, _ = log_interval(ratios)
    return round(center, 3), [None if x is None else round(x, 3) for x in (lo, hi)]


def pool(cells: list[dict[str, Any]]) -> None:
    """Each cell's two ratios of adaptive, pooled over its rounds as the study pools a configuration's
    pairs in its confirmation round (tuner.study.selection.clipped_mean, issue 39): each round's log
    held within CLIP_BANDS noise bands of the cell's median, the noise the spread of every cell's
    rounds about its own mean with each cell's furthest round left out (`spread_without_furthest`);
    the interval over the held rounds. A round where the host's speed stepped between two passes
    back to back (a ratio of 0.7 among rounds of 1.0) then weighs as a round at the band's edge, not
    as a third of a cell of six. Sets `adaptive_vs_best_static` and `adaptive_vs_off` (with `_ci`) to
    that pooling and keeps the plain geometric mean of every round beside them (`..._plain`), from
    each cell's `..._rounds`."""
    for key in ("adaptive_vs_best_static", "adaptive_vs_off"):
        scale = spread_without_furthest([c[key + "_rounds"] for c in cells])
        for c in cells:
            rs = c[key + "_rounds"]
            c[key + "_plain"], c[key + "_plain_ci"] = _interval(rs)
            # no cell of three rounds or more: no noise to hold them by, so the rounds stand as they read
            c[key], c[key + "_ci"] = _interval(held_in(rs, scale) if scale > 0 else rs)


def held_out_best(tok: dict[str, dict[int, float]], static: list[str]) -> dict[int, str]:
    """Per round, the static configuration of the highest geometric mean over the other rounds
    (`tok[k][r]`: configuration k's figure in round r; ties to the first of `static`): the chain
    that round's figures are judged against, chosen on figures independent of them (the module's
    docstring says why). Needs two rounds at least."""
    rounds = sorted(tok[static[0]])
    if len(rounds) < 2:
        raise ValueError("the best static is chosen on the other rounds: two rounds at least")
    return {r: max(static, key=lambda k: log_interval([tok[k][q] for q in rounds if q != r])[0]) for r in rounds}


def _cell(rows: list[dict[str, Any]], w: str, c: int, static: list[str], adaptive: str,
          field: str) -> dict[str, Any] | None:
    """One cell's figures on `field` (tok/s or steady tok/s): off, the best static configuration
    (each round's chosen on the other rounds, `held_out_best`: its figure is the geometric mean of
    the chosen chains' figures in the rounds they were chosen for; `best_static` names the chain
    chosen in most rounds, `best_static_by_round` every round's), adaptive, and adaptive's two
    ratios with their intervals; None where a round has no figure."""
    tok = {k: _by_round(rows, w, k, c, field) for k in ["off", *static, adaptive]}
    if any(v is None for got in tok.values() for v in got.values()):
        return None
    mean = {k: log_interval(list(v.values()))[0] for k, v in tok.items()}
    chosen = held_out_best(tok, static)
    judged = {r: tok[k][r] for r, k in chosen.items()}
    best = max(static, key=lambda k: (sum(v == k for v in chosen.values()), mean[k]))
    return {"off": round(mean["off"], 2), "best_static": best,
            "best_static_by_round": [chosen[r] for r in sorted(chosen)],
            "best_static_tok_s": round(log_interval(list(judged.values()))[0], 2),
            "adaptive_tok_s": round(mean[adaptive], 2),
            # the rounds' ratios; `pool` sets each cell's figures from them over the whole table
            "adaptive_vs_best_static_rounds": [round(x, 4) for x in _ratio(tok[adaptive], judged)],
            "adaptive_vs_off_rounds": [round(x, 4) for x in _ratio(tok[adaptive], tok["off"])]}


def compare(rows: list[dict[str, Any]], specs_: list[SpecConfig], workloads: list[str],
            levels: list[int]) -> list[dict[str, Any]]:
    """Per workload and level that finished two rounds at least, on the tok/s while the level was
    held (`steady_tok_s`, the module's docstring says why): off, the best static configuration (each
    round's chosen on the other rounds: `held_out_best`) and adaptive, the two ratios of adaptive with
    their intervals, and the three's mean requests in flight over the level (over whole passes);
    `whole_pass`: the same on each whole pass's tok/s, its drain included."""
    static = [s.key() for s in specs_ if s.method != "off" and not s.adaptive]
    adaptive = next(s.key() for s in specs_ if s.adaptive)
    out = []
    for w in workloads:
        for c in levels:
            # only the rounds every configuration finished (a run stopped early may end mid-round)
            done = set.intersection(*({r["round"] for r in rows if (r["workload"], r["config"], r["concurrency"]) ==
                                       (w, k, c)} for k in ["off", *static, adaptive]))
            if len(done) < 2:  # held_out_best chooses each round's best static on the others
                continue
            kept = [r for r in rows if r["round"] in done]
            held = _cell(kept, w, c, static, adaptive, "steady_tok_s")
            whole = _cell(kept, w, c, static, adaptive, "tok_s")
            # every measured pass streamed (a pass with errors stops the run), so each has its held span
            assert held is not None and whole is not None
            planned = max(r.get("planned_rounds", 0) for r in rows if (r["workload"], r["concurrency"]) == (w, c))
            out.append({"workload": w, "concurrency": c, "rounds": len(done), "planned_rounds": max(planned, len(done)),
                        **held,
                        "in_flight": {name: round(statistics.fmean(_by_round(rows, w, k, c, "in_flight").values()), 3)
                                      for name, k in (("off", "off"), ("best_static", held["best_static"]),
                                                      ("adaptive", adaptive))},
                        # per pass: the engine's steps, and those below the level with the places they left empty
                        "steps": {name: [round(statistics.fmean(_by_round(rows, w, k, c, f).values()), 1)
                                         for f in ("steps", "short_steps", "empty_places")]
                                  for name, k in (("off", "off"), ("best_static", held["best_static"]),
                                                  ("adaptive", adaptive))},
                        "whole_pass": whole})
    pool(out)
    pool([t["whole_pass"] for t in out])
    return out


def summary(table: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON's minima over the table's cells: adaptive against the best static and against off
    while the level was held (the goals' figures), and the same over whole passes (`min_whole_pass_`),
    each with its cell's interval; each pooled as the study pools (`pool`) and plainly (`..._plain`)."""
    out: dict[str, Any] = {}
    for prefix, cells in (("min_", table), ("min_whole_pass_", [t["whole_pass"] for t in table])):
        for key in ("adaptive_vs_best_static", "adaptive_vs_off"):
            for name in (key, key + "_plain"):
                worst = min(cells, key=lambda t: t[name])
                out[prefix + name], out[prefix + name + "_ci"] = worst[name], worst[name + "_ci"]
    return out


def greedy_differences(texts: dict[tuple[str, str, int, int], list[str]]) -> list[dict[str, Any]]:
    """Every pass whose answers differ from speculation off's in the same cell and round (T=0: a
    lossless engine answers as off does): workload, config, level, round and how many requests
    differ; never the texts (users' traffic stays private, and so do its answers)."""
    out = []
    for (w, k, c, r), got in sorted(texts.items()):
        ref = texts.get((w, "off", c, r))
        if k == "off" or ref is None:
            continue
        n = sum(a != b for a, b in zip(got, ref))
        if n:
            out.append({"workload": w, "config": k, "concurrency": c, "round": r, "requests": n, "of": len(ref)})
    return out


def _ci(lo_hi: list[float | None]) -> str:
    return "" if lo_hi[0] is None else f" [{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]"


# the settings that make runs the rounds of one command (`pooled_runs` checks them before pooling)
SAME = ("levels", "workloads", "depths", "method", "weights", "waves", "pass_s", "split", "mixed_lengths",
        "nice_servers", "prompts", "max_new_tokens")
GOALS = {"adaptive_vs_best_static": 0.97, "adaptive_vs_off": 1.0}  # issue 36's goals for the minima


def below_goal(table: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Per goal (GOALS), the cells ("workload level") whose 95% interval lies wholly below it: a
    shortfall the rounds' noise does not explain, where the minimum of the table's point figures
    may fall below a goal by noise alone (the lowest of 12 cells whose rounds spread a few percent
    reads a few percent under their typical value)."""
    return {key: [f"{t['workload']} {t['concurrency']}" for t in table
                  if t[key + "_ci"][1] is not None and t[key + "_ci"][1] < goal] for key, goal in GOALS.items()}


def pooled_runs(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The passes (`rows`) and greedy differences of several runs of one command (their JSON
    objects) as one run's: each run's rounds numbered after the runs' before it. A round is the
    same pairs of passes played back to back whichever run it came from, so a cell's ratios pool
    over the runs as over more rounds of one run. ValueError naming the first setting (SAME) in
    which a run differs from the first."""
    first = runs[0]
    for i, r in enumerate(runs[1:], 2):
        for k in SAME:
            if r.get(k) != first.get(k):
                raise ValueError(f"run {i}: {k}={r.get(k)!r} where run 1 has {first.get(k)!r}: only runs of one "
                                 f"command pool (they differ in none of {', '.join(SAME)})")
    rows: list[dict[str, Any]] = []
    differ: list[dict[str, Any]] = []
    for r in runs:
        offset = max((x["round"] for x in rows), default=-1) + 1
        rows += [{**x, "round": x["round"] + offset} for x in r["rows"]]
        differ += [{**d, "round": d["round"] + offset} for d in r.get("greedy_differences", [])]
    return rows, differ


def read_run(path: str) -> dict[str, Any]:
    """The JSON object a run printed last (its output saved to `path`, progress lines and all).
    ValueError where the file holds none."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--pool {path}: {exc.strerror}") from None
    for line in reversed(lines):
        if line.startswith("{") and '"rows"' in line:
            return json.loads(line)
    raise ValueError(f"--pool {path}: no run's JSON line in it (the last line of benchmarks/adaptive.py's output)")


def report(rows: list[dict[str, Any]], grid: list[SpecConfig], cfg: dict[str, Any], wall: float, load: float,
           differ: list[dict[str, Any]], controller: list[dict[str, Any]], runs: int = 1) -> int:
    """Print the table of `rows` (compare) and the JSON line: `cfg` (the settings SAME names, the rounds), the
    passes, the controller's states, the minima (summary) and the cells below a goal (below_goal)."""
    table = compare(rows, grid, cfg["workloads"], cfg["levels"])
    if not table:
        print("no cell finished two rounds (each round's best static is chosen on the others)", file=sys.stderr)
        return 1
    print(f"\nload average {load:.1f} at the start; {cfg['prompts']} prompts per workload, {cfg['max_new_tokens']} "
          f"new tokens, {cfg['weights']}, T=0, {cfg['rounds']} round(s) of max(prompts, {cfg['waves']} x level) "
          f"requests, whole waves more until a pass lasts {cfg['pass_s']:g} s"
          + (f" / {cfg['split']}, in as many more rounds as keep each cell's requests" if cfg["split"] > 1 else "")
          + (", answer budgets mixed (x0.5-1.5 in turn)" if cfg["mixed_lengths"] else "")
          + (f", servers niced {cfg['nice_servers']} below the load generator" if cfg["nice_servers"] else "")
          + (f"; the rounds of {runs} runs pooled" if runs > 1 else "")
          + f"; adaptive = {grid[-1].key()}; {wall:.0f} s")
    print(f"{'workload':<8} {'c':>3} {'off':>8} {'best static':>24} {'tok/s':>8} {'adaptive':>9} "
          f"{'vs static [95%]':>22} {'vs off [95%]':>22} {'plain: static [95%]':>22} {'off [95%]':>22} "
          f"{'in flight':>16}")
    for t in table:
        f = t["in_flight"]
        named = f"{t['best_static']} {t['best_static_by_round'].count(t['best_static'])}/{t['rounds']}"
        print(f"{t['workload']:<8} {t['concurrency']:>3} {t['off']:8.1f} {named:>24} "
              f"{t['best_static_tok_s']:8.1f} {t['adaptive_tok_s']:9.1f} "
              f"{t['adaptive_vs_best_static']:6.3f}x{_ci(t['adaptive_vs_best_static_ci']):<15} "
              f"{t['adaptive_vs_off']:6.3f}x{_ci(t['adaptive_vs_off_ci']):<15} "
              f"{t['adaptive_vs_best_static_plain']:6.3f}x{_ci(t['adaptive_vs_best_static_plain_ci']):<15} "
              f"{t['adaptive_vs_off_plain']:6.3f}x{_ci(t['adaptive_vs_off_plain_ci']):<15} "
              f"{f['off']:.2f}/{f['best_static']:.2f}/{f['adaptive']:.2f}"
              + (f"  ({t['rounds']} of {t['planned_rounds']} rounds)" if t["rounds"] < t["planned_rounds"] else ""))
    print("(output tok/s while the level was held: from the pass's start until the first client had no request "
          "left to send; geometric means over the rounds; best static: each round judged against the chain of the "
          "grid fastest over the other rounds (named: the one chosen in most rounds, with how many); "
          f"ratios: per-round ratios' geometric mean and 95% interval, each round's log held within {CLIP_BANDS:g} "
          "noise bands of the cell's median as the study's confirmation round pools (pool), and plain: every round "
          "as it read; in flight: mean requests in flight over the "
          "level over whole passes, off/best static/adaptive)")
    print("\nthe engine's steps per pass (means over the rounds): all of them / those that ran fewer sequences than the "
          "level / the places those left empty")
    for t in table:
        print(f"{t['workload']:<8} {t['concurrency']:>3} " + "   ".join(
            f"{name} {a:g} / {b:g} / {e:g}" for name, (a, b, e) in t["steps"].items()))
    print(f"greedy_identical: {not differ}" + "".join(
        f"\n  differs: {d['workload']} {d['config']} c={d['concurrency']} r{d['round']}: {d['requests']} of {d['of']}"
        for d in differ))
    print("\nwhole passes, the drain included (the clients running dry one by one after the last request was sent)")
    for t in table:
        h = t["whole_pass"]
        print(f"{t['workload']:<8} {t['concurrency']:>3} {h['off']:8.1f} {h['best_static']:>24} "
              f"{h['best_static_tok_s']:8.1f} {h['adaptive_tok_s']:9.1f} "
              f"{h['adaptive_vs_best_static']:6.3f}x{_ci(h['adaptive_vs_best_static_ci']):<15} "
              f"{h['adaptive_vs_off']:6.3f}x{_ci(h['adaptive_vs_off_ci']):<15} "
              f"{h['adaptive_vs_best_static_plain']:6.3f}x{_ci(h['adaptive_vs_best_static_plain_ci']):<15} "
              f"{h['adaptive_vs_off_plain']:6.3f}x{_ci(h['adaptive_vs_off_plain_ci']):<15}")
    goals = below_goal(table)
    print("\ncells whose 95% interval lies wholly below the goal: " + "; ".join(
        f"{key.replace('adaptive_vs_', 'vs ').replace('_', ' ')} ({GOALS[key]:g}): {', '.join(cells) or 'none'}"
        for key, cells in goals.items()))
    out = {**cfg, "runs": runs, "wall_s": round(wall), "load_average": round(load, 2), "table": table,
           "greedy_identical": not differ, "greedy_differences": differ, "rows": rows, "controller": controller,
           **summary(table), "below_goal": goals}
    print(json.dumps(out))
    return 0


def pool_outputs(paths: list[str]) -> int:
    """--pool: the table and JSON of the runs saved in `paths` (read_run), pooled (pooled_runs); 2
    with one line where a file holds no run or the runs are not of one command."""
    try:
        runs = [read_run(p) for p in paths]
        rows, differ = pooled_runs(runs)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    first = runs[0]
    settings = {k: first[k] for k in SAME} | {"rounds": sum(r["rounds"] for r in runs)}
    grid = specs(first["method"], first["depths"])
    return report(rows, grid, settings, sum(r["wall_s"] for r in runs), max(r["load_average"] for r in runs), differ,
                  [c for r in runs for c in r["controller"]], runs=len(runs))


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,2,4,8,16,32")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per workload (a level plays max(prompts, N))")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--depths", default="2,4,8", help="the static grid's chain depths; the deepest bounds adaptive")
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix"], help="a drafter that needs no head")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell, alternating the order")
    ap.add_argument("--weights", default="fp32", choices=["fp32", "bf16", "auto"],
                    help="every server's weights (auto resolves per max_batch: the levels would change the format)")
    ap.add_argument("--waves", type=int, default=2,
                    help="a level of N plays max(prompts, waves x N) requests, N in flight until the last wave")
    ap.add_argument("--pass-s", type=float, default=4.0,
                    help="each pass plays whole waves more until it lasts about this long (its cell's warm-up says)")
    ap.add_argument("--mixed-lengths", action="store_true",
                    help="each request's max-new-tokens x 0.5, 0.75, 1, 1.25, 1.5 in turn, the same for every "
                         "configuration (requests_of): answers that end apart, as served traffic's do")
    ap.add_argument("--nice-servers", type=int, default=0, metavar="N",
                    help="run every server N steps of CPU priority below the load generator (0-19): on a host "
                         "where both share the cores, a client whose request ended waits for no server's forward "
                         "before it sends its next (reported beside the default, never instead)")
    ap.add_argument("--split", type=int, default=1,
                    help="passes of pass-s / split in as many more rounds as keep each cell's requests (rounds_at)")
    ap.add_argument("--pool", nargs="+", default=[], metavar="OUTPUT",
                    help="measure nothing: the table and JSON of the saved outputs of earlier runs of one command, "
                         "their rounds pooled as one run's (pooled_runs)")
    args = ap.parse_args(argv)
    if args.pool:
        return pool_outputs(args.pool)
    try:
        levels = sorted({int(x) for x in args.levels.split(",") if x})
        depths = sorted({int(x) for x in args.depths.split(",") if x})
    except ValueError:
        print(f"--levels={args.levels} / --depths={args.depths}: comma-separated integers", file=sys.stderr)
        return 2
    workloads = [w for w in args.workloads.split(",") if w]
    if not levels or levels[0] < 1 or not depths or depths[0] < 1 or depths[-1] > 16:
        print("--levels: each >= 1; --depths: each in 1..16", file=sys.stderr)
        return 2
    if bad := [w for w in workloads if w not in WORKLOADS]:
        print(f"--workloads: {bad[0]} is not allowed (allowed: {', '.join(WORKLOADS)})", file=sys.stderr)
        return 2
    if args.prompts < 1 or args.max_new_tokens < 1 or args.waves < 1:
        print("--prompts, --max-new-tokens and --waves must be >= 1", file=sys.stderr)
        return 2
    if args.rounds < 2:
        print(f"--rounds={args.rounds}: must be >= 2 (each round's best static is chosen on the other rounds)",
              file=sys.stderr)
        return 2
    if args.split < 1:
        print(f"--split={args.split}: must be >= 1 (1: passes of --pass-s)", file=sys.stderr)
        return 2
    if not 0 <= args.nice_servers <= 19:
        print(f"--nice-servers={args.nice_servers}: must be in 0..19 (a niceness)", file=sys.stderr)
        return 2
    if args.pass_s < 0:
        print(f"--pass-s={args.pass_s}: must be >= 0 (0: passes of requests_at alone)", file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    grid = specs(args.method, depths)
    texts: dict[tuple[str, str, int, int], list[str]] = {}
    began = time.monotonic()
    states: dict[tuple[str, int], dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    # a time limit's SIGTERM (or Ctrl-C) stops the measuring and the servers, and the table and JSON
    # hold the cells whose rounds every configuration finished, not nothing
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        run(grid, workloads, levels, args.prompts, args.max_new_tokens, args.rounds, args.waves, texts, states, rows,
            args.weights, args.pass_s, args.split, args.mixed_lengths, args.nice_servers)
    except KeyboardInterrupt:
        print(f"\nstopped early: {len(rows)} passes measured; the table and JSON hold the finished rounds",
              file=sys.stderr)
    wall = time.monotonic() - began
    # the settings SAME names, as parsed (what pooling later checks), and the rounds
    settings = {k: getattr(args, k) for k in SAME} | {"levels": levels, "workloads": workloads, "depths": depths,
                                                      "rounds": args.rounds}
    return report(rows, grid, settings, wall, load, greedy_differences(texts),
                  [{"workload": w, "concurrency": c, **st} for (w, c), st in states.items()])


if __name__ == "__main__":
    sys.exit(main())
