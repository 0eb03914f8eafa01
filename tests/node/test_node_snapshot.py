"""Three workers, and node snapshots: a node process killed with SIGKILL mid-run and restarted on the same
snapshot directory resumes there (that run in the chaos mode, workers and node, with batches given to
``train_step``), the workers rejoin and replay, and the run ends with the losses of an uninterrupted node run bit
for bit; that run's losses and the grad norms the workers report (the node's)
equal the single-process run's on the global batch within 1e-5 relative. One set of worker processes
serves both runs: process start-up is most of this test's time. So does a run of two workers pushing onebit
payloads, whose replay starts from the residuals each worker kept at the snapshot's step."""

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
from luwu_rt.node.steps import HALT_ENV
from luwu_rt.node.snapshot import latest_snapshot, write_snapshot

WORKERS = 3
HALT_AFTER = 5  # snapshots every 2 steps: the node dies with step 4 on disk and step 5 to run again


def _node(port: int, snapshots: Path, log: Path, *, workers: int = WORKERS, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "luwu_rt", "node", "serve", "--bind", f"tcp://127.0.0.1:{port}",
                             "--num-workers", str(workers), "--host-mem", "64MiB", "--timeout", "60",
                             "--snapshot-dir", str(snapshots), "--snapshot-every", "2"],
                            env={**os.environ, CHAOS_ENV: "", **env}, stderr=open(log, "w"))


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert proc.poll() is None, f"the node exited ({proc.returncode}):\n{path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} from the node:\n{path.read_text()[-3000:]}"
        time.sleep(0.05)


def _killed_and_plain(tmp_path: Path, *, workers: int, halt: int, snapshot_step: int, run: dict, steps: int | None,
                      chaos: tuple[str, str, str], given: tuple[str, ...] = ()) -> dict:
    """Two node runs side by side, one plain and one killed with SIGKILL after step ``halt`` (its snapshot of
    ``snapshot_step`` on disk) and restarted on the same snapshot directory; ``workers`` ranks train against both
    (``run``: the workers' config beside the node address). ``chaos``: the seeds of the first node, the killed
    run's workers and the restarted node; ``given``: the runs whose batches the workers pass to ``train_step``
    (``node_jobs.train_metrics``). Returns each rank's metrics per run, with the restarted node's log."""
    ports = {"plain": free_port(), "killed": free_port()}
    logs = {k: tmp_path / f"{k}.log" for k in ports}
    plain = _node(ports["plain"], tmp_path / "plain", logs["plain"], workers=workers)
    first = _node(ports["killed"], tmp_path / "killed", logs["killed"], workers=workers,
                  **{HALT_ENV: str(halt), CHAOS_ENV: chaos[0]})
    procs = [plain, first]
    try:
        runs = [(k, {"strategy": "node", "node": f"tcp://127.0.0.1:{p}", "timeout": 60, **run},
                 chaos[1] if k == "killed" else "") for k, p in ports.items()]
        results: list = []
        extra = () if steps is None else (steps,)
        ranks = threading.Thread(target=lambda: results.append(run_ranks(node_jobs.train_metrics, workers, runs,
                                                                         given, *extra)), daemon=True)
        ranks.start()
        _wait_for(logs["killed"], f"halted after step {halt}", first)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert latest_snapshot(tmp_path / "killed").step == snapshot_step
        restarted_log = logs["killed"].with_suffix(".2.log")
        second = _node(ports["killed"], tmp_path / "killed", restarted_log, workers=workers,
                       **{CHAOS_ENV: chaos[2]})
        procs.append(second)
        ranks.join(240)
        assert results, "the workers did not finish"
        assert second.wait(60) == 0 and plain.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {"ranks": results[0], "restarted_log": restarted_log.read_text()}


def test_a_killed_node_resumes_from_its_snapshot_with_the_same_losses(tmp_path):
    # The killed run runs in the chaos mode (workers and node), the plain one without: equal all the same.
    out = _killed_and_plain(tmp_path, workers=WORKERS, halt=HALT_AFTER, snapshot_step=4, run={}, steps=None,
                            chaos=("41", "43", "47"), given=("killed",))
    results = [out["ranks"]]
    assert "resumed run" in out["restarted_log"]
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


def test_a_compressed_run_replays_exactly_after_a_node_restart(tmp_path):
    """onebit pushes from two workers: the node killed after step 3 (its snapshot of step 2 on disk) and
    restarted; each worker puts back its residuals of step 2 before it replays ([Note: a node that restarts] in
    node/worker.py), so the run ends with the uninterrupted compressed run's losses and grad norms bit for bit,
    the killed one in the chaos mode. With the residuals the workers hold at the restart instead (their error
    of step 3, or of 3 and 4) the losses part from step 4 on."""
    workers = 2
    results = [_killed_and_plain(tmp_path, workers=workers, halt=3, snapshot_step=2, run={"compress": "onebit"},
                                 steps=6, chaos=("61", "67", "71"))["ranks"]]
    for rank in range(workers):
        got = results[0][rank]
        assert got["killed"]["rejoins"] == 1 and got["killed"]["replayed"] in (0, 1), got["killed"]
        assert got["killed"]["loss"] == got["plain"]["loss"], "a node restart changed a compressed run's losses"
        assert got["killed"]["grad_norm"] == got["plain"]["grad_norm"]


def _states(value: float) -> list:
    """A node snapshot's states of ``test_protocol.manifest()``'s units, each filled with ``value``."""
    from test_protocol import SIZES

    import torch

    from luwu_rt.node.protocol import INIT_STATES

    return [((u, s), torch.full((n,), value + u)) for u, n in enumerate(SIZES) for s in INIT_STATES]


def test_a_damaged_snapshot_is_skipped_for_the_previous_one(tmp_path):
    """Two snapshots are kept; the newest damaged, a node started there resumes from the one before."""
    import torch
    from test_protocol import manifest

    from luwu_rt.node.service import NodeConfig, NodeService

    m = manifest()
    for step in (2, 4, 6):
        newest = write_snapshot(tmp_path, manifest=m, step=step, adam_step=step, states=_states(step), shard=[0, 1])
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000006"], "keep two"
    data = bytearray((newest / "u0.master.bin").read_bytes())
    data[5] ^= 1  # a bit flipped on disk: the file no longer matches its CRC-32C
    (newest / "u0.master.bin").write_bytes(bytes(data))
    (tmp_path / ".partial_step_00000008_deadbeef").mkdir()  # a write a kill interrupted
    seen: list[str] = []
    snap = latest_snapshot(tmp_path, log=seen.append)
    assert snap.step == 4 and torch.equal(snap.state(1, "exp_avg"), torch.full((5000,), 5.0))
    assert "step_00000006" in seen[0] and "checksum" in seen[0], seen
    lines: list[str] = []
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB", snapshot_dir=str(tmp_path)), run_steps=False,
                          log=lines.append, chaos=None)
    assert service.resumed_from == 4 and service.runner.step == 4
    assert any("step_00000006" in line and "skipped" in line for line in lines), lines


def test_snapshots_and_training_checkpoints_are_told_apart(tmp_path, capsys):
    """One writer and reader for both, and ``meta.kind`` between them: ``luwu ckpt verify`` checks a snapshot
    too, a node refuses a directory of training checkpoints, ``luwu train --resume`` refuses one of node
    snapshots, and an old-format snapshot (``meta.json``) is refused naming its path and what to do."""
    import pytest
    from test_protocol import manifest

    from luwu_rt.ckpt.format import NODE_SNAPSHOT, CheckpointReader, CheckpointWriter
    from luwu_rt.ckpt.resume import choose_checkpoint
    from luwu_rt.cli.main import main
    from luwu_rt.node.service import NodeConfig, NodeService

    snaps = tmp_path / "snaps"
    path = write_snapshot(snaps, manifest=manifest(), step=3, adam_step=3, states=_states(0), shard=[0, 1])
    assert CheckpointReader(path, kind=NODE_SNAPSHOT).meta["adam_step"] == 3
    assert main(["ckpt", "verify", str(snaps)]) == 0 and main(["ckpt", "list", str(snaps)]) == 0
    out = capsys.readouterr().out
    assert "node snapshot of step 3 (shard 0/1), complete, all checksums match" in out, out
    assert "step 3  optimizer node snapshot" in out, out
    with pytest.raises(ValueError, match="is an optimizer node's snapshot .*, not a training checkpoint"):
        CheckpointReader(path)
    with pytest.raises(ValueError, match="no usable checkpoint .* optimizer node's snapshot"):
        choose_checkpoint(str(snaps), resume=True, if_exists=False, say=print)
    ckpt = tmp_path / "ckpt"
    with CheckpointWriter(ckpt, step=1) as w:
        w.commit({"run_id": "x"})
    with pytest.raises(ValueError, match="is a training checkpoint .*, not an optimizer node's snapshot"):
        NodeService(NodeConfig(num_workers=2, snapshot_dir=str(ckpt)), run_steps=False, log=print)
    old = tmp_path / "old" / "step_00000004"
    old.mkdir(parents=True)
    (old / "meta.json").write_text('{"snapshot_version": 1}')
    with pytest.raises(ValueError, match=r"holds node snapshots of an older luwu_rt .*step_00000004/meta.json.*move"):
        NodeService(NodeConfig(num_workers=2, snapshot_dir=str(tmp_path / "old")), run_steps=False, log=print)


def test_a_failed_snapshot_write_is_logged_and_training_goes_on(tmp_path, monkeypatch):
    """The disk fills while the node writes step 2's snapshot (ENOSPC after some bytes of a file): the
    node logs the path, removes the partial directory, and steps 3 and its snapshot follow; the
    snapshots of steps 1 and 3 verify."""
    import errno

    import torch
    from test_protocol import CHUNK, SIZES, _joined

    from luwu_rt.ckpt import format as ckpt_format
    from luwu_rt.node.manifest import job_id
    from luwu_rt.node.protocol import Message, T, encode
    from luwu_rt.node.service import NodeConfig, NodeService

    write = ckpt_format._write_file

    def full_disk(path, data):
        if ".partial_step_00000002" in str(path) and path.name != "manifest.json":
            with open(path, "wb") as f:
                f.write(bytes(memoryview(data)[:100]))
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, data)

    monkeypatch.setattr(ckpt_format, "_write_file", full_disk)
    lines: list[str] = []
    service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB", timeout=30.0, snapshot_dir=str(tmp_path),
                                     snapshot_every=1), log=lines.append, chaos=None)
    job = job_id(_joined(service))
    for step in (1, 2, 3):
        deadline = time.monotonic() + 30
        while min(service.runner.pushes.applied) < step - 1:  # the node took the step before
            assert time.monotonic() < deadline and service.error is None, (service.error, lines)
            time.sleep(0.01)
        for rank in (0, 1):
            for u, n in enumerate(SIZES):
                data = torch.full((n,), 0.01 * step).numpy().tobytes()
                for off in range(0, len(data), CHUNK):
                    service.handle(b"w%d" % rank, encode(Message(T.PUSH_GRAD, job=job, rank=rank, step=step, unit=u,
                                                                 chunk=off // CHUNK, offset=off, dtype=1,
                                                                 epoch=service.epoch, payload=data[off:off + CHUNK])))
    assert service.done_steps.wait(60)
    assert service.error is None, service.error
    failed = [line for line in lines if "snapshot of step 2 failed" in line]
    assert len(failed) == 1 and "No space left on device" in failed[0] and ".partial_step_00000002" in failed[0]
    assert "training goes on" in failed[0] and "step_00000001" in failed[0], failed
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".luwu")) == \
        ["step_00000001", "step_00000003"], "the partial directory of step 2 is gone"
    assert latest_snapshot(tmp_path).step == 3


def test_a_rejoin_to_a_node_without_the_snapshot_is_told_why(tmp_path):
    """A worker that rejoins its run at step 3 hears what really happened to the node's snapshots: none
    was written into its --snapshot-dir, or every one there is damaged, or it has no --snapshot-dir."""
    from test_protocol import manifest

    from luwu_rt.node.manifest import manifest_bytes
    from luwu_rt.node.protocol import DTYPE_CODES, Message, T, decode, encode
    from luwu_rt.node.service import NodeConfig, NodeService

    def refusal(snapshot_dir) -> str:
        service = NodeService(NodeConfig(num_workers=2, host_mem="16MiB", snapshot_dir=snapshot_dir),
                              run_steps=False, log=lambda line: None)
        service.handle(b"w0", encode(Message(T.HELLO, rank=0, step=3, dtype=DTYPE_CODES["json"],
                                             payload=manifest_bytes(manifest()))))
        reply = decode(service.protocol.outbox[-1][1])
        assert reply.type == T.ERROR and service.manifest is None
        return bytes(reply.payload).decode()

    assert "started without --snapshot-dir" in refusal(None)
    empty = refusal(str(tmp_path / "empty"))
    assert f"--snapshot-dir {tmp_path / 'empty'} held no snapshot" in empty
    assert "start the node with the --snapshot-dir" not in empty and "luwu train --resume" in empty
    damaged = tmp_path / "damaged"
    path = write_snapshot(damaged, manifest=manifest(), step=2, adam_step=2, states=_states(0), shard=[0, 1])
    (path / "u1.exp_avg.bin").write_bytes(b"\0" * 8)
    assert "every snapshot in --snapshot-dir" in refusal(str(damaged)) and "step_00000002" in refusal(str(damaged))
