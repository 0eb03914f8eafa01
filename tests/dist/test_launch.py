"""``luwu train --nproc N`` and the failure handling of multi-rank runs, with real processes.

The failure tests (a rank killed, stopped, or failing) run ``launch`` on a stand-in rank program (this
file run as a script: an all-reduce per step through ``run_rank``), so that they exercise the launcher,
the heartbeats and ``explain`` whatever the engine's collectives do; ``luwu train --nproc 2`` itself is
run for success and for a killed rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from luwu_rt.dist.launch import core_slice

_MARK = "LUWU_TEST_LAUNCH"  # in the environment of every process a test starts, to find leftovers


# ---------------------------------------------------------------------------------------------- helpers


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def _marked(mark: str) -> list[int]:
    """Live processes started by the test run ``mark`` (the launcher, its ranks, and theirs)."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
    return [p for p in pids if _alive(p) and _environ(p).get(_MARK) == mark]


def _rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's children, found by scanning /proc."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), None)
        if ppid == launcher and "RANK" in (env := _environ(int(p))):
            out[int(env["RANK"])] = int(p)
    return out


def _wait_for(predicate, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")


class _Run:
    """A launcher process started by a test; its stderr is collected in a file."""

    def __init__(self, argv: list[str], tmp_path: Path, *, sigint_ignored: bool = False):
        """``sigint_ignored``: started as a script's background job is, with SIGINT ignored."""
        self.mark = uuid.uuid4().hex
        self.stderr_path, self.stdout_path = tmp_path / "stderr.txt", tmp_path / "stdout.txt"
        env = dict(os.environ, **{_MARK: self.mark})
        env.pop("WORLD_SIZE", None)
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        with open(self.stderr_path, "wb") as err, open(self.stdout_path, "wb") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, cwd=tmp_path, preexec_fn=ignore)

    def ranks(self, n: int) -> dict[int, int]:
        def found():
            pids = _rank_pids(self.proc.pid)
            return pids if len(pids) == n else None

        return _wait_for(found, 20, f"{n} ranks")

    def wait(self, seconds: float) -> tuple[int, str]:
        try:
            code = self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the launcher did not exit within {seconds} s; stderr:\n{self.stderr()}") from None
        return code, self.stderr()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def assert_nothing_left(self) -> None:
        # A rank's PR_SET_PDEATHSIG kill is asynchronous: allow it a moment.
        left = []
        for _ in range(30):
            left = _marked(self.mark)
            if not left:
                return
            time.sleep(0.1)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"processes left behind: {left}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in _marked(self.mark):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def runs():
    started: list[_Run] = []
    yield started
    for run in started:
        run.close()


def _luwu_train(tmp_path: Path, runs: list, *flags: str) -> _Run:
    run = _Run([sys.executable, "-m", "luwu_rt", "train", *flags], tmp_path)
    runs.append(run)
    return run


def _stand_in(tmp_path: Path, runs: list, *, timeout_s: float, fail_rank: int = -1, fail_step: int = -1,
              sigint_ignored: bool = False) -> _Run:
    """``launch`` of 2 stand-in ranks, each writing its last step to tmp_path/step<rank>."""
    rank_cmd = [sys.executable, __file__, str(tmp_path), str(timeout_s), str(fail_rank), str(fail_step)]
    code = (f"import sys; from luwu_rt.dist.launch import launch; "
            f"sys.exit(launch({rank_cmd!r}, 2, timeout_s={timeout_s}))")
    run = _Run([sys.executable, "-c", code], tmp_path, sigint_ignored=sigint_ignored)
    runs.append(run)
    return run


def _step(tmp_path: Path, rank: int) -> int:
    try:
        return int((tmp_path / f"step{rank}").read_text() or -1)
    except (OSError, ValueError):
        return -1


def _stand_in_rank(tmp_path: str, timeout_s: str, fail_rank: str, fail_step: str) -> int:
    """One stand-in rank: an all-reduce per step, its progress recorded, failing on request."""
    import torch
    import torch.distributed as dist

    from luwu_rt.dist import health
    from luwu_rt.dist.launch import pin_cores, run_rank

    rank = int(os.environ["RANK"])
    pin_cores(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))

    def train() -> int:
        t = torch.ones(16)
        for step in range(100_000):
            if rank == int(fail_rank) and step == int(fail_step):
                raise ValueError(f"stand-in failure at step {step}")
            dist.all_reduce(t)
            health.progress(step)
            Path(tmp_path, f"step{rank}").write_text(str(step))
            time.sleep(0.05)
        return 0

    try:
        return run_rank(train, timeout_s=float(timeout_s))
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------------------------------------- core split


def test_core_slice_splits_contiguously_and_covers_every_core():
    for n_cores in range(1, 13):
        for size in range(1, n_cores + 1):
            slices = [core_slice(range(n_cores), r, size) for r in range(size)]
            assert [c for s in slices for c in s] == list(range(n_cores)), (n_cores, size)
            assert max(map(len, slices)) - min(map(len, slices)) <= 1


def test_core_slice_uses_the_allowed_cores_and_shares_when_too_few():
    assert core_slice({9, 2, 3, 8}, 0, 2) == [2, 3]
    assert core_slice({9, 2, 3, 8}, 1, 2) == [8, 9]
    assert [core_slice({4, 5}, r, 5) for r in range(5)] == [[4], [5], [4], [5], [4]]


def test_core_slice_rejects_a_bad_rank():
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        core_slice(range(4), 2, 2)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        core_slice(range(4), 0, 0)


def test_pin_cores_pins_the_process_and_sizes_the_thread_pools():
    code = ("import os, torch; from luwu_rt.dist.launch import pin_cores, core_slice; "
            "cores = sorted(os.sched_getaffinity(0)); mine = pin_cores(1, 2); "
            "assert mine == core_slice(cores, 1, 2), mine; "
            "assert sorted(os.sched_getaffinity(0)) == mine; assert torch.get_num_threads() == len(mine); "
            "assert os.environ['NUMBA_NUM_THREADS'] == str(len(mine)); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# ---------------------------------------------------------------------------------------------- luwu train


def test_luwu_train_nproc_2_exits_0(tmp_path, runs):
    """One line naming the strategy, rank 0's JSON log (a line per step), one trace with a row per rank, a
    checkpoint of both ranks' slices, an evaluation on both ranks; nothing left behind."""
    log, trace, ckpt = tmp_path / "log.jsonl", tmp_path / "trace.json", tmp_path / "ckpt"
    run = _luwu_train(tmp_path, runs, "--nproc", "2", "--steps", "4", "--model", "gpt-tiny", "--batch-size", "2",
                      "--seq-len", "32", "--eval-every", "2", "--quiet", "--strategy", "zero3", "--json-log", str(log),
                      "--trace", str(trace), "--ckpt-dir", str(ckpt))
    code, err = run.wait(90)
    assert code == 0, err
    run.assert_nothing_left()
    assert err.count("strategy zero3 on 2 ranks") == 1, err
    out = run.stdout_path.read_text()  # the validation and summary lines, from rank 0 only
    assert out.count("step 2: validation loss") == 1 and out.count("step 4: validation loss") == 1, out
    assert out.count("step 4: loss") == 1, out
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["step"] for e in entries if "loss" in e] == [1, 2, 3, 4]
    assert [e["step"] for e in entries if "val_loss" in e] == [2, 4]
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1} and any(e["name"].startswith("Gather") for e in events)
    saved = ckpt / "step_00000004"
    assert (saved / "u0.master.slice0of2.bin").is_file() and (saved / "u0.master.slice1of2.bin").is_file()


def test_luwu_train_rank_killed_fails_naming_it(tmp_path, runs):
    log = tmp_path / "log.jsonl"
    run = _luwu_train(tmp_path, runs, "--nproc", "2", "--steps", "100000", "--batch-size", "2", "--seq-len", "32",
                      "--eval-every", "0", "--quiet", "--timeout", "20", "--json-log", str(log))
    pids = run.ranks(2)
    _wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 2, 30, "two steps")
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    code, err = run.wait(20 + 15)
    assert code != 0, err
    assert "luwu: rank 1 was killed by signal SIGKILL" in err, err
    assert time.monotonic() - start < 20 + 10, err
    run.assert_nothing_left()


def _losses(log: Path) -> list[float]:
    return [e["loss"] for e in map(json.loads, log.read_text().splitlines()) if "loss" in e]


@pytest.mark.parametrize("strategy", ["zero3", "node"])
def test_max_restarts_starts_the_ranks_again_from_the_newest_checkpoint(tmp_path, runs, monkeypatch, strategy):
    """[Note: restarting the ranks] in cli/train.py: rank 1 SIGKILLed after the checkpoint of step 2; the
    launcher starts both ranks again (with a fresh spawned node under strategy node), they resume from that
    checkpoint, and the run ends with the losses of one nobody killed, bit for bit (the killed run in the
    chaos mode), its JSON log a line per step."""
    from luwu_rt.exec.chaos import CHAOS_ENV

    flags = ["--nproc", "2", "--steps", "8", "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--quiet",
             "--timeout", "30", "--strategy", strategy, "--ckpt-every", "2",
             *(["--spawn-node"] if strategy == "node" else [])]
    plain_dir, killed_dir = tmp_path / "plain", tmp_path / "killed"
    plain_dir.mkdir(), killed_dir.mkdir()
    monkeypatch.setenv(CHAOS_ENV, "")
    plain = _luwu_train(plain_dir, runs, *flags, "--ckpt-dir", "ck", "--json-log", "log.jsonl")
    code, err = plain.wait(240)
    assert code == 0, err
    monkeypatch.setenv(CHAOS_ENV, "73")
    log = killed_dir / "log.jsonl"
    killed = _luwu_train(killed_dir, runs, *flags, "--ckpt-dir", "ck", "--json-log", "log.jsonl",
                         "--max-restarts", "2")
    pids = killed.ranks(2)
    _wait_for(lambda: (killed_dir / "ck" / "step_00000002" / "manifest.json").exists(), 120, "a checkpoint")
    assert killed.proc.poll() is None, killed.stderr()
    os.kill(pids[1], signal.SIGKILL)
    code, err = killed.wait(300)
    assert code == 0, err
    assert "luwu: rank 1 was killed by signal SIGKILL" in err, err
    assert err.count("starting its 2 ranks again from the newest checkpoint") == 1, err
    killed.assert_nothing_left()
    assert [e["step"] for e in map(json.loads, log.read_text().splitlines())] == list(range(1, 9))
    assert _losses(log) == _losses(plain_dir / "log.jsonl")


def test_max_restarts_needs_a_checkpoint_directory_and_no_running_node(tmp_path, runs):
    code, err = _luwu_train(tmp_path, runs, "--nproc", "2", "--steps", "2", "--max-restarts", "1").wait(60)
    assert code == 2 and "--max-restarts needs --ckpt-dir" in err, err
    code, err = _luwu_train(tmp_path, runs, "--nproc", "2", "--steps", "2", "--max-restarts", "1", "--ckpt-dir", "ck",
                            "--strategy", "node", "--node", "tcp://127.0.0.1:5555").wait(60)
    assert code == 2 and "--max-restarts goes with --spawn-node under strategy node" in err, err


# ---------------------------------------------------------------------------------------------- failures


def test_killed_rank_is_named_by_the_survivor_and_the_launcher(tmp_path, runs):
    run = _stand_in(tmp_path, runs, timeout_s=20)
    pids = run.ranks(2)
    # Past step 40 (~2 s): a heartbeat since the first carries a step.
    _wait_for(lambda: _step(tmp_path, 1) >= 40, 30, "rank 1 at step 40")
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    code, err = run.wait(20 + 15)
    assert code == 128 + signal.SIGKILL, err
    assert "luwu: rank 1 was killed by signal SIGKILL" in err, err
    assert "luwu: rank 0: rank 1 stopped responding (no heartbeat for" in err, err
    assert ", last at step" in err, err
    assert time.monotonic() - start < 10, err  # no waiting for the timeout: the survivor exits at once
    run.assert_nothing_left()


def test_stopped_rank_is_named_when_the_timeout_expires(tmp_path, runs):
    timeout = 10
    run = _stand_in(tmp_path, runs, timeout_s=timeout)
    pids = run.ranks(2)
    _wait_for(lambda: _step(tmp_path, 1) >= 3, 30, "rank 1 at step 3")
    os.kill(pids[1], signal.SIGSTOP)
    start = time.monotonic()
    code, err = run.wait(timeout + 20)
    elapsed = time.monotonic() - start
    assert code == 1, err
    assert "luwu: rank 0: rank 1 stopped responding (no heartbeat for" in err, err
    assert timeout - 1 < elapsed < timeout + 10, (elapsed, err)
    run.assert_nothing_left()  # the stopped rank was killed, not left stopped


def test_rank_that_fails_itself_is_named_once(tmp_path, runs):
    run = _stand_in(tmp_path, runs, timeout_s=20, fail_rank=1, fail_step=3)
    code, err = run.wait(40)
    assert code == 2, err  # a ValueError: an error the user can fix exits 2, as one process does
    assert "luwu: rank 1: ValueError: stand-in failure at step 3" in err, err
    assert "luwu: rank 0: rank 1 failed: ValueError: stand-in failure at step 3" in err, err
    assert "exited with code" not in err, err  # the launcher does not repeat what the rank said
    run.assert_nothing_left()


def test_ctrl_c_stops_every_rank(tmp_path, runs):
    run = _stand_in(tmp_path, runs, timeout_s=20)
    run.ranks(2)
    _wait_for(lambda: _step(tmp_path, 0) >= 2, 30, "rank 0 at step 2")
    run.proc.send_signal(signal.SIGINT)
    code, err = run.wait(15)
    assert code == 130, err
    assert "stopped responding" not in err, err  # a rank that loses its peer to Ctrl-C does not blame it
    run.assert_nothing_left()



def test_ctrl_c_stops_a_launcher_started_with_sigint_ignored(tmp_path, runs):
    """A script's background job inherits SIGINT ignored; the launcher installs its handler itself, so
    kill -INT still stops the run (it ran to the end before)."""
    run = _stand_in(tmp_path, runs, timeout_s=20, sigint_ignored=True)
    run.ranks(2)
    _wait_for(lambda: _step(tmp_path, 0) >= 2, 30, "rank 0 at step 2")
    run.proc.send_signal(signal.SIGINT)
    code, err = run.wait(15)
    assert code == 130, err
    run.assert_nothing_left()


# ---------------------------------------------------------------------------------------------- leftovers


def test_a_failed_multi_rank_run_leaves_no_nvme_state(tmp_path, runs):
    """Rank 0 fails writing --json-log (a full disk): each rank removes its NVMe tier before it ends at once,
    and the user's error exits 2 (before: every rank's luwu_state/*.bin stayed, and the run exited 1)."""
    nvme = tmp_path / "nvme"
    run = _luwu_train(tmp_path, runs, "--nproc", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "16",
                      "--eval-every", "0", "--quiet", "--chunk-size", "64KiB", "--json-log", "/dev/full",
                      "--offload-optimizer", "nvme", "--nvme-dir", str(nvme))
    code, err = run.wait(120)
    assert code == 2, err
    assert "luwu: rank 0: OSError: writing --json-log failed: No space left on device" in err, err
    assert "Traceback" not in err, err
    run.assert_nothing_left()
    assert (nvme / "rank-0").is_dir(), "the run did not get as far as its NVMe tier"
    left = [p for p in nvme.rglob("*") if p.is_file() and p.name != ".luwu.lock"]
    assert not left, left


def test_a_spawn_node_launcher_killed_leaves_no_node_and_no_scratch(tmp_path, runs):
    """SIGKILL of `luwu train --spawn-node` while its node and scratch directory exist: the node dies with it
    (before: re-parented to PID 1, alive for --timeout or forever), and ./luwu-scratch-* goes too."""
    run = _luwu_train(tmp_path, runs, "--spawn-node", "--nproc", "2", "--steps", "100000", "--batch-size", "1",
                      "--seq-len", "16", "--eval-every", "0", "--quiet", "--timeout", "600",
                      "--offload-params", "nvme")
    run.ranks(2)
    _wait_for(lambda: any(tmp_path.glob("luwu-scratch-*/rank-*/luwu_state")), 120, "the ranks' NVMe tier")
    node = [p for p in _marked(run.mark) if "serve" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    assert node, "no optimizer node was started"
    run.proc.kill()
    run.proc.wait()
    run.assert_nothing_left()
    _wait_for(lambda: not list(tmp_path.glob("luwu-scratch-*")), 10, "the scratch directory to go")


if __name__ == "__main__":
    sys.exit(_stand_in_rank(*sys.argv[1:]))
