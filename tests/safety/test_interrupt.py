"""Issue 12, case 2: Ctrl-C and SIGTERM stop `luwu train` cleanly at a step boundary, with a checkpoint.

A test hook (LUWU_TEST_SIGNAL_AT, luwu_rt/interrupt.py) makes the run send itself SIGINT at a
named phase of a chosen step, so every phase is hit on every run; the resumed run must then go on
exactly as one that was never interrupted (the same losses, bit for bit, and the same final weights).
"""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safety_common import SMALL, losses, luwu

from luwu_rt.ckpt.format import CheckpointReader, list_checkpoints

STEPS = 4


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run: its losses and its final checkpoint."""
    d = tmp_path_factory.mktemp("straight")
    r = luwu("train", "--steps", str(STEPS), *SMALL, "--json-log", str(d / "log.jsonl"), "--ckpt-dir", str(d / "ck"))
    assert r.returncode == 0, r.stderr
    return losses(d / "log.jsonl"), CheckpointReader(list_checkpoints(d / "ck")[-1])


def _same_weights(a: CheckpointReader, b: CheckpointReader) -> None:
    assert a.step == b.step and a.meta["adam_step"] == b.meta["adam_step"]
    assert sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        assert torch.equal(a.read(name), b.read(name)), name


@pytest.mark.parametrize("phase, step, stopped_at", [
    ("start", 1, 0), ("forward", 2, 2), ("backward", 2, 2), ("optimizer", 3, 3), ("checkpoint", 2, 2),
])
def test_sigint_at_a_phase_saves_and_resume_is_exact(tmp_path, straight, phase, step, stopped_at) -> None:
    expect, final = straight
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    env = dict(os.environ, LUWU_TEST_SIGNAL_AT=f"{phase}@{step}")
    args = ["train", "--steps", str(STEPS), *SMALL, "--json-log", str(log), "--ckpt-dir", str(ck), "--ckpt-every", "2"]
    r = luwu(*args, env=env)
    assert r.returncode == 130, r.stderr  # not 134 (SIGABRT) nor a signal death
    assert "Traceback" not in r.stderr and "terminate called" not in r.stderr, r.stderr
    assert f"stopped after step {stopped_at}" in r.stderr, r.stderr
    saved = [p.name for p in list_checkpoints(ck)]
    assert saved[-1:] == ([f"step_{stopped_at:08d}"] if stopped_at else []), saved  # the last completed step
    assert not list(ck.glob(".partial_*")), "a partial checkpoint was left behind"

    r = luwu(*args, "--resume-if-exists")
    assert r.returncode == 0, r.stderr
    assert losses(log) == expect  # the interrupted steps' lines, then the resumed ones: the straight run's
    _same_weights(CheckpointReader(list_checkpoints(ck)[-1]), final)


def test_sigterm_exits_143_with_a_checkpoint(tmp_path) -> None:
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "luwu_rt", "train", "--steps", "500", *SMALL, "--json-log", str(log),
                             "--ckpt-dir", str(ck)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not log.exists() or not log.read_text().count("\n")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    done = max(losses(log))
    assert [p.name for p in list_checkpoints(ck)] == [f"step_{done:08d}"], err


@pytest.mark.slow
def test_sigint_at_random_instants(tmp_path, straight) -> None:
    """Random instants instead of named phases; every run ends 130 and its resume is exact."""
    expect, final = straight
    rng = random.Random(12)
    for trial in range(3):
        log, ck = tmp_path / f"log{trial}.jsonl", tmp_path / f"ck{trial}"
        args = ["train", "--steps", str(STEPS), *SMALL, "--json-log", str(log), "--ckpt-dir", str(ck)]
        proc = subprocess.Popen([sys.executable, "-m", "luwu_rt", *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(1.0, 4.0))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (0, 130), err  # 0: it had finished before the signal came
        assert "Traceback" not in err and "terminate called" not in err, err
        r = luwu(*args, "--resume-if-exists") if proc.returncode == 130 else None
        assert r is None or r.returncode in (0, 2), r.stderr
        if r is not None and r.returncode == 2:  # it had saved the last step already
            assert "not beyond step" in r.stderr, r.stderr
        assert losses(log) == expect
        _same_weights(CheckpointReader(list_checkpoints(ck)[-1]), final)
