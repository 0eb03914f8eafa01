from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from luwu_rt.config import Flag, flag, from_mapping, load_toml, merge, upgrade_keys


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


@dataclass(kw_only=True, slots=True)
class Renamed:
    size_bytes: int = 1
    """A size, once ``size``."""
    inner: Inner = field(default_factory=Inner)
    """Nested table."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {"size": "size_bytes", "table": "inner"}


def test_renamed_keys_are_read_under_their_new_names() -> None:
    """[Note: renamed config keys]: a config file or a checkpoint's settings written before a rename load."""
    assert from_mapping(Renamed, {"size": 5}).size_bytes == 5
    assert from_mapping(Renamed, {"table": {"size": 3}}).inner.size == 3
    assert upgrade_keys(Renamed, {"size": 5, "table": {"size": 2}, "other": 1}) == {
        "size_bytes": 5, "inner": {"size": 2}, "other": 1}
    with pytest.raises(ValueError, match="config: size is the old name of size_bytes; give only size_bytes"):
        from_mapping(Renamed, {"size": 5, "size_bytes": 6})
    # Two sources upgraded before they merge: the override wins whichever name either used.
    merged = merge(upgrade_keys(Renamed, {"size": 1}), upgrade_keys(Renamed, {"size_bytes": 2}))
    assert from_mapping(Renamed, merged).size_bytes == 2
    merged = merge(upgrade_keys(Renamed, {"size_bytes": 1}), upgrade_keys(Renamed, {"size": 2}))
    assert from_mapping(Renamed, merged).size_bytes == 2
    with pytest.raises(ValueError, match=r"unknown key\(s\) sise; valid keys are: size_bytes, inner"):
        from_mapping(Renamed, {"sise": 1})


def test_flag_metadata() -> None:
    meta = flag("a help", choices=("a", "b"), plans=True)["flag"]
    assert isinstance(meta, Flag) and meta.help == "a help" and meta.choices == ("a", "b") and meta.plans
    with pytest.raises(TypeError):
        flag("a help", choises=("a",))  # a typo in the table is an error, not a silently plain flag


def test_train_config_reads_the_keys_it_had_before_the_units_rule() -> None:
    from luwu_rt.engine import TrainConfig

    old = {"timeout": 5, "offload": {"device_mem": "64MiB", "host_mem": "8MiB", "chunk_size": "64KiB"}}
    config = from_mapping(TrainConfig, old)
    assert config.timeout_s == 5 and config.offload.device_mem_bytes == 64 * 2**20
    assert config.offload.host_mem_bytes == 8 * 2**20 and config.offload.chunk_bytes == 64 * 2**10
    with pytest.raises(ValueError, match="config.offload: host_mem is the old name of host_mem_bytes"):
        from_mapping(TrainConfig, {"offload": {"host_mem": "8MiB", "host_mem_bytes": "8MiB"}})
