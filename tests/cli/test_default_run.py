"""Issue 13: `luwu train` with no arguments uses all three tiers for real. Its defaults leave the
parameters room on the device and keep the optimizer state out of the host budget, so the planner itself
puts that state on NVMe, in a scratch directory under the current directory that is removed at exit
(success, error, Ctrl-C); the run's first line says where each state lives and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from luwu_rt.cli.main import main
from luwu_rt.engine.budgets import DEMO_BUDGETS
from luwu_rt.plan import format_size

# The default run, shortened: the model, batch, sequence and budgets that decide the plan stay as they are.
SHORT = ["--steps", "2", "--eval-every", "0", "--quiet"]


def _luwu(*args: str, cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "luwu_rt", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _scratches(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("luwu-scratch-"))


def test_the_default_plan_puts_params_on_device_and_the_optimizer_on_nvme(capsys) -> None:
    assert main(["plan", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["fits"]
    assert planned["placement"]["params"] == "device" and planned["placement"]["optimizer"] == "nvme"
    optimizer = sum(planned["states"][s]["bytes"] for s in ("master", "exp_avg", "exp_avg_sq"))
    # The planner had to: the host budget is below the optimizer state (no placement was forced).
    assert planned["budgets"]["host"] < optimizer
    assert planned["budgets"]["nvme"] > 0 and "luwu-scratch-" in planned["nvme_dir"]


def test_default_run_names_its_tiers_first_and_removes_its_scratch(tmp_path) -> None:
    r = _luwu("train", *SHORT, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("gpt-tiny: ") and "params and grads on device (" in first, first
    assert "device arena" in first and "of activations" in first, first
    host = format_size(DEMO_BUDGETS[1])  # the demo's budget: `auto` for gpt-tiny built by name
    assert "optimizer state on nvme at ./luwu-scratch-" in first and f"(host budget {host} < optimizer state" in first
    scratch = first.split(" at ")[1].split()[0]
    assert not (tmp_path / scratch).exists() and _scratches(tmp_path) == []


def test_scratch_is_removed_after_an_error_and_after_ctrl_c(tmp_path) -> None:
    # An error after the engine (and its NVMe tier) exists: the first weights cannot be read.
    r = _luwu("train", *SHORT, "--init-from", "missing.safetensors", cwd=tmp_path)
    assert r.returncode == 2 and "missing.safetensors" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert _scratches(tmp_path) == []
    env = dict(os.environ, LUWU_TEST_SIGNAL_AT="backward@1")  # Ctrl-C in the first step's backward
    r = _luwu("train", "--steps", "3", "--eval-every", "0", "--quiet", cwd=tmp_path, env=env)
    assert r.returncode == 130 and "stopped after step 1" in r.stderr, r.stderr
    assert "on nvme at ./luwu-scratch-" in r.stderr and _scratches(tmp_path) == []


def test_keep_nvme_state_keeps_the_scratch_and_says_where(tmp_path) -> None:
    r = _luwu("train", *SHORT, "--keep-nvme-state", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (kept,) = _scratches(tmp_path)
    assert any((tmp_path / kept / "luwu_state").iterdir())
    assert f"stay in ./{kept} (--keep-nvme-state)" in r.stderr


def test_a_run_that_needs_no_nvme_leaves_no_directory(tmp_path) -> None:
    """With a batch small enough for everything to fit on the device, the plan uses no NVMe: the scratch
    made before planning is gone before the first step, and the first line names no NVMe tier."""
    r = _luwu("train", *SHORT, "--batch-size", "2", "--seq-len", "16", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "nvme" not in r.stderr.splitlines()[0] and _scratches(tmp_path) == []


def test_explicit_and_empty_nvme_dir(tmp_path) -> None:
    """An explicit --nvme-dir keeps its behaviour (no scratch; a directory that existed stays, its files go);
    an empty one is one clear line."""
    nv = tmp_path / "nv"
    nv.mkdir()
    r = _luwu("train", *SHORT, "--nvme-dir", str(nv), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"optimizer state on nvme at {nv} (" in r.stderr and _scratches(tmp_path) == []
    assert nv.is_dir() and not (nv / "luwu_state").exists()
    r = _luwu("train", *SHORT, "--nvme-dir", "", cwd=tmp_path)
    assert r.returncode == 2 and "--nvme-dir) is empty" in r.stderr and "Traceback" not in r.stderr
    assert _scratches(tmp_path) == []


def test_a_tier_in_memory_or_without_o_direct_is_named(tmp_path, monkeypatch) -> None:
    """The run's one line about a tier that is not a real disk with O_DIRECT (its IO then goes through the
    page cache): a file system in memory, or one that refuses O_DIRECT."""
    import errno

    from luwu_rt.cli import dirs

    monkeypatch.setattr(dirs, "_fs_type", lambda path: "tmpfs")
    assert dirs.disk_problem(tmp_path) == "is on tmpfs, which keeps files in memory, not on a disk"
    monkeypatch.setattr(dirs, "_fs_type", lambda path: "fuse.example")
    real_open = os.open

    def no_direct(path, flags, *rest):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *rest)

    monkeypatch.setattr(dirs.os, "open", no_direct)
    assert dirs.disk_problem(tmp_path) == "is on a file system (fuse.example) without O_DIRECT"
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
