"""`tuner push-head RUN_OR_HEAD --to ORG/NAME`: a trained draft head onto a hub repository, and the
run's manifests pointing at it (deploy.push does the upload)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tuner.schema.config import BestResult, SpecConfig, UserError
from tuner.schema.methods import METHODS
from tuner.cli.help import examples

BEST = "best.yaml"


def _local_ref(spec: SpecConfig | None) -> tuple[str, str] | None:
    """(field, local path) of a spec's drafter when it lives on this machine."""
    field = METHODS[spec.method].draft_field if spec is not None else None
    if field is None:
        return None
    ref = getattr(spec, field)
    return (field, ref) if ref and Path(ref).expanduser().is_dir() else None


def push_run(run_dir: Path, repo_id: str, private: bool = False) -> tuple[BestResult, list[Path]]:
    """Upload the run's head, record the repository in best.yaml (spec and chain_spec) and re-render
    RUN_DIR/k8s, so the manifests reference the hub repository. Returns (best, files)."""
    from deploy.push import push_dir
    from deploy.render import load_best, render
    from tuner.schema.compose import load_saved_config
    from tuner.report.figures import write_best

    best = load_best(run_dir / BEST)
    refs = {r for r in (_local_ref(best.spec), _local_ref(best.chain_spec)) if r is not None}
    if not refs:
        raise UserError(f"{run_dir / BEST}: the winner ({best.spec.key()}) has no draft head on this machine to push")
    paths = {ref for _, ref in refs}
    if len(paths) > 1:
        raise UserError(f"{run_dir / BEST}: spec and chain_spec use different heads ({', '.join(sorted(paths))}): "
                        "push each with `tuner push-head HEAD_DIR --to ORG/NAME`")
    push_dir(Path(paths.pop()).expanduser(), repo_id, private, message=f"spectune: draft head of run {run_dir.name}")

    def moved(spec: SpecConfig | None) -> SpecConfig | None:
        r = _local_ref(spec)
        return spec if r is None else spec.model_copy(update={r[0]: repo_id})  # type: ignore[union-attr]

    best = best.model_copy(update={"spec": moved(best.spec), "chain_spec": moved(best.chain_spec)})
    write_best(best, run_dir / BEST)
    _, files = render(load_saved_config(run_dir / "config.yaml"), best, run_dir / "k8s")
    return best, files


def push_winner(run_dir: Path, repo_id: str) -> str:
    """`tuner report --storage ... --push-head ORG/NAME`: push the winner's head, when it has one on
    this machine, and re-render RUN_DIR/k8s against the repository (push_run); one line saying what
    was done (a training-free winner has nothing to push)."""
    from deploy.render import load_best

    best = load_best(run_dir / BEST)
    if _local_ref(best.spec) is None and _local_ref(best.chain_spec) is None:
        return f"the winner ({best.spec.key()}) has no trained head here: nothing pushed to {repo_id}"
    best, files = push_run(run_dir, repo_id)
    return (f"pushed the winner's head to {repo_id}; {run_dir / BEST} and {run_dir / 'k8s'} now reference it "
            f"({len(files)} files)")


def _cmd_push_head(args: argparse.Namespace) -> int:
    from deploy.push import push_dir

    src = Path(args.source)
    if (src / BEST).is_file():
        _, files = push_run(src, args.to, args.private)
        print(f"pushed the head of {src} to {args.to}; {src / BEST} and {src / 'k8s'} now reference it "
              f"({len(files)} files)")
    else:
        url = push_dir(src, args.to, args.private)
        print(f"pushed {src} to {args.to} ({url}); serve it with spec.head_path={args.to}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `push-head` to the tuner CLI."""
    p = sub.add_parser("push-head", help="upload a trained draft head to a hub repository (HF_ENDPOINT, HF_TOKEN); "
                                         "for a run directory also point its best.yaml and manifests at it",
                       **examples(
                           "tuner push-head runs/STUDY --to my-org/smollm2-eagle  # also repoints best.yaml and re-renders",
                           "tuner push-head path/to/head --to my-org/head --private",
                       ))
    p.add_argument("source", metavar="RUN_OR_HEAD", help="a run directory of `tuner optimize`, or a head directory")
    p.add_argument("--to", required=True, metavar="ORG/NAME", help="the hub repository (created if missing)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.set_defaults(func=_cmd_push_head)
