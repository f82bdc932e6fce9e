"""`tuner check`: is a running endpoint still performing as tuned? A regression gate for CI
canaries and after upgrades.

The endpoint is measured as the study measured the winner on its held-out prompts (the run's
workload, its held-out split, every concurrency level, the one load generator over HTTP), and the
figures are compared with best.yaml's held-out ones: tau (from the endpoint's /metrics), output
tokens/s and TPOT p99. A figure regresses when it is worse than the tuned one by more than the
noise: the tuned tokens/s interval's relative half-width, at least `tolerance`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from tuner.schema.config import BestResult, Config, Figures, UserError


@dataclass(frozen=True)
class Comparison:
    """One figure, tuned against measured."""

    name: str
    tuned: float
    measured: float | None
    allowed: float  # the worst value within noise
    higher_is_better: bool

    @property
    def regressed(self) -> bool:
        if self.measured is None:
            return False
        return self.measured < self.allowed if self.higher_is_better else self.measured > self.allowed

    def line(self) -> str:
        """`name: measured vs tuned (allowed)`, said as a regression when it is one."""
        if self.measured is None:
            return f"{self.name}: not measured (the endpoint exports no speculative-decoding counters)"
        cmp = ("below" if self.higher_is_better else "above") if self.regressed else "within noise of"
        return (f"{self.name}: {self.measured:.3g} {cmp} the tuned {self.tuned:.3g} "
                f"({'at least' if self.higher_is_better else 'at most'} {self.allowed:.3g} allowed)")


def run_figures(run_dir: Path) -> tuple[Config, BestResult, Figures]:
    """A run's config, best.yaml and the held-out figures a check compares with."""
    from deploy.render import load_best
    from tuner.schema.compose import load_saved_config

    cfg = load_saved_config(run_dir / "config.yaml")
    best = load_best(run_dir / "best.yaml")
    if cfg.workload is None or cfg.workload.num_heldout == 0 or best.heldout is None:
        raise UserError(f"--against {run_dir}: best.yaml has no held-out figures (workload.num_heldout=0, or the "
                        "winner was not re-measured): there is nothing measured to check against")
    return cfg, best, best.heldout


def measure_endpoint(url: str, model: str, cfg: Config, repeats: int) -> Figures:
    """The endpoint's figures on the run's held-out prompts, aggregated over the concurrency
    levels as best.yaml's held-out figures are (tuner.study.objective: mean tokens/s and tau, the
    worst TPOT p99)."""
    from engine.measure.runner import HttpTarget, measure
    from engine.measure.workloads import load_prompts, sampling_params

    wl = cfg.workload
    assert wl is not None
    prompts = load_prompts(wl, "heldout")
    target = HttpTarget(url, model, wl.chat_template)
    runs = [measure(target, prompts, sampling_params(wl), c, warmup=1, repeats=repeats) for c in wl.concurrency]
    for c, s in zip(wl.concurrency, runs):
        if not any(m.n_requests for m in s.runs):
            raise UserError(f"--url {url}: every request failed at concurrency {c}: {s.errors[0]}")
    taus = [s.tau for s in runs if s.tau is not None]
    tpots = [s.tpot_p99_ms for s in runs if s.tpot_p99_ms is not None]
    return Figures(output_tokens_per_s=statistics.fmean(s.output_tokens_per_s for s in runs),
                   tau=statistics.fmean(taus) if taus else None, tpot_p99_ms=max(tpots) if tpots else None)


def compare(tuned: Figures, measured: Figures, tolerance: float, tau_tolerance: float) -> list[Comparison]:
    """The figures of `measured` against `tuned`; speed and latency within the tuned interval's
    noise (at least `tolerance`), tau within `tau_tolerance` (it hardly varies between passes)."""
    noise = tolerance
    if tuned.ci_low is not None and tuned.ci_high is not None and tuned.output_tokens_per_s > 0:
        noise = max(noise, (tuned.ci_high - tuned.ci_low) / 2 / tuned.output_tokens_per_s)
    out = []
    if tuned.tau is not None:
        out.append(Comparison("tau", tuned.tau, measured.tau, tuned.tau * (1 - tau_tolerance), True))
    out.append(Comparison("tok/s", tuned.output_tokens_per_s, measured.output_tokens_per_s,
                          tuned.output_tokens_per_s * (1 - noise), True))
    if tuned.tpot_p99_ms is not None:
        out.append(Comparison("TPOT p99 ms", tuned.tpot_p99_ms, measured.tpot_p99_ms, tuned.tpot_p99_ms * (1 + noise),
                              False))
    return out
