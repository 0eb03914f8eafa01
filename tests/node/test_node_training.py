"""Strategy node end to end: two worker processes and an optimizer node on loopback train gpt-tiny for
10 steps; their losses equal the single-process run on the global batch within 1e-5 relative, plainly and
with every process (the node too) drawing chaos delays and CURVE on, while a client sends the node garbage."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading

import pytest

import node_jobs
from ranks import run_ranks

from luwu_rt.exec.chaos import CHAOS_ENV, Chaos
from luwu_rt.node.auth import keygen
from luwu_rt.node.service import NodeConfig, NodeService

WORKERS = 2


class Node:
    """A node service on a loopback port, its loop on a thread of the test process."""

    def __init__(self, *, chaos: Chaos | None, timeout: float = 120.0, auth_keys: str | None = None) -> None:
        self.service = NodeService(NodeConfig(bind="tcp://127.0.0.1:*", num_workers=WORKERS, host_mem="64MiB",
                                              timeout=timeout, auth_keys=auth_keys), chaos=chaos, log=lambda line: None)
        self.ready = threading.Event()
        self.code: list[int] = []
        self.thread = threading.Thread(target=lambda: self.code.append(self.service.serve(ready=self.ready)),
                                       daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    @property
    def address(self) -> str:
        return self.service.address

    def finish(self) -> int:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the node did not stop after every worker said BYE"
        return self.code[0]


def _garbage(node: "Node", sent: list[int], count: int = 1000) -> None:
    """Once the node welcomed its workers: ``count`` malformed messages (random bytes, bad headers,
    truncations, a peer that never said HELLO), sent at once, so that they all reach the node while it
    trains: it cannot stop before the workers finished every step and said BYE."""
    import zmq

    from luwu_rt.node.protocol import HEADER, MAGIC, VERSION

    while not node.service.welcomed:
        if not node.thread.is_alive():
            return
        threading.Event().wait(0.01)
    rng = random.Random(5)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(node.address)
    for _ in range(count):
        kind = rng.randrange(3)
        if kind == 0:
            frames = [rng.randbytes(rng.randrange(0, 100)) for _ in range(rng.randrange(1, 4))]
        elif kind == 1:  # a well-formed push from a peer that never said HELLO
            frames = [HEADER.pack(MAGIC, VERSION, 3, 0, 0, 0, 1, 0, 0, 0, 8, 1, 0, 0), b"\0" * 8]
        else:
            frames = [HEADER.pack(MAGIC, VERSION + 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)[: rng.randrange(60)]]
        sock.send_multipart(frames)
        sent[0] += 1
    sock.close()
    ctx.term()


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= 1e-5, f"{what}: losses differ from the single-process run by {worst:.2e} relative\n{got}\n{want}"


@pytest.fixture(scope="module")
def local_losses():
    from luwu_rt.engine import Engine

    with pytest.MonkeyPatch.context() as m:
        m.delenv(CHAOS_ENV, raising=False)
        with Engine(None, node_jobs.config(batch_size=2 * WORKERS)) as engine:
            return [engine.train_step()["loss"] for _ in range(node_jobs.STEPS)]


def test_two_workers_and_a_node_equal_the_single_process_run(local_losses, tmp_path):
    """Both runs in the same two worker processes, one after the other, each against its own node; the
    chaotic one also over CURVE (keys from ``luwu node keygen``)."""
    keygen(tmp_path / "keys")
    plain = Node(chaos=None)
    chaotic = Node(chaos=Chaos(seed=17, rank=1 << 16), auth_keys=str(tmp_path / "keys"))
    sent = [0]
    attacker = threading.Thread(target=_garbage, args=(plain, sent), daemon=True)
    attacker.start()
    runs = [("plain", {"strategy": "node", "node": plain.address}, ""),
            ("chaos", {"strategy": "node", "node": chaotic.address,
                       "node_key": str(tmp_path / "keys" / "worker.key_secret")}, "23")]
    results = run_ranks(node_jobs.train, WORKERS, runs, env={CHAOS_ENV: ""})
    attacker.join(10)
    assert plain.finish() == 0 and chaotic.finish() == 0
    for key in ("plain", "chaos"):
        _close(results[0][key], local_losses, f"strategy node ({key})")
        assert results[1][key] == results[0][key], "every worker reports the global loss"
    # The garbage was dropped and counted; training went on unharmed.
    rejects = plain.service.rejects
    assert sent[0] > 0 and sum(rejects.values()) == sent[0], (sent[0], dict(rejects))
    assert rejects["internal"] == 0 and sum(chaotic.service.rejects.values()) == 0


def test_luwu_train_spawn_node_runs_and_stops_the_node(tmp_path):
    """The one-command try-out: two workers and two spawned node shards; the shards exit when training
    ends, after the final checkpoint read the optimizer state from them. ``--trace`` has each shard's
    queues as a process row of its own, after the ranks'. The nodes' per-step lines stay off the
    terminal of the workers' progress bar: they go to ``--node-log``, which the nodes name."""
    env = {**os.environ, CHAOS_ENV: ""}
    out = subprocess.run([sys.executable, "-m", "luwu_rt", "train", "--strategy", "node", "--nproc", "2",
                          "--spawn-node", "--node-shards", "2", "--steps", "2", "--batch-size", "1", "--seq-len", "16",
                          "--eval-every", "0", "--keep-graphs", "none", "--quiet", "--timeout", "60", "--trace",
                          "t.json", "--ckpt-dir", "ck", "--node-log", "node.log"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "strategy node on 2 ranks" in out.stdout + out.stderr
    assert out.stderr.count("luwu node: done: 2 steps") == 2, out.stderr[-3000:]
    assert "luwu node: step " not in out.stderr and "per-step lines go to node.log" in out.stderr, out.stderr[-3000:]
    steps = re.findall(r"\d\d:\d\d:\d\d (step \d+ \(shard \d/2\)):", (tmp_path / "node.log").read_text())
    assert sorted(steps) == ["step 1 (shard 0/2)", "step 1 (shard 1/2)", "step 2 (shard 0/2)",
                             "step 2 (shard 1/2)"], (tmp_path / "node.log").read_text()
    assert (tmp_path / "ck" / "step_00000002").is_dir()
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    rows = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert rows == {0: "rank 0", 1: "rank 1", 2: "optimizer node 0/2", 3: "optimizer node 1/2"}, rows
    for pid in (2, 3):
        node_queues = {e["tid"] for e in events if e["ph"] == "X" and e["pid"] == pid}
        assert {"push", "optim", "pull", "reduce"} <= node_queues, node_queues
