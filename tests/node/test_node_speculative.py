"""Exact clipping on the optimizer node with speculative updates (issue 21 item 3): its optimizer state on NVMe,
double-buffered, each unit updated as its gradients arrive; the serves of a step wait for its norm, and a step
whose norm needed clipping is run again from the untouched half with the sums the node kept. Two workers and a
node on loopback: the losses equal the single-process run's, whether every step commits or every one is redone."""

from __future__ import annotations

import threading

import pytest

import node_jobs
from ranks import run_ranks

from luwu_rt.exec.chaos import CHAOS_ENV
from luwu_rt.exec.step import OptimizerStep
from luwu_rt.node.service import NodeConfig, NodeService

WORKERS = 2
NODE_HOST_MEM = "25MiB"
"""Room for the node's buffers and a few units of staging: its optimizer state must go to NVMe."""


class Node:
    def __init__(self, nvme_dir: str) -> None:
        self.service = NodeService(NodeConfig(bind="tcp://127.0.0.1:*", num_workers=WORKERS, host_mem=NODE_HOST_MEM,
                                              nvme_dir=nvme_dir, timeout=120.0), chaos=None, log=lambda line: None)
        self.ready = threading.Event()
        self.code: list[int] = []
        self.thread = threading.Thread(target=lambda: self.code.append(self.service.serve(ready=self.ready)),
                                       daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    def finish(self) -> int:
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self.code[0]


def _local(clip: float) -> list[float]:
    from luwu_rt.engine import Engine

    with pytest.MonkeyPatch.context() as m:
        m.delenv(CHAOS_ENV, raising=False)
        with Engine(None, node_jobs.config(batch_size=2 * WORKERS, optim={"grad_clip": clip})) as engine:
            return [engine.train_step()["loss"] for _ in range(node_jobs.STEPS)]


def test_a_speculating_node_commits_or_redoes_and_matches_the_single_process_run(tmp_path, monkeypatch):
    monkeypatch.setattr(OptimizerStep, "SPECULATION", "always")  # the node's, in this process: every step speculates
    clips = {"commit": 1e6, "redo": 1e-6}
    nodes = {key: Node(str(tmp_path / key)) for key in clips}
    runs = [(key, {"strategy": "node", "node": nodes[key].service.address, "optim": {"grad_clip": clip}}, "")
            for key, clip in clips.items()]
    results = run_ranks(node_jobs.train, WORKERS, runs, env={CHAOS_ENV: ""})
    for key, clip in clips.items():
        node = nodes[key]
        assert node.finish() == 0
        runner = node.service.runner
        assert runner.placement.optimizer == "nvme" and runner.speculation is not None
        assert runner.speculation.counts[key] == node_jobs.STEPS, runner.speculation.counts
        want = _local(clip)
        worst = max(abs(g - w) / abs(w) for g, w in zip(results[0][key], want))
        assert worst <= 1e-5, f"{key}: {results[0][key]} vs {want}"
        assert results[1][key] == results[0][key]
