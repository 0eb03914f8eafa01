"""Node shards: several optimizer node processes split every unit; their partial norms meet at shard 0.

[Note: node shards]
``luwu node serve --shard i/k`` owns elements ``[i S, min((i+1) S, n))`` of every
unit of ``n`` elements, ``S = ceil(n / k)`` ([Note: node layout] in
plan/node.py): each shard keeps, updates and serves only its slices, so k
shards hold 1/k of the optimizer state each and the workers' traffic is spread
over k sockets. Workers name the k addresses in shard order (``--node
A0,A1,...``); a worker pushes slice i of a unit's gradient to shard i and pulls
slice i of its parameters from there, and worker 0 sends each shard its slices
of the initial state. A shard checks that the workers count k shards and each
WELCOME names its shard, so a list in the wrong order is an error, not a
silently wrong model.

The gradient norm is the one thing the shards must agree on: exact clipping
scales every update by the global norm. The manifest carries the address list,
which is how shard i > 0 finds shard 0: in each step's NormReduce every shard
computes the squared norm of its slices, shards i > 0 send it (a NORM message)
to shard 0 over a DEALER of their own (``NormLink``), and shard 0 (``NormHub``)
answers every shard with all k partials in shard order once it has them. Every
shard sums them in that order in float64, so all compute the same bits. A
shard resends its NORM every second until answered: the order in which shards
start does not matter, and a repeated NORM only repeats the answer. A NORM
carries its shard's epoch: after shards restart ([Note: node shards that
restart] in worker.py) a partial that an earlier incarnation of a shard left at
shard 0 is dropped once that shard's new incarnation is heard from, so a step
run again never sums a partial of the run it replaces. Over CURVE
a shard connects to shard 0 with the node's own key pair (the shards share the
``--auth-keys`` directory), which shard 0's authenticator admits beside the
workers' keys.
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from collections.abc import Callable

from .protocol import DTYPE_CODES, Message, ProtocolError, T, decode, encode

__all__ = ["NormHub", "NormLink", "parse_shard", "slice_of"]

_F64 = struct.Struct("<d")
RESEND_S = 1.0
"""How often a shard repeats its unanswered NORM."""
_KEEP_STEPS = 4
"""Answered steps shard 0 remembers, to answer a repeated NORM."""


def slice_of(numel: int, index: int, count: int) -> tuple[int, int]:
    """(first element, elements) of ``numel`` that node shard ``index`` of ``count`` owns."""
    part = -(-numel // count)
    start = min(numel, index * part)
    return start, max(0, min(part, numel - start))


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/k"`` -> (i, k); raises ``ValueError`` naming the flag."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: give it as i/k, shard i (from 0) of k node processes, e.g. 0/2") from None
    if not (count >= 1 and 0 <= index < count):
        raise ValueError(f"--shard {text}: need k >= 1 and 0 <= i < k")
    return index, count


def pack_norms(values: list[float]) -> bytes:
    return b"".join(_F64.pack(v) for v in values)


def unpack_norms(payload, count: int) -> list[float]:
    data = bytes(payload)
    if len(data) != 8 * count:
        raise ProtocolError("norm", f"NORM of {len(data)} bytes, expected {count} float64")
    return [_F64.unpack_from(data, 8 * i)[0] for i in range(count)]


class NormHub:
    """Shard 0's side of the exchange: collects each step's partials, answers once all k are in."""

    def __init__(self, count: int, *, timeout_s: float, on_complete: Callable[[int], None]) -> None:
        self.count, self.timeout_s, self.on_complete = count, timeout_s, on_complete
        self.partials: dict[int, dict[int, float]] = {}
        self.answers: dict[int, list[float]] = {}
        self.epochs: dict[int, int] = {}
        """shard -> the epoch of its incarnation heard last (0 for shard 0's own partials)."""
        self.peers: dict[int, dict[int, bytes]] = {}
        """step -> shard -> socket identity the answer goes to."""
        self.cond = threading.Condition()

    def offer(self, step: int, shard: int, value: float, identity: bytes | None = None, *, epoch: int = 0) -> None:
        """Files a partial (shard 0's own from its runner, the others' from NORM messages, with the epoch of
        the sending shard's incarnation)."""
        if not 0 <= shard < self.count:
            raise ProtocolError("norm", f"NORM from shard {shard} of {self.count}")
        with self.cond:
            if self.epochs.setdefault(shard, epoch) != epoch:  # the shard restarted: its old partials are void
                self.epochs[shard] = epoch
                for parts in self.partials.values():
                    parts.pop(shard, None)
            if identity is not None:
                self.peers.setdefault(step, {})[shard] = identity
            if step in self.answers:  # a repeat: answer again
                complete = True
            else:
                self.partials.setdefault(step, {}).setdefault(shard, value)
                complete = len(self.partials[step]) == self.count
                if complete:
                    got = self.partials.pop(step)
                    self.answers[step] = [got[i] for i in range(self.count)]
                    for old in [s for s in self.answers if s <= step - _KEEP_STEPS]:
                        self.answers.pop(old)
                        self.peers.pop(old, None)
                    self.cond.notify_all()
        if complete:
            self.on_complete(step)

    def replies(self, step: int) -> list[tuple[bytes, list[float]]]:
        """(identity, partials) for every shard that asked about ``step``, once it is answered."""
        with self.cond:
            if step not in self.answers:
                return []
            return [(identity, self.answers[step]) for identity in self.peers.get(step, {}).values()]

    def exchange(self, step: int, value: float) -> list[float]:
        """Shard 0's own partial in; every shard's out, in shard order (waits for the others)."""
        self.offer(step, 0, value)
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while step not in self.answers:
                left = deadline - time.monotonic()
                if left <= 0:
                    have = sorted(self.partials.get(step, {}))
                    missing = [i for i in range(self.count) if i not in have]
                    raise TimeoutError(f"optimizer node shard 0: step {step}: no gradient norm from node shard(s) "
                                       f"{missing} within {self.timeout_s:g}s; a node shard died or hung - see its "
                                       f"log, or raise --timeout")
                self.cond.wait(min(left, 1.0))
            return list(self.answers[step])


class NormLink:
    """Shard i > 0's side: a DEALER to shard 0 on a thread of its own (ZeroMQ sockets stay on one thread)."""

    def __init__(self, address: str, *, shard: int, count: int, job: int, timeout_s: float, epoch: int,
                 curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.address, self.shard, self.count, self.job, self.timeout_s = address, shard, count, job, timeout_s
        self.epoch = epoch
        """This shard's incarnation, sent with each NORM."""
        self.curve = curve
        self.answers: dict[int, list[float]] = {}
        self.cond = threading.Condition()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"luwu-node-norm-{shard}", daemon=True)
        self._thread.start()

    def exchange(self, step: int, value: float) -> list[float]:
        self._out.put((step, value))
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while step not in self.answers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"optimizer node shard {self.shard}: step {step}: node shard 0 at "
                                       f"{self.address} gave no gradient norm within {self.timeout_s:g}s; is it "
                                       f"running (luwu node serve --shard 0/{self.count})? Or raise --timeout")
                self.cond.wait(min(left, 1.0))
            return self.answers.pop(step)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        import zmq

        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            dealer.curve_publickey, dealer.curve_secretkey, dealer.curve_serverkey = self.curve
        dealer.connect(self.address)
        pending: dict[int, float] = {}
        sent_at = 0.0
        try:
            while not self._stop.is_set():
                while not self._out.empty():
                    step, value = self._out.get()
                    pending[step] = value
                    sent_at = 0.0
                if pending and time.monotonic() - sent_at > RESEND_S:
                    for step, value in pending.items():
                        dealer.send_multipart(encode(Message(T.NORM, job=self.job, rank=self.shard, step=step,
                                                             epoch=self.epoch, dtype=DTYPE_CODES["float64"],
                                                             payload=pack_norms([value])),
                                                     checksum=self.curve is None))
                    sent_at = time.monotonic()
                if dealer.poll(50):
                    try:
                        msg = decode(dealer.recv_multipart(copy=False), trusted=self.curve is not None)
                        if msg.type != T.NORM or msg.job != self.job:
                            continue
                        parts = unpack_norms(msg.payload, self.count)
                    except ProtocolError:
                        continue
                    if pending.pop(msg.step, None) is not None:
                        with self.cond:
                            self.answers[msg.step] = parts
                            self.cond.notify_all()
        finally:
            dealer.close()
            ctx.term()
