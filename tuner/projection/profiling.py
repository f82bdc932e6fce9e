"""What the tuner measures acceptance on: which prompts and which precision, decided here once from
the whole config, so the engine (engine.measure.profile) receives only explicit arguments.

- The tuning prompts: the first `search.trial_prompts` prompts of a split (all when null). Trials,
  acceptance profiles and guided search all play these. The winner's held-out check compares the
  held-out prompts with as many tuning prompts (`check_prompt_count`), those matched to the held-out
  prompts on what drives a speedup (`matched_check`: the greedy answers' replayed n-gram tau and the
  context decoded over), so that the check's gap measures the winner, not which prompts each side holds.
- The precision: FP8-rounded weights when the deployment serves FP8 or the built-in engine is set
  to emulate it, since acceptance changes with the weights' rounding.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tuner.schema.config import Config, SpecConfig, UserError


def fp8_profile(cfg: Config) -> bool:
    """Whether acceptance must be measured under FP8-rounded weights: the deployment serves FP8
    (deploy.quantization=fp8) or the built-in engine is set to emulate it."""
    return cfg.engine.builtin.weights == "fp8" or cfg.deploy.quantization == "fp8"


def tuning_prompts(cfg: Config, split: str = "tune", n: int | None = None, encoder: Any = None) -> list[Any]:
    """The first `n` prompts of cfg.workload's `split` (default n: search.trial_prompts, the
    prompts every trial plays; all of them when that is null). With `encoder` (what tokenises a
    request), a file's requests get their token budgets and must fit model.max_context."""
    from engine.measure.workloads import load_prompts

    if cfg.workload is None:
        raise UserError("no workload given: add +workload=NAME (code, chat, math, json, creative, file, mix)")
    prompts = load_prompts(cfg.workload, split, encoder, cfg.model.max_context if encoder is not None else None)
    return prompts[: n if n is not None else cfg.search.trial_prompts]


# The split of the tuning prompts the winner's held-out check compares with (study_prompts)
CHECK = "tune-check"
# The split the held-out check plays: its tuning prompts and the held-out ones in one pass, in turn
# (check_order), so that whatever the machine does during a pass falls on both sides alike
CHECK_PASS = "check-pass"


def check_order(n_tune: int, n_heldout: int) -> tuple[list[int], list[int]]:
    """Where the held-out check's pass (CHECK_PASS) plays each side's prompts: the i-th of each side
    next to each other, the tuning one first for even i, the held-out one first for odd i (t h h t
    t h ...: a machine that drifts steadily over the pass gives both sides the same mean position),
    the longer side's rest at the end; the positions of the tuning prompts and those of the
    held-out prompts, each in its side's order."""
    tune: list[int] = []
    held: list[int] = []
    for i in range(max(n_tune, n_heldout)):
        couple = ((tune, n_tune), (held, n_heldout))
        for side, n in couple if i % 2 == 0 else couple[::-1]:
            if i < n:
                side.append(len(tune) + len(held))
    return tune, held


def check_prompt_count(cfg: Config) -> int:
    """How many tuning prompts the held-out check measures the winner on: as many as there are
    held-out prompts (the two figures then average over as many prompts: a speedup varies from
    prompt to prompt with its tau), at least the trials' own, at most every tuning prompt."""
    w = cfg.workload
    trial = cfg.search.trial_prompts if cfg.search.trial_prompts is not None else w.num_prompts
    return min(w.num_prompts, max(w.num_heldout, trial))


# The n-gram chains whose replayed tau a check side is matched on: short, middle and long drafts, so
# the sides agree on how much of the answers repeats however far the winner drafts.
PROXY_DEPTHS = (2, 4, 8)
# How much a mismatch of the context decoded over counts against one of tau (both on logs): off's
# step costs more on a longer context, and on this workload's held-out prompts, about a third
# shorter, off ran a few percent faster (docs/results.md, issue 39): about a quarter of the
# context's ratio reaches the speed.
CONTEXT_WEIGHT = 0.25


@dataclass(frozen=True)
class PromptProxy:
    """What one prompt's greedy answer says of the speedup it gives, before any timing: its prompt
    and answer tokens and the target forwards n-gram chains of PROXY_DEPTHS take to commit the
    answer (engine.drafters.ngram.replayed_forwards). Counts only: no text."""

    prompt_tokens: int
    answer_tokens: int
    forwards: tuple[int, ...]


def side_tau(side: Sequence[PromptProxy], k: int) -> float:
    """Tokens per target forward of a set of prompts under the chain of PROXY_DEPTHS[k] (as the
    check reads tau: total tokens over total forwards; 1.0 for answers of no tokens)."""
    forwards = sum(p.forwards[k] for p in side)
    return sum(p.answer_tokens for p in side) / forwards if forwards else 1.0


def side_context(side: Sequence[PromptProxy]) -> float:
    """The mean context a set of prompts' answer tokens are decoded over (prompt plus half the answer,
    weighted by answer tokens; at least one token)."""
    tokens = sum(p.answer_tokens for p in side)
    ctx = sum(p.answer_tokens * (p.prompt_tokens + p.answer_tokens / 2) for p in side) / max(1, tokens)
    return max(1.0, ctx)


def mismatch(a: Sequence[PromptProxy], b: Sequence[PromptProxy]) -> float:
    """How far two sets of prompts lie apart on what drives a speedup: the mean |log tau ratio| over
    PROXY_DEPTHS plus CONTEXT_WEIGHT x |log context ratio|; 0 for sets alike."""
    taus = [abs(math.log(side_tau(a, k) / side_tau(b, k))) for k in range(len(PROXY_DEPTHS))]
    return sum(taus) / len(taus) + CONTEXT_WEIGHT * abs(math.log(side_context(a) / side_context(b)))


# Sets of tuning prompts matched_check compares one by one at most (924 at the default 6 of 12,
# 12,870 at 8 of 16); beyond, a swap descent, which can stop at a set a little off the nearest.
EXHAUSTIVE_SETS = 20_000


def matched_check(tune: Sequence[PromptProxy], held: Sequence[PromptProxy], n: int) -> list[int]:
    """The indices (ascending) of `n` tuning prompts whose set lies nearest the held-out set
    (`mismatch`), the first such set in lexicographic order: every set compared while there are at
    most EXHAUSTIVE_SETS, else from the first n the best single swap of a chosen prompt for an
    unchosen one while it lowers the mismatch. Deterministic."""
    chosen = list(range(min(n, len(tune))))
    if len(chosen) == len(tune) or not held:
        return chosen
    if math.comb(len(tune), len(chosen)) <= EXHAUSTIVE_SETS:
        best_set = min(itertools.combinations(range(len(tune)), len(chosen)),
                       key=lambda c: mismatch([tune[i] for i in c], held))  # min keeps the first of equals
        return list(best_set)
    cost = mismatch([tune[i] for i in chosen], held)
    while True:
        best: tuple[float, int, int] | None = None
        for a in range(len(chosen)):
            for j in range(len(tune)):
                if j in chosen:
                    continue
                trial = chosen[:a] + [j] + chosen[a + 1:]
                c = mismatch([tune[i] for i in trial], held)
                if c < cost - 1e-12 and (best is None or c < best[0]):
                    best = (c, a, j)
        if best is None:
            return sorted(chosen)
        cost, a, j = best
        chosen[a] = j


def profile_config(cfg: Config, specs: Sequence[SpecConfig], split: str = "tune", n_prompts: int | None = None,
                   on_point: Callable[[Any], None] | None = None) -> Any:
    """The acceptance profile (engine.measure.profile.Profile) of `specs` for cfg's model,
    workload and sampling settings, on the tuning prompts of `split` (`n_prompts` of them, default
    search.trial_prompts), under the precision that will be served."""
    from engine.measure.profile import profile_prompts

    prompts = tuning_prompts(cfg, split, n_prompts)
    return profile_prompts(cfg.model, cfg.engine.builtin, cfg.workload, prompts, specs, fp8=fp8_profile(cfg),
                           cache_dir=cfg.cache_dir, seed=cfg.seed, on_point=on_point)
