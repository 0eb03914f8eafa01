"""One flag table (issue 18, item 5): `luwu train` and `luwu plan` take their shared flags from TrainConfig's
fields, with the fields' types, defaults and choices; the launcher of --nproc passes them on unchanged."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

import pytest

from luwu_rt.cli import plan, train
from luwu_rt.cli.flags import add_config_flags, config_argv, config_flags, config_overrides
from luwu_rt.cli.main import build_parser, main
from luwu_rt.config import from_mapping
from luwu_rt.engine import TrainConfig


def _parser(module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="luwu", allow_abbrev=False)
    module.add_arguments(parser)
    return parser


def _helps(module) -> dict[str, str]:
    """Each flag's help text, by its first spelling."""
    return {a.option_strings[0]: a.help for a in _parser(module)._actions if a.option_strings}


def _default(path: tuple[str, ...]):
    cls, value = TrainConfig, None
    for key in path:
        value = next(f for f in dataclasses.fields(cls) if f.name == key).default
        cls = typing.get_type_hints(cls)[key]
    return value


def test_every_config_flag_is_a_train_flag_and_shows_the_fields_default() -> None:
    helps = _helps(train)
    for f in config_flags():
        assert f.spelling in helps, f.spelling
        default = _default(f.path)
        if default not in (None, False, dataclasses.MISSING):
            assert f"default {default}" in helps[f.spelling], (f.spelling, helps[f.spelling])


def test_plan_shares_trains_flags_and_their_help() -> None:
    """The flags both commands take have one help (plan may add a note after it): before, plan redeclared
    them and their texts and defaults drifted."""
    train_helps, plan_helps = _helps(train), _helps(plan)
    shared = [f.spelling for f in config_flags() if f.flag.plans]
    assert {"--model", "--device-mem", "--host-mem", "--chunk-size", "--keep-graphs", "--grad-clip", "--dtype",
            "--strategy", "--shard-group-size", "--offload-params", "--nvme-dir"} <= set(shared)
    for spelling in shared:
        assert plan_helps[spelling].startswith(train_helps[spelling]), spelling
    # Flags that change nothing in a plan are train's alone.
    assert "--lr" not in plan_helps and "--ckpt-dir" not in plan_helps and "--steps" not in plan_helps


@pytest.mark.parametrize("command", ["train", "plan"])
@pytest.mark.parametrize("flag, value", [("--dtype", "fp33"), ("--strategy", "zero4"),
                                         ("--offload-optimizer", "disk")])
def test_a_typo_in_a_choice_is_refused_at_once(capsys, command, flag, value) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: luwu {command}" in err and "invalid choice" in err and value in err


def test_train_help_lists_the_choices() -> None:
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for choices in ("{fp32,bf16,fp16}", "{auto,io_uring,threads}", "{device,host,nvme,auto}",
                    "{auto,local,ddp,zero1,zero2,zero3,hsdp,node}"):
        assert choices in text


# A value for every config flag, none of them the default: what the ranks of --nproc must get back.
GIVEN = {"--model": "gpt-small", "--init-from": "w.safetensors", "--steps": "7", "--batch-size": "3",
         "--seq-len": "32", "--grad-accum": "2", "--dtype": "bf16", "--seed": "5", "--eval-every": "0",
         "--trace": "t.json", "--json-log": "-log.jsonl", "--keep-graphs": "2", "--io-backend": "threads",
         "--strategy": "hsdp", "--node": "tcp://h:1", "--node-key": "k", "--shard-group-size": "2",
         "--compress": "auto:bf16,onebit", "--compress-warmup": "9", "--profile": "hw.json", "--timeout": "12.5",
         "--data": "d.bin",
         "--data-dtype": "uint32", "--tokenizer": "tok", "--text-field": "body", "--offload-params": "host",
         "--offload-optimizer": "nvme", "--offload-grads": "host",
         "--device-mem": "1GiB", "--host-mem": "2GiB", "--nvme-dir": "nv", "--keep-nvme-state": None,
         "--chunk-size": "64KiB", "--lr": "0.0001", "--schedule-steps": "40", "--grad-clip": "0.5", "--ckpt-dir": "ck",
         "--ckpt-every": "3",
         "--resume": None}


def test_the_ranks_of_nproc_get_every_flag_back() -> None:
    assert set(GIVEN) == {f.spelling for f in config_flags()}, "a new flag: give it a value here"
    argv = [flag if value is None else f"{flag}={value}" for flag, value in GIVEN.items()]
    parser = _parser(train)
    args = parser.parse_args(argv)
    given = config_overrides(args)
    again = parser.parse_args(config_argv(args))
    assert config_overrides(again) == given
    assert given["json_log"] == "-log.jsonl" and given["keep_graphs"] == 2 and given["timeout_s"] == 12.5
    assert given["offload"]["keep_nvme_state"] is True
    assert given["checkpoint"] == {"dir": "ck", "every": 3, "resume": True}
    # Only what was given: the rest stays with the --config file, the checkpoint or the defaults.
    assert config_overrides(parser.parse_args(["--lr", "0.5"])) == {"optim": {"lr": 0.5}}
    assert config_argv(parser.parse_args(["--lr", "0.5"])) == ["--lr=0.5"]


def test_keep_graphs_is_read_one_way() -> None:
    """--keep-graphs N is a number of units in train and in plan alike (once a string in one of them)."""
    for module in (train, plan):
        args = _parser(module).parse_args(["--keep-graphs", "3"])
        assert config_overrides(args)["keep_graphs"] == 3
        assert from_mapping(TrainConfig, config_overrides(args)).keep_graphs == 3


def test_group_size_is_an_alias_in_both_commands() -> None:
    for module in (train, plan):
        args = _parser(module).parse_args(["--group-size", "4"])
        assert config_overrides(args) == {"shard_group_size": 4}


def test_notes_name_flags_that_exist() -> None:
    with pytest.raises(AssertionError, match="not added"):
        add_config_flags(argparse.ArgumentParser(), plans_only=True, notes={"lr": "plan has no --lr"})


def test_readme_flag_table_names_real_flags() -> None:
    """README's table of `luwu train` flags names only flags that exist (and every config flag)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("| flag |"):]
    table = table[:table.index("\n\n")]
    named = set(re.findall(r"`(--[a-z-]+)", table))
    spellings = {s for a in _parser(train)._actions for s in a.option_strings}
    assert named <= spellings, named - spellings
    assert {f.spelling for f in config_flags()} <= named
