"""`tuner check --url URL --against RUN`: thin over tuner.run.regression."""

from __future__ import annotations

import argparse
from pathlib import Path

from tuner.cli.help import examples
from tuner.schema.config import UserError


def _cmd_check(args: argparse.Namespace) -> int:
    from tuner.cli.bench import _served_model
    from tuner.run.regression import compare, measure_endpoint, run_figures

    if not 0 < args.tolerance < 1 or not 0 < args.tau_tolerance < 1:
        raise UserError(f"--tolerance {args.tolerance} / --tau-tolerance {args.tau_tolerance}: each is a share "
                        "between 0 and 1, e.g. 0.1")
    if args.repeats < 1:
        raise UserError(f"--repeats {args.repeats}: at least 1")
    cfg, best, tuned = run_figures(args.against)
    model = args.model or _served_model(args.url)
    measured = measure_endpoint(args.url, model, cfg, args.repeats)
    result = compare(tuned, measured, args.tolerance, args.tau_tolerance)
    regressed = [c for c in result if c.regressed]
    if tuned.tau is None:  # a launched server's held-out check counts forwards over both sides' pass
        print(f"tau: not compared: {args.against}/best.yaml has no held-out tau")
    for c in regressed or result:
        print(c.line())
    if regressed:
        return 1
    print(f"{args.url} performs as tuned in {args.against} (spec '{best.spec.key()}', workload {cfg.workload.name} "
          f"held-out, concurrency {','.join(map(str, cfg.workload.concurrency))})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `check` to the tuner CLI."""
    c = sub.add_parser("check", help="measure a running endpoint on a run's held-out prompts and compare with its "
                                     "best.yaml (exit 1 on a regression)",
                       **examples(
                           "tuner check --url http://spectune.serving:8000 --against runs/STUDY",
                           "tuner check --url http://127.0.0.1:8000 --against runs/STUDY --tolerance 0.2",
                       ))
    c.add_argument("--url", required=True, help="the running OpenAI-compatible endpoint (its /metrics gives tau)")
    c.add_argument("--against", required=True, type=Path, help="run directory holding config.yaml and best.yaml")
    c.add_argument("--model", help="the model name to request (default: the first in /v1/models)")
    c.add_argument("--repeats", type=int, default=2, help="passes over the held-out prompts per level (default 2, "
                                                          "as the study's held-out check)")
    c.add_argument("--tolerance", type=float, default=0.1,
                   help="tok/s and TPOT p99 regress beyond this share or the tuned interval's, whichever is wider "
                        "(default 0.1)")
    c.add_argument("--tau-tolerance", type=float, default=0.05, help="tau regresses below this share (default 0.05)")
    c.set_defaults(func=_cmd_check)
