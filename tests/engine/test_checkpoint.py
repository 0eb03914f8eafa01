import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from luwu_rt.ckpt.format import (
    CheckpointReader,
    CheckpointWriter,
    latest_checkpoint,
    list_checkpoints,
)


def _save(root, step: int, value: float) -> None:
    with CheckpointWriter(root, step=step) as w:
        w.add("a", torch.full((3, 5), value))
        w.add("b", torch.arange(7, dtype=torch.bfloat16))
        w.add("empty", torch.empty(0, dtype=torch.int64))
        w.commit({"value": value})


def test_round_trip_and_latest(tmp_path) -> None:
    _save(tmp_path, 10, 1.0)
    _save(tmp_path, 20, 2.0)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000010", "step_00000020"]
    r = CheckpointReader(latest_checkpoint(tmp_path))
    assert r.step == 20 and r.meta == {"value": 2.0}
    assert torch.equal(r.read("a"), torch.full((3, 5), 2.0))
    assert torch.equal(r.read("b"), torch.arange(7, dtype=torch.bfloat16))
    assert r.read("empty").shape == (0,)


def test_resaving_a_step_replaces_it(tmp_path) -> None:
    _save(tmp_path, 10, 1.0)
    _save(tmp_path, 10, 3.0)
    assert CheckpointReader(latest_checkpoint(tmp_path)).meta == {"value": 3.0}
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000010"]


def test_corrupt_file_is_named(tmp_path) -> None:
    _save(tmp_path, 1, 1.0)
    path = latest_checkpoint(tmp_path) / "a.bin"
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(OSError, match="does not match its checksum") as info:
        CheckpointReader(latest_checkpoint(tmp_path)).read("a")
    assert info.value.filename == str(path)


def test_exception_while_writing_leaves_no_partial(tmp_path) -> None:
    _save(tmp_path, 1, 1.0)
    with pytest.raises(RuntimeError):
        with CheckpointWriter(tmp_path, step=2) as w:
            w.add("a", torch.ones(4))
            raise RuntimeError("disk fell off")
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]


def test_kill_during_write_keeps_previous_checkpoint(tmp_path) -> None:
    _save(tmp_path, 1, 1.0)
    script = textwrap.dedent(f"""
        import torch, sys
        from luwu_rt.ckpt.format import CheckpointWriter
        w = CheckpointWriter({str(tmp_path)!r}, step=2)
        for i in range(10**6):
            w.add(f"t{{i}}", torch.full((4096,), float(i)))
            if i == 3:
                print("writing", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000001"
    assert torch.equal(CheckpointReader(latest).read("a"), torch.full((3, 5), 1.0))
    _save(tmp_path, 3, 3.0)  # the next writer clears the killed one's partial directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]


def test_not_a_checkpoint(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        CheckpointReader(tmp_path)


def test_export_loads_into_the_plain_model(tmp_path) -> None:
    from safetensors.torch import load_file

    from luwu_rt.config import from_mapping
    from luwu_rt.engine import Engine, TrainConfig
    from luwu_rt.ckpt.export import export
    from luwu_rt.models.gpt import build_gpt

    config = from_mapping(TrainConfig, {"steps": 2, "batch_size": 2, "seq_len": 16,
                                        "offload": {"params": "host", "optimizer": "host", "grads": "host",
                                                    "device_mem": "64MiB", "host_mem": "64MiB"}})
    engine = Engine(None, config)
    engine.train_step()
    ckpt = engine.save(tmp_path / "ck")
    out = export(ckpt, tmp_path / "model.safetensors")
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file of the user's, not 0600
    model = build_gpt("gpt-tiny", device="cpu").model
    state = load_file(str(out))
    model.load_state_dict(state)  # strict: every name and shape matches
    x = torch.randint(0, 256, (2, 16))
    ref = engine.evaluate([(x, x)])
    with torch.no_grad():
        assert float(model(x, x)) == pytest.approx(ref, rel=1e-5)
    assert torch.load(export(ckpt, tmp_path / "model.pt")).keys() == state.keys()
