"""`tuner train-draft [overrides] +workload=NAME`: train (or reuse) the EAGLE head for the configured
target and workload (engine.heads.pipeline.ensure_head), with a progress bar, and print where it lies."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tuner.schema import Config


def train_draft(cfg: Config, retrain: bool = False, quiet: bool = False) -> Path:
    """Train or reuse the head for cfg (rich progress unless quiet); returns its directory."""
    from engine.heads.pipeline import ensure_head
    from tuner.config import packaged_workloads, require_workload

    require_workload(cfg)

    from tuner.progress_heads import head_progress

    with head_progress(quiet) as report:
        return ensure_head(cfg, retrain=retrain, workloads=packaged_workloads(cfg), report=report)


def _cmd_train(args: argparse.Namespace) -> int:
    from tuner.config import load_config

    from engine.heads.pipeline import read_meta

    cfg = load_config(args.overrides)
    path = train_draft(cfg, retrain=args.retrain, quiet=args.json)
    meta = read_meta(path)
    if args.json:
        print(json.dumps({"head_path": str(path), **meta}))
        return 0
    acc = " ".join(f"{a:.2f}" for a in meta.get("acceptance_per_depth", []))
    print(f"head: {path}")
    print(f"  trained {meta['steps']} steps in {meta.get('train_seconds', 0):.0f} s on "
          f"{meta['data'].get('tokens', 0)} tokens of {meta['data'].get('prompts', 0)} prompts; "
          f"loss {meta.get('loss_first')} -> {meta.get('loss_last')}")
    print(f"  offline T=0 chain acceptance per depth: {acc}  (tau estimate {meta.get('tau_chain_offline')})")
    print(f"  use it: spec.method=eagle spec.head_path={path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `train-draft` to the tuner CLI."""
    t = sub.add_parser("train-draft", help="train an EAGLE draft head on the target's own answers (cached per target and workload)")
    t.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. train.steps=600 +workload=code")
    t.add_argument("--retrain", action="store_true", help="train again even if a head is cached")
    t.add_argument("--json", action="store_true", help="print the head's metadata as one JSON object (no progress bar)")
    t.set_defaults(func=_cmd_train)
