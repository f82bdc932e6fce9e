"""`tuner optimize`: compose the config, load the model once, run the study, pick and prove the winner.

The flow: config -> run directory (config.yaml, study.db) -> engine (model loaded once) -> the
draft (n-gram needs nothing) -> the study (trial 0 `off`, the engines' defaults, then the sampler)
with live progress -> the winner (ties within noise go to the smaller budget; `off` when nothing
beats the baseline beyond noise) -> the winner re-measured on the held-out prompts -> best.yaml,
trials.csv, report.html, PNGs -> manifests in k8s/.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.config import load_config, load_saved_config, require_workload, save_config
from tuner.distributed import mask_url
from tuner.objective import OFF, MeasureFn, Objective, Sample, TrialOutcome, mean_ci, spec_of
from tuner.report import write_report
from tuner.schema import BestResult, Config, Figures, Provenance, SpecConfig, UserError
from tuner.space import SearchSpace
from tuner.study import create_study, default_study_name, finished_count, load_study, role, storage_url, waiting_count

CONFIG_FILE = "config.yaml"
# Below this many tokens per target forward, drafts are too rarely accepted to pay for drafting
# and verification at all; above it, a slowdown means verifying costs more than it saves.
TAU_LOW = 1.3


# ---- the winner ---------------------------------------------------------------------------------

@dataclass
class Candidate:
    """All complete trials of one SpecConfig, pooled: a point sampled twice is twice the evidence."""

    spec: SpecConfig
    trials: list[FrozenTrial]
    speedup: float
    ci_low: float | None
    ci_high: float | None
    tau: float | None
    feasible: bool

    @classmethod
    def of(cls, spec: SpecConfig, trials: list[FrozenTrial]) -> "Candidate":
        if len(trials) == 1:  # keep the trial's own interval
            a = trials[0].user_attrs
            sp, lo, hi = a["speedup"], a.get("speedup_ci_low"), a.get("speedup_ci_high")
        else:
            sp, lo, hi = mean_ci([r for t in trials for r in t.user_attrs.get("ratios", [t.user_attrs["speedup"]])])
        taus = [t.user_attrs["tau"] for t in trials if t.user_attrs.get("tau") is not None]
        return cls(spec, trials, sp, lo, hi, statistics.fmean(taus) if taus else None,
                   all(all(c <= 0 for c in t.constraints.values()) for t in trials))

    def mean(self, key: str) -> float | None:
        vals = [t.user_attrs[key] for t in self.trials if t.user_attrs.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    def beats_baseline(self, noise_rel: float) -> bool:
        """Faster than the baseline beyond noise. Without accepted drafts (tau ~ 1) nothing can be
        faster than plain decoding, so such a measurement is noise, however large."""
        return (self.speedup >= 1 + noise_rel and (self.ci_low is None or self.ci_low > 1.0)
                and (self.tau is None or self.tau >= 1 + noise_rel))


@dataclass
class Winner:
    spec: SpecConfig
    candidate: Candidate | None  # None: speculation off wins
    reason: str
    chain: Candidate | None = None  # best chain (topk=1) beating the baseline, for vLLM targets


def candidates(trials: list[FrozenTrial]) -> list[Candidate]:
    """Complete speculative trials grouped by SpecConfig, in order of first appearance."""
    groups: dict[str, list[FrozenTrial]] = {}
    specs: dict[str, SpecConfig] = {}
    for t in trials:
        spec = spec_of(t)
        if (t.state != TrialState.COMPLETE or role(t) == "baseline" or spec is None or spec.method == "off"
                or "speedup" not in t.user_attrs):
            continue
        key = spec.model_dump_json()
        groups.setdefault(key, []).append(t)
        specs[key] = spec
    return [Candidate.of(specs[k], ts) for k, ts in groups.items()]


def _cheapest_of_best(cands: list[Candidate], noise_rel: float) -> tuple[Candidate, int]:
    """The best speedup, and among those within noise of it the smallest budget (then depth)."""
    top = max(c.speedup for c in cands)
    tied = [c for c in cands if c.speedup >= top * (1 - noise_rel)]
    return min(tied, key=lambda c: (c.spec.budget, c.spec.depth, -c.speedup)), len(tied)


def pick_winner(trials: list[FrozenTrial], noise_rel: float, concurrency: list[int]) -> Winner:
    """The proven winner of a study, or `off` with the reason why speculation does not pay."""
    done = candidates(trials)
    if not done:
        return Winner(OFF, None, "no speculative configuration completed a measurement: speculation stays off")
    feasible = [c for c in done if c.feasible]
    if not feasible:
        viol = sorted({t.user_attrs.get("slo_violations", "") for c in done for t in c.trials} - {""})
        return Winner(OFF, None, "no speculative configuration met the workload's SLOs "
                                 f"({'; '.join(viol[:3])}): speculation stays off")
    winners = [c for c in feasible if c.beats_baseline(noise_rel)]
    chains = [c for c in winners if c.spec.topk == 1]
    chain = _cheapest_of_best(chains, noise_rel)[0] if chains else None
    if not winners:
        best = max(feasible, key=lambda c: c.speedup)
        ci = f", 95% CI [{best.ci_low:.3f}, {best.ci_high:.3f}]" if best.ci_low is not None else ""
        head = (f"slowdown trap: no speculative configuration beats the baseline beyond noise "
                f"(+{noise_rel:.0%}); the best, {best.spec.key()}, reached {best.speedup:.3f}x{ci}. ")
        tau = best.tau
        if tau is None:
            why = "Acceptance unknown (the engine reported no tau)."
        elif tau < TAU_LOW:
            why = (f"Acceptance too low: tau={tau:.2f} tokens per target forward, so drafts are rarely "
                   "accepted and drafting plus verifying is pure overhead.")
        else:
            why = (f"Verification too costly at concurrency {concurrency}: tau={tau:.2f} tokens per target "
                   f"forward, but verifying {best.spec.budget} tokens per step costs more than the accepted "
                   "tokens save.")
        return Winner(OFF, None, head + why + " Serve without speculation.")
    pick, n_tied = _cheapest_of_best(winners, noise_rel)
    n = len(pick.trials)
    reason = f"{pick.spec.key()}: {pick.speedup:.3f}x over the baseline measured adjacent in time"
    if pick.ci_low is not None:
        reason += f" (95% CI [{pick.ci_low:.3f}, {pick.ci_high:.3f}])"
    if pick.tau is not None:
        reason += f", tau {pick.tau:.2f}"
    if n > 1:
        reason += f", pooled over {n} trials"
    if n_tied > 1:
        reason += f"; {n_tied} configurations were within noise ({noise_rel:.0%}) of the best: the smallest budget wins"
    return Winner(pick.spec, pick, reason, chain)


# ---- measuring with the engine ------------------------------------------------------------------

def _sample(m: Any, n_prompts: int) -> Sample:
    if m.errors:  # a configuration that breaks requests is no candidate
        raise RuntimeError(f"{len(m.errors)}/{n_prompts} requests failed; first: {m.errors[0]}")
    return Sample(m.output_tokens_per_s, m.tau, m.ttft_p99_ms, m.tpot_p99_ms)


def study_prompts(cfg: Config) -> dict[str, list[Any]]:
    """The prompts a study measures: the first search.trial_prompts tuning prompts (all when
    null) for trials, every held-out prompt for the winner's re-measurement."""
    from engine.workloads import load_prompts

    return {"tune": load_prompts(cfg.workload, "tune")[: cfg.search.trial_prompts],
            "heldout": load_prompts(cfg.workload, "heldout")}


def make_measure(engine: Any, cfg: Config, prompts: dict[str, list[Any]]) -> MeasureFn:
    """A MeasureFn over the built-in engine and the shared load generator (engine.runner)."""
    from engine.runner import InProcessTarget
    from engine.workloads import sampling_params

    target = InProcessTarget(engine, chat_template=cfg.workload.chat_template)
    params = sampling_params(cfg.workload, seed=cfg.seed)
    current: list[SpecConfig | None] = [None]

    def measure(spec: SpecConfig, split: str, concurrency: int) -> Sample:
        if current[0] != spec:
            current[0] = None  # a failing set_spec must not leave a stale 'current'
            engine.set_spec(spec)
            current[0] = spec
        return _sample(target.run(prompts[split], params, concurrency), len(prompts[split]))

    return measure


def make_launched_measure(launcher: Any, cfg: Config, prompts: dict[str, list[Any]]) -> MeasureFn:
    """A MeasureFn over a launched vLLM / SGLang server (restarted only when its flags change),
    measured over HTTP by the same load generator. Start-up time is never part of a measurement."""
    from engine.runner import HttpTarget
    from engine.workloads import sampling_params

    params = sampling_params(cfg.workload, seed=cfg.seed)

    def measure(spec: SpecConfig, split: str, concurrency: int) -> Sample:
        target = HttpTarget(launcher.ensure(spec), launcher.model, cfg.workload.chat_template)
        return _sample(target.run(prompts[split], params, concurrency), len(prompts[split]))

    # A restart costs far more than a measurement: the objective measures the served spec first.
    measure.serving = getattr(launcher, "serves", None)  # type: ignore[attr-defined]
    measure.startups = lambda: (getattr(launcher, "starts", 0), getattr(launcher, "total_startup_s", 0.0))  # type: ignore[attr-defined]
    return measure


def open_engine(cfg: Config) -> Any:
    """The built-in engine with the target model loaded (once per process)."""
    from engine.loop import Engine

    return Engine.from_config(cfg)


# ---- the study loop -----------------------------------------------------------------------------

def run_study(study: optuna.Study, objective: Objective, cfg: Config,
              on_trial: Callable[[TrialOutcome], None] | None = None) -> None:
    """Run trials until search.n_trials are finished (all sessions together) or search.timeout_s."""
    started = time.monotonic()
    while finished_count(study) < cfg.search.n_trials:
        if cfg.search.timeout_s is not None and time.monotonic() - started > cfg.search.timeout_s:
            break
        if cfg.search.sampler == "grid" and waiting_count(study) == 0:
            break  # every grid point measured
        outcome = objective.run_one()
        if on_trial is not None:
            on_trial(outcome)


class Progress:
    """Live progress on stderr: trial k/N, parameters, tok/s, speedup, best so far, ETA."""

    def __init__(self, study: optuna.Study, n_trials: int, quiet: bool = False) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self.study = study
        self.console = Console(stderr=True, quiet=quiet)
        self.bar = RichProgress(TextColumn("[bold]trials"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.description}"), TimeElapsedColumn(),
                                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=False)
        self.task = self.bar.add_task("", total=n_trials, completed=finished_count(study))
        self.best: float | None = None

    def __enter__(self) -> "Progress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def log(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def __call__(self, o: TrialOutcome) -> None:
        n = finished_count(self.study)
        if o.state == TrialState.COMPLETE and o.spec.method != "off" and o.speedup is not None:
            self.best = max(self.best or 0.0, o.speedup)
        if o.state == TrialState.COMPLETE:
            what = f"{o.tok_s:7.2f} tok/s {o.speedup:.3f}x"
        else:
            what = f"{o.state.name}: {o.reason}"
        best = f"best {self.best:.3f}x" if self.best is not None else "best -"
        self.log(f"trial {n}/{self.task_total} #{o.number} {o.spec.key()}: {what} | {best}")
        self.bar.update(self.task, completed=n, description=best)

    @property
    def task_total(self) -> int:
        return int(self.bar.tasks[0].total or 0)


# ---- the whole command --------------------------------------------------------------------------

def prepare_run(overrides: list[str] | None, resume: Path | None) -> tuple[Config, Path, bool]:
    """(config, run directory, is_resume). A new run saves its composed config first."""
    if resume is not None:
        if overrides:
            raise UserError(f"--resume {resume}: overrides are not allowed (the run continues its saved "
                            f"{CONFIG_FILE}); got {' '.join(overrides)}")
        cfg = load_saved_config(resume / CONFIG_FILE)
        return cfg, resume, True
    cfg = load_config(overrides)
    require_workload(cfg)
    cfg.search.study_name = default_study_name(cfg)
    run_dir = Path(cfg.run_dir) / cfg.search.study_name
    if (run_dir / CONFIG_FILE).exists():
        raise UserError(f"{run_dir} already holds a study: continue it with --resume {run_dir} "
                        "or set search.study_name=NEW")
    save_config(cfg, run_dir / CONFIG_FILE)
    return cfg, run_dir, False


def get_draft(cfg: Config, engine: Any, quiet: bool = False) -> str | None:
    """The drafter the searched methods need: n-gram needs none; EAGLE heads come from training
    (engine.train.ensure_head: the cached head of this target and workload, or a new one)."""
    needs_head = [m for m in cfg.search.methods if m in ("eagle", "eagle3", "medusa")]
    if not needs_head:
        return None
    from engine.train import cached_head, ensure_head
    from rich.console import Console

    console = Console(stderr=True, quiet=quiet)
    if cached_head(cfg) is not None:
        return str(cached_head(cfg))
    console.print(f"training an EAGLE head for {cfg.model.name} on workload {cfg.workload.name} "
                  "(once: cached for later studies)", highlight=False)
    shown: dict[str, int] = {}

    def report(phase: str, done: int, total: int, info: dict) -> None:
        tenth = 10 * done // max(total, 1)
        if shown.get(phase, -1) < tenth:  # one line per 10%
            shown[phase] = tenth
            loss = f" loss {info['loss']:.3f}" if "loss" in info else ""
            console.print(f"  {phase} {done}/{total}{loss}", highlight=False)

    from tuner.cli_train import packaged_workloads

    # The other packaged workloads add diversity and, above all, have their held-out prompts excluded.
    return str(ensure_head(cfg, engine, report=report, workloads=packaged_workloads(cfg)))


def best_result(cfg: Config, study: optuna.Study, run_dir: Path, win: Winner, objective: Objective) -> BestResult:
    """Re-measure the winner on the held-out prompts and assemble best.yaml."""
    trials = study.get_trials(deepcopy=False)
    base_trial = next((t for t in trials if role(t) == "baseline" and t.state == TrialState.COMPLETE), None)

    def figs(a: dict[str, Any], prefix: str = "tok_s") -> Figures:
        return Figures(output_tokens_per_s=a[prefix], ci_low=a.get(f"{prefix}_ci_low"),
                       ci_high=a.get(f"{prefix}_ci_high"), tau=a.get("tau"),
                       ttft_p99_ms=a.get("ttft_p99_ms"), tpot_p99_ms=a.get("tpot_p99_ms"))

    c = win.candidate
    if c is not None:
        metrics = Figures(output_tokens_per_s=c.mean("tok_s"), ci_low=c.mean("tok_s_ci_low"),
                          ci_high=c.mean("tok_s_ci_high"), tau=c.tau,
                          ttft_p99_ms=max(t.user_attrs.get("ttft_p99_ms") or 0.0 for t in c.trials) or None,
                          tpot_p99_ms=max(t.user_attrs.get("tpot_p99_ms") or 0.0 for t in c.trials) or None)
        baseline = Figures(output_tokens_per_s=c.mean("baseline_tok_s"))
        speedup = c.speedup
    else:
        metrics = figs(base_trial.user_attrs) if base_trial is not None else None
        baseline = metrics
        speedup = 1.0 if metrics is not None else None
    heldout = heldout_speedup = None
    if cfg.workload.num_heldout > 0:
        h = objective.evaluate(win.spec, "heldout", repeats_max=1)  # one more pair: the check, not a search
        heldout = Figures(output_tokens_per_s=h["tok_s"], ci_low=h["tok_s_ci_low"], ci_high=h["tok_s_ci_high"],
                          tau=h["tau"], ttft_p99_ms=h["ttft_p99_ms"], tpot_p99_ms=h["tpot_p99_ms"])
        heldout_speedup = h["speedup"]
    chain = win.chain.spec if win.chain is not None else None
    return BestResult(
        spec=win.spec, chain_spec=chain, metrics=metrics, baseline=baseline, speedup=speedup,
        heldout=heldout, heldout_speedup=heldout_speedup, reason=win.reason,
        k_schedule_note=("K per concurrency band tuned (spec.k_per_batch_size)" if win.spec.k_per_batch_size else None),
        provenance=Provenance(
            study=study.study_name, trial=c.trials[0].number if c is not None else
            (base_trial.number if base_trial is not None else None),
            storage=mask_url(storage_url(cfg.search, run_dir)),  # no password in best.yaml
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            model=cfg.model.name, hardware=cfg.hardware.name, engine=cfg.engine.kind, workload=cfg.workload.name),
    )


def render_manifests(run_dir: Path) -> list[Path]:
    """Render RUN_DIR/k8s from best.yaml with the deployment code (same as `tuner render --from`)."""
    from tuner.cli_deploy import render_run

    _, files = render_run(run_dir)
    return files


def search(cfg: Config, study: optuna.Study, space: SearchSpace, measure: MeasureFn, run_dir: Path,
           resuming: bool, quiet: bool) -> BestResult:
    """Run the study with live progress, pick the winner and re-measure it on the held-out prompts."""
    objective = Objective(study, space, measure, cfg.workload, cfg.search)
    total = cfg.search.n_trials
    if cfg.search.sampler == "grid":  # the grid ends when every enqueued point is measured
        total = min(total, finished_count(study) + waiting_count(study))
    with Progress(study, total, quiet=quiet) as progress:
        if resuming:
            progress.log(f"resuming {study.study_name}: {finished_count(study)} trials already finished")
        run_study(study, objective, cfg, progress)
        win = pick_winner(study.get_trials(deepcopy=False), cfg.search.noise_rel, cfg.workload.concurrency)
        progress.log(f"winner: {win.spec.key()} — {win.reason}")
        if cfg.workload.num_heldout > 0:
            progress.log("re-measuring the winner on the held-out prompts")
        return best_result(cfg, study, run_dir, win, objective)


def optimize(overrides: list[str] | None = None, resume: Path | None = None, quiet: bool = False,
             engine: Any = None, measure: MeasureFn | None = None) -> Path:
    """The whole `tuner optimize` flow; returns the run directory (see the module docstring).

    `engine` / `measure` let a caller that already holds a loaded engine (or a benchmark that
    replays measurements) reuse it; by default the engine is loaded here, once.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own progress says what happens
    cfg, run_dir, resuming = prepare_run(overrides, resume)
    if cfg.search.workers > 1:  # N worker processes on one shared study
        from tuner.distributed import optimize_parallel

        return optimize_parallel(cfg, run_dir, resuming, quiet=quiet, engine=engine, measure=measure)
    launched = cfg.engine.kind in ("vllm", "sglang")
    if engine is None and measure is None and not launched:
        engine = open_engine(cfg)
    head = get_draft(cfg, engine, quiet)
    space = SearchSpace.from_config(cfg, head_path=head)
    if resuming:
        study = load_study(cfg, run_dir, cfg.search.study_name)
    else:
        study = create_study(cfg, space, run_dir, cfg.search.study_name)
    prompts = study_prompts(cfg)
    with ExitStack() as stack:
        if measure is None and launched:
            from engine.launch import Launcher

            launcher = stack.enter_context(Launcher.from_config(cfg, log_dir=run_dir / "servers"))
            measure = make_launched_measure(launcher, cfg, prompts)
        elif measure is None:
            measure = make_measure(engine, cfg, prompts)
        best = search(cfg, study, space, measure, run_dir, resuming, quiet)
    write_report(study, run_dir, best)
    render_manifests(run_dir)
    print(run_dir)
    return run_dir
