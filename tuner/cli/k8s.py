"""`tuner render` and `tuner apply`: thin over deploy.render / deploy.validate / deploy.apply."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tuner.schema.config import UserError
from tuner.cli.help import examples


def _cmd_render(args: argparse.Namespace) -> int:
    from deploy.render import out_arg
    from deploy.validate import check_dir
    from tuner.schema.compose import load_config

    out = out_arg(args.out)
    if args.check is not None:
        # --check validates what is there: a flag that would shape a render has nothing to act on
        extra = [f for f, on in (("--from", args.run_dir is not None), ("--projected", args.projected),
                                  ("--out", out is not None)) if on]
        extra += [o for o in args.overrides if o.split("=", 1)[0].lstrip("+~") != "deploy.k8s_version"]
        if extra:
            raise UserError(f"--check {args.check} validates existing manifests and takes only deploy.k8s_version=X; "
                            f"got {' '.join(extra)} (render first, then --check the directory)")
        version = load_config(args.overrides).deploy.k8s_version
        errors = check_dir(args.check, version)
        for line in errors:
            print(line, file=sys.stderr)
        if errors:
            return 2
        print(f"{args.check}: all manifests valid for Kubernetes {version} (strict)")
        return 0
    if args.projected and args.run_dir is None:
        raise UserError("--projected needs --from RUN: a run directory holding profile.json (`tuner profile --from RUN`)")
    if args.run_dir is not None:
        from tuner.run.rundir import render_run

        plan, files = render_run(args.run_dir, args.overrides, out, projected=args.projected)
    else:
        from deploy.render import render

        cfg = load_config(args.overrides)
        plan, files = render(cfg, None, out or Path(cfg.run_dir) / "k8s")
    for note in (*plan.served.notes, *plan.platform_notes):
        print(f"note: {note}", file=sys.stderr)
    cfg = plan.cfg
    if cfg.deploy.hpa.enabled:  # nothing in the cluster serves the HPA's metric until an adapter does
        from deploy.manifests import hpa_metric_name

        print(f"note: the HPA scales on {hpa_metric_name(cfg.deploy.hpa.metric)} from the custom metrics API: "
              f"install prometheus-adapter with the rule written at the top of hpa.yaml (docs/deploy.md, "
              "Autoscaling), or set deploy.hpa.enabled=false", file=sys.stderr)
    from tuner.schema.config import deploy_image

    image = deploy_image(cfg, plan.served.spec)
    if image.startswith(f"{cfg.image_repo}/"):  # spectune's own (deploy=builtin, vLLM with arctic-inference)
        from tuner.cli.cluster import image_note

        image_note(cfg, image)
    errors = check_dir(files[0].parent, cfg.deploy.k8s_version)
    for line in errors:  # never expected: a failure here is a renderer bug, reported like --check does
        print(line, file=sys.stderr)
    pj = plan.best.projection if plan.best is not None else None
    if pj is not None:
        # one figure per level: a geometric mean over levels would read as the figure at each of them
        levels = "; ".join(f"{p.concurrency}: {p.speedup:.2f}x, TPOT {p.tpot_ms:.2f} ms"
                           + (f" ('{p.spec}')" if p.spec != plan.best.spec.key() else "") for p in pj.per_concurrency)
        print(f"projected for {pj.hardware} ({pj.cost_model}, TP {pj.tensor_parallel_size}) from {pj.profile}: "
              f"'{plan.best.spec.key()}', predicted at concurrency {levels}; geometric mean "
              f"{pj.predicted_speedup:.2f}x" + (f" (measured winner: '{pj.measured_spec}')" if pj.measured_spec else ""))
    # what the cluster must already have (also in README.md beside the manifests), one line each
    for line in plan.prerequisites:
        print(f"needs: {line}")
    # without --out, name the directory in full: the default lands under the current directory
    nodes = f" x {plan.nodes} nodes" if plan.nodes > 1 else ""
    where = f"{files[0].parent}" if out is not None else f"{files[0].parent.resolve()} (default --out;"
    print(f"rendered {len(files)} files into {where}{' ' if out is None else ' ('}deploy={cfg.deploy.target}, "
          f"spec '{plan.served.spec.key()}', "
          f"TP {plan.tp}{nodes}, Kubernetes {cfg.deploy.k8s_version}{', INVALID' if errors else ', valid'})")
    return 2 if errors else 0


def _cmd_apply(args: argparse.Namespace) -> int:
    from deploy.apply import api_client, apply_docs, manifests_to_apply

    docs = manifests_to_apply(args.dir)  # a wrong directory is named before the kubeconfig is read
    results = apply_docs(docs, api_client(args.kubeconfig, args.context), dry_run=args.dry_run)
    for r in results:
        print(r.line())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `render` and `apply` to the `tuner` command line."""
    r = sub.add_parser("render", help="render the winner into Kubernetes manifests (or --check existing ones)",
                       **examples(
                           "tuner render --from runs/STUDY  # the run's winner into runs/STUDY/k8s",
                           "tuner render --from runs/STUDY deploy=vllm hardware=h100x8 --out k8s/prod",
                           "tuner render --from runs/STUDY spec.depth=5  # the winner at depth 5 (not measured: said so)",
                           "tuner render --check k8s/prod deploy.k8s_version=1.29",
                       ))
    r.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. deploy=sglang hardware=h100x8 deploy.replicas=3")
    r.add_argument("--from", dest="run_dir", type=Path, help="run directory holding best.yaml and config.yaml: overrides "
                                                            "apply on top of its config.yaml, spec.* ones on top of "
                                                            "its winner (served with a note: not measured)")
    r.add_argument("--out", help="output directory, created if missing (default: RUN/k8s with --from RUN, "
                                 "else <run_dir>/k8s, i.e. ./runs/k8s)")
    r.add_argument("--projected", action="store_true",
                   help="with --from RUN: serve the configuration that RUN's acceptance profile (RUN/profile.json, "
                        "`tuner profile --from RUN`) predicts best on hardware= for the workload's concurrency "
                        "(for deploy=vllm a K schedule when the best K differs between levels), instead of the "
                        "measured winner; the ConfigMap records it as projected. Without this flag a hardware= "
                        "override still renders the measured winner, with a note")
    r.add_argument("--check", type=Path, metavar="DIR",
                   help="validate the manifests in DIR strictly for deploy.k8s_version instead of rendering")
    r.set_defaults(func=_cmd_render)

    a = sub.add_parser("apply", help="server-side apply rendered manifests (fieldManager=spectune)",
                       **examples(
                           "tuner apply runs/STUDY/k8s --dry-run",
                           "tuner apply k8s/prod --context prod-cluster",
                       ))
    a.add_argument("dir", type=Path, help="directory of rendered manifests (e.g. RUN_DIR/k8s)")
    a.add_argument("--dry-run", action="store_true", help="server-side dry run (dryRun=All): nothing is changed")
    a.add_argument("--kubeconfig", help="kubeconfig file (default $KUBECONFIG or ~/.kube/config)")
    a.add_argument("--context", help="kubeconfig context (default: the current one)")
    a.set_defaults(func=_cmd_apply)
