"""The `tuner` command line: thin over library functions.

Each subcommand takes Hydra overrides (`hardware=h100x8 spec.depth=4 +workload=code`) as
positional arguments. User errors print one line and exit 2.
"""

from __future__ import annotations

import _signal  # signal's C core: `import signal` first imports enum, a few ms more without a handler
import os
import sys


def _interrupted_before_main(signum: int, frame: object) -> None:
    """Ctrl-C while the `tuner` process still imports this module: nothing has been done yet, so
    one line and exit 130 at once (Python's own handler would print a KeyboardInterrupt traceback)."""
    os.write(2, b"interrupted\n")
    os._exit(130)


def _is_cli_process() -> bool:
    """Whether this process runs the `tuner` command (the console script, or python -m tuner.cli),
    rather than importing this module as a library (tests, other programs)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return sys.argv[:1] != [] and os.path.basename(sys.argv[0]) == "tuner" or any(
        a == "-m" and b == "tuner.cli" for a, b in zip(argv, argv[1:]))


# First, before the other imports: main() takes over from this handler (interrupts_outside_imports).
if _is_cli_process():
    _signal.signal(_signal.SIGINT, _interrupted_before_main)

import argparse  # noqa: E402
import functools  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

# Only light imports here: `tuner` imports this module before main() can catch a Ctrl-C.
from tuner.cli.help import examples, start_here

Handler = Callable[[argparse.Namespace], int | None]


def _cmd_config(args: argparse.Namespace) -> int:
    from tuner.schema.compose import load_config, require_workload, to_json, to_yaml

    cfg = load_config(args.overrides)
    if args.require_workload:
        require_workload(cfg)
    print(to_json(cfg) if args.json else to_yaml(cfg), end="" if not args.json else "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree. Each subcommand sets `func`; its overrides land in `args.overrides`."""
    p = argparse.ArgumentParser(
        prog="tuner",
        description="spectune: tune speculative decoding (depth, top-k, draft budget) and render Kubernetes manifests.",
        epilog=start_here(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("config", help="print the composed, validated config (YAML, or JSON with --json)",
                       **examples(
                           "tuner config +workload=code hardware=h100x8",
                           "tuner config --json model=llama-3.1-8b-instruct hardware=h100x8 engine=vllm deploy=vllm",
                           "tuner config search=quick +workload=chat --require-workload",
                       ))
    c.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. hardware=h100x8 +workload=code")
    c.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    c.add_argument("--require-workload", action="store_true", help="fail unless a workload is given")
    c.set_defaults(func=_cmd_config)

    for register in _extensions():
        register(sub)
    return p


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """build_parser's tree, built once per process: parsing leaves it unchanged (each parse makes its own
    Namespace), and a process that calls main() again (the tests, hundreds of times) skips rebuilding
    its 17 subcommands and their help."""
    return build_parser()


# Modules that define more subcommands, each with `register(subparsers)`. One line per issue's
# command module keeps this file thin: the handlers live beside the library code they wrap.
COMMAND_MODULES: list[str] = [
    "tuner.cli.k8s",
    "tuner.cli.bench",
    "tuner.cli.serve",
    "tuner.cli.optimize",
    "tuner.cli.train",
    "tuner.cli.cluster",
    "tuner.cli.project",
    "tuner.cli.hub",
    "tuner.cli.workload",
    "tuner.cli.check",
]


def _extensions() -> list[Callable[[argparse._SubParsersAction], None]]:
    import importlib

    return [importlib.import_module(m).register for m in COMMAND_MODULES]


def command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subparser of command `name` (for its usage line)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def unknown_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """One line for a first argument that names no command (the nearest one, and the list), or None."""
    from tuner.schema.compose import closest

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    word = next((a for a in argv if not a.startswith("-")), None)
    if word is None or word in sub.choices:
        return None
    near = closest(word, sub.choices)
    return (f"{word}: unknown command" + (f"; did you mean tuner {near}?" if near else "")
            + f" (commands: {', '.join(sub.choices)})")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line, overrides and options in any order: argparse stops filling a
    positional list at the first option, so the overrides after it come back unrecognized; they
    join the command's overrides in the order given. Anything else unrecognized is answered with
    the command's own usage line (argparse's would be the top-level one). An unknown command is a
    UserError naming the nearest one."""
    from tuner.schema.spec import UserError

    unknown = unknown_command(parser, sys.argv[1:] if argv is None else argv)
    if unknown:
        raise UserError(unknown)
    args, extra = parser.parse_known_args(argv)
    if extra:
        cmd = command_parser(parser, args.command)
        takes = isinstance(getattr(args, "overrides", None), list)
        stray = [a for a in extra if a.startswith("-") or not takes]
        if stray:
            cmd.error(f"unrecognized arguments: {' '.join(stray)}")
        args.overrides = [*args.overrides, *extra]
    return args


def _in_import(frame: object) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):  # type: ignore[attr-defined]
            return True
        frame = frame.f_back  # type: ignore[attr-defined]
    return False


@contextmanager
def interrupts_outside_imports() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt as usual, except while a module is being imported: raised
    inside an extension's initialisation it leaves a half-made module, a Rust panic (pydantic_core)
    or an exit by signal instead of one line; there it is re-delivered a moment later, once the
    import is done. Only in the main thread and over Python's own handler or the one this module
    installs while the command starts (a test's stays)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, _interrupted_before_main)):
        yield
        return

    pending: list[threading.Timer] = []

    def on_sigint(signum: int, frame: object) -> None:
        pending.clear()
        if not _in_import(frame):
            raise KeyboardInterrupt
        later = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
        later.daemon = True
        pending.append(later)
        later.start()

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for later in pending:  # a Ctrl-C still waiting for its import: the command ended first
            later.cancel()
        if pending:
            raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tuner` console script. A user error is one line and exit 2; Ctrl-C at
    any point, imports included, is one line and exit 130."""
    try:
        with interrupts_outside_imports():
            from tuner.schema.spec import UserError

            try:
                parser = _parser()
                rc = (args := parse(parser, argv)).func(args)
            except UserError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)

