"""Hardware projection: acceptance measured once (engine.measure.profile), cost from a hardware profile's
roofline (tuner.projection.costmodel), the predicted TPOT, throughput and speedup of every configuration at
every concurrency on hardware the user does not have at hand, and the best configuration per
concurrency band (for vLLM: the K schedule, `num_speculative_tokens_per_batch_size`).

Acceptance depends on the model, so a profile only projects its own model; another model needs a
tau from the user (`--tau` for the configured spec, or `--acceptance-file`), and the output says
which acceptance was used.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml
from pydantic import ValidationError

from engine.measure.stats import geomean
from tuner.projection.costmodel import Prediction, StepCost, measured_cost, predict, roofline_for
from tuner.schema.config import (BestResult, Config, ProjectedPoint, Projection, Provenance, SpecConfig, UserError,
                                 measured_weights)

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONTEXT = 1024


@dataclass
class Acceptance:
    """Configurations with their tau, and where the numbers came from."""

    points: list[tuple[SpecConfig, float]]
    source: str
    # what a step verifies, by spec key (profile): shares of steps by tokens verified, or their mean
    verified: dict[str, float | dict[str, float]] | None = None
    estimate: bool = False
    context: int | None = None  # mean context of the profiled generations
    draft_s: dict[str, float] | None = None  # measured draft seconds per step (profile, this machine)
    engine: str = ""  # the engine setting that profiled (for the measured cost model)


def _profile_path(run: Path | None, profile: Path | None) -> Path | None:
    if profile is not None:
        return profile
    if run is not None:
        return run / "profile.json"
    return None


def acceptance_from_profile(path: Path, model: str) -> Acceptance:
    """The profiled points of `path` (a profile file or a run directory holding one) for `model`."""
    from engine.measure.profile_file import load_profile  # no torch: projecting needs only the stored profile

    if not path.exists():
        raise UserError(f"{path}: no acceptance profile there (make one with `tuner profile --from RUN`)")
    prof = load_profile(path)
    if prof.model != model:
        raise UserError(f"model={model}: the profile {path} measured {prof.model}; acceptance depends on the "
                        "model, so give --tau T (for spec.*) or --acceptance-file FILE")
    points = [(SpecConfig(**p["spec"]), float(p["tau"])) for p in prof.points]
    ctx = [s["prompt_len"] + s["n_new"] / 2 for s in prof.sequences]
    label = "estimated" if not prof.exact else "exact greedy"
    return Acceptance(points=points, source=f"profile {path} ({prof.model}, {prof.workload}, {label} tau"
                      f"{', FP8 weights' if prof.fp8 else ''})", estimate=not prof.exact,
                      context=int(sum(ctx) / len(ctx)) if ctx else None,
                      draft_s={p["key"]: p.get("draft_s_per_step", 0.0) for p in prof.points}, engine=prof.engine,
                      verified={p["key"]: p.get("verified_shares") or p.get("verified_per_step", p["spec"]["budget"])
                                for p in prof.points})


ENTRY_FIELDS = "method, depth, topk, budget, tau"


def _entry_error(path: Path, i: int, err: ValidationError) -> str:
    """One line naming the file, the entry and its bad field (pydantic's own text ends in a link),
    with the nearest field or method where one is misspelt."""
    from tuner.schema.compose import closest

    e = err.errors()[0]
    field = ".".join(str(p) for p in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        allowed = ", ".join([*SpecConfig.model_fields, "tau"])
        near = closest(field, [*SpecConfig.model_fields, "tau"])
        why = f"unknown field {field!r} ({f'did you mean {near}? ' if near else ''}allowed: {allowed})"
    elif e["type"] == "literal_error":
        choices = re.findall(r"'([^']*)'", msg)
        near = closest(str(e.get("input")), choices)
        why = f"{field}={e.get('input')!r}: allowed: {', '.join(choices)}" + (f"; did you mean {near}?" if near else "")
    elif not field:  # a rule between fields (e.g. a chain's budget): its message names them
        why = msg
    else:
        why = f"{field}={e.get('input')!r}: {msg}"
    return f"--acceptance-file {path}: entry {i}: {why}"


def acceptance_from_file(path: Path) -> Acceptance:
    """A YAML/JSON list of {method, depth, topk, budget, ..., tau} (a published head's acceptance)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"--acceptance-file {path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise UserError(f"--acceptance-file {path}: not YAML/JSON{where} ({problem}); expected a list of "
                        f"{{{ENTRY_FIELDS}}} entries") from None
    if not isinstance(data, list) or not data:
        raise UserError(f"--acceptance-file {path}: expected a list of {{{ENTRY_FIELDS}}} entries")
    points = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise UserError(f"--acceptance-file {path}: entry {i} is {type(entry).__name__}, expected a mapping "
                            f"{{{ENTRY_FIELDS}}}")
        tau = entry.get("tau")
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or tau < 1:
            given = "no tau" if tau is None else f"tau={tau!r}"
            raise UserError(f"--acceptance-file {path}: entry {i}: {given}: needs a number >= 1 "
                            "(tokens per target forward)")
        fields = {k: v for k, v in entry.items() if k != "tau"}
        try:
            spec = SpecConfig(**fields)
        except ValidationError as exc:
            raise UserError(_entry_error(path, i, exc)) from None
        error = tau_error(spec, tau)
        if error:
            raise UserError(f"--acceptance-file {path}: entry {i}: tau={tau!r}: {error}")
        points.append((spec, float(tau)))
    return Acceptance(points=points, source=f"acceptance file {path}")


def tau_error(spec: SpecConfig, tau: object) -> str | None:
    """Why `tau` cannot be the tokens per target forward of `spec`, or None: a finite number from 1
    (nothing accepted: the target's own token) to depth + 1 (every drafted token of the deepest path
    accepted, plus the target's bonus token)."""
    most = 1 if spec.method == "off" else spec.depth + 1
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or not 1 <= tau <= most:
        return (f"tau is tokens per target forward: a number from 1 to {most} for '{spec.key()}' "
                f"(spec.depth + 1: every drafted token accepted plus the bonus token)")
    return None


def check_projection_inputs(cfg: Config, tp: int, concurrency: list[int], context: int) -> None:
    """Refuse, before anything is written, what no deployment of cfg could run: a context beyond the
    model's, or more sequences at that context than the KV headroom of the hardware holds."""
    m = cfg.model
    if not 1 <= context <= m.max_context:
        raise UserError(f"--context {context}: model {m.name} has a context of {m.max_context} tokens "
                        f"(allowed: 1..{m.max_context})")
    if cfg.hardware.accelerator != "cuda":
        return  # hardware=cpu projects concurrency 1 from this machine's measured cost
    from tuner.schema.fit import kv_cache_tokens, served_weight_gib

    d = cfg.deploy
    capacity = kv_cache_tokens(m, cfg.hardware, d, tp)
    fits = capacity // context
    over = [c for c in concurrency if c > fits]
    if over:
        raise UserError(f"--concurrency {','.join(map(str, over))}: at context {context} the KV cache of "
                        f"{cfg.hardware.name} holds at most {fits} sequences ({capacity} KV tokens at deploy.kv_cache_dtype="
                        f"{d.kv_cache_dtype}: deploy.gpu_memory_utilization={d.gpu_memory_utilization:g} of {tp} x "
                        f"{cfg.hardware.gpu_memory_gib:g} GiB less {served_weight_gib(m, d.quantization):.1f} GiB of weights)")


def acceptance_for(cfg: Config, run: Path | None = None, profile: Path | None = None, tau: float | None = None,
                   acceptance_file: Path | None = None) -> Acceptance:
    """Where the taus come from, in order: --tau (for cfg.spec), --acceptance-file, the profile."""
    if tau is not None:
        if cfg.spec.method == "off":
            raise UserError("--tau needs a speculative spec: set spec.method, spec.depth, spec.topk, spec.budget")
        error = tau_error(cfg.spec, tau)
        if error:
            raise UserError(f"--tau {tau}: {error}")
        return Acceptance(points=[(cfg.spec, tau)], source=f"--tau {tau} for {cfg.spec.key()}")
    if acceptance_file is not None:
        return acceptance_from_file(acceptance_file)
    path = _profile_path(run, profile)
    if path is None:
        raise UserError("no acceptance given: use --from RUN (with its profile.json), --profile FILE, "
                        "--tau T or --acceptance-file FILE")
    return acceptance_from_profile(path, cfg.model.name)


def project(cost: StepCost, acc: Acceptance, concurrency: list[int], context: int) -> list[Prediction]:
    """Every configuration (and `off`) at every concurrency; a profiled point verifies its measured
    mean tokens per step (an n-gram lookup without a match verifies the root alone)."""
    points = list(acc.points)
    if not any(s.method == "off" for s, _ in points):
        points.insert(0, (SpecConfig(method="off"), 1.0))
    ver = acc.verified or {}
    return [predict(cost, spec, tau, c, context, ver.get(spec.key())) for c in concurrency for spec, tau in points]


def best_per_concurrency(preds: list[Prediction], chains_only: bool = False) -> dict[int, Prediction]:
    """The highest predicted throughput per concurrency (ties within 1%: the smaller budget)."""
    out: dict[int, Prediction] = {}
    for c in sorted({p.concurrency for p in preds}):
        cands = [p for p in preds if p.concurrency == c and (not chains_only or p.spec.topk == 1)]
        top = max(p.tok_s for p in cands)
        near = [p for p in cands if p.tok_s >= top * 0.99]
        out[c] = min(near, key=lambda p: (p.spec.budget if p.spec.method != "off" else 1, -p.tok_s))
    return out


def _schedule_tops(preds: list[Prediction], lead: SpecConfig) -> dict[int, Prediction]:
    """Per concurrency, the fastest chain of `lead`'s method (or `off`): what a K schedule serves there."""
    out = {}
    for c in sorted({p.concurrency for p in preds}):
        same = [p for p in preds if p.concurrency == c and p.spec.topk == 1
                and p.spec.method in (lead.method, "off")]
        out[c] = max(same, key=lambda p: p.tok_s)
    return out


def _lead_chain(preds: list[Prediction]) -> SpecConfig | None:
    """The chain a vLLM deployment serves: the best chain at the lowest level where one beats `off`."""
    best = best_per_concurrency(preds, chains_only=True)
    return next((best[c].spec for c in sorted(best) if best[c].spec.method != "off"), None)


def k_schedule(preds: list[Prediction]) -> tuple[SpecConfig | None, list[tuple[int, int, int]]]:
    """The vLLM K schedule: the best chain method's K per concurrency band ([lo, hi, K], K=0: off).
    One method and its drafter are served, so the method is that of the best chain at concurrency 1."""
    lead = _lead_chain(preds)
    if lead is None:
        return None, []
    bands, lo = [], 1
    for c, top in _schedule_tops(preds, lead).items():
        k = 0 if top.spec.method == "off" else top.spec.depth
        if bands and bands[-1][2] == k:
            bands[-1] = (bands[-1][0], c, k)
        else:
            bands.append((lo, c, k))
        lo = c + 1
    depth = max(max(k for _, _, k in bands), 1)
    spec = lead.model_copy(update={"depth": depth, "budget": depth + 1, "k_per_batch_size": None})
    return spec, bands


def choose_projected(preds: list[Prediction], target: str) -> tuple[SpecConfig, list[Prediction]]:
    """The one configuration a deployment of `target` serves at all the predictions' concurrency
    levels, and its prediction at each level (ascending).

    vLLM (chains only): the K schedule of `k_schedule`, as `k_per_batch_size` when it has several
    bands (each level's prediction is then its band's chain). Otherwise the configuration with the
    highest geometric mean of predicted speedup over the levels (what a study maximises; at one
    level simply the fastest), ties within 1% going to the smaller budget; for SGLang among the
    methods it serves (off, eagle, eagle3) when the profile has one of them."""
    levels = sorted({p.concurrency for p in preds})
    if target == "vllm":
        chain, bands = k_schedule(preds)
        if chain is None:
            return SpecConfig(method="off"), [next(p for p in preds if p.concurrency == c and p.spec.method == "off")
                                              for c in levels]
        tops = _schedule_tops(preds, _lead_chain(preds))
        spec = chain if len(bands) == 1 else chain.model_copy(update={"k_per_batch_size": bands})
        return SpecConfig.model_validate(spec.model_dump()), [tops[c] for c in levels]
    cands = preds
    if target == "sglang":
        from tuner.schema.methods import engine_refusal

        def servable(spec: SpecConfig) -> bool:  # what SGLang runs, asked of the method registry
            return engine_refusal(spec.method, spec.topk, "sglang") is None

        if any(servable(p.spec) and p.spec.method != "off" for p in preds):
            cands = [p for p in preds if servable(p.spec)]
    rows: dict[str, list[Prediction]] = {}
    for p in cands:
        rows.setdefault(p.spec.model_dump_json(), []).append(p)
    scored = [(sorted(r, key=lambda p: p.concurrency), geomean([p.speedup for p in r])) for r in rows.values()
              if len(r) == len(levels)]
    top = max(score for _, score in scored)
    near = [(r, score) for r, score in scored if score >= top * 0.99]
    row, _ = min(near, key=lambda x: (x[0][0].spec.budget if x[0][0].spec.method != "off" else 1, -x[1]))
    return row[0].spec, row


def write_csv(preds: list[Prediction], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["concurrency", "config", "method", "depth", "topk", "budget", "tau", "verify_ms", "draft_ms",
                    "tpot_ms", "tok_s", "speedup"])
        for p in preds:
            s = p.spec
            w.writerow([p.concurrency, s.key(), s.method, s.depth if s.method != "off" else 0,
                        s.topk if s.method != "off" else 0, s.budget if s.method != "off" else 1, f"{p.tau:.3f}",
                        f"{p.verify_s * 1e3:.3f}", f"{p.draft_s * 1e3:.3f}", f"{p.tpot_ms:.3f}", f"{p.tok_s:.1f}",
                        f"{p.speedup:.3f}"])
    return path


def plot(preds: list[Prediction], title: str, path: Path, top: int = 6) -> Path:
    """Speedup over autoregressive vs concurrency for the best few configurations and the best per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({p.concurrency for p in preds})
    keys = sorted({p.spec.key() for p in preds if p.spec.method != "off"},
                  key=lambda k: -max(p.tok_s for p in preds if p.spec.key() == k and p.concurrency == levels[0]))[:top]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k in keys:
        ys = [next(p.speedup for p in preds if p.spec.key() == k and p.concurrency == c) for c in levels]
        ax.plot(levels, ys, marker="o", label=k)
    best = best_per_concurrency(preds)
    ax.plot(levels, [best[c].speedup for c in levels], "k--", lw=1, label="best per concurrency")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (sequences per replica)")
    ax.set_ylabel("predicted speedup over autoregressive")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(preds: list[Prediction], per_level: int = 5) -> str:
    """The best `per_level` configurations and `off` at each concurrency, as text."""
    lines = [f"{'conc':>5}  {'configuration':<24} {'tau':>5} {'TPOT ms':>8} {'tok/s':>10} {'speedup':>8}"]
    for c in sorted({p.concurrency for p in preds}):
        rows = sorted((p for p in preds if p.concurrency == c), key=lambda p: -p.tok_s)
        shown = rows[:per_level] + [p for p in rows[per_level:] if p.spec.method == "off"]
        for p in shown:
            lines.append(f"{c:>5}  {p.spec.key():<24} {p.tau:>5.2f} {p.tpot_ms:>8.2f} {p.tok_s:>10.1f} "
                         f"{p.speedup:>7.2f}x")
    return "\n".join(lines)


def measured_here(cfg: Config, acc: Acceptance, refresh: bool = False, batches: tuple[int, ...] = (1,)) -> StepCost:
    """The measured cost model of this machine for cfg's built-in engine (target forward vs tokens
    and context, alone and as a batched step of each of `batches`, cached per machine and engine)
    with the draft times the profile measured."""
    import torch

    from engine.models.machine import cache_root

    from engine.models.target import load_target
    from engine.measure.profile import engine_key
    from tuner.projection.profiling import fp8_profile

    if acc.draft_s is None:
        raise UserError("hardware=cpu projects with the measured cost of this machine: it needs a profile "
                        "(--from RUN or --profile), whose replay measured the draft times")
    if cfg.engine.builtin.threads:
        torch.set_num_threads(cfg.engine.builtin.threads)
    target = load_target(cfg.model, cfg.engine.builtin.model_copy(
        update={"weights": "fp8" if fp8_profile(cfg) else cfg.engine.builtin.weights}),
                         cfg.cache_dir, cfg.seed)
    b = cfg.engine.builtin
    key = engine_key(target, b.forward, b.compile, b.linear_plan)
    if acc.engine and acc.engine != key:
        raise UserError(f"the profile's draft times were measured with {acc.engine}, this engine is "
                        f"{key}: profile again with the same engine.builtin settings")
    cost = measured_cost(target, key, cache_root(cfg.cache_dir), refresh=refresh, builtin=b,
                         spectune_cache=cfg.cache_dir, batches=batches)
    cost.draft = dict(acc.draft_s)
    return cost


def cost_for(cfg: Config, acc: Acceptance) -> tuple[StepCost, int]:
    """The step cost of cfg.model on cfg.hardware as cfg.deploy serves it, and its tensor parallel
    size: this machine's measured cost for hardware=cpu (concurrency 1 only), else the roofline."""
    from tuner.schema.fit import tensor_parallel_size

    hw = cfg.hardware
    tp = tensor_parallel_size(cfg.model, hw, cfg.deploy)
    if hw.accelerator == "cpu":
        return measured_here(cfg, acc), tp
    draft = cfg.spec.draft_model or (cfg.model.draft_sources.draft_model[:1] or [None])[0]
    return roofline_for(cfg.model, hw, tp, cfg.deploy.quantization, cfg.deploy.kv_cache_dtype, draft), tp


def run_projection(cfg: Config, acc: Acceptance, out_dir: Path, concurrency: list[int] | None = None,
                   context: int | None = None) -> tuple[list[Prediction], dict]:
    """Project `acc` onto cfg.hardware for cfg.model as cfg.deploy serves it; write projection.csv,
    projection.png and projection.yaml (best per concurrency, the K schedule, what was assumed).
    hardware=cpu (here) uses the measured cost model at concurrency 1; GPUs the roofline."""
    from deploy.render import make_out_dir
    from tuner.schema.fit import tensor_parallel_size

    hw = cfg.hardware
    if hw.accelerator == "cpu":
        concurrency = [1]
    if concurrency is None:
        levels = cfg.workload.concurrency if cfg.workload and len(cfg.workload.concurrency) > 1 else DEFAULT_CONCURRENCY
        concurrency = sorted(set(levels))
    ctx = context or acc.context or DEFAULT_CONTEXT
    check_projection_inputs(cfg, tensor_parallel_size(cfg.model, hw, cfg.deploy), list(concurrency), ctx)
    make_out_dir(out_dir)  # before the cost: a file in its place is said before anything is measured
    cost, tp = cost_for(cfg, acc)
    preds = project(cost, acc, list(concurrency), ctx)
    write_csv(preds, out_dir / "projection.csv")
    here = "measured cost of this machine" if hw.accelerator == "cpu" else f"TP {tp}, roofline"
    title = (f"{cfg.model.name} on {hw.name} ({here}, {'FP8' if cfg.deploy.quantization == 'fp8' else '16-bit'} "
             f"weights), context {ctx}; tau: {acc.source}")
    plot(preds, title, out_dir / "projection.png")
    best = best_per_concurrency(preds)
    chain, bands = k_schedule(preds)
    summary = {
        "projected": True,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": cfg.model.name, "hardware": hw.name, "tensor_parallel_size": tp,
        "cost_model": "measured here" if hw.accelerator == "cpu" else "roofline",
        "quantization": cfg.deploy.quantization, "kv_cache_dtype": cfg.deploy.kv_cache_dtype,
        "context": ctx, "acceptance": acc.source, "tau_is_estimate": acc.estimate,
        "best": [{"concurrency": c, "spec": p.spec.key(), "tau": round(p.tau, 3), "tpot_ms": round(p.tpot_ms, 3),
                  "tok_s": round(p.tok_s, 1), "speedup": round(p.speedup, 3)} for c, p in best.items()],
        "vllm_chain": chain.key() if chain else None,
        "k_per_batch_size": [list(b) for b in bands] if chain else None,
    }
    (out_dir / "projection.yaml").write_text(yaml.safe_dump(summary, sort_keys=False))
    return preds, summary


def default_out_dir(cfg: Config, run: Path | None) -> Path:
    name = f"projection-{cfg.hardware.name}-{cfg.model.name}"
    if run is not None:
        return run / name
    return Path(cfg.run_dir) / f"{name}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"


def with_run(cfg: Config, run: Path, overrides: list[str]) -> Config:
    """cfg with the run's model, workload and engine settings (what was profiled) unless overridden:
    `tuner project --from RUN hardware=h100x1` projects the run's own model, not the default one."""
    from tuner.schema.config import EngineConfig, ModelConfig, WorkloadConfig

    path = run / "config.yaml"
    if not path.is_file():
        raise UserError(f"--from {run}: no config.yaml there (a run directory of `tuner optimize` or `tuner profile`)")
    saved = yaml.safe_load(path.read_text()) or {}
    touched = {o.lstrip("+~").split("=")[0].split(".")[0] for o in overrides}
    if saved.get("model") and "model" not in touched:
        cfg.model = ModelConfig(**saved["model"])
    if saved.get("workload") and "workload" not in touched:
        cfg.workload = WorkloadConfig(**saved["workload"])
    if saved.get("engine") and "engine" not in touched:
        cfg.engine = EngineConfig(**saved["engine"])
    return cfg



def projected_best(cfg: Config, run: Path) -> BestResult:
    """What `tuner render --from RUN --projected` serves: the run's acceptance profile
    (RUN/profile.json) projected onto cfg.hardware, and the configuration `choose_projected` picks
    for cfg.deploy.target at the workload's concurrency levels, as a best.yaml whose `projection`
    says that it was predicted, for which hardware, from which profile, with which figures.

    cfg is the run's config with the render's overrides (config_for_run). Deterministic: the date is
    the profile's modification time, so the same run renders the same bytes."""
    from deploy.render import load_best
    from tuner.schema.compose import load_saved_config

    path = run / "profile.json"
    if not path.is_file():
        raise UserError(f"--projected: {run} holds no profile.json; make one with `tuner profile --from {run}`, "
                        "then render again")
    acc = acceptance_from_profile(path, cfg.model.name)
    hw = cfg.hardware
    cost, tp = cost_for(cfg, acc)
    levels = [1] if hw.accelerator == "cpu" else sorted(set(cfg.workload.concurrency if cfg.workload else [1]) or {1})
    ctx = acc.context or DEFAULT_CONTEXT
    check_projection_inputs(cfg, tp, levels, ctx)
    preds = project(cost, acc, levels, ctx)
    spec, rows = choose_projected(preds, cfg.deploy.target)
    measured = load_best(run / "best.yaml") if (run / "best.yaml").is_file() else None
    saved = load_saved_config(run / "config.yaml")
    date = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat(timespec="seconds")
    if measured is not None:
        prov = measured.provenance.model_copy(update={"trial": None, "date": date})
    else:
        prov = Provenance(study=saved.search.study_name or run.name, date=date, model=saved.model.name,
                          hardware=saved.hardware.name, engine=saved.engine.kind,
                          workload=saved.workload.name if saved.workload else "",
                          measured_weights=measured_weights(saved), served_weights=saved.model.hf_id)
    speedup = geomean([p.speedup for p in rows])
    projection = Projection(
        hardware=hw.name, run=str(run), profile=str(path), acceptance=acc.source, tau_is_estimate=acc.estimate,
        cost_model="measured here" if hw.accelerator == "cpu" else "roofline", tensor_parallel_size=tp,
        context=ctx, concurrency=levels, predicted_speedup=round(speedup, 4),
        predicted_tpot_ms=round(geomean([p.tpot_ms for p in rows]), 4),
        per_concurrency=[ProjectedPoint(concurrency=p.concurrency, spec=p.spec.key(), tau=round(p.tau, 4),
                                        tpot_ms=round(p.tpot_ms, 4), tok_s=round(p.tok_s, 2),
                                        speedup=round(p.speedup, 4)) for p in rows],
        measured_spec=measured.spec.key() if measured is not None else None)
    chain, bands = k_schedule(preds)  # recorded as best.yaml's chain_spec records a study's best chain
    if chain is not None and len(bands) > 1:
        chain = chain.model_copy(update={"k_per_batch_size": bands})
    return BestResult(
        spec=spec, chain_spec=SpecConfig.model_validate(chain.model_dump()) if chain is not None else None,
        k_schedule_note="K per concurrency band projected (spec.k_per_batch_size)" if spec.k_per_batch_size else None,
        reason=(f"projected onto {hw.name} from {path}: the best predicted configuration for deploy="
                f"{cfg.deploy.target} at concurrency {','.join(map(str, levels))} (not measured on {hw.name})"),
        provenance=prov, projection=projection)
