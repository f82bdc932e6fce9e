"""What the tuner measures acceptance on: which prompts and which precision, decided here once from
the whole config, so the engine (engine.measure.profile) receives only explicit arguments.

- The tuning prompts: the first `search.trial_prompts` prompts of a split (all when null). Trials,
  acceptance profiles and guided search all play these. The winner's held-out check compares the
  held-out prompts with as many tuning prompts (`check_prompt_count`).
- The precision: FP8-rounded weights when the deployment serves FP8 or the built-in engine is set
  to emulate it, since acceptance changes with the weights' rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def check_prompt_count(cfg: Config) -> int:
    """How many tuning prompts the held-out check measures the winner on: as many as there are
    held-out prompts (the two figures then average over as many prompts: a speedup varies from
    prompt to prompt with its tau), at least the trials' own, at most every tuning prompt."""
    w = cfg.workload
    trial = cfg.search.trial_prompts if cfg.search.trial_prompts is not None else w.num_prompts
    return min(w.num_prompts, max(w.num_heldout, trial))


def profile_config(cfg: Config, specs: Sequence[SpecConfig], split: str = "tune", n_prompts: int | None = None,
                   on_point: Callable[[Any], None] | None = None) -> Any:
    """The acceptance profile (engine.measure.profile.Profile) of `specs` for cfg's model,
    workload and sampling settings, on the tuning prompts of `split` (`n_prompts` of them, default
    search.trial_prompts), under the precision that will be served."""
    from engine.measure.profile import profile_prompts

    prompts = tuning_prompts(cfg, split, n_prompts)
    return profile_prompts(cfg.model, cfg.engine.builtin, cfg.workload, prompts, specs, fp8=fp8_profile(cfg),
                           cache_dir=cfg.cache_dir, seed=cfg.seed, on_point=on_point)
