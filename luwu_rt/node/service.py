"""``NodeService``: one optimizer node process (``luwu node serve``), put together from its parts.

[Note: the node's threads]
One thread, the socket loop (loop.py), owns the ROUTER socket: ZeroMQ sockets
are not thread-safe, so every send and receive happens there, and it alone
drives the protocol state machine (``NodeProtocol``, machine.py), which
touches no socket. The node's plan runs on the executor's queue threads
(``NodeRunner``, runner.py); its ``Serve`` ops post "unit u of step s is
served" to the loop's ``Mailbox`` (events.py), which wakes the loop with a
message on an inproc socket, and the loop answers the pulls waiting for it. A
third thread, ``NodeSteps`` (steps.py), runs the steps one after another and,
between two of them, reads the state a checkpoint asks for and writes the
snapshots; it posts its results to the loop too. With CURVE, pyzmq's
authenticator thread checks each client's key (``NodeGate``, auth.py).

Each file has one job: machine.py the protocol, loop.py the socket, steps.py
the steps thread, auth.py the keys, snapshot.py the snapshots, events.py what
the threads hand each other; this one makes the parts of one run (the runner,
with several node shards the norm exchange, the snapshot it resumes from).
The node exits once the last step is done and every worker said BYE (or
``timeout_s`` after the last step).
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable

from .config import NodeConfig
from .events import Mailbox, NormsKnown, UnitServed
from .loop import serve_loop
from .machine import NodeProtocol
from .protocol import INIT_STATES
from .runner import NodeRunner
from .shards import NormHub, NormLink
from .snapshot import KEEP_SNAPSHOTS, SnapshotDir
from .steps import NodeSteps

__all__ = ["NodeConfig", "NodeService"]


def _stderr(line: str) -> None:
    print(f"luwu node: {line}", file=sys.stderr, flush=True)


class NodeService:
    """An optimizer node: the protocol, the socket loop and the steps of one run ([Note: the node's threads])."""

    def __init__(self, config: NodeConfig, *, run_steps: bool = True, log: Callable[[str], None] | None = None,
                 step_log: Callable[[str], None] | None = None, chaos="env",
                 restart: Callable[[int, str], None] | None = None) -> None:
        """``log``: the node's lines (default: stderr); ``step_log``: its per-step lines (default: ``log``);
        ``chaos``: the node executor's chaos mode, ``"env"`` reads ``LUWU_CHAOS_SEED`` (exec/chaos.py);
        ``restart(step, address)``: starts this node anew on its snapshot of ``step``, listening at the
        ``address`` it is bound to, in place of this one (``luwu node serve`` replaces its process); without
        it the node refuses to go back to a snapshot ([Note: node shards that restart] in worker.py)."""
        self.config = config
        self.restart = restart
        self.run_steps = run_steps
        self.chaos = chaos
        self.log = log or _stderr
        self.step_log = step_log or self.log
        self.address = config.bind
        """Where the node listens (the system's port once bound to ``tcp://HOST:*``)."""
        self.mailbox = Mailbox()
        self._stopping = threading.Event()
        between: queue.SimpleQueue = queue.SimpleQueue()
        self.hub: NormHub | None = None
        """Shard 0 of several: every shard's partial norms meet here ([Note: node shards] in shards.py)."""
        if config.num_shards > 1 and config.shard_index == 0:
            self.hub = NormHub(config.num_shards, timeout_s=config.timeout,
                               on_complete=lambda step: self.mailbox.post(NormsKnown(step)))
        self.link: NormLink | None = None
        """Shard i > 0: its line to shard 0's hub."""
        self.protocol = NodeProtocol(config, make_runner=self._make_runner, on_welcomed=self._welcomed,
                                     between=between, log=self.log, hub=self.hub, rollback=self._rollback)
        self.snapshots = None
        if config.snapshot_dir:
            self.snapshots = SnapshotDir(config.snapshot_dir, shard=(config.shard_index, config.num_shards),
                                         log=self.log)
        self.steps = NodeSteps(self.protocol, config=config, between=between, mailbox=self.mailbox,
                               stopping=self._stopping, snapshots=self.snapshots, log=self.log,
                               step_log=self.step_log)
        try:
            self._restore()
        except BaseException:
            self._close()
            raise

    # The state the tests and the CLI look at, kept by the parts.
    rejects = property(lambda self: self.protocol.rejects)
    duplicates = property(lambda self: self.protocol.duplicates)
    manifest = property(lambda self: self.protocol.manifest)
    runner = property(lambda self: self.protocol.runner)
    peers = property(lambda self: self.protocol.peers)
    welcomed = property(lambda self: self.protocol.welcomed)
    epoch = property(lambda self: self.protocol.epoch)
    resumed_from = property(lambda self: self.protocol.resumed_from)
    error = property(lambda self: self.steps.error)
    done_steps = property(lambda self: self.steps.done)

    def handle(self, identity: bytes, frames: list) -> None:
        """One incoming message, as the loop hands it to the protocol (tests drive the node through it)."""
        self.protocol.handle(identity, frames)

    def _restore(self) -> None:
        """Resumes from the newest snapshot in ``snapshot_dir``, or from the one of ``resume_step``: the run's
        manifest, its states and its step come from there, so the workers' HELLOs only have to agree with it (no
        INIT). Without it the node still serves, and a worker that rejoins is told why."""
        if self.snapshots is None:
            return
        step = self.config.resume_step
        try:
            snap = self.snapshots.latest() if step is None else self.snapshots.at(step)
        except ValueError as exc:  # the workers that wait for this shard's step hear why, not a timeout
            self.log(f"cannot resume at step {step}: {exc}")
            self.protocol.no_snapshot = str(exc)
            return
        if snap is None:
            self.protocol.no_snapshot = self.snapshots.absence()
            return
        runner = self._make_runner(snap.manifest, start_step=snap.step, adam_step=snap.adam_step)
        for unit in range(len(runner.numels)):
            for state in INIT_STATES:
                runner.write_initial(unit, state, snap.state(unit, state))
        self.protocol.resume(snap.manifest, runner, step=snap.step)
        self.log(f"resumed run {self.protocol.job:08x} from {snap.path} (step {snap.step}); waiting for the "
                 f"workers to replay")

    def _make_runner(self, manifest: dict, **resume) -> NodeRunner:
        """The runner of this node's shard of the run ``manifest``; with several shards, also shard i > 0's
        link to shard 0 ([Note: node shards] in shards.py)."""
        c = self.config
        exchange = self.hub.exchange if self.hub is not None else None
        if c.num_shards > 1 and c.shard_index > 0:
            from .manifest import job_id

            curve = None
            if c.auth_keys:
                from .auth import server_keys

                public, secret, _ = server_keys(c.auth_keys)
                curve = (public, secret, public)  # shard 0 has the same key pair ([Note: node keys] in auth.py)
            self.link = NormLink(manifest["nodes"][0], shard=c.shard_index, count=c.num_shards, job=job_id(manifest),
                                 timeout_s=c.timeout, epoch=self.protocol.epoch, curve=curve)
            exchange = self.link.exchange
        return NodeRunner(manifest, num_workers=c.num_workers, host_bytes=c.host_mem, nvme_dir=c.nvme_dir,
                          timeout_s=c.timeout, on_served=lambda unit, step: self.mailbox.post(UnitServed(unit, step)),
                          io_backend=c.io_backend, chaos=self.chaos, shard_index=c.shard_index,
                          num_shards=c.num_shards, exchange_norms=exchange, **resume)

    def _rollback(self, step: int) -> str:
        """A worker asks this shard back to its snapshot of ``step`` ([Note: node shards that restart] in
        worker.py): once no snapshot is being written, ``restart`` replaces this node. Returns why it cannot
        (the ERROR the worker gets); returns only then, or with an in-process ``restart``."""
        c = self.config
        if self.snapshots is None:
            return (f"node shard {c.shard} was started without --snapshot-dir, so it cannot go back to step {step}, "
                    f"where another shard restarted: resume the workers from their last checkpoint (luwu train "
                    f"--resume) against fresh node shards")
        if not self.snapshots.holds(step):
            return (f"node shard {c.shard} holds no snapshot of step {step} in {self.snapshots.root}, where another "
                    f"shard restarted (snapshots are kept for the newest {KEEP_SNAPSHOTS} steps): resume the workers "
                    f"from their last checkpoint (luwu train --resume) against node shards on empty snapshot "
                    f"directories")
        if self.restart is None:
            return (f"node shard {c.shard} runs inside another program, which did not say how to restart it: start "
                    f"it again with --resume-step {step} on its --snapshot-dir")
        self.snapshots.freeze()
        self.log(f"another node shard restarted at step {step}: going back to this shard's snapshot of it "
                 f"(a new incarnation at {self.address})")
        self.restart(step, self.address)
        return ""

    def _welcomed(self) -> None:
        if self.run_steps:
            self.steps.start()

    def serve(self, *, ready: threading.Event | None = None) -> int:
        """Binds and runs until the run is over; returns the exit status (1 when a step failed)."""
        try:
            return serve_loop(config=self.config, protocol=self.protocol, steps=self.steps, mailbox=self.mailbox,
                              stopping=self._stopping, log=self.log, bound=self._bound, ready=ready)
        finally:
            self._stopping.set()  # the steps thread, between two steps or after the last, ends too
            self._close()

    def _bound(self, address: str) -> None:
        self.address = address

    def stop(self) -> None:
        """Makes ``serve`` return (status 0) at its next turn, from any thread."""
        self._stopping.set()
        self.mailbox.post()

    def _close(self) -> None:
        if self.protocol.runner is not None:
            self.protocol.runner.close()
        if self.link is not None:
            self.link.close()
        if self.snapshots is not None:
            self.snapshots.close()
