"""``NodeSteps``: the optimizer node's steps thread - the steps one after another, and between two of
them the reads of a checkpoint and the snapshots.

[Note: between two steps]
After a step the node's state is that step's, and stays so until the steps
thread runs the next plan: it waits for the first worker's BEGIN of the next
step (sent as the worker starts it, so the node's reads ahead still overlap the
workers' forward), and meanwhile answers GET_STATE - a checkpoint's reads of
the optimizer state - from the quiet store. Workers checkpoint all together
between two steps ([Note: checkpoints of several ranks] in ckpt/format.py),
so no BEGIN comes until they are done. After the last step it goes on
answering them until every worker said BYE.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable

import torch

from .config import NodeConfig
from .events import Begin, Mailbox, ReadState, Refusal, StateRead, StepDone
from .machine import NodeProtocol
from .protocol import INIT_STATES
from .snapshot import SnapshotDir

__all__ = ["HALT_ENV", "NodeSteps"]

HALT_ENV = "LUWU_NODE_TEST_HALT_AFTER"
"""Tests only: the node stops working (stays up, answers nothing more) after this step, to be killed there."""


class NodeSteps:
    """Runs the node's steps on a thread of its own once the workers are welcomed ([Note: the node's
    threads] in service.py)."""

    def __init__(self, protocol: NodeProtocol, *, config: NodeConfig, between: queue.SimpleQueue, mailbox: Mailbox,
                 stopping: threading.Event, snapshots: SnapshotDir | None, log: Callable[[str], None],
                 step_log: Callable[[str], None]) -> None:
        """``between``: the requests the protocol files for this thread; ``stopping``: the service is asked
        to stop; ``step_log``: where the per-step lines go (errors go to ``log``)."""
        self.protocol, self.config, self.between, self.mailbox = protocol, config, between, mailbox
        self.stopping, self.snapshots, self.log, self.step_log = stopping, snapshots, log, step_log
        self.error: BaseException | None = None
        """What made a step fail; the loop tells every worker and exits 1."""
        self.done = threading.Event()
        """Set once the last step ran, or one failed."""

    def start(self) -> None:
        threading.Thread(target=self._run, name="luwu-node-steps", daemon=True).start()

    def _run(self) -> None:
        runner = self.protocol.runner
        steps = int(self.protocol.manifest["steps"])
        try:
            while runner.step < steps:
                self._between(runner.step + 1)
                m = runner.run_step()
                stats = {"step": m["step"], "grad_norm": m["grad_norm"], "skipped": m["skipped"]}
                if m["step"] == steps:  # the run's last: for the workers' --trace
                    stats["spans"] = [[x.name, x.queue, x.start_s, x.end_s, x.nbytes, x.tier]
                                      for x in runner.last_spans]
                self.mailbox.post(StepDone(m["step"], json.dumps(stats).encode()))
                self._snapshot()
                shard = f" (shard {self.config.shard})" if self.config.num_shards > 1 else ""
                self.step_log(f"step {m['step']}{shard}: {m['step_s'] * 1e3:.1f} ms (recv {m['recv_s'] * 1e3:.1f}, "
                              f"optim {m['optim_s'] * 1e3:.1f}, io {m['io_s'] * 1e3:.1f}, send "
                              f"{m['send_s'] * 1e3:.1f} ms), grad norm {m['grad_norm']:.4f}")
                halt = os.environ.get(HALT_ENV, "")
                if halt and runner.step == int(halt):
                    self.log(f"halted after step {runner.step} ({HALT_ENV}; a test kills the node here)")
                    threading.Event().wait()
        except BaseException as exc:
            self.error = exc
        self.done.set()
        self.mailbox.post()
        if self.error is None:  # after the last step the workers may still checkpoint it
            self._between(None)

    def _between(self, step: int | None) -> None:
        """[Note: between two steps]: serves the GET_STATEs of a checkpoint until a worker BEGINs ``step``;
        ``None``: after the last step, until every worker said BYE."""
        deadline = time.monotonic() + self.config.timeout
        while step is not None or not (self.stopping.is_set() or len(self.protocol.byes) >= self.config.num_workers):
            try:
                request = self.between.get(timeout=0.2)
            except queue.Empty:
                if step is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"optimizer node: no worker began step {step} within {self.config.timeout:g}s "
                                       f"after step {step - 1}; the workers died or hung - see their logs, or raise "
                                       f"--timeout") from None
                continue
            if isinstance(request, Begin):
                if request.step == step:
                    return
                continue  # another worker's BEGIN of a step that already ran
            assert isinstance(request, ReadState), request
            self._read_state(request)
            deadline = time.monotonic() + self.config.timeout

    def _read_state(self, request: ReadState) -> None:
        runner, msg = self.protocol.runner, request.request
        if msg.step != runner.step:
            self.protocol.rejects["stale"] += 1
            self.mailbox.post(Refusal(request.identity, f"worker {msg.rank} asked for the optimizer state after step "
                                                        f"{msg.step}, but this node's last step is {runner.step}"))
            return
        values = runner.store.read_state(msg.unit, INIT_STATES[msg.chunk],
                                         torch.empty(runner.numels[msg.unit], dtype=torch.float32))
        self.mailbox.post(StateRead(request.identity, msg, values))

    def _snapshot(self) -> None:
        """Between two steps, every ``snapshot_every`` steps ([Note: node snapshots] in snapshot.py); a
        failed write is logged there and training goes on."""
        runner, every = self.protocol.runner, self.config.snapshot_every
        if not every or runner.step % every or self.snapshots is None:
            return
        start = time.perf_counter()
        path = self.snapshots.write(manifest=self.protocol.manifest, step=runner.step, adam_step=runner.adam_step,
                                    states=runner.read_states())
        runner.metrics["snapshot_s"] = time.perf_counter() - start
        if path is not None:
            self.step_log(f"snapshot {path} in {runner.metrics['snapshot_s'] * 1e3:.0f} ms")
