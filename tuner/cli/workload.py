"""`tuner workload inspect`: the shape of a workload of the user's own requests (engine.measure.workloads.describe),
counts and lengths only, never a request's text."""

from __future__ import annotations

import argparse

from tuner.cli.help import examples


def _cmd_inspect(args: argparse.Namespace) -> int:
    from engine.measure.workloads import describe
    from tuner.schema.compose import load_config, require_workload
    from tuner.study.measurer import request_encoder

    cfg = load_config(args.overrides)
    require_workload(cfg)
    assert cfg.workload is not None
    encoder = request_encoder(cfg) if args.tokens else None
    for line in describe(cfg.workload, encoder):
        print(line)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `workload inspect` to the tuner CLI."""
    w = sub.add_parser("workload", help="look at a workload of your own requests (tuner workload inspect ...)",
                       **examples(
                           "tuner workload inspect +workload=file workload.path=requests.jsonl",
                           "tuner workload inspect +workload=mix 'workload.mix=[{workload:code,weight:0.7},"
                           "{path:chat.jsonl,weight:0.3}]'",
                       ))
    wsub = w.add_subparsers(dest="workload_command", metavar="SUBCOMMAND")
    wsub.required = True
    i = wsub.add_parser("inspect", help="the shape of a file (or mix) workload: requests, split, lengths, sampling, turns",
                        **examples(
                            "tuner workload inspect +workload=file workload.path=requests.jsonl",
                            "tuner workload inspect +workload=file workload.path=sharegpt.json workload.format=sharegpt --tokens",
                        ))
    i.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +workload=file workload.path=PATH")
    i.add_argument("--tokens", action="store_true",
                   help="also tokenise the played requests with the model's tokenizer (prompt tokens, budgets)")
    i.set_defaults(func=_cmd_inspect)
