"""Validated configuration: dataclasses loaded from dicts, TOML files and CLI flags.

Every config is ``@dataclass(kw_only=True, slots=True)`` with a docstring under
each field and validation in ``__post_init__`` (DESIGN.md, style 3). Unknown
keys are errors that list the valid ones: a typo in a config file must never be
silently ignored while a run trains with the default.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["from_mapping", "load_toml", "merge"]

T = TypeVar("T")


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


def from_mapping(cls: type[T], data: Mapping[str, Any], *, where: str = "config") -> T:
    """Builds ``cls`` from ``data``; nested dataclass fields take nested mappings.

    Raises ``ValueError`` naming the unknown key and the valid ones, or the
    field whose value ``__post_init__`` rejected.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a table of keys, got {type(data).__name__}")
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys are: {', '.join(valid)}")
    values = {}
    for key, value in data.items():
        _checked(cls, key, value, where)
        nested = _nested_type(cls, key)
        values[key] = from_mapping(nested, value, where=f"{where}.{key}") if nested and isinstance(value, Mapping) else value
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


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``, table by table (flags over a config file)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
