"""CLI: `tuner render-tuner` (Kubernetes objects of a distributed study) and `tuner wait-storage`
(the pods' wait for the database); thin over deploy.tuner_manifests and tuner.run.distributed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tuner.schema.config import Config, UserError
from tuner.cli.help import examples

DEFAULT_OUT = Path("k8s/tuner")
HEADER = "# Rendered by `tuner render-tuner` (spectune). Change the config and re-render rather than editing.\n"


def _given(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def study_overrides(overrides: list[str]) -> list[str]:
    """The render's overrides with the workers' engine made explicit: the engine the deployment
    serves (deploy.target), so the study measures what the manifests serve, in the precision they
    serve it (vLLM/SGLang with deploy.quantization on GPUs). An engine= that differs from the
    deployment's is refused in one line naming both keys."""
    from tuner.schema.compose import load_config

    cfg = load_config([*overrides, "search.storage=env"] if not _given(overrides, "search.storage") else overrides)
    served = cfg.deploy.target
    if cfg.engine.kind == served:
        return overrides
    if _given(overrides, "engine"):
        raise UserError(f"render-tuner engine={cfg.engine.kind} with deploy={served}: the workers would measure "
                        f"another engine (and precision) than the deployment serves; give engine={served}, or "
                        f"deploy={cfg.engine.kind}")
    return [*overrides, f"engine={served}"]


def tuner_config(overrides: list[str]) -> Config:
    """The config a render describes (with study_overrides' engine). Its storage is the pods'
    business (set in their arguments), so one is assumed here when the overrides give none
    (search.workers>1 requires one). A given search.storage=postgresql://USER@HOST/DB is the
    database the pods use (no PostgreSQL is rendered); a storage the pods cannot share, or a second
    database, is refused in one line."""
    from tuner.schema.compose import load_config

    overrides = study_overrides(overrides)
    given = _given(overrides, "search.storage")
    cfg = load_config(overrides if given else [*overrides, "search.storage=env"])
    if given:
        check_storage(cfg)
    return cfg


def check_storage(cfg: Config) -> None:
    """A search.storage the render's pods can use, or a UserError naming what is allowed."""
    url, ext = cfg.search.storage or "", cfg.distributed.external_url_secret
    ways = ("search.storage=postgresql://USER@HOST/DB (password from the Secret distributed.db_secret, key password), "
            "distributed.external_url_secret={name: NAME, key: KEY} (a Secret holding the whole URL), or neither "
            "(an in-cluster PostgreSQL)")
    if url.startswith("postgresql") and ext is not None:
        raise UserError(f"search.storage={url} and distributed.external_url_secret={ext.name}: two databases; "
                        "give one of them")
    if url == "env" and ext is None:
        raise UserError("search.storage=env: the pods read SPECTUNE_STORAGE_URL from a Secret: name it with "
                        f"distributed.external_url_secret={{name: NAME, key: KEY}}; allowed: {ways}")
    if url != "env" and not url.startswith("postgresql"):
        raise UserError(f"search.storage={url or 'null'}: the workers are pods on several nodes and share a database, not a "
                        f"file; allowed: {ways}")


def image_note(cfg: Config, image: str) -> None:
    """One stderr line when manifests name a spectune image at the default image_repo, which
    publishes none: how to build and push it and render with the user's repository."""
    from tuner.schema.config import DEFAULT_IMAGE_REPO

    if cfg.image_repo == DEFAULT_IMAGE_REPO:
        print(f"note: {image} is not published: build and push it (make image push IMAGE_REPO=REPO) and render "
              "with image_repo=REPO (docs/deploy.md, Images)", file=sys.stderr)


def render_tuner(overrides: list[str], out: Path) -> tuple[list[Path], list[str]]:
    """Write the kustomize base of a distributed study into `out`; (files, validation errors)."""
    from deploy.render import write_docs
    from deploy.tuner_manifests import build
    from deploy.validate import check_dir

    cfg = tuner_config(overrides)
    files = write_docs(build(cfg, study_overrides(overrides)), out, HEADER)
    return files, check_dir(out, cfg.deploy.k8s_version)


def _cmd_render_tuner(args: argparse.Namespace) -> int:
    from deploy.render import out_arg
    from deploy.tuner_manifests import study_name, user_database, worker_gpus, worker_image

    out = out_arg(args.out)
    assert out is not None  # --out has a default
    files, errors = render_tuner(args.overrides, out)
    for line in errors:  # never expected: a failure here is a renderer bug
        print(line, file=sys.stderr)
    cfg = tuner_config(args.overrides)
    if study_overrides(args.overrides) != args.overrides:
        print(f"note: the workers run engine={cfg.engine.kind}, the engine deploy={cfg.deploy.target} serves "
              "(give both to change it)", file=sys.stderr)
    if cfg.distributed.image is None:
        image_note(cfg, worker_image(cfg))
    db = (f"external database (Secret {cfg.distributed.external_url_secret.name})"
          if cfg.distributed.external_url_secret
          else f"external database {user_database(cfg)} (password from Secret {cfg.distributed.db_secret}, key password)"
          if user_database(cfg) else f"PostgreSQL (Secret {cfg.distributed.db_secret})")
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
                                            "a study-creator Job, an Indexed Job of workers, a report Job",
                       **examples(
                           "tuner render-tuner +workload=code hardware=h200x1 search.workers=4",
                           "tuner render-tuner +workload=code search.workers=4 search.storage=postgresql://tuner@db.example/optuna",
                           "tuner render-tuner +workload=chat 'distributed.external_url_secret={name: tuner-db-url, key: url}' --out k8s/chat",
                       ))
    r.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +workload=code hardware=h200x1 search.workers=4 "
                                                   "(search.storage=postgresql://USER@HOST/DB: that database instead "
                                                   "of an in-cluster PostgreSQL)")
    r.add_argument("--out", default=str(DEFAULT_OUT), help=f"output directory, created if missing (default {DEFAULT_OUT})")
    r.set_defaults(func=_cmd_render_tuner)

    w = sub.add_parser("wait-storage", help="wait until a study storage answers (and a study exists)",
                       **examples(
                           "tuner wait-storage --storage env --study code-smollm2-135m-builtin",
                           "tuner wait-storage --storage postgresql://tuner@db:5432/optuna --timeout 120",
                       ))
    w.add_argument("--storage", required=True, help="postgresql://USER@HOST/DB (password from PGPASSWORD), "
                                                    "env (SPECTUNE_STORAGE_URL) or journal:PATH")
    w.add_argument("--study", help="also wait until this study exists")
    w.add_argument("--timeout", type=float, default=600, help="seconds before giving up (exit 2)")
    w.set_defaults(func=_cmd_wait_storage)
