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
waiting transfer fails naming the node's address.

[Note: byte credits]
A push (or INIT) chunk is sent only while the chunks this client sent and the
node has not ACKed stay within ``CREDIT_CHUNKS`` chunks (protocol.py): the push
queue waits for the node's ACKs, so the bytes queued towards the node, in this
process's socket and in the node's, stay bounded however fast backward makes
gradients. A chunk larger than the credit is sent alone.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterable

import numpy as np
import torch

from .manifest import job_id, manifest_bytes
from .protocol import CREDIT_CHUNKS, DTYPE_CODES, MAX_PAYLOAD_BYTES, F, Message, ProtocolError, T, decode, encode

__all__ = ["NodeClient", "NodeError", "NodeLost"]

PARAMS = -1
"""The kind of an expected transfer that is a unit's parameters (else the index of an optimizer state)."""
HEARTBEAT_S = 1.0
"""How often the client says it is alive, and asks the node to say so."""


class NodeError(RuntimeError):
    """The optimizer node refused, failed or went silent."""


class NodeLost(NodeError):
    """The node this client joined restarted (a new epoch answered): the worker reconnects and replays
    ([Note: a node that restarts] in worker.py)."""


class _Transfer:
    def __init__(self, remaining: int) -> None:
        self.remaining = remaining
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
        self._welcomed = threading.Event()
        self._acks: dict[tuple[int, int], tuple[_Transfer, set[int]]] = {}
        self._pulls: dict[tuple[int, int, int], tuple[_Transfer, list[tuple[int, torch.Tensor]]]] = {}
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
            with self._lock:
                self._wake.send(b"")

    def _wait(self, event: threading.Event, what: str) -> None:
        while not event.wait(0.2):
            self._check(what)
        if self.error is not None:
            raise NodeError(f"{what}: {self.error}")

    def _check(self, what: str) -> None:
        """Raises if the node restarted, failed or went silent; for every wait on it."""
        if self.lost is not None:
            raise NodeLost(f"{what}: {self.lost}")
        if self.error is not None:
            raise NodeError(f"{what}: {self.error}")
        silent = time.monotonic() - self.last_heard
        if silent > self.timeout_s:
            raise NodeError(f"{what}: the optimizer node at {self.address} said nothing for {silent:.0f}s (it "
                            f"died or hung; is `luwu node serve` running there?); raise --timeout to wait longer")

    def _send_credited(self, msg: Message, what: str, *, flush: bool) -> None:
        """Sends a push or INIT once the credit allows it ([Note: byte credits])."""
        n = len(msg.payload)
        with self._credit_cv:
            if self._inflight and self._inflight + n > self._credit:
                with self._lock:  # what is queued must go out for its ACKs to come back
                    self._wake.send(b"")
                while self._inflight and self._inflight + n > self._credit:
                    self._check(what)
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
                data = memoryview(values.contiguous().view(torch.uint8).numpy())
                for offset in range(0, len(data), self.chunk_bytes):
                    self._send_credited(Message(T.INIT, job=self.job, rank=0, unit=unit, chunk=state, offset=offset,
                                                dtype=DTYPE_CODES["float32"],
                                                payload=bytes(data[offset : offset + self.chunk_bytes])),
                                        f"worker 0 sending the initial state of unit {unit}", flush=False)
            self._send(Message(T.INIT, flags=F.LAST, job=self.job, rank=0))
        self._wait(self._welcomed, f"worker {self.rank} joining the optimizer node")
        return self.welcome

    def push(self, step: int, unit: int, pieces: list[tuple[int, torch.Tensor]]):
        """Sends ``unit``'s fp32 gradient for ``step``: ``pieces`` are ``(byte offset in the buffer the node
        keeps of the unit, tensor)``, in order and together the whole buffer. A message chunk within one piece
        is sent as a view of it; one that spans two (a node shard's slice starts anywhere: [Note: node
        shards] in shards.py) as a copy of its parts. The handle waits for the node's ACKs."""
        chunks: list[tuple[int, memoryview | bytes]] = []
        parts: list[memoryview] = []
        start = 0
        for offset, tensor in pieces:
            data = memoryview(tensor.view(torch.uint8).numpy())
            assert offset == start, "pieces cover the buffer in order"
            while len(data):
                have = sum(len(p) for p in parts)
                take = min(len(data), self.chunk_bytes - have)
                parts.append(data[:take])
                data, start = data[take:], start + take
                if have + take == self.chunk_bytes:
                    chunks.append((start - self.chunk_bytes, parts[0] if len(parts) == 1 else b"".join(parts)))
                    parts = []
        if parts:
            n = sum(len(p) for p in parts)
            chunks.append((start - n, parts[0] if len(parts) == 1 else b"".join(parts)))
        transfer = _Transfer(len(chunks))
        with self._lock:
            self._acks[(step, unit)] = (transfer, {off // self.chunk_bytes for off, _ in chunks})
        what = f"worker {self.rank}: pushing unit {unit} of step {step}"
        for i, (offset, data) in enumerate(chunks):
            self._send_credited(Message(T.PUSH_GRAD, job=self.job, rank=self.rank, step=step, unit=unit,
                                        chunk=offset // self.chunk_bytes, offset=offset, dtype=DTYPE_CODES["float32"],
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
        checkpoint ([Note: between two steps] in service.py); written into ``pieces`` like a pull's."""
        transfer = self._expect(index, step, unit, pieces)
        self._send(Message(T.GET_STATE, job=self.job, rank=self.rank, step=step, unit=unit, chunk=index,
                           epoch=self.epoch))
        return _Wait(self, transfer, f"worker {self.rank}: reading unit {unit}'s optimizer state after step {step}")

    def begin(self, step: int) -> None:
        """Tells the node this worker starts ``step`` ([Note: between two steps] in service.py)."""
        self._send(Message(T.BEGIN, job=self.job, rank=self.rank, step=step, epoch=self.epoch))

    def _expect(self, kind: int, step: int, unit: int, pieces: list[tuple[int, torch.Tensor]]) -> _Transfer:
        transfer = _Transfer(sum(t.numel() * t.element_size() for _, t in pieces))
        with self._lock:
            self._pulls[(kind, step, unit)] = (transfer, [(o, t.view(torch.uint8)) for o, t in pieces])
        return transfer

    def close(self, *, bye: bool = True) -> None:
        """Says BYE (the node stops once every worker did) and joins the IO thread."""
        if self._thread.is_alive():
            if bye and self.welcome is not None:
                self._send(Message(T.HEARTBEAT, flags=F.BYE, job=self.job, rank=self.rank, epoch=self.epoch))
            self._stop.set()
            with self._lock:
                self._wake.send(b"")
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
        dealer.connect(self.address)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
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
                    dealer.send_multipart(self._out.get(), copy=False)
                while dealer.poll(0):
                    self._receive(dealer.recv_multipart(copy=False))
                if stopping:
                    return
                if time.monotonic() - beat > HEARTBEAT_S and self.job:
                    beat = time.monotonic()
                    dealer.send_multipart(encode(Message(T.HEARTBEAT, job=self.job, rank=self.rank, epoch=self.epoch)))
        finally:
            dealer.close()
            self._wake_in.close(0)

    def _receive(self, frames: list) -> None:
        try:
            msg = decode(frames, trusted=self._curve is not None)
        except ProtocolError:
            self.rejects += 1
            return
        self.last_heard = time.monotonic()
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
        transfer, pieces = entry
        data = np.frombuffer(msg.payload, dtype=np.uint8)
        end = msg.offset + data.size
        for start, piece in pieces:
            lo, hi = max(start, msg.offset), min(start + piece.numel(), end)
            if lo < hi:
                piece.numpy()[lo - start : hi - start] = data[lo - msg.offset : hi - msg.offset]
                transfer.remaining -= hi - lo
        if transfer.remaining <= 0:
            with self._lock:
                self._pulls.pop(key, None)
            transfer.done.set()
