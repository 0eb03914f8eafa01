"""Validated configuration: dataclasses loaded from dicts, TOML files and CLI flags.

Every config is ``@dataclass(kw_only=True, slots=True)`` with a docstring under
each field and validation in ``__post_init__`` (DESIGN.md, style 3). Unknown
keys are errors that list the valid ones: a typo in a config file must never be
silently ignored while a run trains with the default.

A field can also be a command-line flag: ``field(metadata=flag(...))`` gives its spelling, help and choices,
and ``luwu_rt/cli/flags.py`` turns the fields into argparse arguments ([Note: one flag table] there). A field
that was renamed keeps working under its old key ([Note: renamed config keys]).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["Flag", "flag", "from_mapping", "load_toml", "merge", "upgrade_keys"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Flag:
    """How a config field appears on the command line (``field(metadata=flag(...))``)."""

    help: str
    """One line for ``--help``. ``{default}`` in it is replaced by the field's default; without it the default
    is appended as ``(default X)`` when there is one (not ``None``, not ``False``)."""
    name: str | None = None
    """The flag's spelling, e.g. ``--ckpt-dir``; ``None``: ``--`` and the field's name with dashes."""
    aliases: tuple[str, ...] = ()
    """Other spellings of the same flag."""
    choices: tuple[str, ...] | None = None
    """The closed set of values, listed by ``--help`` and checked when the flag is parsed (a typo is refused
    before anything starts); the field's ``__post_init__`` checks the same tuple for TOML files and the API."""
    metavar: str | None = None
    """The value's name in ``--help``."""
    parse: Callable[[str], Any] | None = None
    """Turns the flag's text into the field's value; ``None``: from the field's type (``int``, ``float``,
    else the text itself, e.g. a size such as ``4GiB`` that ``__post_init__`` reads)."""
    plans: bool = False
    """The plan of a step depends on this field: ``luwu plan`` takes the flag too, so that it plans what
    ``luwu train`` with the same flags runs."""


def flag(help: str, **kwargs: Any) -> dict[str, Flag]:
    """Field metadata that makes a config field a command-line flag (the keywords of ``Flag``)."""
    return {"flag": Flag(help=help, **kwargs)}


def _nested_type(cls: type, name: str) -> type | None:
    """The dataclass type of field ``name`` of ``cls``, if it is a nested config."""
    hint = typing.get_type_hints(cls).get(name)
    return hint if dataclasses.is_dataclass(hint) else None


_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "nothing"}


def _matches(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` has type ``hint``; ``None`` when the hint is not one of the simple kinds checked here.
    A bool is not an integer or a number (``steps = true`` is a mistake, not one step)."""
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if hint in (str, bool, type(None)):
        return isinstance(value, hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [_matches(value, h) for h in typing.get_args(hint)]
        return None if None in found else any(found)
    return None


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    return _NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _checked(cls: type, key: str, value: Any, where: str) -> None:
    """Raises ``ValueError`` naming ``where.key`` when ``value`` is not of the field's declared type."""
    hint = typing.get_type_hints(cls).get(key)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}.{key}: expected a table of keys ([{key}] in TOML), got {value!r}")
    elif _matches(value, hint) is False:
        raise ValueError(f"{where}.{key}: expected {_describe(hint)}, got {type(value).__name__} {value!r}")


# [Note: renamed config keys]
# A config field that is renamed (e.g. to follow the units rule: ``offload.host_mem`` became
# ``offload.host_mem_bytes``) keeps being read under its old key, because old keys live on where users
# cannot edit them: in TOML files, in scripts' ``overrides``, and in the config stored inside every
# checkpoint (``CheckpointReader.settings``), which a resume merges with the new run's flags, and which
# can be years old. The class that owns the field lists ``old key -> new key`` in a ``RENAMED_KEYS`` class
# variable beside its fields (a ``ClassVar``, not a field), and nothing else knows the old names:
# ``upgrade_keys`` applies each table at its level of the nesting, and ``from_mapping`` calls it first. Two mappings
# from different sources (a checkpoint's config and the flags, a TOML file and the flags) must each be
# upgraded before they are merged, or the old and the new key of one field would both survive the merge;
# one mapping holding both is an error. Old keys are never written: a saved config uses the new names.


def upgrade_keys(cls: type, data: Mapping[str, Any], *, where: str = "config") -> dict[str, Any]:
    """``data`` with the keys that ``cls`` (and its nested configs) renamed under their new names
    ([Note: renamed config keys]); other keys, known or not, are left for ``from_mapping`` to judge."""
    renamed: Mapping[str, str] = getattr(cls, "RENAMED_KEYS", {})
    out: dict[str, Any] = {}
    for key, value in data.items():
        new = renamed.get(key, key)
        if new in out or (new != key and new in data):
            raise ValueError(f"{where}: {key} is the old name of {new}; give only {new}")
        nested = _nested_type(cls, new) if new in _field_names(cls) else None
        out[new] = upgrade_keys(nested, value, where=f"{where}.{new}") if nested and isinstance(value, Mapping) \
            else value
    return out


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def from_mapping(cls: type[T], data: Mapping[str, Any], *, where: str = "config") -> T:
    """Builds ``cls`` from ``data``; nested dataclass fields take nested mappings, and renamed keys are read
    under their new names ([Note: renamed config keys]).

    Raises ``ValueError`` naming the unknown key and the valid ones, or the
    field whose value ``__post_init__`` rejected.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a table of keys, got {type(data).__name__}")
    data = upgrade_keys(cls, data, where=where)
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys are: {', '.join(valid)}")
    values = {}
    for key, value in data.items():
        _checked(cls, key, value, where)
        nested = _nested_type(cls, key)
        values[key] = (from_mapping(nested, value, where=f"{where}.{key}") if nested and isinstance(value, Mapping)
                       else value)
    try:
        return cls(**values)
    except TypeError as exc:  # a wrong type that __post_init__ did not catch first
        raise ValueError(f"{where}: {exc}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict, with a clear error for a missing or malformed file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # a binary file: tomllib's own message names no file
        raise ValueError(f"config file {path} is not valid TOML: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise OSError(exc.errno, f"cannot read config file ({exc.strerror})", str(path)) from None


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``, table by table (flags over a config file)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
