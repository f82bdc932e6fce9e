"""CLI: `tuner optimize`, `tuner report RUN_DIR`, `tuner dashboard RUN_DIR` (thin over the library)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from tuner.schema.config import UserError
from tuner.cli.help import examples


def _cmd_optimize(args: argparse.Namespace) -> int:
    from tuner.run.session import optimize
    from tuner.run.rundir import run_dir_of

    if args.dry_run and (args.worker or args.create_only):
        raise UserError("--dry-run is for `tuner optimize` of a new study, not with --worker or --create-only")
    if args.worker or args.create_only:  # distributed studies (tuner.run.distributed)
        from tuner.run import distributed
        if args.resume:
            raise UserError("--resume is for a run directory; a worker joins its study with --worker")
        if args.create_only:
            print(distributed.create_only(args.overrides))
        else:
            distributed.run_worker(args.overrides, quiet=args.quiet, wait_drafts_s=args.wait_drafts)
        return 0
    if args.wait_drafts is not None:
        raise UserError(f"--wait-drafts {args.wait_drafts:g} is for a worker (--worker): a study started here "
                        "trains its drafts itself")
    if args.dry_run:
        from tuner.run.dryrun import dry_run
        from tuner.schema.compose import load_config, require_workload
        from tuner.schema.fit import check_study_fits

        if args.resume:
            raise UserError("--dry-run is for a new study: a resumed one continues with the servers it started")
        cfg = load_config(args.overrides)
        require_workload(cfg)
        check_study_fits(cfg)
        print(dry_run(cfg, "optimize"))
        return 0
    optimize(args.overrides, resume=run_dir_of(args.resume) if args.resume else None, quiet=args.quiet)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from deploy.render import make_out_dir, out_arg
    from tuner.report.figures import read_best, write_report
    from tuner.run.rundir import open_run_study, run_dir_of
    from tuner.schema.compose import load_saved_config

    out = out_arg(args.out)
    if args.storage or args.study:  # a shared study, read from its storage (tuner.run.distributed)
        from tuner.run.distributed import report_from_storage

        if not (args.storage and args.study) or args.run_dir:
            raise UserError("tuner report takes RUN_DIR, or --storage URL with --study NAME")
        if args.push_head is not None:
            from tuner.schema.config import HUB_REPO

            if not HUB_REPO.fullmatch(args.push_head):
                raise UserError(f"--push-head {args.push_head}: not a hub repository id (allowed: ORG/NAME, "
                                "letters, digits, - _ .)")
        written = report_from_storage(args.storage, args.study, out, args.wait)
        if args.push_head is not None:
            from tuner.cli.hub import push_winner

            print(push_winner(written, args.push_head), file=sys.stderr)
        print(written)
        return 0
    if args.run_dir is None:
        raise UserError("tuner report takes RUN_DIR, or --storage URL with --study NAME")
    if args.push_head is not None:
        raise UserError(f"--push-head {args.push_head} is for a shared study (--storage URL --study NAME); "
                        f"push a run's head with `tuner push-head {args.run_dir} --to {args.push_head}`")
    if args.wait is not None:  # a run directory's study is read as it stands: nothing to wait for
        raise UserError(f"--wait {args.wait:g} is for a shared study (--storage URL --study NAME); "
                        f"tuner report {args.run_dir} reports the run as it stands")
    run_dir = run_dir_of(args.run_dir)
    from tuner.run.distributed import is_distributed_run, report_from_storage

    if is_distributed_run(run_dir):  # a worker's run dir: best.yaml and manifests from the shared study
        search = load_saved_config(run_dir / "config.yaml").search
        print(report_from_storage(search.storage, search.study_name, out or run_dir))
        return 0
    # --out: trials.csv, the figures, report.html (and a copy of best.yaml) there; the run is only read
    study = open_run_study(run_dir)  # before --out is made: a run without a study writes nothing
    cfg = load_saved_config(run_dir / "config.yaml")
    if out is not None:
        make_out_dir(out)
        write_report(study, out, read_best(run_dir / "best.yaml"), cfg, source=run_dir)
        print(out / "report.html")
        return 0
    write_report(study, run_dir, cfg=cfg)
    print(run_dir / "report.html")
    return 0


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from tuner.schema.compose import load_saved_config
    from tuner.run.rundir import run_dir_of
    from tuner.study.storage import storage_url

    run_dir = run_dir_of(args.run_dir)
    url = storage_url(load_saved_config(run_dir / "config.yaml").search, run_dir)
    exe = shutil.which("optuna-dashboard") or str(Path(sys.executable).parent / "optuna-dashboard")
    if not Path(exe).exists():
        raise UserError("optuna-dashboard is not installed: pip install optuna-dashboard (a spectune dependency)")
    cmd = [exe, "--host", "127.0.0.1", "--port", str(args.port)]
    if url.startswith("journal:"):
        cmd += ["--storage-class", "JournalFileStorage", url[len("journal:"):]]
    else:
        cmd.append(url)
    print(f"optuna-dashboard on http://127.0.0.1:{args.port}/ (Ctrl-C to stop)", file=sys.stderr, flush=True)
    # Become the dashboard: a signal sent to `tuner dashboard` (SIGTERM from a supervisor) then
    # reaches the server itself instead of orphaning it.
    sys.stdout.flush()
    os.execv(exe, cmd)
    return 0  # not reached


def register(sub: argparse._SubParsersAction) -> None:
    """Add optimize, report and dashboard to the `tuner` parser."""
    o = sub.add_parser("optimize", help="search depth, top-k and draft budget against the live engine; "
                                        "prints the run directory last",
                       **examples(
                           "tuner optimize +workload=code",
                           "tuner optimize +workload=chat search=quick model=llama-3.1-8b-instruct hardware=h200x1 engine=vllm",
                           "tuner optimize --resume runs/STUDY  # continue after an interruption",
                       ))
    o.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +workload=code search=quick")
    o.add_argument("--resume", metavar="RUN_DIR", help="continue the study of RUN_DIR after an interruption")
    o.add_argument("--quiet", action="store_true", help="no live progress, only the run directory")
    o.add_argument("--dry-run", action="store_true",
                   help="print the command and environment of the baseline server and of the first trial's server, "
                        "then exit without starting anything")
    o.add_argument("--worker", action="store_true",
                   help="join the shared study search.study_name in search.storage (its config comes from the "
                        "study; only search.storage, search.study_name, engine.*, run_dir, cache_dir are taken)")
    o.add_argument("--wait-drafts", type=float, metavar="SECONDS",
                   help="with --worker: first wait up to SECONDS for the trained drafts the study needs in "
                        "cache_dir (`tuner train-draft --searched`, e.g. render-tuner's train Job) instead of "
                        "training them in this worker")
    o.add_argument("--create-only", action="store_true",
                   help="create the shared study (baseline and defaults enqueued once) and exit; idempotent")
    o.set_defaults(func=_cmd_optimize)

    r = sub.add_parser("report", help="re-render trials.csv, the PNGs and report.html of a run directory; for a "
                                    "shared study (--storage/--study, or a worker's run dir) also best.yaml and "
                                    "the manifests",
                       **examples(
                           "tuner report runs/STUDY",
                           "tuner report runs/STUDY --out reports/STUDY  # the report into another directory",
                           "tuner report --storage env --study code-smollm2-135m-builtin --out results/",
                       ))
    r.add_argument("run_dir", metavar="RUN_DIR", nargs="?")
    r.add_argument("--storage", help="a shared study's storage: postgresql://USER@HOST/DB (password from "
                                     "PGPASSWORD), env (SPECTUNE_STORAGE_URL) or journal:PATH")
    r.add_argument("--study", help="the shared study's name (with --storage)")
    r.add_argument("--push-head", metavar="ORG/NAME",
                   help="with --storage: then push the winner's trained head to this hub repository (HF_ENDPOINT, "
                        "HF_TOKEN) and write the manifests against it, as `tuner push-head` does")
    r.add_argument("--out", help="directory for best.yaml, the report and manifests, created if missing "
                                 "(default RUN_DIR, or <run_dir>/<study>)")
    r.add_argument("--wait", type=float, metavar="SECONDS",
                   help="with --storage: first wait up to SECONDS until the study's budget is spent")
    r.set_defaults(func=_cmd_report)

    d = sub.add_parser("dashboard", help="optuna-dashboard on 127.0.0.1 for a run directory's study",
                       **examples(
                           "tuner dashboard runs/STUDY",
                           "tuner dashboard runs/STUDY --port 8090",
                       ))
    d.add_argument("run_dir", metavar="RUN_DIR")
    d.add_argument("--port", type=int, default=8080)
    d.set_defaults(func=_cmd_dashboard)
