"""``NodeService``: the optimizer node's message handling and its ZeroMQ loop (``luwu node serve``).

[Note: the node's threads]
One thread, the loop in ``serve``, owns the ROUTER socket: ZeroMQ sockets are not
thread-safe, so every send and receive happens there. The node's plan runs on
the executor's queue threads (``NodeRunner``); its ``Serve`` ops hand the loop
"unit u of step s is served" through ``_events`` and a wake-up message on an
inproc socket, and the loop answers the pulls that wait for it. A third thread
runs the steps one after another. ``handle`` is the whole protocol state
machine and touches no socket: it appends replies to ``_outbox``, which is what
lets the fuzz test drive it directly.

[Note: between two steps]
After a step the node's state is that step's, and stays so until the steps
thread runs the next plan: it waits for the first worker's BEGIN of the next
step (sent as the worker starts it, so the node's reads ahead still overlap the
workers' forward), and meanwhile answers GET_STATE - a checkpoint's reads of
the optimizer state - from the quiet store. Workers checkpoint all together
between two steps ([Note: checkpoints of several ranks] in ckpt/format.py),
so no BEGIN comes until they are done.

Phases: until every worker said HELLO with one manifest and worker 0 sent the
initial state (INIT ... LAST) the node only collects; then it WELCOMEs every
worker and runs steps ``start_step + 1 .. steps``; it exits once the last step
is done and every worker said BYE (or ``timeout_s`` after the last step).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import sys
import threading
import time
from collections import Counter

import numpy as np
import torch

from .config import NodeConfig
from .manifest import difference, job_id
from .protocol import CREDIT_CHUNKS, DTYPE_CODES, INIT_STATES, F, Message, ProtocolError, T, decode, encode
from .runner import NodeRunner
from .shards import NormHub, NormLink, pack_norms, unpack_norms
from .snapshot import latest_snapshot, unit_states, write_snapshot

HALT_ENV = "LUWU_NODE_TEST_HALT_AFTER"
"""Tests only: the node stops working (stays up, answers nothing more) after this step, to be killed there."""
_HALT_AFTER = os.environ.get(HALT_ENV, "")

__all__ = ["NodeConfig", "NodeService"]


class NodeService:
    """The protocol state machine of one optimizer node ([Note: the node's threads])."""

    def __init__(self, config: NodeConfig, *, run_steps: bool = True, log=None, chaos="env") -> None:
        self.config = config
        self.run_steps = run_steps
        self.chaos = chaos
        """The node executor's chaos mode: ``"env"`` reads ``LUWU_CHAOS_SEED`` (exec/chaos.py)."""
        self.log = log or (lambda line: print(f"luwu node: {line}", file=sys.stderr, flush=True))
        self.epoch = secrets.randbits(31) + 1
        self.rejects: Counter[str] = Counter()
        """Reason -> messages dropped: malformed, unexpected, stale or from an unknown peer."""
        self.duplicates = 0
        self.manifest: dict | None = None
        self.job = 0
        self.peers: dict[bytes, int] = {}
        """Socket identity -> worker rank, from its HELLO."""
        self.hellos: dict[int, bytes] = {}
        self.runner: NodeRunner | None = None
        self.welcomed = False
        self.byes: set[int] = set()
        self.error: BaseException | None = None
        self.done_steps = threading.Event()
        self._stopping = threading.Event()
        self._init: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self._init_done = False
        self._waiting: dict[tuple[int, int], list[tuple[bytes, int]]] = {}
        self._outbox: list[tuple[bytes, list]] = []
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._between: queue.SimpleQueue = queue.SimpleQueue()
        """BEGINs and GET_STATEs, for the steps thread between two steps ([Note: between two steps])."""
        self._begun = 0
        self._wake = None
        self._wake_lock = threading.Lock()
        self.address = config.bind
        """Where the node listens (the system's port once bound to ``tcp://HOST:*``)."""
        self.hub: NormHub | None = None
        """Shard 0 of several: every shard's partial norms meet here ([Note: node shards] in shards.py)."""
        self.link: NormLink | None = None
        """Shard i > 0: its line to shard 0's hub."""
        self.resumed_from: int | None = None
        """The step of the snapshot this node resumed from, if it did ([Note: node snapshots])."""
        self._restore()

    def _restore(self) -> None:
        """Resumes from the newest snapshot in ``snapshot_dir``: the run's manifest, its states and its step
        come from there, so the workers' HELLOs only have to agree with it (no INIT)."""
        snap = latest_snapshot(self.config.snapshot_dir, log=self.log)
        if snap is None:
            return
        shard = [self.config.shard_index, self.config.num_shards]
        if snap.meta.get("shard", [0, 1]) != shard:
            raise ValueError(f"--snapshot-dir {self.config.snapshot_dir} holds node shard "
                             f"{'/'.join(map(str, snap.meta.get('shard', [0, 1])))}'s snapshot, this is shard "
                             f"{self.config.shard}: give each shard its own snapshot directory")
        self.manifest, self.job = snap.manifest, job_id(snap.manifest)
        self.runner = self._make_runner(start_step=snap.step, adam_step=snap.adam_step)
        for unit, state in unit_states(self.runner.numels):
            self.runner.write_initial(unit, state, snap.state(unit, state))
        self._init_done = True
        self.resumed_from = snap.step
        self.log(f"resumed run {self.job:08x} from {snap.path} (step {snap.step}); waiting for the workers to replay")

    def _make_runner(self, **resume) -> NodeRunner:
        """The runner of this node's shard of the run in ``self.manifest``; with several shards, also the
        norm exchange ([Note: node shards] in shards.py)."""
        c = self.config
        exchange = None
        if c.num_shards > 1 and c.shard_index == 0:
            self.hub = NormHub(c.num_shards, timeout_s=c.timeout, on_complete=self._norms_known)
            exchange = self.hub.exchange
        elif c.num_shards > 1:
            curve = None
            if c.auth_keys:
                from .auth import server_keys

                public, secret, _ = server_keys(c.auth_keys)
                curve = (public, secret, public)  # shard 0 has the same key pair ([Note: node keys] in auth.py)
            self.link = NormLink(self.manifest["nodes"][0], shard=c.shard_index, count=c.num_shards, job=self.job,
                                 timeout_s=c.timeout, curve=curve)
            exchange = self.link.exchange
        return NodeRunner(self.manifest, num_workers=c.num_workers, host_bytes=c.host_mem, nvme_dir=c.nvme_dir,
                          timeout_s=c.timeout, on_served=self._served, io_backend=c.io_backend, chaos=self.chaos,
                          shard_index=c.shard_index, num_shards=c.num_shards, exchange_norms=exchange, **resume)

    def _norms_known(self, step: int) -> None:
        """Shard 0's hub has every shard's norm of ``step`` (any thread): the loop answers the shards."""
        self._events.put(("norm", step, b""))
        self._notify()

    def _norm(self, identity: bytes, msg: Message) -> None:
        """A node shard's partial norm ([Note: node shards] in shards.py); only shard 0 takes them."""
        if self.hub is None:
            raise ProtocolError("type", "NORM to a node that is not shard 0 of several")
        if msg.job != self.job:
            raise ProtocolError("job", "NORM of another run")
        if msg.dtype != DTYPE_CODES["float64"] or msg.rank == 0:
            raise ProtocolError("norm", "a NORM carries one float64 from shard 1..k-1")
        (value,) = unpack_norms(msg.payload, 1)
        self.hub.offer(msg.step, msg.rank, value, identity)

    def answer_norms(self, step: int) -> None:
        for identity, parts in self.hub.replies(step):
            self._reply(identity, Message(T.NORM, job=self.job, step=step, dtype=DTYPE_CODES["float64"],
                                          payload=pack_norms(parts)))

    # -- the protocol ([Note: the node protocol] in protocol.py) ------------------------------------

    def handle(self, identity: bytes, frames: list) -> None:
        """Processes one incoming message; a bad one is dropped and counted in ``rejects``, never raised."""
        try:
            msg = decode(frames, max_payload=self.config.max_message_bytes, trusted=bool(self.config.auth_keys))
            if msg.type == T.HELLO:
                self._hello(identity, msg)
                return
            if msg.type == T.NORM:  # from another node shard, not a worker
                self._norm(identity, msg)
                return
            rank = self.peers.get(identity)
            if rank is None and msg.type == T.HEARTBEAT:
                # Likely a worker of this node's previous incarnation: our epoch tells it to say HELLO again.
                self._reply(identity, Message(T.HEARTBEAT, epoch=self.epoch))
            if rank is None or rank != msg.rank:
                raise ProtocolError("peer", "message from a peer that has not said HELLO as this rank")
            if msg.job != self.job:
                raise ProtocolError("job", "message of another run")
            if self.runner is not None:
                self.runner.pushes.heard[rank] = time.monotonic()
            if msg.type == T.INIT:
                self._init_chunk(identity, msg)
            elif msg.type == T.HEARTBEAT:
                if msg.flags & F.BYE:
                    self.byes.add(rank)
                self._reply(identity, Message(T.HEARTBEAT, job=self.job, epoch=self.epoch))
            elif not self.welcomed:
                raise ProtocolError("early", f"{msg.name} before the node welcomed the workers")
            elif msg.epoch != self.epoch:
                raise ProtocolError("epoch", "message for an earlier incarnation of the node")
            elif msg.type == T.PUSH_GRAD:
                self._push(identity, msg)
                self._began(msg.step)  # a push of a step is its BEGIN too
            elif msg.type == T.PULL_PARAM:
                self._pull(identity, msg)
            elif msg.type == T.BEGIN:
                self._began(msg.step)
            elif msg.type == T.GET_STATE:
                if not (0 <= msg.unit < len(self.runner.numels) and 0 <= msg.chunk < len(INIT_STATES)):
                    raise ProtocolError("range", f"GET_STATE of unit {msg.unit} state {msg.chunk}")
                self._between.put(("state", identity, msg))
            else:
                raise ProtocolError("type", f"a node does not accept {msg.name}")
        except ProtocolError as exc:
            self.rejects[exc.reason] += 1
        except Exception as exc:  # a bug of ours, not the peer's: counted and logged, the node stays up
            self.rejects["internal"] += 1
            self.log(f"internal error on a message: {type(exc).__name__}: {exc}")

    def _reply(self, identity: bytes, msg: Message) -> None:
        # Over CURVE the MAC guards every frame: no CRC pass ([Note: the node protocol]).
        self._outbox.append((identity, encode(msg, checksum=not self.config.auth_keys)))

    def _refuse(self, identity: bytes, text: str) -> None:
        self.log(f"refused a worker: {text}")
        self._reply(identity, Message(T.ERROR, epoch=self.epoch, dtype=DTYPE_CODES["utf8"], payload=text.encode()))

    def _hello(self, identity: bytes, msg: Message) -> None:
        try:
            manifest = json.loads(bytes(msg.payload))
            num_workers = int(manifest["num_workers"])
        except (ValueError, KeyError, TypeError):
            raise ProtocolError("hello", "HELLO payload is not a manifest") from None
        if msg.step and self.resumed_from is None:  # a rejoin ([Note: a node that restarts] in worker.py)
            self.rejects["hello"] += 1
            self._refuse(identity, f"worker {msg.rank} rejoins its run in step {msg.step}, but this node holds no "
                                   f"snapshot of it: start the node with the --snapshot-dir it snapshotted into, "
                                   f"or restart the workers too")
            return
        shards = manifest.get("nodes", [None])
        if len(shards) != self.config.num_shards:
            self.rejects["hello"] += 1
            self._refuse(identity, f"worker {msg.rank} names {len(shards)} node address(es) in --node, but this node "
                                   f"is shard {self.config.shard} of {self.config.num_shards}: list every node shard's "
                                   f"address, in shard order")
            return
        if num_workers != self.config.num_workers or not 0 <= msg.rank < num_workers:
            self.rejects["hello"] += 1
            self._refuse(identity, f"worker rank {msg.rank} of {num_workers} workers, but this node serves "
                                   f"--num-workers {self.config.num_workers}; start both with the same count")
            return
        if self.manifest is None:
            self.manifest, self.job = manifest, job_id(manifest)
        else:
            diff = difference(self.manifest, manifest)
            if diff:
                self.rejects["hello"] += 1
                self._refuse(identity, f"worker {msg.rank}'s run differs from the one this node serves at {diff}; "
                                       f"give every worker the same configuration (or restart the node)")
                return
        old = self.hellos.get(msg.rank)
        if old is not None and old != identity:
            self.peers.pop(old, None)  # a worker that reconnected
        self.peers[identity], self.hellos[msg.rank] = msg.rank, identity
        if self.runner is None:
            try:
                self.runner = self._make_runner()
            except ValueError as exc:  # the run does not fit this node: every worker hears why
                self.manifest, self.job = None, 0
                self.peers.pop(identity, None)
                self.hellos.pop(msg.rank, None)
                self._refuse(identity, f"{exc} (luwu node serve --host-mem / --nvme-dir)")
                return
            self.log(f"run {self.job:08x}: {len(self.runner.numels)} units, "
                     f"{sum(self.runner.numels):,} parameters, placement {self.runner.placement}")
        if self.welcomed:
            self._welcome(identity)
        else:
            self._maybe_start()

    def _init_chunk(self, identity: bytes, msg: Message) -> None:
        runner = self.runner
        if self.welcomed or msg.rank != 0 or runner is None:
            raise ProtocolError("init", "initial state comes from worker 0 before the first step")
        if msg.nbytes:
            if not (0 <= msg.unit < len(runner.numels) and msg.chunk < len(INIT_STATES)
                    and msg.dtype == DTYPE_CODES["float32"]):
                raise ProtocolError("range", f"INIT of unit {msg.unit} state {msg.chunk}")
            n = runner.numels[msg.unit] * 4
            if msg.offset + msg.nbytes > n:
                raise ProtocolError("range", f"INIT bytes [{msg.offset}, {msg.offset + msg.nbytes}) past {n}")
            key = (msg.unit, msg.chunk)
            if key not in self._init and self._init:  # one staging buffer at a time: counted in --host-mem
                raise ProtocolError("init", "INIT of another state before the last one was whole")
            buf, got = self._init.get(key, (None, 0))
            if buf is None:
                buf = torch.empty(runner.numels[msg.unit], dtype=torch.float32)
            buf.view(torch.uint8).numpy()[msg.offset : msg.offset + msg.nbytes] = np.frombuffer(msg.payload, np.uint8)
            got += msg.nbytes
            if got >= n:  # the unit's state is whole: into the store, and the staging buffer is dropped
                runner.write_initial(msg.unit, INIT_STATES[msg.chunk], buf)
                self._init.pop(key, None)
            else:
                self._init[key] = (buf, got)
            self._reply(identity, Message(T.ACK, job=self.job, rank=0, unit=msg.unit, chunk=msg.chunk,
                                          offset=msg.offset, epoch=self.epoch))  # the worker's credit back
        if msg.flags & F.LAST:
            self._init_done = True
            self._maybe_start()

    def _maybe_start(self) -> None:
        if self.welcomed or not self._init_done or len(self.hellos) < self.config.num_workers:
            return
        self.welcomed = True
        for identity in self.hellos.values():
            self._welcome(identity)
        self.log(f"{self.config.num_workers} worker(s) joined; training from step {self.runner.step}")
        if self.run_steps:
            threading.Thread(target=self._steps, name="luwu-node-steps", daemon=True).start()

    def _welcome(self, identity: bytes) -> None:
        payload = json.dumps({"step": self.runner.step, "adam_step": self.runner.adam_step, "epoch": self.epoch,
                              "shard": [self.config.shard_index, self.config.num_shards],
                              "snapshot_every": self.config.snapshot_every}).encode()
        self._reply(identity, Message(T.WELCOME, job=self.job, epoch=self.epoch, dtype=DTYPE_CODES["json"],
                                      payload=payload))

    def _push(self, identity: bytes, msg: Message) -> None:
        if msg.dtype != DTYPE_CODES["float32"]:
            raise ProtocolError("dtype", "gradients are pushed in fp32")
        fresh = self.runner.pushes.offer(rank=msg.rank, step=msg.step, unit=msg.unit, offset=msg.offset,
                                         payload=msg.payload)
        self.duplicates += not fresh
        self._reply(identity, Message(T.ACK, flags=0 if fresh else F.DUPLICATE, job=self.job, rank=msg.rank,
                                      step=msg.step, unit=msg.unit, chunk=msg.chunk, offset=msg.offset,
                                      epoch=self.epoch))

    def _pull(self, identity: bytes, msg: Message) -> None:
        runner = self.runner
        if not 0 <= msg.unit < len(runner.numels):
            raise ProtocolError("range", f"pull of unit {msg.unit}")
        newest = runner.served.newest(msg.unit)
        if msg.step > newest + 1:
            raise ProtocolError("future", f"pull of unit {msg.unit} after step {msg.step}; served {newest}")
        if not self._send_params(identity, msg.unit, msg.step, msg.rank):
            if msg.step <= newest:
                raise ProtocolError("stale", f"unit {msg.unit} after step {msg.step} is no longer kept")
            self._waiting.setdefault((msg.unit, msg.step), []).append((identity, msg.rank))

    def _send_params(self, identity: bytes, unit: int, step: int, rank: int) -> bool:
        runner = self.runner
        buf = runner.served.get(unit, step)
        if buf is None:
            return False
        dtype = DTYPE_CODES[{"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[runner.manifest["dtype"]]]
        # A view of the served buffer, sent without a copy: it is rewritten two steps later at the
        # earliest, after every worker received it ([Note: double-buffered parameters] in runner.py).
        self._send_chunks(identity, T.PARAM, buf, dtype=dtype, rank=rank, step=step, unit=unit)
        return True

    def _send_chunks(self, identity: bytes, kind: int, buf: torch.Tensor, *, index: int | None = None,
                     **fields) -> None:
        """``buf``'s bytes as messages of at most one chunk each, ``LAST`` on the final one; ``chunk`` is
        the message's index, or ``index`` (a state's, for STATE)."""
        size = self.runner.model.chunk_bytes
        data = memoryview(buf.view(torch.uint8).numpy())
        for i, offset in enumerate(range(0, len(data), size)):
            last = offset + size >= len(data)
            self._reply(identity, Message(kind, flags=F.LAST if last else 0, job=self.job, epoch=self.epoch,
                                          chunk=i if index is None else index, offset=offset,
                                          payload=data[offset : offset + size], **fields))

    # -- between two steps ------------------------------------------------------------------------

    def _began(self, step: int) -> None:
        if step > self._begun:  # the first word of a step wakes the steps thread; later ones need not
            self._begun = step
            self._between.put(("begin", step))

    def _between_steps(self, step: int | None) -> None:
        """[Note: between two steps]: serves the GET_STATEs of a checkpoint until a worker BEGINs ``step``;
        ``None``: after the last step, until every worker said BYE."""
        deadline = time.monotonic() + self.config.timeout
        while step is not None or not (self._stopping.is_set() or len(self.byes) >= self.config.num_workers):
            try:
                item = self._between.get(timeout=0.2)
            except queue.Empty:
                if step is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"optimizer node: no worker began step {step} within {self.config.timeout:g}s "
                                       f"after step {step - 1}; the workers died or hung - see their logs, or raise "
                                       f"--timeout") from None
                continue
            if item[0] == "begin":
                if item[1] == step:
                    return
                continue  # another worker's BEGIN of a step that already ran
            _, identity, msg = item
            self._read_state(identity, msg)
            deadline = time.monotonic() + self.config.timeout

    def _read_state(self, identity: bytes, msg: Message) -> None:
        runner = self.runner
        if msg.step != runner.step:
            self.rejects["stale"] += 1
            self._events.put(("error", identity, f"worker {msg.rank} asked for the optimizer state after step "
                                                 f"{msg.step}, but this node's last step is {runner.step}"))
        else:
            values = runner.store.read_state(msg.unit, INIT_STATES[msg.chunk],
                                             torch.empty(runner.numels[msg.unit], dtype=torch.float32))
            self._events.put(("state", identity, (msg, values)))
        self._notify()

    def _served(self, unit: int, step: int) -> None:
        """Called by the plan's Serve (an executor thread): the loop answers the waiting pulls."""
        self._events.put(("served", unit, step))
        self._notify()

    def answer_served(self, unit: int, step: int) -> None:
        for identity, rank in self._waiting.pop((unit, step), []):
            self._send_params(identity, unit, step, rank)

    def _steps(self) -> None:
        runner = self.runner
        try:
            while runner.step < int(self.manifest["steps"]):
                self._between_steps(runner.step + 1)
                m = runner.run_step()
                stats = {"step": m["step"], "grad_norm": m["grad_norm"], "skipped": m["skipped"]}
                if m["step"] == int(self.manifest["steps"]):  # the run's last: for the workers' --trace
                    stats["spans"] = [[x.name, x.queue, x.start_s, x.end_s, x.nbytes, x.tier]
                                      for x in runner.last_spans]
                stats = json.dumps(stats)
                self._events.put(("stats", m["step"], stats.encode()))
                self._notify()
                self._maybe_snapshot()
                self.log(f"step {m['step']}: {m['step_s'] * 1e3:.1f} ms (recv {m['recv_s'] * 1e3:.1f}, optim "
                         f"{m['optim_s'] * 1e3:.1f}, io {m['io_s'] * 1e3:.1f}, send {m['send_s'] * 1e3:.1f} ms), "
                         f"grad norm {m['grad_norm']:.4f}")
                if _HALT_AFTER and runner.step == int(_HALT_AFTER):
                    self.log(f"halted after step {runner.step} ({HALT_ENV}; a test kills the node here)")
                    threading.Event().wait()
        except BaseException as exc:
            self.error = exc
        self.done_steps.set()
        self._notify()
        if self.error is None:  # after the last step the workers may still checkpoint it
            self._between_steps(None)

    def _maybe_snapshot(self) -> None:
        """Between two steps, every ``snapshot_every`` steps ([Note: node snapshots] in snapshot.py)."""
        runner, every = self.runner, self.config.snapshot_every
        if not every or runner.step % every:
            return
        start = time.perf_counter()
        path = write_snapshot(self.config.snapshot_dir, manifest=self.manifest, step=runner.step,
                              adam_step=runner.adam_step, states=runner.read_states(),
                              shard=[self.config.shard_index, self.config.num_shards])
        runner.metrics["snapshot_s"] = time.perf_counter() - start
        self.log(f"snapshot {path} in {runner.metrics['snapshot_s'] * 1e3:.0f} ms")

    def _send_stats(self, payload: bytes) -> None:
        for identity, rank in list(self.peers.items()):
            self._reply(identity, Message(T.STATS, job=self.job, rank=rank, epoch=self.epoch,
                                          dtype=DTYPE_CODES["json"], payload=payload))

    def stop(self) -> None:
        """Makes ``serve`` return (status 0) at its next turn, from any thread."""
        self._stopping.set()
        self._notify()

    def _notify(self) -> None:
        with self._wake_lock:
            if self._wake is not None:
                self._wake.send(b"")

    # -- the socket loop --------------------------------------------------------------------------

    def _secure(self, ctx, router):
        """With ``auth_keys``: CURVE on the ROUTER, a ZAP authenticator admitting the allow-list, and a
        monitor that counts refused handshakes ([Note: node keys] in auth.py). Else (None, None)."""
        if not self.config.auth_keys:
            return None, None
        import zmq
        from zmq.auth.thread import ThreadAuthenticator

        from .auth import server_keys

        public, secret, clients = server_keys(self.config.auth_keys)
        authenticator = ThreadAuthenticator(ctx)
        authenticator.start()
        # The workers' keys, and the node's own: other node shards connect with it ([Note: node shards]).
        authenticator.configure_curve_callback(domain="*", credentials_provider=_Allowed(clients, public))
        router.curve_server = True
        router.curve_publickey, router.curve_secretkey = public, secret
        monitor = router.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        return authenticator, monitor

    def _count_handshakes(self, monitor) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event & (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                self.rejects["auth"] += 1

    def serve(self, *, ready: threading.Event | None = None) -> int:
        """Binds and runs until the run is over; returns the exit status (1 when a step failed)."""
        import zmq

        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 2000)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting worker takes over its identity
        router.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes + 4096)
        # Per peer: its credit's chunks and room for small messages; beyond that a peer waits in TCP.
        router.setsockopt(zmq.RCVHWM, CREDIT_CHUNKS + 64)
        authenticator, monitor = self._secure(ctx, router)
        router.bind(self.config.bind)
        self.address = router.getsockopt_string(zmq.LAST_ENDPOINT)  # the port the system picked for a ``*``
        wake_addr = f"inproc://luwu-node-wake-{id(self)}"
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(wake_addr)
        with self._wake_lock:
            self._wake = ctx.socket(zmq.PUSH)
            self._wake.connect(wake_addr)
        self.log(f"listening on {self.address} for {self.config.num_workers} worker(s) "
                 + (f"(CURVE: clients in {self.config.auth_keys}/clients only)" if authenticator else
                    "(open: loopback without --auth-keys, every local client is accepted)"))
        if ready is not None:
            ready.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(inbox, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        finished_at = None
        try:
            while True:
                events = dict(poller.poll(500))
                while router in events:
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.handle(frames[0].bytes, frames[1:])
                if monitor is not None and monitor in events:
                    self._count_handshakes(monitor)
                if inbox in events:
                    while inbox.poll(0):
                        inbox.recv()
                while not self._events.empty():
                    kind, a, b = self._events.get()
                    if kind == "served":
                        self.answer_served(a, b)
                    elif kind == "norm":
                        self.answer_norms(a)
                    elif kind == "state":
                        msg, values = b
                        self._send_chunks(a, T.STATE, values, index=msg.chunk, rank=msg.rank, step=msg.step,
                                          unit=msg.unit, dtype=DTYPE_CODES["float32"])
                    elif kind == "error":
                        self._refuse(a, b)
                    else:
                        self._send_stats(b)
                outbox, self._outbox = self._outbox, []
                for identity, frames in outbox:
                    router.send_multipart([identity, *frames], copy=False)
                if self._stopping.is_set():
                    return 0
                if self.error is not None:
                    self.log(f"error: {self.error}")
                    text = f"optimizer node failed: {self.error}".encode()
                    for identity in self.hellos.values():
                        router.send_multipart([identity, *encode(Message(T.ERROR, epoch=self.epoch,
                                                                        dtype=DTYPE_CODES["utf8"], payload=text))])
                    return 1
                if self.done_steps.is_set():
                    finished_at = finished_at or time.monotonic()
                    if len(self.byes) >= self.config.num_workers or time.monotonic() - finished_at > self.config.timeout:
                        self.log(f"done: {self.runner.step} steps; rejected {dict(self.rejects) or 'none'}, "
                                 f"{self.duplicates} duplicate pushes")
                        return 0
        finally:
            with self._wake_lock:
                self._wake.close(0)
                self._wake = None
            if self.runner is not None:
                self.runner.close()
            if self.link is not None:
                self.link.close()
            inbox.close(0)
            if monitor is not None:
                router.disable_monitor()
                monitor.close(0)
            if authenticator is not None:
                authenticator.stop()
            router.close()
            ctx.term()


class _Allowed:
    """ZAP credentials: the public keys in the allow-list directory, read at start, and the node's own."""

    def __init__(self, clients, node_public: bytes) -> None:
        import zmq.auth

        self.keys = set(zmq.auth.load_certificates(str(clients))) | {node_public}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys
