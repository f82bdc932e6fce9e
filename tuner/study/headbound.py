"""Whether a trained head could win on this machine, decided before its full answers and training.

A head's answers and training take minutes. Cheaper measurements come first.

1. The step (seconds): the built-in engine runs a few steps with an untrained head of the trained
   head's shape (engine.drafters.untrained_drafter: its drafts are rejected, and a step costs what
   the trained head's costs) as chains of every searched depth and two wide trees, interleaved with
   steps of speculation off, on the first tuning prompt, one request alone (where speculation gains
   most), in `ROUNDS` rounds; each configuration's fastest step counts, and its drafting and its
   verification apart. A chain of depth d commits at most min(d + 1, tau) tokens a step for a head
   whose acceptance is at most tau (item 2), and a tree of the same depth costs at least what the
   chain costs, so

       bound = max over depths d of  min(d + 1, tau) x (step off) / (step of the chain d)

   When even that is below 1.0, no head of that shape can beat speculation off here. Below the
   published tau only the chains up to depth ceil(tau - 1) are timed (`bound_depths`): a deeper one
   commits no more and costs no less; the pilot, when it runs, has every depth and the trees timed.

2. The budget, before any step (no measurement): the generous published tau (`PUBLISHED_TAU`) comes
   from heads trained on far more data than a config's training budget holds (published runs:
   hundreds of thousands of samples; the default here: at most 160 answers of 128 tokens).
   `TAU_BY_TOKENS` holds the held-out tau measured for heads of this recipe against their answer
   tokens; `budget_tau` reads it at the tokens the config trains on at most (`budget_tokens`), grows
   its gain by `BUDGET_MARGIN`, and keeps the published tau where the table does not speak (another
   family, more tokens or epochs than it measured). The bound at that tau over every searched depth
   (`ceiling`) must clear the rival (item 4) for the pilot to run: where a head's draft step
   costs a large share of a target step (the 2-core AVX2 EPYC, docs/results.md), a default budget's
   tau cannot pay for it, and the pilot's minutes of answers and training would decide what these
   seconds do.

3. The pilot, when that ceiling clears the rival: a head trained by the same recipe (train.epochs over its data) on
   `PILOT_SHARE` of the prompts, its acceptance measured on answers it did not see (`PILOT_EVAL` of
   its prompts; engine.heads.evaluate): per depth, a chain's, and how often each node of its top-k
   tree (the widest searched top-k) holds the target's token. The full budget's head is taken to
   reach at most `GROWTH` times the pilot's figure (on its one-sided upper confidence bound) at
   every depth and node. That bounds each shape's tau: a chain of depth d, 1 + the bounded
   acceptances of depths 1..d; a tree of b nodes, 1 + the b - 1 largest bounded node shares within
   its depth (never more than b). A draft's step costs at least its depth's chain step, and a tree's
   at least that chain's drafting plus the verification of the most tokens measured within b:

       bound = max over chains and trees of  tau x (step off) / (least step)

   `GROWTH` is set well above the ratio of the full head's acceptance to the pilot's measured in
   docs/results.md (benchmarks/head_pilot.py), so a head that would have won is not dropped.

4. The rival: a head wins only by beating what the study measures without it, so the n-gram chain
   every study measures (tuner.search.space.NGRAM_CHAIN_DEFAULT) is timed against off on the trials'
   prompts in `REFERENCE_ROUNDS` interleaved rounds, and its lowest round that another round confirms
   (`reference_figure`: within `REFERENCE_BANDS` noise bands; rounds are added, up to
   `REFERENCE_ROUNDS_MAX`, until two agree), when above 1.0, is the rival; within a round off and the
   chain alternate prompt by prompt. A bound must clear the rival's one-sided upper confidence bound
   (its agreeing rounds' geometric mean + `Z` standard errors, their spread never taken below the
   study's noise figure: `rival_upper`) by one noise band for the bound's own noise (`to_beat`): a
   bound is the best a full head could reach, and one within the noise of the rival would at best tie
   a chain that needs no training (on the 2-core AVX2 EPYC the pilot's bound and the rival read 1.47x / 1.40x, 1.48x /
   1.56x and 1.18x / 1.49x in three runs, while a full head measured 0.39-0.70x there). One
   round's load spike once read the chain at 0.36x against ~1.5x and had the full head trained
   (answers and training, ~7 minutes) on a machine where it could not win. The rival is measured
   before the pilot: when even the budget's ceiling cannot reach it, the pilot's answers and training
   are not needed to decide (and when that ceiling is below off's bar, neither are the rival's rounds).

When the last bound falls short the study leaves the method out, prints one line with the figures
and records them (best.yaml `head_bounds`); at or above it, the head is trained as before (the
pilot's answers and steps are then the price of the decision). The decision is kept beside the
head's cache entry, so later runs with that cache (a resumed study too) search the same space
without measuring again.

Never for a head the user gave or pinned (spec.head_path, spec.method, a search of head methods
alone, search.head_bound=false), nor for a study other machines share (search.storage set: every
worker must search one space): those train as before.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.schema.config import Config, HeadBound, HeadPilot, SpecConfig
from tuner.schema.methods import method as method_info

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.api import SamplingParams
    from engine.decode.loop import Engine
    from engine.heads.pipeline import TrainJob
    from engine.heads.schedule import Report

# The highest published mean accepted length of each head family, greedy (EAGLE-3 paper, Table 1:
# EAGLE-2 on HumanEval with Vicuna-13B 5.41; EAGLE-3 on HumanEval with Vicuna-13B 7.54).
PUBLISHED_TAU = {"eagle": 5.41, "eagle3": 7.54}
# Held-out tau of EAGLE heads trained by this recipe (train.epochs 7) on this many answer tokens of the
# packaged SmolLM2, at their best measured shape (a 16-node tree), greedy, on the code workload's held-out
# prompts (docs/results.md, "Issue 39's head decision"); acceptance grows about log-linearly with the
# training tokens (Scylla, arXiv 2505.07858), so between the rows tau is read on log tokens.
TAU_BY_TOKENS = {"eagle": ((5_067, 1.45), (19_565, 1.70), (81_970, 2.12))}
TABLE_EPOCHS = 7.0  # the table's heads' passes over their data: a config that trains longer is not bounded by it
# A budget's head is taken to gain at most this times the table's tau - 1: more than the table's next
# fourfold of data gave, for another target, the shape searched and the run-to-run spread of one measurement
BUDGET_MARGIN = 2.0
STEPS = 16  # generated tokens per timed run: every step of an untrained head commits one
ROUNDS = 2  # (off, drafts...) rounds; each configuration's fastest step counts
EVAL_DEPTH = 5  # the depths the pilot's acceptance is measured at (engine.heads.evaluate.EVAL_DEPTH)
REFERENCE_ROUNDS = 2  # (off, reference) rounds on the trials' prompts; the lowest confirmed ratio counts
REFERENCE_ROUNDS_MAX = 4  # rounds at most while no two agree (then the lowest counts, as before)
REFERENCE_BANDS = 3  # two rounds agree within this many search.noise_rel bands (the trials' outlier rule)
PILOT_SHARE = 0.25  # of train.prompts answered for the pilot
PILOT_EVAL = 0.25  # of the pilot's prompts held back: its acceptance is measured on their answers
PILOT_MIN_PROMPTS = 8  # a pilot of fewer would measure its acceptance on one or two answers
GROWTH = 2.0  # the full budget's acceptance at any depth is at most this times the pilot's (docs/results.md)
Z = 2.0  # one-sided upper confidence bounds: mean + Z standard errors (a pilot's acceptance, Wilson; the rival)
NODES = 64  # the pilot's most often accepted tree nodes kept (engine.heads.evaluate.chain_acceptance)
BOUND_FILE = "bound.json"


def probed_methods(cfg: Config) -> list[str]:
    """The head methods whose bound is measured before training: searched beside a training-free
    method, not pinned by the user, in a study that lives on this machine."""
    if not cfg.search.head_bound or cfg.search.storage is not None:
        return []
    methods = [m for m in cfg.search.methods if m != "off"]
    if not any(method_info(m).training_free for m in methods):
        return []  # the user searches heads alone: train them
    return [m for m in methods if m in PUBLISHED_TAU and cfg.spec.method != m]


def bound_path(head_dir: Path) -> Path:
    """Where the decision for the head that would live in `head_dir` is kept."""
    return head_dir.parent / f"{head_dir.name}.{BOUND_FILE}"


def searched_depths(cfg: Config) -> list[int]:
    """Every chain depth the space holds (search.depth within budget_max): each one's step is timed."""
    top = max(cfg.search.depth.min, min(cfg.search.depth.max, cfg.search.budget_max - 1))
    return list(range(cfg.search.depth.min, top + 1))


def timed_depths(cfg: Config) -> list[int]:
    """The chain depths whose steps are timed: the searched ones up to EVAL_DEPTH (where the pilot's
    acceptance is measured), and the deepest; a depth between takes the step of the deepest timed
    chain within it (a deeper chain never costs less)."""
    depths = searched_depths(cfg)
    return [d for d in depths if d <= EVAL_DEPTH] + [d for d in depths[-1:] if d > EVAL_DEPTH]


def wide_trees(cfg: Config, method: str) -> list[SpecConfig]:
    """Untrained trees timed for what verifying many tokens costs (the chains cover budgets up to the
    deepest chain's): the widest searched top-k at budgets from a few above the chains' to the
    largest, each at the shallowest depth that holds it within search.depth."""
    k, top = max(cfg.search.topk), searched_depths(cfg)[-1]
    if k == 1:
        return []
    out = []
    for budget in sorted({min(cfg.search.budget_max, top + 4), cfg.search.budget_max}):
        depth = max(cfg.search.depth.min, math.ceil((budget - 1) / k))
        if budget > top + 1 and depth <= cfg.search.depth.max:
            out.append(SpecConfig(method=method, depth=depth, topk=k, budget=budget))
    return out


def bound_depths(cfg: Config, tau: float) -> list[int]:
    """The chain depths whose steps can bound a head at `tau`: every timed one (timed_depths) at the
    published tau; below it those up to the first that commits tau (depth ceil(tau - 1)), since a
    deeper chain commits no more and never costs less (the shallowest timed one at least)."""
    depths = timed_depths(cfg)
    return depths if tau >= max(PUBLISHED_TAU.values()) else ([d for d in depths if d <= math.ceil(tau - 1)]
                                                              or depths[:1])


def measure_bound(cfg: Config, engine: Engine, method: str, tau: float | None = None) -> HeadBound:
    """Time speculation off and chains of an untrained `method` head, interleaved, with each step's
    drafting and verification apart; the bound at `tau`. At the published tau (the default) the chains
    of every timed depth and two wide trees, what the pilot's bounds read; below it the chains of
    bound_depths alone (a budget's ceiling needs no more)."""
    from engine.drafters import untrained_drafter
    from engine.measure.workloads import encode, sampling_params
    from tuner.projection.profiling import tuning_prompts

    tau = PUBLISHED_TAU[method] if tau is None else tau
    full = tau >= PUBLISHED_TAU[method]
    prompt = tuning_prompts(cfg, n=1)[0]
    ids = encode(engine, prompt, cfg.workload.chat_template)
    params = replace(sampling_params(cfg.workload, seed=cfg.seed), max_new_tokens=STEPS, temperature=0.0)
    off = SpecConfig(method="off")
    depths = timed_depths(cfg) if full else bound_depths(cfg, tau)
    chains = [SpecConfig(method=method, depth=d, topk=1, budget=d + 1) for d in depths]
    drafts = [*chains, *(wide_trees(cfg, method) if full else [])]
    drafters = {c.key(): untrained_drafter(c, engine.target, cfg.train.draft_vocab, cfg.seed) for c in drafts}

    def step_s(spec: SpecConfig, run: SamplingParams) -> tuple[float, float, float]:
        """(step, its drafting, its verification) in seconds, decode steps only (the prefill excluded)."""
        if spec.method == "off":
            engine.set_spec(spec)
        else:
            engine.set_drafter(drafters[spec.key()], spec)
        s = engine.generate(ids, run).stats
        n = max(s.target_forwards - 1, 1)
        return (s.total_s - s.ttft_s) / n, s.draft_s / n, max(s.verify_s - s.ttft_s, 0.0) / n

    best: dict[str, tuple[float, float, float]] = {}
    warm = replace(params, max_new_tokens=4)
    for spec in [off, *drafts]:  # a short warm-up each: the head's first steps build its buffers
        step_s(spec, warm)
    for _ in range(ROUNDS):
        for spec in [off, *drafts]:
            got = step_s(spec, params)
            old = best.get(spec.key(), (math.inf,) * 3)
            best[spec.key()] = (min(old[0], got[0]), min(old[1], got[1]), min(old[2], got[2]))
    engine.set_spec(off)
    off_s = best[off.key()][0]
    points = {c.key(): round(min(c.depth + 1, tau) * off_s / best[c.key()][0], 3) for c in chains}
    ms = {c.key(): tuple(round(x * 1e3, 3) for x in best[c.key()]) for c in drafts}
    return HeadBound(method=method, tau=tau, off_step_ms=round(off_s * 1e3, 3),
                     step_ms={k: v[0] for k, v in ms.items()}, draft_ms={k: v[1] for k, v in ms.items()},
                     verify_ms={k: v[2] for k, v in ms.items()},
                     bounds=points, bound=max(points.values()), trained=max(points.values()) >= 1.0)


def reference_spec(cfg: Config) -> SpecConfig | None:
    """The training-free chain every study of cfg measures (tuner.search.space.NGRAM_CHAIN_DEFAULT,
    within the searched depths), or None when n-gram is not searched."""
    from tuner.search.space import NGRAM_CHAIN_DEFAULT

    if "ngram" not in cfg.search.methods:
        return None
    d = min(max(NGRAM_CHAIN_DEFAULT[0], searched_depths(cfg)[0]), searched_depths(cfg)[-1])
    return SpecConfig(method="ngram", depth=d, topk=1, budget=d + 1)


def reference_figure(ratios: list[float], band: float) -> float | None:
    """The reference's figure from its rounds' speedups: the lowest round that another round confirms
    (the other within a factor 1 + `band` above it), read low as before but never on one round that
    no other round repeats (a pass slowed by a load spike); None while no two rounds agree."""
    ranked = sorted(ratios)
    for low, high in zip(ranked, ranked[1:]):
        if high <= low * (1 + band):
            return low
    return None


def measure_reference(cfg: Config, engine: Engine) -> list[float] | None:
    """The reference chain's speedup over off on the trials' prompts, one request at a time, one
    interleaved round after another (within a round off and the chain alternate prompt by prompt):
    REFERENCE_ROUNDS rounds, then more while no two agree
    (reference_figure), REFERENCE_ROUNDS_MAX at most; every round's ratio (None without a reference)."""
    from engine.measure.workloads import encode, sampling_params
    from tuner.projection.profiling import tuning_prompts

    ref = reference_spec(cfg)
    if ref is None:
        return None
    prompts = [encode(engine, p, cfg.workload.chat_template) for p in tuning_prompts(cfg)]
    params = replace(sampling_params(cfg.workload, seed=cfg.seed), temperature=0.0)

    def decode(spec: SpecConfig, ids: list[int], run: SamplingParams = params) -> tuple[float, int]:
        """(decode seconds, decoded tokens) of one prompt (its prefill excluded)."""
        engine.set_spec(spec)
        s = engine.generate(ids, run).stats
        return s.total_s - s.ttft_s, s.new_tokens - 1

    off = SpecConfig(method="off")
    for spec in (off, ref):  # a short untimed pass each: the first steps' one-time costs
        for ids in prompts:
            decode(spec, ids, replace(params, max_new_tokens=4))
    band = REFERENCE_BANDS * cfg.search.noise_rel
    ratios: list[float] = []
    while len(ratios) < REFERENCE_ROUNDS or (reference_figure(ratios, band) is None
                                             and len(ratios) < REFERENCE_ROUNDS_MAX):
        seconds, tokens = {off.key(): 0.0, ref.key(): 0.0}, {off.key(): 0, ref.key(): 0}
        for ids in prompts:  # off and the chain prompt by prompt: a drift of the machine's speed falls on both
            for spec in (off, ref):
                s, n = decode(spec, ids)
                seconds[spec.key()] += s
                tokens[spec.key()] += n
        per_token = {k: seconds[k] / max(tokens[k], 1) for k in seconds}
        ratios.append(round(per_token[off.key()] / per_token[ref.key()], 3))
    engine.set_spec(off)
    return ratios


def reference_of(cfg: Config, ratios: list[float] | None) -> float | None:
    """The figure a head must beat from the reference's rounds: the lowest confirmed round
    (reference_figure), or the lowest round when none agree within REFERENCE_ROUNDS_MAX."""
    if not ratios:
        return None
    got = reference_figure(ratios, REFERENCE_BANDS * cfg.search.noise_rel)
    return round(min(ratios) if got is None else got, 3)


def rival_upper(cfg: Config, ratios: list[float] | None) -> tuple[float, float] | None:
    """(upper, spread) of the rival from its rounds' speedups, or None without a figure (reference_of): the
    one-sided upper confidence bound of the geometric mean of the rounds that agree with its figure (within
    REFERENCE_BANDS bands), exp(mean log + Z x spread / sqrt(n)), where the spread is their standard
    deviation on logs, never below the study's noise figure log(1 + search.noise_rel): rounds that agree by
    chance do not make the rival exact, and a single round (none agree) gets that figure's band."""
    figure = reference_of(cfg, ratios)
    if not ratios or figure is None:
        return None
    band = REFERENCE_BANDS * cfg.search.noise_rel
    logs = [math.log(r) for r in ratios if figure <= r <= figure * (1 + band)]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)) if len(logs) > 1 else 0.0
    spread = max(sd, math.log1p(cfg.search.noise_rel))
    return round(math.exp(mean + Z * spread / math.sqrt(len(logs))), 3), round(spread, 4)


def to_beat(cfg: Config, ratios: list[float] | None) -> float:
    """What a head's bound must reach to be trained: the rival's upper confidence bound (rival_upper), or
    speculation off's 1.0 when higher, grown by one noise band (search.noise_rel) for the bound's own
    noise. A bound is the most a full head could reach, so one within the rival's noise would at best tie
    a chain that needs no training (the module's docstring, item 4); and a bar read on the rival's upper
    bound, not on one of its rounds, does not fall when both quick rounds happen to read it low."""
    up = rival_upper(cfg, ratios)
    return round(max(1.0, up[0] if up is not None else 1.0) * (1 + cfg.search.noise_rel), 3)


def budget_tokens(cfg: Config) -> int:
    """The answer tokens the config's head trains on at most: every answer at train.max_new_tokens, and
    the fixed text (read before any answer exists, so the budget, not the data)."""
    t = cfg.train
    return t.prompts * t.answers_per_prompt * t.max_new_tokens + t.fixed_text_tokens


def budget_tau(cfg: Config, method: str) -> float:
    """The most tau a head of `method` trained on the config's budget reaches: 1 + BUDGET_MARGIN x (the
    measured table's tau at budget_tokens - 1), read on log tokens between the rows (below the first, the
    first's), never above the published tau. The published tau where the table does not speak: a family
    it did not measure, a budget beyond its largest row (published runs train on far more), more epochs."""
    table = TAU_BY_TOKENS.get(method)
    tokens = budget_tokens(cfg)
    published = PUBLISHED_TAU[method]
    if table is None or tokens > table[-1][0] or cfg.train.epochs > TABLE_EPOCHS:
        return published
    tau = table[0][1]
    for (n0, t0), (n1, t1) in zip(table, table[1:]):
        if n0 < tokens <= n1:
            tau = t0 + (t1 - t0) * math.log(tokens / n0) / math.log(n1 / n0)
    return round(min(published, 1 + BUDGET_MARGIN * (tau - 1)), 3)


def ceiling(cfg: Config, bound: HeadBound, tau: float | None = None) -> float:
    """The most any searched draft of the head could reach at `tau` (the published tau by default): a
    draft of depth d commits at most min(d + 1, tau) tokens a step and costs at least the step of the
    deepest timed chain within d (a tree at least its depth's chain), over every searched depth, not only
    the timed ones (at eagle3's tau 7.54 an untimed depth 6 or 7 commits more than depth 5)."""
    tau = bound.tau if tau is None else tau
    timed = {_shape(k)[0]: ms for k, ms in bound.step_ms.items() if _shape(k)[1] == 1}
    best = 0.0
    for d in searched_depths(cfg):
        within = [t for t in timed if t <= d]
        step = timed[max(within)] if within else min(timed.values())
        best = max(best, min(d + 1, tau) * bound.off_step_ms / step)
    return round(best, 3)


def upper(p: float, n: int, z: float = Z) -> float:
    """The one-sided upper confidence bound (Wilson score) on a proportion `p` measured on `n` trials."""
    if n <= 0:
        return 1.0
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


def bounded_acceptance(measured: list[float], positions: int, growth: float) -> list[float]:
    """The full budget's acceptance per depth at most: `growth` x the upper confidence bound of the
    pilot's, at most 1 and never above the shallower depth's (a deeper draft is accepted only after
    every shallower one)."""
    out, last = [], 1.0
    for p in measured:
        last = min(last, growth * upper(p, positions))
        out.append(round(last, 4))
    return out


def _shape(key: str) -> tuple[int, int, int]:
    """(depth, topk, budget) of a spec key ("eagle d4 k1 b5")."""
    got = re.search(r" d(\d+) k(\d+) b(\d+)", key)
    if got is None:
        raise ValueError(f"not a draft's spec key: {key}")
    d, k, b = (int(x) for x in got.groups())
    return d, k, b


def node_shares(nodes: list[list[int]], positions: int, growth: float, budget_max: int, depth_max: int,
                listed_max: int) -> list[tuple[int, float]]:
    """(depth, bounded share) of the tree nodes a full-budget head could accept: each listed node's
    share of the pilot's positions at most `growth` x its upper confidence bound; as many nodes
    never seen (or beyond the listed ones) as a tree can hold, at the bound of the least listed
    share, eligible at every depth; beyond the measured depth, each deepest node once more per
    level (the shares of a node's children sum to at most its own)."""
    def bounded(count: float) -> float:
        return min(1.0, growth * upper(count / positions, positions))

    out = [(d, bounded(c)) for d, c in nodes]
    floor = min((c for _, c in nodes), default=0) if len(nodes) >= listed_max else 0
    out += [(1, bounded(floor))] * (budget_max - 1)
    deepest = max((d for d, _ in nodes), default=0)
    out += [(deepest + k, bounded(c)) for k in range(1, depth_max - deepest + 1) for d, c in nodes if d == deepest]
    return out


def tree_tau(shares: list[tuple[int, float]], depth: int, budget: int) -> float:
    """The most a tree of `budget` nodes (root included) no deeper than `depth` accepts a step: 1 + the
    budget - 1 largest shares of nodes within that depth, and at most `budget`."""
    within = sorted((x for d, x in shares if d <= depth), reverse=True)[:budget - 1]
    return min(float(budget), 1 + sum(within))


def pilot_bounds(cfg: Config, bound: HeadBound, acceptance: list[float],
                 shares: list[tuple[int, float]] | None) -> tuple[dict[str, float], dict[str, float]]:
    """(tau, bound) of chains per searched depth ("d<depth>") and, with `shares` (trees searched), of
    the best tree per depth ("d<depth> b<budget>").

    A chain of depth d: tau 1 + the bounded acceptance of depths 1..d (beyond the measured depths the
    deepest one's again: it never rises with depth), over its measured step. A tree of depth d and
    budget b: tree_tau over the least its step can cost, the larger of its depth's chain step and
    that chain's drafting plus the verification of the most tokens measured within b (a tree drafts
    at least what the chain drafts, and verifying more tokens never costs less)."""
    shapes = {k: _shape(k) for k in bound.step_ms}
    timed = {d: k for k, (d, t, _) in shapes.items() if t == 1}
    chain = {d: timed[max([t for t in timed if t <= d], default=min(timed))] for d in searched_depths(cfg)}
    taus, points = {}, {}
    for d in searched_depths(cfg):
        acc = [acceptance[min(j, len(acceptance) - 1)] for j in range(d)] if acceptance else [0.0] * d
        tau = 1 + sum(acc)
        taus[f"d{d}"] = round(tau, 3)
        points[f"d{d}"] = round(tau * bound.off_step_ms / bound.step_ms[chain[d]], 3)
        if shares is None:
            continue
        best: tuple[float, int, float] | None = None
        for b in range(d + 1, min(cfg.search.budget_max, 1 + d * max(cfg.search.topk)) + 1):
            verify = max((bound.verify_ms.get(k, 0.0) for k, (_, _, kb) in shapes.items() if kb <= b), default=0.0)
            step = max(bound.step_ms[chain[d]], bound.draft_ms.get(chain[d], 0.0) + verify)
            t = tree_tau(shares, d, b)
            x = t * bound.off_step_ms / step
            if best is None or x > best[0]:
                best = (x, b, t)
        if best is not None:
            taus[f"d{d} b{best[1]}"] = round(best[2], 3)
            points[f"d{d} b{best[1]}"] = round(best[0], 3)
    return taus, points


def pilot_job(job: TrainJob) -> TrainJob:
    """The full training job on PILOT_SHARE of its prompts, PILOT_EVAL of them held back, answered in
    one batch when a second would hold at most a quarter of train.gen_batch."""
    n = max(PILOT_MIN_PROMPTS, round(job.train.prompts * PILOT_SHARE))
    gen = job.train.gen_batch
    # a short last batch runs as many steps as a full one for a few rows: the default pilot's 32 + 8
    # answers spent 14-18 s of its 68-190 s on the 8 (2-core EPYC); one batch of 40 reads the weights once a step
    if n <= gen + gen // 4:
        gen = max(gen, n)
    update = {"prompts": n, "eval_fraction": PILOT_EVAL, "gen_batch": gen}
    return replace(job, train=job.train.model_copy(update=update))


def measure_pilot(cfg: Config, engine: Engine, method: str, job: TrainJob, report: Report | None = None) -> dict:
    """Train the pilot head of `method` for the full training `job` and measure its acceptance on its
    held-back answers: the trainer's summary (engine.heads.pipeline.train_eagle_head) with `seconds`
    and `prompts` added."""
    import shutil
    import time

    from engine.heads.pipeline import build_data, head_aux_layers, head_dir, train_eagle_head
    from tuner.schema.compose import packaged_workloads

    t0 = time.monotonic()
    pilot = pilot_job(job)
    full = head_dir(job, method)
    work = full.parent / f".{full.name}.pilot"  # its checkpoints, removed once measured
    data = build_data(pilot, engine, packaged_workloads(cfg), report, head_aux_layers(engine, method))
    _, summary = train_eagle_head(engine, data, pilot.train, method, work, report, max(cfg.search.topk), NODES)
    shutil.rmtree(work, ignore_errors=True)
    return {**summary, "prompts": pilot.train.prompts, "seconds": round(time.monotonic() - t0, 1)}


def with_pilot(cfg: Config, bound: HeadBound, summary: dict, rounds: list[float] | None = None) -> HeadBound:
    """`bound` with the pilot's figures (`summary`: measure_pilot's) and the decision they give: the
    head is trained when its best bound reaches what to_beat makes of the reference's `rounds`."""
    topk = max(cfg.search.topk)
    chain = list(summary["acceptance_per_depth"])
    tree = list(summary.get("acceptance_topk_per_depth", chain)) if topk > 1 else chain
    n = int(summary["eval_positions"])
    nodes = [list(x) for x in summary.get("tree_nodes", [])]
    shares = (node_shares(nodes, n, GROWTH, cfg.search.budget_max, searched_depths(cfg)[-1], NODES)
              if topk > 1 else None)
    taus, points = pilot_bounds(cfg, bound, bounded_acceptance(chain, n, GROWTH), shares)
    beat = to_beat(cfg, rounds)
    pilot = HeadPilot(prompts=int(summary["prompts"]), steps=int(summary["steps"]), positions=n, acceptance=chain,
                      topk=topk, tree_acceptance=tree,
                      tree_nodes=[round(c / max(n, 1), 4) for _, c in nodes[:8]], growth=GROWTH, tau=taus,
                      bounds=points, bound=max(points.values()), beat=beat, seconds=float(summary["seconds"]))
    return bound.model_copy(update={"pilot": pilot, "trained": pilot.bound >= beat,
                                    **with_reference(cfg, reference_of(cfg, rounds), rounds)})


def with_reference(cfg: Config, reference: float | None, rounds: list[float] | None = None) -> dict:
    """HeadBound's reference fields."""
    out: dict = {"reference_speedup": reference, "reference": None if reference is None else reference_key(cfg)}
    if rounds is not None:
        out["reference_rounds"] = rounds
    if (up := rival_upper(cfg, rounds)) is not None:
        out["reference_upper"], out["reference_spread"] = up
    return out


def reference_key(cfg: Config) -> str | None:
    """The reference chain's spec key, or None."""
    ref = reference_spec(cfg)
    return None if ref is None else ref.key()


def describe(b: HeadBound) -> str:
    """One line: what was measured and what follows from it."""
    pts = ", ".join(f"{k.split(' k')[0].split(' ')[1]} {b.step_ms[k]:.0f} ms -> {v:.2f}x" for k, v in b.bounds.items())
    def source(tau: float) -> str:
        return ("published" if tau >= PUBLISHED_TAU.get(b.method, 0.0)
                else f"this training budget's most: the measured table, {BUDGET_MARGIN:g}x its gain")

    head = f"{b.method} head bound: speculation off {b.off_step_ms:.0f} ms a step"
    if b.budget_tau is not None:
        head += (f"; a head trained on at most {b.budget_tokens} answer tokens reaches tau <= {b.budget_tau:g} "
                 f"({source(b.budget_tau)})")
    head += (f"; an untrained head's chains at " + ("that tau" if b.tau == b.budget_tau else f"tau <= {b.tau:g} "
             f"({source(b.tau)})") + f": {pts}; best {b.bound:.2f}x")
    if b.ceiling is not None:
        head += f"; every searched draft at this budget's tau at most {b.ceiling:.2f}x"
    rounds = f"rounds {', '.join(f'{r:.2f}' for r in b.reference_rounds)}" if b.reference_rounds else "lowest round"
    ref = f"; {b.reference} read {b.reference_speedup:.2f}x ({rounds})" if b.reference_speedup is not None else ""
    if b.pilot is None:
        head += ref
    else:
        p = b.pilot
        top = sorted(p.bounds.items(), key=lambda kv: -kv[1])[:3]
        head += (f"; a pilot head ({p.prompts} prompts, {p.steps} steps, {p.seconds:.0f} s) accepted "
                 f"{p.acceptance[0]:.2f} at depth 1 ({p.tree_acceptance[0]:.2f} within its top {p.topk}) over "
                 f"{p.positions} unseen positions; a full head at most {p.growth:g}x that: best "
                 + ", ".join(f"{k} tau {p.tau[k]:.2f} -> {v:.2f}x" for k, v in top) + ref)
    upper = b.reference_upper if b.reference_upper is not None else b.reference_speedup
    off = b.reference is None or (upper or 0.0) <= 1.0
    if b.reference_upper is not None and b.reference_spread is not None:
        bar = (f"{b.reference}'s upper bound {b.reference_upper:.2f}x (its agreeing rounds' mean + {Z:g} standard "
               f"errors at a spread of {b.reference_spread:.1%})")
    else:  # a decision kept before the bar was read on the upper bound
        bar = f"the highest of {b.reference}'s agreeing rounds"
    bar = "speculation off" if off else bar
    if b.pilot is None and b.beat is not None:  # the budget's ceiling against to_beat's bar
        rival = f"{bar} by one noise band ({b.beat:.2f}x)"
    elif b.pilot is None:
        rival = "speculation off" if off else f"{b.reference} ({b.reference_speedup:.2f}x)"
    else:  # to_beat's bar
        rival = f"{bar} by one noise band ({b.pilot.beat:.2f}x)"
    verdict = ("trained: a head could win" if b.trained else
               f"{b.method} left out of the search: no head of this shape trained on this budget can beat "
               f"{rival} here (search.head_bound=false or search.methods=[{b.method}] trains it anyway)")
    return f"{head} — {verdict}"


def head_bound(cfg: Config, engine: Engine, method: str, job: TrainJob, report: Report | None = None,
               say: Callable[[str], None] | None = None) -> HeadBound:
    """The bound of `method`'s head for the training `job`: kept from an earlier run with this cache,
    else measured now (the pilot too when the budget's ceiling clears the rival; `say` gets a line before
    it starts) and kept."""
    from engine.heads.pipeline import head_dir

    path = bound_path(head_dir(job, method))
    if path.is_file():
        return HeadBound.model_validate(json.loads(path.read_text()))
    tau = budget_tau(cfg, method)
    got = measure_bound(cfg, engine, method, tau)
    if got.trained:
        top = ceiling(cfg, got, tau)
        budget = {"budget_tokens": budget_tokens(cfg), "budget_tau": tau, "ceiling": top}
        got = got.model_copy(update=budget)
        # the rival's rounds only when the ceiling clears off: below it nothing they read could change the answer
        rounds = measure_reference(cfg, engine) if top >= to_beat(cfg, None) else None
        if top < to_beat(cfg, rounds):  # even this budget's most tau cannot beat the rival: no pilot
            got = got.model_copy(update={"trained": False, "beat": to_beat(cfg, rounds),
                                         **with_reference(cfg, reference_of(cfg, rounds), rounds)})
        else:
            if say is not None:
                say(f"{method} head bound at tau {tau:g} (this training budget's most) {top:.2f}x: training a "
                    f"pilot head on {pilot_job(job).train.prompts} prompts to bound what this budget reaches")
            if tau < PUBLISHED_TAU[method]:  # the pilot's bounds read every depth's chain and the wide trees
                got = measure_bound(cfg, engine, method).model_copy(update=budget)
            got = with_pilot(cfg, got, measure_pilot(cfg, engine, method, job, report), rounds)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(got.model_dump(mode="json"), indent=1) + "\n")
    return got
