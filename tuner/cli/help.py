"""The epilogs of `tuner --help` and of each command's `--help`: examples, and where to start.

The groups' options are read from conf/ (tuner.schema.compose.available), never copied here, so
the help lists what composes today.
"""

from __future__ import annotations

import argparse
from typing import Any

# the groups `tuner --help` lists, with how they are given on the command line
HELP_GROUPS = ("model", "hardware", "engine", "search", "deploy", "workload", "experiment")
ADDED_GROUPS = ("workload", "experiment")  # not in conf/config.yaml's defaults: +GROUP=NAME


def examples(*lines: str) -> dict[str, Any]:
    """`add_parser` keyword arguments giving a command an epilog of examples, one command line
    each (`tuner ...`, optionally followed by `  # why`), printed as written."""
    text = "examples:\n" + "".join(f"  {line}\n" for line in lines)
    return {"epilog": text, "formatter_class": argparse.RawDescriptionHelpFormatter}


def start_here() -> str:
    """The top-level epilog: the first command, what optimize/bench/train-draft need, the groups
    and their options, and how a configuration's key reads."""
    from tuner.schema.compose import available

    width = max(len(g) for g in HELP_GROUPS) + 3
    groups = "".join(f"  {(('+' if g in ADDED_GROUPS else '') + g + '='):<{width}}{', '.join(available(g))}\n"
                     for g in HELP_GROUPS)
    return (
        "start here:\n"
        "  make optimize                      # set up the venv, then tune on the code workload\n"
        "  tuner optimize +workload=code      # the same, in a set-up venv; prints the run directory last\n"
        "  tuner render --from RUN            # that run's winner as Kubernetes manifests (RUN/k8s)\n"
        "\n"
        "+workload=NAME is required for optimize, bench and train-draft (also profile and render-tuner):\n"
        "the workload is not in the defaults, so it is added with '+'.\n"
        "\n"
        "config groups (GROUP=NAME; `tuner config GROUP=NAME` prints the composed config):\n"
        f"{groups}"
        "  any key: e.g. spec.depth=5 search.n_trials=40 deploy.replicas=2 (see `tuner config`)\n"
        "\n"
        "configurations are written as METHOD dD kK bB, e.g. 'ngram d3 k1 b4': method ngram, depth 3\n"
        "(tokens drafted per step), top-k 1 (branching per node; 1 is a chain, more a tree), budget 4\n"
        "(tree nodes verified per step, the root included; a chain's is depth+1).\n"
        "\n"
        "each command has examples: tuner COMMAND --help\n"
    )
