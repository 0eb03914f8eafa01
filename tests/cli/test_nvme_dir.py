"""Issue 13 item 6: `luwu train` and `luwu plan` treat a missing --nvme-dir alike (train creates it, plan
plans with the free space of the disk it will be on), and the scratch tier is removed at exit unless kept."""

from __future__ import annotations

import json
import subprocess
import sys

SMALL = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0", "--quiet",
         "--chunk-size", "64KiB", "--offload-optimizer", "nvme"]


def _luwu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "luwu_rt", *args], capture_output=True, text=True, timeout=300)


def test_train_creates_a_missing_nvme_dir_says_so_and_removes_it(tmp_path) -> None:
    """Issue 19 item 6: one rule for every command ([Note: missing directories]): what a run created it
    removes at exit, as the benchmarks do; before, train kept the directory with its lock file inside."""
    nv = tmp_path / "not" / "yet"
    r = _luwu("train", *SMALL, "--nvme-dir", str(nv))
    assert r.returncode == 0, r.stderr
    assert f"creating --nvme-dir {nv} (it did not exist; removed at exit)" in r.stderr
    assert "optimizer state on nvme" in r.stderr
    assert list(tmp_path.iterdir()) == []  # both levels it made


def test_an_existing_nvme_dir_stays(tmp_path) -> None:
    nv = tmp_path / "nv"
    nv.mkdir()
    r = _luwu("train", *SMALL, "--nvme-dir", str(nv))
    assert r.returncode == 0, r.stderr
    assert "creating" not in r.stderr
    # its files go; the lock file stays ([Note: directory locks])
    assert nv.is_dir() and not (nv / "luwu_state").exists()


def test_a_created_nvme_dir_of_several_ranks_is_removed(tmp_path) -> None:
    """Each rank removes its D/rank-<r>; the last one out removes D. (The ranks get --stop-after too.)"""
    nv = tmp_path / "not" / "yet"
    r = _luwu("train", *SMALL, "--nvme-dir", str(nv), "--nproc", "2", "--strategy", "ddp", "--stop-after", "1")
    assert r.returncode == 0, r.stderr
    assert "creating --nvme-dir" in r.stderr and list(tmp_path.iterdir()) == []
    assert "stopped after step 1 of 2 (--stop-after)" in r.stderr, r.stderr


def test_a_created_nvme_dir_is_kept_with_keep_nvme_state(tmp_path) -> None:
    nv = tmp_path / "made"
    r = _luwu("train", *SMALL, "--nvme-dir", str(nv), "--keep-nvme-state")
    assert r.returncode == 0, r.stderr
    assert f"creating --nvme-dir {nv} (it did not exist; kept: --keep-nvme-state)" in r.stderr
    assert any((nv / "luwu_state").iterdir())


def test_keep_nvme_state_keeps_it(tmp_path) -> None:
    nv = tmp_path / "nv"
    nv.mkdir()
    r = _luwu("train", *SMALL, "--nvme-dir", str(nv), "--keep-nvme-state")
    assert r.returncode == 0, r.stderr
    assert "creating" not in r.stderr
    assert any((nv / "luwu_state").iterdir())


def test_plan_accepts_what_train_would_create(tmp_path, capsys) -> None:
    from luwu_rt.cli.main import main

    nv = tmp_path / "not" / "yet"
    assert main(["plan", "--offload-optimizer", "nvme", "--nvme-dir", str(nv), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] and report["budgets"]["nvme"] > 0
    assert not nv.exists()  # planning has no side effects; train creates it
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["plan", "--nvme-dir", str(blocker)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
