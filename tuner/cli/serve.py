"""`tuner serve`: the built-in engine behind an OpenAI-compatible HTTP server (engine.serving.server), with
the configured spec; vLLM and SGLang serve themselves (see `tuner render`)."""

from __future__ import annotations

import argparse
import socket

from tuner.schema.config import UserError
from tuner.cli.help import examples


def _cmd_serve(args: argparse.Namespace) -> int:
    from tuner.schema.compose import load_config

    cfg = load_config(args.overrides)
    if cfg.engine.kind != "builtin":
        raise UserError(f"engine={cfg.engine.kind}: `tuner serve` runs the built-in engine only (engine=builtin); "
                        "vLLM and SGLang serve themselves (see `tuner render`)")
    host, port = cfg.serve.host, cfg.serve.port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"serve.host/serve.port: cannot listen on {host}:{port} ({exc.strerror})") from None
    from engine.serving.server import serve
    from tuner.study.measurer import open_engine, spec_with_trained_draft

    cfg = cfg.model_copy(update={"spec": spec_with_trained_draft(cfg)})  # never a random head
    engine = open_engine(cfg)
    print(f"serving {cfg.model.name} (spec {cfg.spec.key()}) on http://{host}:{port}/v1 "
          f"(metrics: /metrics, health: /health)", flush=True)
    serve(engine, cfg.model, cfg.serve)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `serve` to the tuner CLI."""
    s = sub.add_parser("serve", help="serve the built-in engine with the configured spec (OpenAI-compatible API)",
                       **examples(
                           "tuner serve spec.method=ngram spec.depth=3 serve.port=8001",
                           "tuner serve model=tiny-random spec.method=off",
                       ))
    s.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. serve.port=8001 spec.method=ngram")
    s.set_defaults(func=_cmd_serve)
