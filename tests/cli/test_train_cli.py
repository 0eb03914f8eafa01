"""`luwu train` as a user runs it: real processes, kill -9, resume, bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

SMALL = ["--batch-size", "2", "--seq-len", "16", "--eval-every", "0", "--quiet", "--chunk-size", "64KiB"]


def luwu(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "luwu_rt", *args], capture_output=True, text=True, timeout=timeout)


def _log(path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, open(path))}


def test_train_logs_and_checkpoints(tmp_path) -> None:
    log = tmp_path / "log.jsonl"
    r = luwu("train", "--steps", "4", *SMALL, "--json-log", str(log), "--ckpt-dir", str(tmp_path / "ck"),
             "--trace", str(tmp_path / "trace.json"))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in open(log)]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all({"step", "loss", "tokens_per_s", "step_s"} <= row.keys() for row in rows)
    assert (tmp_path / "ck" / "step_00000004" / "manifest.json").exists()
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert "per step" in r.stdout


def test_kill_minus_nine_then_resume_continues_from_last_checkpoint(tmp_path) -> None:
    steps, ck = 12, tmp_path / "ck"
    straight = tmp_path / "straight.jsonl"
    assert luwu("train", "--steps", str(steps), *SMALL, "--json-log", str(straight)).returncode == 0

    log = tmp_path / "killed.jsonl"
    cmd = [sys.executable, "-m", "luwu_rt", "train", "--steps", str(steps), *SMALL, "--json-log", str(log),
           "--ckpt-dir", str(ck), "--ckpt-every", "2", "--offload-optimizer", "nvme",
           "--nvme-dir", str(tmp_path / "nv")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and (not log.exists() or len(open(log).readlines()) < 5):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len(open(log).readlines())
    assert 5 <= killed_at < steps, "training finished before it could be killed"

    r = luwu("train", "--steps", str(steps), *SMALL, "--json-log", str(log), "--ckpt-dir", str(ck), "--resume",
             "--offload-optimizer", "nvme", "--nvme-dir", str(tmp_path / "nv"))
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stderr
    start = int(r.stderr.split("(step ")[1].split()[0])  # "resuming from ... (step S of run ...)"
    assert start <= killed_at and start % 2 == 0  # an even checkpoint
    # The lines past the checkpoint were dropped (item 7 of issue 13): each step once, the straight run's losses.
    rows = [json.loads(line) for line in open(log)]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert {row["step"]: row["loss"] for row in rows} == _log(straight)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--host-mem", "1KiB", "--device-mem", "1KiB"], "does not fit"),
        (["--nvme-dir", ""], "--nvme-dir) is empty"),
        (["--device-mem", "lots"], "cannot read size"),
        (["--steps", "0"], "steps must be a positive integer"),
        (["--model", "gpt-7"], "unknown model preset"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, args, message) -> None:
    r = luwu("train", *SMALL, "--steps", "2", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_unknown_config_key_and_unwritable_nvme_dir(tmp_path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('steps = 2\n[offload]\nparams = "host"\nhostmem = "1GiB"\n')
    r = luwu("train", "--config", str(cfg))
    assert r.returncode == 2 and "unknown key(s) hostmem" in r.stderr and "host_mem" in r.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = luwu("train", *SMALL, "--steps", "2", "--offload-optimizer", "nvme", "--nvme-dir", str(blocker / "x"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and str(blocker) in r.stderr


def test_failed_checkpoint_write_leaves_previous_checkpoint(tmp_path) -> None:
    # RLIMIT_FSIZE makes the kernel refuse file growth (EFBIG) like a full disk would.
    ck = tmp_path / "ck"
    assert luwu("train", "--steps", "2", *SMALL, "--ckpt-dir", str(ck)).returncode == 0
    script = (
        "import resource, signal, sys, runpy\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))\n"
        "sys.argv = ['luwu', 'train', '--steps', '4', '--resume', '--ckpt-dir', sys.argv[1]] + sys.argv[2:]\n"
        "runpy.run_module('luwu_rt', run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(ck), *SMALL], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    # The run's lock file stays.
    assert sorted(p.name for p in ck.iterdir() if p.name != ".luwu.lock") == ["step_00000002"]
    assert luwu("train", "--steps", "3", *SMALL, "--ckpt-dir", str(ck), "--resume").returncode == 0
