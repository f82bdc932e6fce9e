"""Whether a trained head could win on this machine, measured before its answers and training.

A head's answers and training take minutes (207 s of the main command on 2 cores). Before they
start, one cheap measurement bounds the best speedup any head of that shape could reach here: the
built-in engine runs a few steps with an untrained head of the trained head's shape
(engine.drafters.untrained_drafter: its drafts are rejected, and a step costs what the trained
head's costs), interleaved with steps of speculation off, on the first tuning prompt, one request
alone (where speculation gains most), in rounds until the bound is clear (`CLEAR`) or `ROUNDS` ran. A chain of depth d commits at most min(d + 1, tau) tokens a
step for a head whose acceptance is the generous published one (`PUBLISHED_TAU`), and a tree of the
same depth costs at least what the chain costs, so

    bound = max over the measured depths d of  min(d + 1, tau) x (step off) / (step of the chain d)

When even that bound is below 1.0, no head of that shape can be faster than speculation off here:
the study leaves the method out, prints one line with the figures and records them (best.yaml
`head_bounds`). The decision is kept beside the head's cache entry, so later runs with that cache
(a resumed study too) search the same space without measuring again.

Never for a head the user gave or pinned (spec.head_path, spec.method, a search of head methods
alone, search.head_bound=false), nor for a study other machines share (search.storage set: every
worker must search one space): those train as before.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tuner.schema.config import Config, HeadBound, SpecConfig
from tuner.schema.methods import method as method_info

if TYPE_CHECKING:
    from engine.api import SamplingParams
    from engine.decode.loop import Engine

# The highest published mean accepted length of each head family, greedy (EAGLE-3 paper, Table 1:
# EAGLE-2 on HumanEval with Vicuna-13B 5.41; EAGLE-3 on HumanEval with Vicuna-13B 7.54): far above
# what a head trained here in minutes reaches (tau 2.12 at d4 k4 b16, docs/results.md).
PUBLISHED_TAU = {"eagle": 5.41, "eagle3": 7.54}
STEPS = 16  # generated tokens per timed run: every step of an untrained head commits one
ROUNDS = 3  # (off, chains...) rounds at most; each configuration's fastest step counts
CLEAR = 1.5  # a bound this far above 1.0 after a round decides at once: the step times of one round
# on a loaded 2-core machine differ by up to ~30% (docs/results.md), less than this margin
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


def chain_depths(cfg: Config, tau: float) -> list[int]:
    """The chain depths whose bound is measured, within search.depth and budget_max. With a step that
    grows by a head step per depth, min(d + 1, tau) / step(d) peaks at one of three: the shallowest
    depth (a head step costing about a target step or more), the deepest whose d + 1 stays within
    tau, or the next, where tau caps it (which of the two depends on the head step's cost)."""
    top = min(cfg.search.depth.max, cfg.search.budget_max - 1)
    lo = cfg.search.depth.min
    return sorted({lo, *(max(lo, min(top, d)) for d in (math.floor(tau) - 1, math.ceil(tau) - 1))})


def measure_bound(cfg: Config, engine: Engine, method: str) -> HeadBound:
    """Time speculation off and chains of an untrained `method` head, interleaved; the bound."""
    from engine.drafters import untrained_drafter
    from engine.measure.workloads import encode, sampling_params
    from tuner.projection.profiling import tuning_prompts

    tau = PUBLISHED_TAU[method]
    prompt = tuning_prompts(cfg, n=1)[0]
    ids = encode(engine, prompt, cfg.workload.chat_template)
    params = replace(sampling_params(cfg.workload, seed=cfg.seed), max_new_tokens=STEPS, temperature=0.0)
    off = SpecConfig(method="off")
    chains = [SpecConfig(method=method, depth=d, topk=1, budget=d + 1) for d in chain_depths(cfg, tau)]
    drafters = {c.depth: untrained_drafter(c, engine.target, cfg.train.draft_vocab, cfg.seed) for c in chains}

    def step_s(spec: SpecConfig, run: SamplingParams) -> float:
        if spec.method == "off":
            engine.set_spec(spec)
        else:
            engine.set_drafter(drafters[spec.depth], spec)
        s = engine.generate(ids, run).stats
        return (s.total_s - s.ttft_s) / max(s.target_forwards - 1, 1)  # decode steps: the prefill excluded

    def bounds() -> dict[str, float]:
        return {c.key(): round(min(c.depth + 1, tau) * best[off.key()] / best[c.key()], 3) for c in chains}

    best: dict[str, float] = {}
    warm = replace(params, max_new_tokens=4)
    for spec in [off, *chains]:  # a short warm-up each: the head's first steps build its buffers
        step_s(spec, warm)
    for _ in range(ROUNDS):
        for spec in [off, *chains]:
            best[spec.key()] = min(best.get(spec.key(), math.inf), step_s(spec, params))
        if max(bounds().values()) >= CLEAR:
            break
    engine.set_spec(off)
    points = bounds()
    return HeadBound(method=method, tau=tau, off_step_ms=round(best[off.key()] * 1e3, 2),
                     step_ms={c.key(): round(best[c.key()] * 1e3, 2) for c in chains},
                     bounds=points, bound=max(points.values()), trained=max(points.values()) >= 1.0)


def describe(b: HeadBound) -> str:
    """One line: what was measured and what follows from it."""
    pts = ", ".join(f"{k} {b.step_ms[k]:.0f} ms a step -> {v:.2f}x" for k, v in b.bounds.items())
    verdict = ("trained: a head could win" if b.trained else
               f"{b.method} left out of the search: no head of this shape can beat speculation off here "
               f"(pin it with search.methods=[{b.method}] to train it anyway)")
    return (f"{b.method} head bound: speculation off {b.off_step_ms:.0f} ms a step; an untrained head of the trained "
            f"shape at tau <= {b.tau:g} (published): {pts}; best {b.bound:.2f}x — {verdict}")


def head_bound(cfg: Config, engine: Engine, method: str, head_dir: Path) -> HeadBound:
    """The bound of `method`'s head: kept from an earlier run with this cache, else measured now and kept."""
    path = bound_path(head_dir)
    if path.is_file():
        return HeadBound.model_validate(json.loads(path.read_text()))
    got = measure_bound(cfg, engine, method)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(got.model_dump(mode="json"), indent=1) + "\n")
    return got
