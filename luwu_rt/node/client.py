"""``NodeClient``: a worker's connection to the optimizer node (DEALER), shared by its push and pull queues.

[Note: the client's threads]
The executor's ``push`` and ``pull`` queues run on different threads, and a
ZeroMQ socket may be used by one thread only, so the DEALER belongs to an IO
thread of its own: the queues hand it outgoing frames through ``_out`` and a
wake-up on an inproc socket, and it files incoming ACKs and PARAM chunks into
the transfer they complete. A push's payload frames are views of the store's
gradient shards, sent without a copy; its handle waits for the node's ACK of
every chunk, so the plan rewrites the shard only after the node has stored it.
A pull's handle waits until every chunk of the unit was written into the
store's parameter shards (by the IO thread, while the pull queue waits).
While the node says nothing for ``timeout_s`` - it answers each heartbeat - a
waiting transfer fails naming the node's address, and so does every wait (a
transfer, the credit of a push or INIT) that sees nothing but heartbeats for
``timeout_s``; the join waits at most ``timeout_s`` for the WELCOME after this
worker's last HELLO or INIT. A
refused handshake (no CURVE keys, a key not allowed) fails every wait at once
([Note: refused handshakes] in auth.py), and a stop request (SIGINT, SIGTERM)
ends a wait that sees no progress for ``STOP_GRACE_S``, the join at once ([Note: interrupting a run] in
interrupt.py).
The IO thread never blocks on a send: a DEALER with no live connection would
hold it (and so ``close``) forever.

Ranges go out cut by ``cut`` and come back put together by one ``Assembly``
each ([Note: wire chunks] in chunks.py).

[Note: byte credits]
A push (or INIT) chunk is sent only while the chunks this client sent and the
node has not ACKed stay within ``CREDIT_CHUNKS`` chunks (protocol.py): the push
queue waits for the node's ACKs, so the bytes queued towards the node, in this
process's socket and in the node's, stay bounded however fast backward makes
gradients. A chunk larger than the credit is sent alone.
"""

from __future__ import annotations

import collections
import json
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable

import torch

from luwu_rt import interrupt

from .auth import handshake_problem
from .chunks import Assembly, cut
from .manifest import job_id, manifest_bytes
from .protocol import CREDIT_CHUNKS, DTYPE_CODES, MAX_PAYLOAD_BYTES, F, Message, ProtocolError, T, decode, encode

__all__ = ["NodeClient", "NodeError", "NodeLost", "await_answer"]

PARAMS = -1
"""The kind of an expected transfer that is a unit's parameters (else the index of an optimizer state)."""
HEARTBEAT_S = 1.0
"""How often the client says it is alive, and asks the node to say so."""
STOP_GRACE_S = 10.0
"""After a stop request, how long a wait within a step may see no progress from the node before it gives
up (the step, and the checkpoint after it, are worth a few seconds; a hung node is not). A join, with no
step under way, gives up at once."""
_VAGUE_FAILURES = 3
"""Handshakes that fail without a reason, in a row, before the client believes it (a connection cut
mid-handshake, once, is not a refusal)."""


class NodeError(ConnectionError):
    """The optimizer node refused, failed or went silent: one line naming the node and what to do (an
    ``OSError``, so that ``luwu`` reports it as one)."""


class NodeLost(NodeError):
    """The node this client joined restarted (a new epoch answered): the worker reconnects and replays
    ([Note: a node that restarts] in worker.py)."""


class _Transfer:
    def __init__(self) -> None:
        self.done = threading.Event()


class _Wait:
    def __init__(self, client: "NodeClient", transfer: _Transfer, what: str) -> None:
        self.client, self.transfer, self.what = client, transfer, what

    def wait(self) -> None:
        self.client._wait(self.transfer.done, self.what)


class NodeClient:
    """One worker's link to one optimizer node at ``address``."""

    def __init__(self, address: str, *, rank: int, timeout_s: float, chunk_bytes: int,
                 node_key: str | None = None) -> None:
        if not 4096 <= chunk_bytes <= MAX_PAYLOAD_BYTES:
            raise ValueError(f"node message chunk {chunk_bytes} bytes: choose a --chunk-size from 4KiB to 16MiB")
        self.address, self.rank, self.timeout_s, self.chunk_bytes = address, rank, timeout_s, chunk_bytes
        self.node_key = node_key
        if node_key is not None:
            from .auth import client_keys

            self._curve = client_keys(node_key)  # [Note: node keys] in auth.py
        else:
            self._curve = None
        self.job, self.epoch = 0, 0
        self.welcome: dict | None = None
        self.error: str | None = None
        self.lost: str | None = None
        """Set when a new incarnation of the node answered: every wait raises ``NodeLost``."""
        self._stats: dict[int, dict] = {}
        self._stats_cv = threading.Condition()
        self._stats_waits: dict[int, threading.Event] = {}
        self.rejects = 0
        self.last_heard = time.monotonic()
        self.last_progress = time.monotonic()
        """When the node last answered anything but a heartbeat (a stop request ends a wait without it)."""
        self.refused: str | None = None
        """Set when the handshake with the node failed for good: every wait raises it ([Note: refused
        handshakes] in auth.py)."""
        self._vague = 0
        """Handshakes that failed without a reason since the last that succeeded."""
        self._welcomed = threading.Event()
        self._acks: dict[tuple[int, int], tuple[_Transfer, set[int]]] = {}
        self._pulls: dict[tuple[int, int, int], tuple[_Transfer, Assembly]] = {}
        self._lock = threading.Lock()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._credit = CREDIT_CHUNKS * chunk_bytes
        self._inflight = 0
        self._unacked: dict[tuple[int, int, int, int], int] = {}
        """(step, unit, chunk, offset) of a push or INIT not yet ACKed -> its bytes ([Note: byte credits])."""
        self._credit_cv = threading.Condition()
        self._stop = threading.Event()
        import zmq

        self._ctx = zmq.Context()
        self._wake_addr = f"inproc://luwu-client-{id(self)}"
        self._wake_in = self._ctx.socket(zmq.PULL)
        self._wake_in.bind(self._wake_addr)
        self._wake = self._ctx.socket(zmq.PUSH)
        self._wake.connect(self._wake_addr)
        self._thread = threading.Thread(target=self._loop, name=f"luwu-node-client-{rank}", daemon=True)
        self._thread.start()

    # -- the queues' side -------------------------------------------------------------------------

    def _send(self, msg: Message, *, flush: bool = True) -> None:
        self._out.put(encode(msg, checksum=self._curve is None))  # CURVE's MAC guards each frame
        if flush:
            self._nudge()

    def _nudge(self) -> None:
        """Wakes the IO thread; never blocks. A full pipe holds a wake already, and once the thread has returned
        (close() set the stop flag, or the loop failed) its end of the pipe is closed and a blocking send would
        wait forever: a worker hung in close() that way after its last step, the thread having seen the flag
        between close()'s two wakes (CI, the node run of test_planner_truth_on_a_small_model)."""
        import zmq

        with self._lock:
            try:
                self._wake.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

    def _wait(self, event: threading.Event, what: str, *, deadline: float | None = None, late: str = "",
              grace_s: float = STOP_GRACE_S) -> None:
        """Waits for ``event``; ``deadline``: a monotonic time by which it must be set (``late`` says why
        it was not); ``grace_s``: how long it may see no progress after a stop request."""
        started = time.monotonic()
        while not event.wait(0.2):
            # With a deadline of its own the wait says what it waited for when it passes, not only that the
            # node answered nothing but heartbeats.
            self._check(what, started=started, grace_s=grace_s, idle=deadline is None)
            if deadline is not None and time.monotonic() > deadline:
                raise NodeError(f"{what}: {late}; raise --timeout to wait longer")
        if self.error is not None:
            raise NodeError(f"{what}: {self.error}")

    def _check(self, what: str, *, started: float, grace_s: float = STOP_GRACE_S, idle: bool = True) -> None:
        """Raises if the node restarted, failed, refused the handshake or went silent, or (``idle``) answered
        nothing but heartbeats since ``started``, or (``Interrupted``) a stop was requested and the node shows
        no progress; for every wait on it."""
        if self.lost is not None:
            raise NodeLost(f"{what}: {self.lost}")
        if self.error is not None:
            raise NodeError(f"{what}: {self.error}")
        if self.refused is not None:  # whatever this worker was doing: the line fits a rank's failure report
            raise NodeError(self.refused)
        now = time.monotonic()
        silent = now - self.last_heard
        if silent > self.timeout_s:
            raise NodeError(f"{what}: the optimizer node at {self.address} said nothing for {silent:.0f}s (it "
                            f"died or hung; is `luwu node serve` running there?); raise --timeout to wait longer")
        waited = now - max(started, self.last_progress)
        if idle and waited > self.timeout_s:  # it answers heartbeats, and nothing else: no wait outlasts --timeout
            raise NodeError(f"{what}: the optimizer node at {self.address} answered nothing but heartbeats for "
                            f"{waited:.0f}s (it waits for another worker, or does not take this one's messages: "
                            f"see its log); raise --timeout to wait longer")
        signum = interrupt.pending()
        if signum is not None and now - max(started, self.last_progress) >= min(grace_s, self.timeout_s):
            raise interrupt.Interrupted(signum, f"{signal.Signals(signum).name}: stopped waiting for the optimizer "
                                                f"node at {self.address} ({what})")

    def _send_credited(self, msg: Message, what: str, *, flush: bool) -> None:
        """Sends a push or INIT once the credit allows it ([Note: byte credits])."""
        n = len(msg.payload)
        with self._credit_cv:
            if self._inflight and self._inflight + n > self._credit:
                self._nudge()  # what is queued must go out for its ACKs to come back
                started = time.monotonic()
                while self._inflight and self._inflight + n > self._credit:
                    self._check(what, started=started)
                    self._credit_cv.wait(0.2)
            self._inflight += n
            self._unacked[(msg.step, msg.unit, msg.chunk, msg.offset)] = n
        self._send(msg, flush=flush)

    def _credit_back(self, msg: Message) -> None:
        with self._credit_cv:
            n = self._unacked.pop((msg.step, msg.unit, msg.chunk, msg.offset), 0)
            if n:
                self._inflight -= n
                self._credit_cv.notify_all()

    def stats(self, step: int) -> dict:
        """The node's STATS of ``step`` (its grad norm), waiting for them like any transfer."""
        done = threading.Event()
        with self._stats_cv:
            if step in self._stats:
                done.set()
            else:
                self._stats_waits[step] = done
        self._wait(done, f"worker {self.rank}: the node's metrics of step {step}")
        with self._stats_cv:
            return self._stats.pop(step)

    def connect(self, manifest: dict, initial: Iterable[tuple[int, int, torch.Tensor]] | None = (), *,
                step: int = 0) -> dict:
        """HELLO with ``manifest``, then (worker 0) the initial state ``(unit, state index, fp32 values)``
        (``None``: a rejoin at ``step``, the node has its state); returns the node's WELCOME (``{"step": s,
        "adam_step": a, "epoch": e}``)."""
        self.job = job_id(manifest)
        self.last_heard = time.monotonic()
        self._send(Message(T.HELLO, job=self.job, rank=self.rank, step=step, dtype=DTYPE_CODES["json"],
                           payload=manifest_bytes(manifest)))
        if self.rank == 0 and initial is not None:
            for unit, state, values in initial:
                for offset, payload in cut([(0, values.float())], chunk_bytes=self.chunk_bytes):
                    self._send_credited(Message(T.INIT, job=self.job, rank=0, unit=unit, chunk=state, offset=offset,
                                                dtype=DTYPE_CODES["float32"], payload=payload),
                                        f"worker 0 sending the initial state of unit {unit}", flush=False)
            self._send(Message(T.INIT, flags=F.LAST, job=self.job, rank=0))
        count = manifest.get("num_workers", 1)
        late = (f"no WELCOME from the optimizer node at {self.address} within {self.timeout_s:g}s; it welcomes the "
                f"workers once all {count} said HELLO and worker 0 sent the initial state: are all {count} started, "
                f"with the same --node?")
        self._wait(self._welcomed, f"worker {self.rank} joining the optimizer node",
                   deadline=time.monotonic() + self.timeout_s, late=late, grace_s=0.0)
        return self.welcome

    def push(self, step: int, unit: int, pieces: list[tuple[int, torch.Tensor]], *, dtype: str = "float32"):
        """Sends ``unit``'s fp32 gradient for ``step`` (``dtype`` ``uint8``: a codec's payload of it): ``pieces``
        are ``(byte offset in the buffer the node keeps of the unit, tensor)``, in order and together the whole
        buffer. A message chunk within one piece
        is sent as a view of it; one that spans two (a node shard's slice starts anywhere: [Note: node
        shards] in shards.py) as a copy of its parts ([Note: wire chunks] in chunks.py). The handle waits for
        the node's ACKs."""
        chunks = cut(pieces, chunk_bytes=self.chunk_bytes)
        transfer = _Transfer()
        with self._lock:
            self._acks[(step, unit)] = (transfer, {off // self.chunk_bytes for off, _ in chunks})
        what = f"worker {self.rank}: pushing unit {unit} of step {step}"
        for i, (offset, data) in enumerate(chunks):
            self._send_credited(Message(T.PUSH_GRAD, job=self.job, rank=self.rank, step=step, unit=unit,
                                        chunk=offset // self.chunk_bytes, offset=offset, dtype=DTYPE_CODES[dtype],
                                        epoch=self.epoch, payload=data), what, flush=i == len(chunks) - 1)
        return _Wait(self, transfer, what)

    def pull(self, step: int, unit: int, pieces: list[tuple[int, torch.Tensor]]):
        """Asks for ``unit``'s parameters after ``step``'s update, to be written into ``pieces`` (``(byte
        offset, tensor)``); the handle waits until all of them arrived."""
        transfer = self._expect(PARAMS, step, unit, pieces)
        self._send(Message(T.PULL_PARAM, job=self.job, rank=self.rank, step=step, unit=unit, epoch=self.epoch))
        return _Wait(self, transfer, f"worker {self.rank}: pulling unit {unit} after step {step}")

    def read_state(self, step: int, unit: int, index: int, pieces: list[tuple[int, torch.Tensor]]):
        """Asks for ``unit``'s optimizer state ``INIT_STATES[index]`` after ``step`` (the node's last), for a
        checkpoint ([Note: between two steps] in steps.py); written into ``pieces`` like a pull's."""
        transfer = self._expect(index, step, unit, pieces)
        self._send(Message(T.GET_STATE, job=self.job, rank=self.rank, step=step, unit=unit, chunk=index,
                           epoch=self.epoch))
        return _Wait(self, transfer, f"worker {self.rank}: reading unit {unit}'s optimizer state after step {step}")

    def rollback(self, step: int) -> None:
        """Asks the node shard back to its snapshot of ``step`` (another shard restarted there: [Note: node shards
        that restart] in worker.py) and waits until its new incarnation answers (``lost`` is set); raises
        ``NodeError`` with the node's reason when it refuses, or when no new incarnation answers in time."""
        self._send(Message(T.ROLLBACK, job=self.job, rank=self.rank, step=step, epoch=self.epoch))
        await_answer(lambda: self.lost is not None, [self], self.timeout_s,
                     f"worker {self.rank}: the optimizer node at {self.address} did not come back on its snapshot of "
                     f"step {step} within {self.timeout_s:g}s (see its log); raise --timeout to wait longer")

    def begin(self, step: int) -> None:
        """Tells the node this worker starts ``step`` ([Note: between two steps] in steps.py)."""
        self._send(Message(T.BEGIN, job=self.job, rank=self.rank, step=step, epoch=self.epoch))

    def _expect(self, kind: int, step: int, unit: int, pieces: list[tuple[int, torch.Tensor]]) -> _Transfer:
        transfer, assembly = _Transfer(), Assembly(pieces, chunk_bytes=self.chunk_bytes)
        if assembly.complete:  # nothing to receive
            transfer.done.set()
        else:
            with self._lock:
                self._pulls[(kind, step, unit)] = (transfer, assembly)
        return transfer

    def close(self, *, bye: bool = True) -> None:
        """Says BYE (the node stops once every worker did) and joins the IO thread."""
        if self._thread.is_alive():
            if bye and self.welcome is not None:
                self._send(Message(T.HEARTBEAT, flags=F.BYE, job=self.job, rank=self.rank, epoch=self.epoch))
            self._stop.set()
            self._nudge()
            self._thread.join(10)
        with self._lock:
            self._wake.close(0)
        self._ctx.term()

    # -- the IO thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        import zmq

        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 2000)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        if self._curve is not None:
            dealer.curve_publickey, dealer.curve_secretkey, dealer.curve_serverkey = self._curve
        monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        dealer.connect(self.address)
        poller = zmq.Poller()
        for sock in (dealer, self._wake_in, monitor):
            poller.register(sock, zmq.POLLIN)
        pending: collections.deque = collections.deque()
        """Frames that could not go out yet (no live connection): sent in order once one is up."""
        beat = time.monotonic()
        try:
            while True:
                poller.poll(int(HEARTBEAT_S * 500))
                # Read before draining: close() queues its BYE before it sets the flag, so a loop that
                # sees the flag here sends the BYE below before it returns.
                stopping = self._stop.is_set()
                while self._wake_in.poll(0):
                    self._wake_in.recv()
                while not self._out.empty():
                    pending.append(self._out.get())
                while pending and _sent(dealer, pending[0]):
                    pending.popleft()
                while dealer.poll(0):
                    self._receive(dealer.recv_multipart(copy=False))
                while monitor.poll(0):
                    self._handshake(monitor)
                if stopping:
                    return
                if time.monotonic() - beat > HEARTBEAT_S and self.job and not pending:
                    beat = time.monotonic()
                    _sent(dealer, encode(Message(T.HEARTBEAT, job=self.job, rank=self.rank, epoch=self.epoch)))
        finally:
            dealer.disable_monitor()
            monitor.close(0)
            dealer.close()
            self._wake_in.close(0)

    def _handshake(self, monitor) -> None:
        """A handshake event of the DEALER ([Note: refused handshakes] in auth.py)."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor)
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._vague = 0
            return
        problem = handshake_problem(event["event"], event["value"], address=self.address, key=self.node_key,
                                    public=self._curve[0] if self._curve else None)
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._vague += 1
            if self._vague < _VAGUE_FAILURES:
                return
            problem = problem or (f"the optimizer node at {self.address} ended the handshake {self._vague} times: it "
                                  f"may require CURVE keys (--node-key DIR/NAME.key_secret), or be no luwu node "
                                  f"serve of this version")
        if problem and self.refused is None:
            self.refused = problem

    def _receive(self, frames: list) -> None:
        try:
            msg = decode(frames, trusted=self._curve is not None)
        except ProtocolError:
            self.rejects += 1
            return
        self.last_heard = time.monotonic()
        if msg.type != T.HEARTBEAT:
            self.last_progress = self.last_heard
        if self.epoch and msg.epoch and msg.epoch != self.epoch and self.lost is None:
            self.lost = f"the optimizer node at {self.address} restarted (a new incarnation answered)"
            return
        if msg.type == T.ERROR:
            self.error = f"the optimizer node at {self.address} says: {bytes(msg.payload).decode(errors='replace')}"
            self._welcomed.set()
        elif msg.type == T.WELCOME:
            self.welcome = json.loads(bytes(msg.payload))
            self.epoch = int(self.welcome["epoch"])
            self._welcomed.set()
        elif msg.type == T.ACK:
            self._credit_back(msg)
            with self._lock:
                entry = self._acks.get((msg.step, msg.unit))
                if entry is not None and msg.chunk in entry[1]:
                    entry[1].discard(msg.chunk)
                    if not entry[1]:
                        del self._acks[(msg.step, msg.unit)]
                        entry[0].done.set()
        elif msg.type in (T.PARAM, T.STATE):
            self._param(msg)
        elif msg.type == T.STATS:
            stats = json.loads(bytes(msg.payload))
            with self._stats_cv:
                self._stats[int(stats["step"])] = stats
                done = self._stats_waits.pop(int(stats["step"]), None)
            if done is not None:
                done.set()

    def _param(self, msg: Message) -> None:
        key = (PARAMS if msg.type == T.PARAM else msg.chunk, msg.step, msg.unit)
        with self._lock:
            entry = self._pulls.get(key)
        if entry is None:
            self.rejects += 1  # an answer to a pull this worker no longer waits for
            return
        transfer, assembly = entry
        try:
            assembly.put(msg.offset, msg.payload)  # [Note: wire chunks] in chunks.py
        except ProtocolError:
            self.rejects += 1
            return
        if assembly.complete:
            with self._lock:
                self._pulls.pop(key, None)
            transfer.done.set()


def await_answer(ready: Callable[[], bool], clients: list[NodeClient], timeout_s: float, late: str) -> None:
    """Polls until ``ready()``: an answer that the clients' receiver threads record. Raises ``NodeError`` with
    a node's reason as soon as one of ``clients`` heard an ERROR, or with ``late`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        for c in clients:
            if c.error is not None:
                raise NodeError(c.error)
        if time.monotonic() > deadline:
            raise NodeError(late)
        time.sleep(0.05)


def _sent(dealer, frames: list) -> bool:
    """Sends ``frames`` unless that would block (no live connection to the node): False then."""
    import zmq

    try:
        dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return False
    return True
