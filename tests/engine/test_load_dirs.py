"""Issue 19, items 2 and 6, from Python: ``Engine.load`` keeps the saved learning-rate schedule and never reuses
the saved run's NVMe directory (a fresh scratch of its own, removed on close), and an engine removes the NVMe
directory it created ([Note: missing directories] in cli/dirs.py)."""

from __future__ import annotations

import pytest

from luwu_rt.ckpt.format import CheckpointReader
from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.fs import SCRATCH_PREFIX
from luwu_rt.optim.schedule import lr_at

STEPS = 4
OPTIM = {"lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 1}


def _config(nvme_dir, **extra) -> TrainConfig:
    return from_mapping(TrainConfig, {
        "model": "gpt-tiny", "steps": STEPS, "batch_size": 2, "seq_len": 16, "eval_every": 0, "optim": OPTIM,
        "offload": {"optimizer": "nvme", "device_mem_bytes": "64MiB", "host_mem_bytes": "64MiB", "chunk_bytes": "64KiB",
                    "nvme_dir": str(nvme_dir)}, **extra})


def _scratches(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith(SCRATCH_PREFIX))


@pytest.fixture
def saved(tmp_path):
    """A finished 4-step run's checkpoint, its NVMe tier in a directory the engine created (and removed)."""
    nv = tmp_path / "made" / "nv"
    with Engine(None, _config(nv)) as engine:
        assert (nv / "luwu_state").is_dir()  # the tier is there while the engine runs
        for _ in range(STEPS):
            engine.train_step()
        path = engine.save(tmp_path / "ck")
    assert not (tmp_path / "made").exists()  # created by the engine (both levels): removed when it closed
    assert CheckpointReader(path).settings["optim"]["schedule_steps"] == STEPS  # the schedule is the run's config
    return path


def test_load_makes_its_own_scratch_and_removes_it(saved, tmp_path, monkeypatch) -> None:
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    with Engine.load(saved, overrides={"steps": STEPS + 1}) as engine:
        nvme_dir = engine.config.offload.nvme_dir
        assert nvme_dir != str(tmp_path / "made" / "nv") and SCRATCH_PREFIX in nvme_dir
        assert _scratches(here) == [nvme_dir.rsplit("/", 1)[-1]] and engine.store.nvme is not None
        engine.train_step()
    assert _scratches(here) == [] and not (tmp_path / "made").exists()  # nothing left, the saved path not re-made


def test_load_with_an_nvme_dir_of_its_own(saved, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "kept"
    kept.mkdir()
    with Engine.load(saved, overrides={"offload": {"nvme_dir": str(kept)}}) as engine:
        assert engine.config.offload.nvme_dir == str(kept)
    assert kept.is_dir() and not (kept / "luwu_state").exists() and _scratches(tmp_path) == []  # it existed: kept


def test_load_keeps_the_saved_schedule(saved, tmp_path, monkeypatch) -> None:
    """More steps than the saved run had: the cosine still ends at step 4 (min_lr after it), unless
    ``optim.schedule_steps`` says otherwise; before, it was recomputed over the new total and the rate jumped."""
    monkeypatch.chdir(tmp_path)
    lr = {key: OPTIM[key] for key in ("lr", "min_lr")}
    with Engine.load(saved, overrides={"steps": STEPS + 2}) as engine:
        assert engine.config.optim.schedule_steps == STEPS
        assert [engine.train_step()["lr"] for _ in range(2)] == [OPTIM["min_lr"]] * 2
    with Engine.load(saved, overrides={"steps": STEPS + 2, "optim": {"schedule_steps": STEPS + 2}}) as engine:
        want = [lr_at(s, **lr, warmup_steps=1, total_steps=STEPS + 2) for s in (STEPS + 1, STEPS + 2)]
        assert [engine.train_step()["lr"] for _ in range(2)] == pytest.approx(want, rel=1e-12)
        assert want[0] > OPTIM["min_lr"]


def test_a_plan_without_nvme_removes_the_directory_at_once(tmp_path) -> None:
    nv = tmp_path / "nv"
    config = _config(nv, offload={"optimizer": "auto", "device_mem_bytes": "64MiB", "nvme_dir": str(nv)})
    with Engine(None, config) as engine:
        assert engine.store.nvme is None and not nv.exists()
        engine.train_step()


def test_a_refused_engine_leaves_no_directory(tmp_path) -> None:
    nv = tmp_path / "nv"
    config = _config(nv, offload={"device_mem_bytes": "1MiB", "optimizer": "nvme", "nvme_dir": str(nv)})
    with pytest.raises(ValueError, match="does not fit"):
        Engine(None, config)
    assert not nv.exists()
