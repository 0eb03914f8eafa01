"""Issue 12, cases 6 and 7: IO errors name the path, outputs are checked before the first step,
config values are type-checked by key."""

import pytest
from safety_common import SMALL, luwu, one_line_error

from luwu_rt.config import from_mapping
from luwu_rt.engine import TrainConfig
from luwu_rt.ckpt.format import CheckpointWriter


def test_outputs_are_checked_before_the_first_step(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = tmp_path / "log.jsonl"
    r = luwu("train", "--steps", "2", *SMALL, "--json-log", str(log), "--ckpt-dir", str(blocker))
    one_line_error(r, str(blocker), "--ckpt-dir")
    assert not log.exists() or not log.read_text()  # found before training, not at the first save
    r = luwu("train", "--steps", "2", *SMALL, "--nvme-dir", str(blocker), "--offload-optimizer", "nvme")
    one_line_error(r, str(blocker), "--nvme-dir names a file")
    one_line_error(luwu("train", "--steps", "2", *SMALL, "--ckpt-dir", ""), "--ckpt-dir) is empty")
    one_line_error(luwu("ckpt", "list", str(tmp_path / "missing")), str(tmp_path / "missing"), "not a directory")


def test_full_disk_during_a_checkpoint_names_the_file(tmp_path, monkeypatch) -> None:
    import builtins
    import errno

    real_open = builtins.open

    def full(path, mode="r", *args, **kwargs):
        if "wb" in mode and str(path).endswith(".bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    import torch

    w = CheckpointWriter(tmp_path, step=1)
    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(OSError) as info:
        with w:
            w.add("a", torch.zeros(4))
    assert info.value.errno == errno.ENOSPC and info.value.filename.endswith("a.bin"), info.value
    assert "writing a checkpoint file" in str(info.value)
    assert not list(tmp_path.glob(".partial_*"))


@pytest.mark.parametrize("data, message", [
    ({"offload": 5}, "config.offload: expected a table"),
    ({"data": 5}, "config.data: expected a table"),
    ({"seed": "abc"}, "config.seed: expected an integer, got str"),
    ({"batch_size": True}, "config.batch_size: expected an integer, got bool"),
    ({"steps": True}, "config.steps: expected an integer, got bool"),
    ({"optim": {"lr": "fast"}}, "config.optim.lr: expected a number"),
    ({"checkpoint": {"resume": 1}}, "config.checkpoint.resume: expected true or false"),
    ({"offload": {"nvme_dir": 3}}, "config.offload.nvme_dir: expected a string or nothing"),
])
def test_config_values_are_type_checked(data, message) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        from_mapping(TrainConfig, data)


def test_config_file_of_wrong_types_is_one_line(tmp_path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("steps = true\n[offload]\nhost_mem = 5\n")
    one_line_error(luwu("train", "--config", str(toml), *SMALL), "config.steps: expected an integer, got bool")
