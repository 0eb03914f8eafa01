"""Three workers, and node snapshots: a node process killed with SIGKILL mid-run and restarted on the same
snapshot directory resumes there (that run in the chaos mode, workers and node, with batches given to
``train_step``), the workers rejoin and replay, and the run ends with the losses of an uninterrupted node run bit for bit; that run's losses and the grad norms the workers report (the node's)
equal the single-process run's on the global batch within 1e-5 relative. One set of worker processes
serves both runs: process start-up is most of this test's time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import node_jobs
from ranks import free_port, run_ranks

from luwu_rt.exec.chaos import CHAOS_ENV
from luwu_rt.node.service import HALT_ENV
from luwu_rt.node.snapshot import latest_snapshot, write_snapshot

WORKERS = 3
HALT_AFTER = 5  # snapshots every 2 steps: the node dies with step 4 on disk and step 5 to run again


def _node(port: int, snapshots: Path, log: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "luwu_rt", "node", "serve", "--bind", f"tcp://127.0.0.1:{port}",
                             "--num-workers", str(WORKERS), "--host-mem", "64MiB", "--timeout", "60",
                             "--snapshot-dir", str(snapshots), "--snapshot-every", "2"],
                            env={**os.environ, CHAOS_ENV: "", **env}, stderr=open(log, "w"))


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert proc.poll() is None, f"the node exited ({proc.returncode}):\n{path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} from the node:\n{path.read_text()[-3000:]}"
        time.sleep(0.05)


def test_a_killed_node_resumes_from_its_snapshot_with_the_same_losses(tmp_path):
    ports = {"plain": free_port(), "killed": free_port()}
    logs = {k: tmp_path / f"{k}.log" for k in ports}
    plain = _node(ports["plain"], tmp_path / "plain", logs["plain"])
    # The killed run runs in the chaos mode (workers and node), the plain one without: equal all the same.
    first = _node(ports["killed"], tmp_path / "killed", logs["killed"], **{HALT_ENV: str(HALT_AFTER), CHAOS_ENV: "41"})
    procs = [plain, first]
    try:
        runs = [(k, {"strategy": "node", "node": f"tcp://127.0.0.1:{p}", "timeout": 60}, "43" if k == "killed" else "")
                for k, p in ports.items()]
        results: list = []
        workers = threading.Thread(target=lambda: results.append(run_ranks(node_jobs.train_metrics, WORKERS, runs,
                                                                           ("killed",))), daemon=True)
        workers.start()
        _wait_for(logs["killed"], f"halted after step {HALT_AFTER}", first)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert latest_snapshot(tmp_path / "killed").step == 4
        second = _node(ports["killed"], tmp_path / "killed", logs["killed"].with_suffix(".2.log"), **{CHAOS_ENV: "47"})
        procs.append(second)
        workers.join(240)
        assert results, "the workers did not finish"
        assert second.wait(60) == 0 and plain.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "resumed run" in logs["killed"].with_suffix(".2.log").read_text()
    for rank in range(WORKERS):
        got = results[0][rank]
        assert got["killed"]["loss"] == got["plain"]["loss"], "a node restart changed the losses"
        assert got["killed"]["grad_norm"] == got["plain"]["grad_norm"]
        # Killed while the workers ran step 5 (then step 5 is run again) or step 6 (then 5 is replayed too).
        assert got["killed"]["rejoins"] == 1 and got["killed"]["replayed"] in (0, 1), got["killed"]
        assert got["plain"]["rejoins"] == 0
    # Three workers train as one process on the global batch; the grad norm they report is the node's.
    from luwu_rt.engine import Engine

    with pytest.MonkeyPatch.context() as m:
        m.delenv(CHAOS_ENV, raising=False)
        with Engine(None, node_jobs.config(batch_size=2 * WORKERS)) as engine:
            local = [engine.train_step() for _ in range(node_jobs.STEPS)]
    plain = results[0][0]["plain"]
    for key in ("loss", "grad_norm"):
        want = [m[key] for m in local]
        worst = max(abs(g - w) / abs(w) for g, w in zip(plain[key], want))
        assert min(want) > 0 and worst <= 1e-5, (key, plain[key], want)
    assert all(results[0][r]["plain"]["loss"] == plain["loss"] for r in range(WORKERS)), "one global loss"


def test_a_torn_snapshot_is_skipped_for_the_previous_one(tmp_path):
    import torch

    states = [((0, "master"), torch.arange(4.0))]
    write_snapshot(tmp_path, manifest={"m": 1}, step=2, adam_step=2, states=states, keep=2)
    newer = write_snapshot(tmp_path, manifest={"m": 1}, step=4, adam_step=4, states=states, keep=2)
    (newer / "u0.master").write_bytes(b"\0" * 8)  # a torn file: its size and SHA-256 no longer match
    (tmp_path / ".tmp-step_00000006").mkdir()  # a write a kill interrupted
    seen: list[str] = []
    snap = latest_snapshot(tmp_path, log=seen.append)
    assert snap.step == 2 and torch.equal(snap.state(0, "master"), torch.arange(4.0)) and "damaged" in seen[0]
