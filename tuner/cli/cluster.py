"""CLI: `tuner render-tuner` (Kubernetes objects of a distributed study) and `tuner wait-storage`
(the pods' wait for the database); thin over deploy.tuner_manifests and tuner.run.distributed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tuner.schema.config import Config

DEFAULT_OUT = Path("k8s/tuner")
HEADER = "# Rendered by `tuner render-tuner` (spectune). Change the config and re-render rather than editing.\n"


def tuner_config(overrides: list[str]) -> Config:
    """The config a render describes. Its storage is the pods' business (set in their arguments),
    so one is assumed here when the overrides give none (search.workers>1 requires one)."""
    from tuner.schema.compose import load_config

    given = any(o.lstrip("+~").startswith("search.storage=") for o in overrides)
    return load_config(overrides if given else [*overrides, "search.storage=env"])


def render_tuner(overrides: list[str], out: Path) -> tuple[list[Path], list[str]]:
    """Write the kustomize base of a distributed study into `out`; (files, validation errors)."""
    from deploy.render import write_docs
    from deploy.tuner_manifests import build
    from deploy.validate import check_dir

    cfg = tuner_config(overrides)
    files = write_docs(build(cfg, overrides), out, HEADER)
    return files, check_dir(out, cfg.deploy.k8s_version)


def _cmd_render_tuner(args: argparse.Namespace) -> int:
    from deploy.render import out_arg
    from deploy.tuner_manifests import study_name, worker_gpus

    out = out_arg(args.out)
    assert out is not None  # --out has a default
    files, errors = render_tuner(args.overrides, out)
    for line in errors:  # never expected: a failure here is a renderer bug
        print(line, file=sys.stderr)
    cfg = tuner_config(args.overrides)
    db = (f"external database (Secret {cfg.distributed.external_url_secret.name})"
          if cfg.distributed.external_url_secret else f"PostgreSQL (Secret {cfg.distributed.db_secret})")
    print(f"rendered {len(files)} files into {out}: study {study_name(cfg)}, {cfg.search.workers} worker(s) x "
          f"{worker_gpus(cfg)} GPU(s) on {cfg.hardware.name}, {db}, Kubernetes {cfg.deploy.k8s_version}"
          f"{', INVALID' if errors else ', valid'}")
    return 2 if errors else 0


def _cmd_wait_storage(args: argparse.Namespace) -> int:
    from tuner.run.distributed import wait_for_study
    from tuner.study.storage import mask_url, reject_password, resolve_storage

    reject_password(args.storage)
    url = resolve_storage(args.storage)
    wait_for_study(url, args.study, args.timeout)
    print(f"{mask_url(url)} is ready" + (f" with study {args.study}" if args.study else ""), file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `render-tuner` and `wait-storage` to the `tuner` command line."""
    r = sub.add_parser("render-tuner", help="render the Kubernetes objects of a distributed study: PostgreSQL, "
                                            "a study-creator Job, an Indexed Job of workers, a report Job")
    r.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +workload=code hardware=h200x1 search.workers=4")
    r.add_argument("--out", default=str(DEFAULT_OUT), help=f"output directory, created if missing (default {DEFAULT_OUT})")
    r.set_defaults(func=_cmd_render_tuner)

    w = sub.add_parser("wait-storage", help="wait until a study storage answers (and a study exists)")
    w.add_argument("--storage", required=True, help="postgresql://USER@HOST/DB (password from PGPASSWORD), "
                                                    "env (SPECTUNE_STORAGE_URL) or journal:PATH")
    w.add_argument("--study", help="also wait until this study exists")
    w.add_argument("--timeout", type=float, default=600, help="seconds before giving up (exit 2)")
    w.set_defaults(func=_cmd_wait_storage)
