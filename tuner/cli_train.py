"""`tuner train-draft [overrides] +workload=NAME`: train (or reuse) the EAGLE head for the configured
target and workload (engine.train.ensure_head), with a progress bar, and print where it lies."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tuner.schema import Config, WorkloadConfig


# Diversity sources in a fixed order (prompt selection depends on it, and so does the data cache key):
# the packaged workloads first, then any others found in conf/workload.
ORDER = ("code", "chat", "math", "json", "creative")


def packaged_workloads(cfg: Config) -> list[WorkloadConfig]:
    """Every packaged workload other than cfg's: diversity prompts, and held-out sets to exclude."""
    from tuner.config import available, load_config

    own = cfg.workload.name if cfg.workload else None
    names = [n for n in ORDER if n in available("workload")] + [n for n in available("workload") if n not in ORDER]
    return [w for w in (load_config([f"+workload={name}"]).workload for name in names)
            if w is not None and w.name != own]


def train_draft(cfg: Config, retrain: bool = False, quiet: bool = False) -> Path:
    """Train or reuse the head for cfg (rich progress unless quiet); returns its directory."""
    from tuner.config import require_workload

    require_workload(cfg)
    from engine.train import ensure_head

    others = packaged_workloads(cfg)
    if quiet:
        return ensure_head(cfg, retrain=retrain, workloads=others)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()) as bar:
        tasks: dict[str, int] = {}

        def report(phase: str, done: int, total: int, info: dict) -> None:
            if phase not in tasks:
                label = "answering prompts" if phase == "generate" else "training head"
                tasks[phase] = bar.add_task(label, total=total, info="", completed=0)
            text = ""
            if "loss" in info:
                text = f"loss {info['loss']:.3f} ce {info.get('ce', 0):.2f} acc@1 {info.get('acc', 0):.2f}"
            bar.update(tasks[phase], completed=done, total=total, info=text)

        return ensure_head(cfg, retrain=retrain, workloads=others, report=report)


def _cmd_train(args: argparse.Namespace) -> int:
    from tuner.config import load_config

    from engine.train import read_meta

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
