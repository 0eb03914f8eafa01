"""Issue 13 item 7: a run says where each checkpoint went; --json-log after a resume holds each step once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

SMALL = ["--batch-size", "2", "--seq-len", "16", "--eval-every", "2", "--quiet", "--chunk-size", "64KiB"]


def _luwu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "luwu_rt", "train", *args], capture_output=True, text=True,
                          timeout=300)


def test_saves_are_named_and_a_resume_leaves_one_line_per_step(tmp_path) -> None:
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    r = _luwu("--steps", "4", *SMALL, "--ckpt-dir", str(ck), "--ckpt-every", "2", "--json-log", str(log))
    assert r.returncode == 0, r.stderr
    for step in (2, 4):
        assert f"step {step}: checkpoint saved to {ck / f'step_{step:08d}'}" in r.stderr, r.stderr
    before = [json.loads(line) for line in open(log)]
    # Lose the last checkpoint: a resume goes back to step 2 and runs steps 3 and 4 again.
    shutil.rmtree(ck / "step_00000004")
    with open(log, "a") as f:
        f.write('{"step": 4, "lo')  # and a line torn by a crash
    r = _luwu("--steps", "4", *SMALL, "--ckpt-dir", str(ck), "--resume", "--json-log", str(log))
    assert r.returncode == 0, r.stderr
    assert "dropped 4 line(s) past step 2" in r.stderr, r.stderr  # steps 3, 4, the eval at 4, the torn line
    assert f"step 4: checkpoint saved to {ck / 'step_00000004'}" in r.stderr
    after = [json.loads(line) for line in open(log)]
    keys = [(row["step"], "val_loss" in row) for row in after]
    assert keys == [(1, False), (2, False), (2, True), (3, False), (4, False), (4, True)]
    assert after[:3] == before[:3]  # the lines the checkpoint kept are left as they were


def test_a_second_run_on_the_same_json_log_is_refused_naming_the_first(tmp_path) -> None:
    """Issue 19 item 7: two runs given one --json-log interleaved their lines; the second is now refused
    in one line naming the pid of the run that writes the log, before it builds or creates anything."""
    import os
    import signal
    import time

    log = tmp_path / "log.jsonl"
    first = subprocess.Popen([sys.executable, "-m", "luwu_rt", "train", "--steps", "100000", *SMALL,
                              "--json-log", str(log)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().count("\n") >= 2):
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start logging"
            time.sleep(0.2)
        work = tmp_path / "second"
        work.mkdir()
        second = subprocess.run([sys.executable, "-m", "luwu_rt", "train", "--steps", "3", *SMALL,
                                 "--json-log", str(log)], cwd=work, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().splitlines() == [
            f"luwu: error: [Errno 16] --json-log is in use by another run (pid {first.pid}); wait for it to end or "
            f"give this run another file: '{log}'"], second.stderr
        assert list(work.iterdir()) == []  # no scratch directory: refused before anything was built
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    steps = [row["step"] for row in map(json.loads, log.read_text().splitlines()) if "loss" in row]
    assert steps == list(range(1, len(steps) + 1))  # one writer: every step once, in order
    os.stat(log)  # the first run's log stays
