"""Issue 12, case 4: one run at a time in an NVMe or checkpoint directory (flock, the holder's pid named)."""

import os
import subprocess
import sys
import time

import pytest
from safety_common import SMALL, luwu, one_line_error

from luwu_rt.fs import LOCK_FILE, lock_dir


def test_second_run_on_the_same_directories_is_refused(tmp_path) -> None:
    nv, ck, log = tmp_path / "nv", tmp_path / "ck", tmp_path / "log.jsonl"
    first = subprocess.Popen([sys.executable, "-m", "luwu_rt", "train", "--steps", "1000", *SMALL,
                              "--offload-optimizer", "nvme", "--nvme-dir", str(nv), "--ckpt-dir", str(ck),
                              "--json-log", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not log.exists() or not log.read_text()):
            time.sleep(0.05)  # it is training: both locks are held
        assert first.poll() is None
        state = sorted(p.name for p in (nv / "luwu_state").rglob("*"))
        r = luwu("train", "--steps", "2", *SMALL, "--offload-optimizer", "nvme", "--nvme-dir", str(nv))
        one_line_error(r, "--nvme-dir", f"pid {first.pid}", str(nv))
        r = luwu("train", "--steps", "2", *SMALL, "--ckpt-dir", str(ck))
        one_line_error(r, "--ckpt-dir", f"pid {first.pid}", str(ck))
        assert first.poll() is None  # the first run goes on, its NVMe state untouched
        assert sorted(p.name for p in (nv / "luwu_state").rglob("*")) == state
    finally:
        first.terminate()
        first.communicate(timeout=120)
    assert first.returncode == 143  # SIGTERM: stopped after a step, saved, and exited


def test_lock_is_counted_within_a_process_and_freed_by_death(tmp_path) -> None:
    a = lock_dir(tmp_path, flag="--ckpt-dir")
    b = lock_dir(tmp_path, flag="--ckpt-dir")  # the CLI and Engine.save of one process share it
    assert a is b and (tmp_path / LOCK_FILE).read_text().strip() == str(os.getpid())
    other = [sys.executable, "-c", "import sys; from luwu_rt.fs import lock_dir; "
             "lock_dir(sys.argv[1], flag='--ckpt-dir')", str(tmp_path)]
    b.release()
    r = subprocess.run(other, capture_output=True, text=True)
    assert r.returncode != 0 and f"pid {os.getpid()}" in r.stderr
    a.release()
    assert subprocess.run(other, capture_output=True, text=True).returncode == 0  # a dead holder holds nothing


def test_a_file_is_not_a_directory(tmp_path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(OSError, match="names a file"):
        lock_dir(tmp_path / "f", flag="--nvme-dir")
