"""CLI: `tuner optimize`, `tuner report RUN_DIR`, `tuner dashboard RUN_DIR` (thin over the library)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from tuner.schema import UserError


def _run_dir(path: str) -> Path:
    d = Path(path)
    if not (d / "config.yaml").is_file():
        raise UserError(f"{d}: not a run directory (no config.yaml); give the directory `tuner optimize` printed")
    return d


def _cmd_optimize(args: argparse.Namespace) -> int:
    from tuner.optimize import optimize

    optimize(args.overrides, resume=_run_dir(args.resume) if args.resume else None, quiet=args.quiet)
    return 0


def open_run_study(run_dir: Path):  # -> optuna.Study
    """The study of a run directory, read from the storage its config.yaml names."""
    import optuna

    from tuner.config import load_saved_config
    from tuner.study import open_storage, storage_url

    cfg = load_saved_config(run_dir / "config.yaml")
    url = storage_url(cfg.search, run_dir)
    try:
        return optuna.load_study(study_name=cfg.search.study_name, storage=open_storage(url))
    except KeyError:
        raise UserError(f"{run_dir}: no study named {cfg.search.study_name!r} in {url}") from None


def _cmd_report(args: argparse.Namespace) -> int:
    from tuner.report import write_report

    run_dir = _run_dir(args.run_dir)
    write_report(open_run_study(run_dir), run_dir)
    print(run_dir / "report.html")
    return 0


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from tuner.config import load_saved_config
    from tuner.study import storage_url

    run_dir = _run_dir(args.run_dir)
    url = storage_url(load_saved_config(run_dir / "config.yaml").search, run_dir)
    exe = shutil.which("optuna-dashboard") or str(Path(sys.executable).parent / "optuna-dashboard")
    if not Path(exe).exists():
        raise UserError("optuna-dashboard is not installed: pip install optuna-dashboard (a spectune dependency)")
    cmd = [exe, "--host", "127.0.0.1", "--port", str(args.port)]
    if url.startswith("journal:"):
        cmd += ["--storage-class", "JournalFileStorage", url[len("journal:"):]]
    else:
        cmd.append(url)
    print(f"optuna-dashboard on http://127.0.0.1:{args.port}/ (Ctrl-C to stop)", file=sys.stderr)
    return subprocess.call(cmd)


def register(sub: argparse._SubParsersAction) -> None:
    """Add optimize, report and dashboard to the `tuner` parser."""
    o = sub.add_parser("optimize", help="search depth, top-k and draft budget against the live engine; "
                                        "prints the run directory last")
    o.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +workload=code search=quick")
    o.add_argument("--resume", metavar="RUN_DIR", help="continue the study of RUN_DIR after an interruption")
    o.add_argument("--quiet", action="store_true", help="no live progress, only the run directory")
    o.set_defaults(func=_cmd_optimize)

    r = sub.add_parser("report", help="re-render trials.csv, the PNGs and report.html of a run directory")
    r.add_argument("run_dir", metavar="RUN_DIR")
    r.set_defaults(func=_cmd_report)

    d = sub.add_parser("dashboard", help="optuna-dashboard on 127.0.0.1 for a run directory's study")
    d.add_argument("run_dir", metavar="RUN_DIR")
    d.add_argument("--port", type=int, default=8080)
    d.set_defaults(func=_cmd_dashboard)
