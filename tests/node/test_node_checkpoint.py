"""Checkpoints of strategy node ([Note: between two steps] in luwu_rt/node/steps.py): two workers save at
step 5 and after the node's last step while the optimizer state lives on the node; the checkpoint holds it
(read from the node), resumes against a fresh node with the uninterrupted run's losses bit for bit, and
resumes as a single-process ``local`` run on the global batch within 1e-5 relative."""

from __future__ import annotations

import node_jobs
from rank_jobs import SAVE_AT
from ranks import run_ranks
from test_node_training import Node

from luwu_rt.engine import Engine
from luwu_rt.ckpt.format import CheckpointReader
from luwu_rt.ckpt.save import verify_checkpoint
from luwu_rt.exec.chaos import CHAOS_ENV

WORKERS = 2


def test_a_node_run_checkpoints_and_resumes_on_a_node_and_locally(tmp_path, monkeypatch):
    monkeypatch.delenv(CHAOS_ENV, raising=False)
    first, second = Node(chaos=None), Node(chaos=None)
    results = run_ranks(node_jobs.save_then_resume, WORKERS, first.address, second.address, str(tmp_path / "ckpt"))
    assert first.finish() == 0 and second.finish() == 0
    run = results[0]
    assert results[1]["losses"] == run["losses"]
    assert run["resumed"] == run["losses"][SAVE_AT:], "resuming on a node repeats the run bit for bit"
    for path in (run["path"], run["last"]):
        assert verify_checkpoint(CheckpointReader(path), read_data=True) > 0
    with Engine.load(run["path"], overrides={"strategy": "local", "batch_size": 2 * WORKERS}) as engine:
        local = [engine.train_step()["loss"] for _ in range(engine.step, node_jobs.STEPS)]
    worst = max(abs(a - b) / abs(b) for a, b in zip(local, run["losses"][SAVE_AT:]))
    assert len(local) == node_jobs.STEPS - SAVE_AT and worst <= 1e-5, (local, run["losses"])
