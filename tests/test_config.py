from dataclasses import dataclass, field

import pytest

from luwu_rt.config import from_mapping, load_toml, merge


@dataclass(kw_only=True, slots=True)
class Inner:
    size: int = 1
    """A size."""

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"inner.size must be >= 0, got {self.size}")


@dataclass(kw_only=True, slots=True)
class Outer:
    name: str = "x"
    """A name."""
    inner: Inner = field(default_factory=Inner)
    """Nested table."""


def test_nested_tables_and_defaults() -> None:
    cfg = from_mapping(Outer, {"inner": {"size": 3}})
    assert cfg.name == "x" and cfg.inner.size == 3


def test_unknown_keys_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"config.inner: unknown key\(s\) sise; valid keys are: size"):
        from_mapping(Outer, {"inner": {"sise": 3}})


def test_validation_errors_pass_through() -> None:
    with pytest.raises(ValueError, match="inner.size must be >= 0"):
        from_mapping(Outer, {"inner": {"size": -1}})


def test_toml_and_merge(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('name = "a"\n[inner]\nsize = 2\n')
    merged = merge(load_toml(path), {"inner": {"size": 5}})
    assert from_mapping(Outer, merged).inner.size == 5 and merged["name"] == "a"
    path.write_text("name = \n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_toml(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
