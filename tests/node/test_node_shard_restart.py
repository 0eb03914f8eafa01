"""Two node shards with snapshots, and one of them killed: shard 0 (the one the norms meet at) is SIGKILLed
mid-run and restarted on its snapshot directory; the live shard 1 is sent ROLLBACK, replaces its own process
at its snapshot of the same step, and the workers rejoin both and replay ([Note: node shards that restart] in
node/worker.py). The run ends with the losses and grad norms of an uninterrupted two-shard run bit for bit,
the killed run in the chaos mode (workers and nodes). And a shard that cannot go back, because it holds no
snapshot of that step, refuses by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import node_jobs
import torch
from ranks import free_port, run_ranks
from test_node_snapshot import _wait_for
from test_protocol import SIZES, manifest

from luwu_rt.exec.chaos import CHAOS_ENV
from luwu_rt.node.manifest import manifest_bytes
from luwu_rt.node.protocol import DTYPE_CODES, INIT_STATES, Message, T, decode, encode
from luwu_rt.node.service import NodeConfig, NodeService
from luwu_rt.node.shards import slice_of
from luwu_rt.node.snapshot import latest_snapshot, write_snapshot
from luwu_rt.node.steps import HALT_ENV

WORKERS = 2
HALT_AFTER = 5  # snapshots every 2 steps: shard 0 dies with step 4 on disk, shard 1 goes back to its step 4
STEPS = 8


def _shard(ports: list[int], index: int, snapshots: Path, log: Path, *extra: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "luwu_rt", "node", "serve", "--bind",
                             f"tcp://127.0.0.1:{ports[index]}", "--num-workers", str(WORKERS), "--host-mem", "64MiB",
                             "--timeout", "60", "--shard", f"{index}/{len(ports)}", "--snapshot-dir", str(snapshots),
                             "--snapshot-every", "2", *extra],
                            env={**os.environ, CHAOS_ENV: "", **env}, stderr=open(log, "a"))


def _address(ports: list[int]) -> str:
    return ",".join(f"tcp://127.0.0.1:{p}" for p in ports)


def test_a_killed_node_shard_and_the_live_one_go_back_to_one_snapshot(tmp_path):
    plain, killed = [free_port(), free_port()], [free_port(), free_port()]
    log = {name: tmp_path / f"{name}.log" for name in ("plain0", "plain1", "killed0", "killed1", "restarted0")}
    procs = [_shard(plain, i, tmp_path / f"plain{i}", log[f"plain{i}"]) for i in range(2)]
    first = _shard(killed, 0, tmp_path / "killed0", log["killed0"], **{HALT_ENV: str(HALT_AFTER), CHAOS_ENV: "53"})
    live = _shard(killed, 1, tmp_path / "killed1", log["killed1"], **{CHAOS_ENV: "59"})
    procs += [first, live]
    try:
        runs = [("plain", {"strategy": "node", "node": _address(plain), "timeout": 60}, ""),
                ("killed", {"strategy": "node", "node": _address(killed), "timeout": 60}, "61")]
        results: list = []
        ranks = threading.Thread(target=lambda: results.append(
            run_ranks(node_jobs.train_metrics, WORKERS, runs, ("killed",), STEPS)), daemon=True)
        ranks.start()
        _wait_for(log["killed0"], f"halted after step {HALT_AFTER}", first)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert latest_snapshot(tmp_path / "killed0").step == 4
        second = _shard(killed, 0, tmp_path / "killed0", log["restarted0"], **{CHAOS_ENV: "67"})
        procs.append(second)
        ranks.join(300)
        assert results, "the workers did not finish"
        # The live shard's process replaced itself (same pid) and ran on to the end.
        assert second.wait(60) == 0 and live.wait(60) == 0
        assert all(p.wait(60) == 0 for p in procs[:2])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    shard1 = log["killed1"].read_text()
    assert "going back to this shard's snapshot of it" in shard1, shard1[-3000:]
    assert "resumed run" in shard1 and "(step 4)" in shard1, shard1[-3000:]
    for rank in range(WORKERS):
        got = results[0][rank]
        assert got["killed"]["rejoins"] == 1 and got["killed"]["replayed"] in (0, 1), got["killed"]
        assert got["killed"]["loss"] == got["plain"]["loss"], "a node shard's restart changed the losses"
        assert got["killed"]["grad_norm"] == got["plain"]["grad_norm"]


def test_a_shard_without_the_snapshot_refuses_to_go_back(tmp_path):
    """The service's side of a ROLLBACK, in this process: a shard asked back to a step it holds no snapshot of
    says so, naming the directory; one that holds it waits for no write and hands the step and its address to
    its restart hook; one run inside a program that gave no hook says how to restart it; one restarted at a step
    whose snapshot it cannot read serves, and tells the worker that rejoins why."""
    m = {**manifest(), "nodes": ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]}
    snaps = tmp_path / "snaps"
    for step in (2, 4):  # shard 1's slices of every unit
        states = [((u, s), torch.full((slice_of(n, 1, 2)[1],), float(step))) for u, n in enumerate(SIZES)
                  for s in INIT_STATES]
        write_snapshot(snaps, manifest=m, step=step, adam_step=step, states=states, shard=[1, 2])
    asked: list[tuple[int, str]] = []
    config = NodeConfig(num_workers=2, host_mem="16MiB", snapshot_dir=str(snaps), shard="1/2")
    service = NodeService(config, run_steps=False, log=print, chaos=None,
                          restart=lambda step, address: asked.append((step, address)))
    try:
        assert service.resumed_from == 4
        assert "holds no snapshot of step 6" in service._rollback(6)
        assert service._rollback(2) == "" and asked == [(2, config.bind)]
        service.restart = None
        assert "start it again with --resume-step 2" in service._rollback(2)
    finally:
        service._close()
    again = NodeService(NodeConfig(num_workers=2, host_mem="16MiB", snapshot_dir=str(snaps), shard="1/2",
                                   resume_step=2), run_steps=False, log=print, chaos=None)
    try:
        assert again.resumed_from == 2 and again.runner.step == 2
    finally:
        again._close()
    # A shard restarted at a step it cannot resume from still serves: the worker that rejoins hears why.
    lines: list[str] = []
    lost = NodeService(NodeConfig(num_workers=2, host_mem="16MiB", snapshot_dir=str(snaps), shard="1/2",
                                  resume_step=3), run_steps=False, log=lines.append, chaos=None)
    try:
        assert lost.resumed_from is None
        lost.handle(b"w1", encode(Message(T.HELLO, rank=1, step=3, dtype=DTYPE_CODES["json"],
                                          payload=manifest_bytes(m))))
        identity, frames = lost.protocol.outbox[-1]
        assert identity == b"w1" and decode(frames).type == T.ERROR
        text = bytes(frames[1]).decode()
        assert "rejoins its run in step 3, but this node holds no snapshot of it" in text, text
        assert "holds no whole snapshot of step 3" in text and "step_00000002, step_00000004" in text, text
        assert any("cannot resume at step 3" in line for line in lines), lines
    finally:
        lost._close()


def _train_spawned(tmp_path: Path, name: str, chaos: str, *, kill_at: int | None = None) -> tuple[list[float], str]:
    """``luwu train --spawn-node`` with 2 workers and 2 node shards snapshotting every 2 steps; with ``kill_at``,
    shard 0 is SIGKILLed once its snapshot of that step is on disk. Returns the losses and the launcher's
    stderr."""
    snaps = tmp_path / f"{name}-snaps"
    cmd = [sys.executable, "-m", "luwu_rt", "train", "--strategy", "node", "--nproc", str(WORKERS), "--spawn-node",
           "--node-shards", "2", "--node-snapshot-every", "2", "--node-snapshot-dir", str(snaps),
           "--steps", str(SPAWNED_STEPS), "--batch-size", "1", "--seq-len", "16", "--eval-every", "0",
           "--keep-graphs", "none", "--quiet", "--timeout", "60", "--json-log", str(tmp_path / f"{name}.jsonl")]
    train = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, CHAOS_ENV: chaos}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    if kill_at is not None:
        held = snaps / "shard-0" / f"step_{kill_at:08d}"
        deadline = time.monotonic() + 120
        while not (held / "manifest.json").exists():  # committed: the directory is renamed into place whole
            assert train.poll() is None, f"the run ended before the kill:\n{train.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, f"shard 0 wrote no snapshot of step {kill_at}"
            time.sleep(0.02)
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_node(p, snaps / "shard-0")]
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
    out, err = train.communicate(timeout=300)
    assert train.returncode == 0, err[-3000:]
    lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    return [line["loss"] for line in lines if "loss" in line], err


def _is_node(proc: Path, snapshots: Path) -> bool:
    try:
        words = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in words and str(snapshots).encode() in words


SPAWNED_STEPS = 14


def test_a_spawned_node_shard_that_dies_is_started_again(tmp_path):
    """[Note: spawned nodes that die] in node/spawn.py: ``luwu train --spawn-node --node-snapshot-every 2``
    starts a killed shard again on its snapshots; the workers rejoin both shards and replay, and the run
    reports the losses of a run nobody killed, bit for bit (the killed run in the chaos mode)."""
    plain, _ = _train_spawned(tmp_path, "plain", "")
    killed, err = _train_spawned(tmp_path, "killed", "67", kill_at=4)
    assert "optimizer node shard 0 exited with status -9; starting it again" in err, err[-3000:]
    assert len(plain) == SPAWNED_STEPS and killed == plain, (killed, plain)
