"""CLI: `tuner profile` (acceptance of every configuration from one target pass, engine.measure.profile)
and `tuner project` (those configurations on a hardware profile's roofline, tuner.projection.projector)."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from tuner.schema.config import Config, SpecConfig, UserError
from tuner.cli.help import examples


def profile_specs(cfg: Config, heads: dict[str, str] | None) -> list[SpecConfig]:
    """The search space's points, one per acceptance identity (a K schedule does not change tau; an adaptive
    point is profiled as the static tree of its bounds)."""
    from tuner.search.space import SearchSpace

    out: list[SpecConfig] = [SpecConfig(method="off")]
    seen = {out[0].model_dump_json()}  # a set: a banded space has thousands of points (a list test is quadratic)
    for spec in SearchSpace.from_config(cfg, head_paths=heads).points():
        # an adaptive point's drafts are sized at run time: the static tree of its bounds is what a profile can measure
        spec = spec.model_copy(update={"k_per_batch_size": None, "adaptive": False})
        dump = spec.model_dump_json()
        if dump not in seen:
            seen.add(dump)
            out.append(spec)
    return out


def _profile_run(args: argparse.Namespace) -> tuple[Config, Path]:
    from tuner.schema.compose import load_config, load_saved_config, require_workload, save_config

    if args.from_run is not None:
        if args.overrides:
            raise UserError(f"--from {args.from_run}: overrides are not allowed (the run's config.yaml is profiled); "
                            f"got {' '.join(args.overrides)}")
        path = Path(args.from_run) / "config.yaml"
        if not path.is_file():
            raise UserError(f"--from {args.from_run}: no config.yaml there (a run directory of `tuner optimize`)")
        cfg = load_saved_config(path)
        require_workload(cfg)
        return cfg, Path(args.from_run)
    cfg = load_config(args.overrides)
    require_workload(cfg)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path(cfg.run_dir) / f"profile-{cfg.workload.name}-{cfg.model.name}-{stamp}"
    save_config(cfg, out / "config.yaml")
    return cfg, out


def _heads(cfg: Config, quiet: bool) -> dict[str, str]:
    """The trained heads the searched methods need, by method, exactly as `tuner optimize` gets them
    (spec.head_path when given, else cached for this target and workload, else trained once)."""
    from tuner.study.measurer import get_drafts

    return get_drafts(cfg, None, quiet)


def _cmd_profile(args: argparse.Namespace) -> int:
    from tuner.projection.profiling import fp8_profile, profile_config

    cfg, run_dir = _profile_run(args)
    specs = profile_specs(cfg, _heads(cfg, args.quiet))
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    log(f"profiling {len(specs)} configurations of {cfg.model.name} on {cfg.workload.name} "
        f"({'FP8-rounded weights' if fp8_profile(cfg) else 'full precision'})")
    done = [0]

    def on_point(r) -> None:
        done[0] += 1
        log(f"  [{done[0]}/{len(specs)}] {r.spec.key():<24} tau {r.tau:.3f}{' (estimate)' if r.estimate else ''}"
            f"  {r.seconds:.1f} s")

    prof = profile_config(cfg, specs, split=args.split, n_prompts=args.prompts, on_point=on_point)
    path = prof.save(run_dir)
    label = "estimated tau (T>0: from draft and target probabilities)" if not prof.exact else "exact greedy tau"
    print(f"{'configuration':<24} {'tau':>6}  accepted per depth   ({label}; {len(prof.prompts)} prompts, "
          f"reference pass {prof.reference_s:.1f} s)")
    for p in sorted(prof.points, key=lambda p: -p["tau"]):
        per = " ".join(f"{a:.2f}" for a in p["accepted_per_pos"])
        print(f"{p['key']:<24} {p['tau']:>6.3f}  {per}")
    print(path)
    return 0


def _parse_levels(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--concurrency {text}: a comma-separated list of integers, e.g. 1,4,16,64") from None
    if not levels or levels[0] < 1:
        raise UserError(f"--concurrency {text}: levels must be >= 1")
    return levels


def _cmd_project(args: argparse.Namespace) -> int:
    import yaml

    from tuner.schema.compose import load_config
    from tuner.projection.projector import acceptance_for, default_out_dir, format_table, run_projection, with_run

    # one source of acceptance, named once: a second one would be dropped without a word
    given = [f for f, v in (("--tau", args.tau), ("--acceptance-file", args.acceptance_file),
                            ("--profile", args.profile)) if v is not None]
    if len(given) > 1:
        raise UserError(f"{' and '.join(given)}: two sources of acceptance; give one of --tau T (for spec.*), "
                        "--acceptance-file FILE, --profile FILE (or --from RUN for its profile.json)")
    if args.context is not None and args.context < 1:
        raise UserError(f"--context {args.context}: KV context tokens per sequence, must be >= 1 "
                        "(default: the profile's mean)")
    cfg = load_config(args.overrides)
    run = Path(args.from_run) if args.from_run else None
    if run is not None:
        cfg = with_run(cfg, run, args.overrides)
    acc = acceptance_for(cfg, run=run, profile=Path(args.profile) if args.profile else None, tau=args.tau,
                         acceptance_file=Path(args.acceptance_file) if args.acceptance_file else None)
    out = Path(args.out) if args.out else default_out_dir(cfg, run)
    preds, summary = run_projection(cfg, acc, out, concurrency=_parse_levels(args.concurrency), context=args.context)
    print(f"projection of {cfg.model.name} on {cfg.hardware.name} ({summary['cost_model']}, "
          f"TP {summary['tensor_parallel_size']}, "
          f"{cfg.deploy.quantization} weights, {cfg.deploy.kv_cache_dtype} KV, context {summary['context']})")
    print(f"acceptance: {acc.source}{' — an estimate' if acc.estimate else ''}")
    print(format_table(preds))
    print("best per concurrency:")
    for b in summary["best"]:
        print(f"  {b['concurrency']:>4}: {b['spec']:<24} {b['tok_s']:.1f} tok/s, {b['speedup']:.2f}x, TPOT {b['tpot_ms']:.2f} ms")
    if summary["vllm_chain"]:
        print(f"vLLM K schedule ({summary['vllm_chain']}): "
              f"spec.k_per_batch_size={yaml.safe_dump(summary['k_per_batch_size'], default_flow_style=True).strip()}")
    print(out)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `profile` and `project` to the tuner CLI."""
    p = sub.add_parser("profile", help="acceptance (tau) of every configuration of the search space from one target pass",
                       **examples(
                           "tuner profile --from runs/STUDY  # writes runs/STUDY/profile.json",
                           "tuner profile +workload=code search.methods=[ngram,suffix] --prompts 8",
                       ))
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +workload=code search.methods=[ngram,eagle]")
    p.add_argument("--from", dest="from_run", metavar="RUN", help="profile a run directory's config; writes RUN/profile.json")
    p.add_argument("--out", metavar="DIR", help="directory for config.yaml and profile.json (default runs/profile-...)")
    p.add_argument("--split", choices=["tune", "heldout"], default="tune", help="which prompts (default: tune)")
    p.add_argument("--prompts", type=int, default=None, help="first N prompts (default: search.trial_prompts)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_cmd_profile)

    j = sub.add_parser("project", help="predicted TPOT, tok/s and speedup of each configuration on a hardware profile",
                       **examples(
                           "tuner project --from runs/STUDY hardware=h100x8",
                           "tuner project hardware=h200x1 model=llama-3.1-8b-instruct spec.method=ngram spec.depth=3 --tau 2.4",
                           "tuner project hardware=h100x8 --acceptance-file heads.yaml --concurrency 1,8,64",
                       ))
    j.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. hardware=h100x8 model=llama-3.1-8b-instruct")
    j.add_argument("--from", dest="from_run", metavar="RUN", help="a run directory holding profile.json (and its workload)")
    j.add_argument("--profile", metavar="FILE", help="an acceptance profile (profile.json or its directory)")
    j.add_argument("--tau", type=float, default=None, help="tau of spec.* (when projecting a model that was not profiled)")
    j.add_argument("--acceptance-file", metavar="FILE", help="YAML/JSON list of {method, depth, topk, budget, tau}")
    j.add_argument("--concurrency", metavar="LIST", help="levels, e.g. 1,4,16,64 (default: the workload's, or 1..64)")
    j.add_argument("--context", type=int, default=None, help="KV context tokens per sequence (default: the profile's mean)")
    j.add_argument("--out", metavar="DIR", help="output directory (default RUN/projection-HW-MODEL)")
    j.set_defaults(func=_cmd_project)
