"""Issue 25.8: every `tuner` command's --help ends with examples, and `tuner --help` says where to
start, what +workload=NAME is for, which options each group has (read from conf/) and how a
configuration's key reads."""

from __future__ import annotations

import argparse

import pytest

from tuner.cli import build_parser, main
from tuner.cli.help import HELP_GROUPS
from tuner.schema.compose import available


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", sorted(_commands()))
def test_each_command_has_examples(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "\nexamples:\n" in text
    examples = [ln.strip() for ln in text.split("\nexamples:\n", 1)[1].splitlines() if ln.strip()]
    assert 2 <= len(examples) <= 4 and all(ln.startswith(f"tuner {command} ") for ln in examples), examples
    # every example parses: the flags it shows exist
    for ln in examples:
        argv = ln.split("  #")[0].split()[1:]
        if command == "render-tuner":  # the quoted override holds spaces
            argv = [a for a in argv if not a.startswith(("'distributed", "key:"))]
        build_parser().parse_args(argv)
        if command == "config":  # and those of `tuner config` compose as shown
            assert main(argv) == 0, ln


def test_top_level_epilog_starts_here_and_lists_the_groups(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    epilog = text.split("\nstart here:\n", 1)[1]
    assert "make optimize" in epilog and "tuner optimize +workload=code" in epilog
    assert "+workload=NAME is required for optimize, bench and train-draft" in epilog
    lines = {ln.split("=", 1)[0].strip(): ln.split("=", 1)[1].strip() for ln in epilog.splitlines()
             if "=" in ln and ln.strip().lstrip("+").split("=")[0] in HELP_GROUPS}
    for group in HELP_GROUPS:
        key = f"+{group}" if group in ("workload", "experiment") else group
        assert lines[key] == ", ".join(available(group)), (group, lines.get(key))
    assert set(available("workload")) >= {"code", "chat"} and "+workload" in lines
    assert "'ngram d3 k1 b4': method ngram, depth 3" in epilog and "top-k 1" in epilog and "budget 4" in epilog
