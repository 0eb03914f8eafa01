"""The `luwu` parser (issue 19, item 8): no prefix matching of flags, a command's typo reported under that
command's usage, and `luwu --version`."""

from __future__ import annotations

import argparse

import pytest

import luwu_rt
from luwu_rt.cli.main import COMMANDS, build_parser, main


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """``(command path, parser)`` of the top-level parser and every parser under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaves(sub, (*path, name))


def test_every_parser_refuses_abbreviations() -> None:
    parsers = dict(_leaves(build_parser()))
    assert {path for path, _, _ in COMMANDS} <= set(parsers)
    for path, parser in parsers.items():
        assert parser.allow_abbrev is False, path


@pytest.mark.parametrize("argv", [["train", "--step", "5"], ["plan", "--world", "2"],
                                  ["ckpt", "list", "d", "--ou", "x"]])
def test_a_prefix_of_a_flag_is_an_error(capsys, argv) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert f"unrecognized arguments: {' '.join(argv[-2:])}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, prog", [(["train", "--step", "5"], "luwu train"),
                                        (["bench", "io", "--dir", "d", "--bogus"], "luwu bench io"),
                                        (["plot", "log.jsonl", "extra"], "luwu plot")])
def test_a_typo_is_reported_under_its_commands_usage(capsys, argv, prog) -> None:
    """Not under `usage: luwu [-h] [--version] COMMAND ...`, which says nothing of the command's flags."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} ") and f"{prog}: error: unrecognized arguments:" in err, err


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"luwu_rt {luwu_rt.__version__}"
