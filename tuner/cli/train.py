"""`tuner train-draft [overrides] +workload=NAME`: train (or reuse) the EAGLE head (spec.method=eagle3:
an EAGLE-3 head; medusa / draft_model: those drafts) for the configured target and workload
(engine.heads.drafts.ensure_draft), with progress, and print where it lies."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tuner.schema.config import Config, UserError
from tuner.schema.methods import trained_by
from tuner.cli.help import examples

# Drafts trained by engine.heads.medusa_train / draft_model_train instead of the EAGLE head pipeline.
OTHER_DRAFTS = trained_by("medusa") + trained_by("draft_model")


def train_draft(cfg: Config, retrain: bool = False, quiet: bool = False, method: str | None = None) -> Path:
    """Train or reuse the head (or, for method medusa / draft_model, that draft) for cfg (rich
    progress unless quiet); returns its directory."""
    from engine.heads.drafts import ensure_draft
    from tuner.schema.compose import packaged_workloads, require_workload
    from tuner.study.measurer import train_job

    require_workload(cfg)

    from tuner.study.progress import head_progress

    with head_progress(quiet) as report:
        trained = method if method in OTHER_DRAFTS or method == "eagle3" else "eagle"
        return ensure_draft(train_job(cfg), trained, retrain=retrain, workloads=packaged_workloads(cfg), report=report)


def train_searched(cfg: Config, quiet: bool = False) -> dict[str, str]:
    """Every draft the searched methods need (tuner.schema.config.trained_drafts), trained once or
    taken from the cache: the lookup a study's workers make (get_drafts), so a worker sharing this
    cache_dir finds them and trains nothing. Returns {method: draft} (given or published ones too)."""
    from tuner.schema.compose import require_workload
    from tuner.study.measurer import get_drafts

    require_workload(cfg)
    return get_drafts(cfg, None, quiet=quiet)


def _cmd_train(args: argparse.Namespace) -> int:
    from tuner.schema.compose import load_config

    from engine.heads.pipeline import read_meta

    if args.searched:
        if any(o.startswith("spec.method=") for o in args.overrides) or args.retrain:
            raise UserError("train-draft --searched trains the drafts of search.methods: give search.methods=[...] "
                            "instead of spec.method, and no --retrain")
        drafts = train_searched(load_config(args.overrides), quiet=args.json)
        if args.json:
            print(json.dumps(drafts))
        for m, path in drafts.items():
            if not args.json:
                print(f"{m}: {path}")
        if not drafts and not args.json:
            print("search.methods needs no trained draft")
        return 0

    # spec.method=draft_model names the draft to train, not one to use: taken out before validation
    # (which would ask for spec.draft_model)
    method = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("spec.method=")), None)
    other = method in OTHER_DRAFTS
    cfg = load_config([o for o in args.overrides if not (other and o.startswith("spec.method="))])
    path = train_draft(cfg, retrain=args.retrain, quiet=args.json, method=method)
    meta = read_meta(path)
    if args.json:
        print(json.dumps({"head_path" if method != "draft_model" else "draft_model": str(path), **meta}))
        return 0
    if other:
        use = f"spec.head_path={path}" if method == "medusa" else f"spec.draft_model={path}"
        print(f"{method}: {path}")
        print(f"  trained {meta['steps']} steps in {meta.get('train_seconds', 0):.0f} s; validation loss "
              f"{meta.get('val_loss_before')} -> {meta.get('val_loss')}")
        if meta.get("acceptance_per_depth"):
            acc = " ".join(f"{a:.2f}" for a in meta["acceptance_per_depth"])
            print(f"  offline T=0 chain acceptance per depth: {acc}  (tau estimate {meta.get('tau_chain_offline')})")
        print(f"  use it: spec.method={method} {use}")
        return 0
    acc = " ".join(f"{a:.2f}" for a in meta.get("acceptance_per_depth", []))
    print(f"head: {path}")
    print(f"  trained {meta['steps']} steps in {meta.get('train_seconds', 0):.0f} s on "
          f"{meta['data'].get('tokens', 0)} tokens of {meta['data'].get('prompts', 0)} prompts; "
          f"loss {meta.get('loss_first')} -> {meta.get('loss_last')}")
    print(f"  offline T=0 chain acceptance per depth: {acc}  (tau estimate {meta.get('tau_chain_offline')})")
    print(f"  draft vocabulary {meta.get('draft_vocab') or 'full'} (held-out coverage {meta.get('draft_vocab_coverage')}); "
          f"data {meta['data'].get('answer_tokens', 0)} answer tokens at {meta['data'].get('generate_tok_s', 0)} tok/s")
    print(f"  use it: spec.method={meta.get('method', 'eagle')} spec.head_path={path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `train-draft` to the tuner CLI."""
    t = sub.add_parser("train-draft", help="train an EAGLE draft head on the target's own answers (cached per target and workload)",
                       **examples(
                           "tuner train-draft +workload=code",
                           "tuner train-draft +workload=chat train.steps=600 --retrain --json",
                           "tuner train-draft --searched +workload=code  # every draft search.methods needs",
                       ))
    t.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. train.steps=600 +workload=code")
    t.add_argument("--retrain", action="store_true", help="train again even if a head is cached")
    t.add_argument("--searched", action="store_true",
                   help="train every draft search.methods needs (as a study's workers look them up), e.g. once "
                        "for all workers of a distributed study")
    t.add_argument("--json", action="store_true", help="print the head's metadata as one JSON object (no progress bar)")
    t.set_defaults(func=_cmd_train)
