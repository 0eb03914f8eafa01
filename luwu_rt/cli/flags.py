"""The flags of ``luwu train`` and ``luwu plan``, made from ``TrainConfig``'s fields ([Note: one flag table])."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from luwu_rt.config import Flag

__all__ = ["ConfigFlag", "add_config_flags", "config_argv", "config_flags", "config_overrides"]

# [Note: one flag table]
# A flag of `luwu train` is a field of TrainConfig (or of a config nested in it: OffloadConfig,
# OptimConfig, CheckpointConfig, DataConfig) whose metadata says `flag(...)`: its spelling, one line of help
# and, for a closed set of values, its choices, which the field's __post_init__ checks too. Its type and
# default come from the field itself. This module is the one reader of that table: it adds the arguments to
# a parser, turns the flags given back into the nested mapping `from_mapping` reads (flags default to None,
# so that only the ones given override a --config file or a checkpoint's settings), and writes them out
# again as `--flag=value` for the ranks that `luwu train --nproc` starts. `luwu plan` takes the flags of the
# fields marked `plans=True`, the ones a step's plan depends on, builds the same TrainConfig from them and
# plans with the engine's own ModelSpec (config_model_spec), so that it answers for the run `luwu train`
# with the same flags makes. Flags that configure no field (--resume-if-exists, --nproc, plan's
# --world-size, ...) stay with their command.


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ConfigFlag:
    """One config field that is a flag."""

    path: tuple[str, ...]
    """Its keys in the nested config mapping, e.g. ``("offload", "device_mem_bytes")``."""
    spelling: str
    """The flag, e.g. ``--device-mem``."""
    dest: str
    """The attribute of the parsed arguments: the spelling with underscores (``device_mem``)."""
    flag: Flag
    """The field's flag metadata."""
    default: Any
    """The field's default (``None`` when it has none to show)."""
    parse: Callable[[str], Any] | None
    """Text to value; ``None`` for a boolean field, which is a switch."""


def config_flags(cls: type | None = None) -> tuple[ConfigFlag, ...]:
    """The flags of ``cls`` (default ``TrainConfig``) and of the configs nested in it, in field order."""
    if cls is None:
        from luwu_rt.engine.config import TrainConfig

        cls = TrainConfig
    out = tuple(_walk(cls, ()))
    spellings = [s for f in out for s in (f.spelling, *f.flag.aliases)]
    assert len(spellings) == len(set(spellings)), f"two config fields claim one flag: {spellings}"
    return out


def _walk(cls: type, path: tuple[str, ...]):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _walk(hint, (*path, f.name))
            continue
        meta: Flag | None = f.metadata.get("flag")
        if meta is None:
            continue
        spelling = meta.name or f"--{f.name.replace('_', '-')}"
        default = f.default if f.default is not dataclasses.MISSING else None
        yield ConfigFlag(path=(*path, f.name), spelling=spelling, dest=spelling[2:].replace("-", "_"), flag=meta,
                         default=default, parse=meta.parse or _parser(hint))


def _parser(hint: Any) -> Callable[[str], Any] | None:
    """How a flag's text becomes a value of type ``hint``: ``int``, ``float``, the text itself for strings
    and sizes (``int | str``, which ``__post_init__`` reads), ``None`` for a switch (``bool``)."""
    kinds = set(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}
    kinds.discard(type(None))
    if kinds == {bool}:
        return None
    if len(kinds) == 1 and kinds <= {int, float}:
        return kinds.pop()
    assert str in kinds, f"no flag parser for {hint}: give flag(parse=...)"
    return str


def _help(f: ConfigFlag, note: str | None) -> str:
    text = f.flag.help
    if "{default}" in text:
        text = text.format(default=f.default)
    elif f.default is not None and f.default is not False and "(default " not in text:  # a help that says it
        text += f" (default {f.default})"
    if note:
        text += f"; {note}"
    return text.replace("%", "%%")  # argparse formats help with %


def add_config_flags(parser: argparse.ArgumentParser, *, plans_only: bool = False,
                     notes: Mapping[str, str] | None = None) -> tuple[ConfigFlag, ...]:
    """Adds the config's flags to ``parser`` (only those a plan depends on with ``plans_only``), each
    defaulting to ``None``; ``notes`` adds a command's own remark to a flag's help, by ``dest``."""
    notes = dict(notes or {})
    added = tuple(f for f in config_flags() if f.flag.plans or not plans_only)
    for f in added:
        common = {"dest": f.dest, "default": None, "help": _help(f, notes.pop(f.dest, None))}
        if f.parse is None:
            parser.add_argument(f.spelling, *f.flag.aliases, action="store_true", **common)
        else:
            parser.add_argument(f.spelling, *f.flag.aliases, type=f.parse, choices=f.flag.choices,
                                metavar=f.flag.metavar, **common)
    assert not notes, f"notes for flags that were not added: {sorted(notes)}"
    return added


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config flags given in ``args``, as the nested mapping ``from_mapping`` reads."""
    out: dict[str, Any] = {}
    for f in config_flags():
        value = getattr(args, f.dest, None)
        if value is None:
            continue
        node = out
        for key in f.path[:-1]:
            node = node.setdefault(key, {})
        node[f.path[-1]] = value
    return out


def config_argv(args: argparse.Namespace) -> list[str]:
    """The config flags given in ``args`` as command-line words, ``--flag=value`` (a value that starts with
    ``-`` survives that form), a switch as ``--flag``."""
    out = []
    for f in config_flags():
        value = getattr(args, f.dest, None)
        if value is None or value is False:
            continue
        out.append(f.spelling if value is True else f"{f.spelling}={value}")
    return out
