"""The optimizer node's wire format: one fixed binary header, then raw payload frames; never pickle.

[Note: the node protocol]
Workers connect a DEALER to the node's ROUTER. A message is the multipart
``[header, payload]`` (the payload frame only where ``nbytes > 0``); the header
is ``HEADER`` below, little endian, 56 bytes. ``decode`` checks, in order and
before it reads a byte of the payload: the frame count, the header's length,
magic, version, type, dtype and flags, the size cap, that the payload frame is
exactly ``nbytes`` long and that offset and size are whole elements; only then
the payload's CRC-32C (``_C.crc32c``: three interleaved streams of the SSE4.2
instruction, about 4x zlib's CRC32, without the GIL). Over CURVE every frame already carries a Poly1305 MAC, so
both sides send flag ``UNCHECKED`` and skip the CRC there (two passes over every
byte: half the throughput, benchmarks/results/2026-12-03-node.md); a receiver
accepts ``UNCHECKED`` only on an authenticated transport (``trusted``). Anything
wrong raises ``ProtocolError`` carrying a short
reason that the node counts (``NodeService.rejects``): a malformed message is
dropped and counted, never answered with a traceback, never applied.

Per message type (W: worker -> node, N: node -> worker):
  HELLO      W  payload: the worker's manifest (JSON, [Note: the manifest] in
                manifest.py); ``rank`` is the sender's rank; ``step`` is 0, or the
                step a worker was running when it rejoins a restarted node (which
                needs a snapshot of the run).
  INIT       W  worker 0 only, after its HELLO: initial state, ``chunk`` = index
                of the state in ``INIT_STATES``, ``offset`` bytes into the unit's
                fp32 buffer; flag ``LAST`` on the final one. ACKed like a push
                (``step`` 0), for the credit (``CREDIT_CHUNKS``).
  WELCOME    N  payload JSON ``{"step": s, "adam_step": a, "epoch": e}``: training
                resumes after step s; every later message carries the node's ``epoch``.
  PUSH_GRAD  W  fp32 gradient bytes of ``unit`` at ``offset``, for ``step``; under a codec
                (the manifest's ``compress``) the bytes of its payload, dtype ``uint8``.
  ACK        N  a push stored; flag ``DUPLICATE`` when it had been before (or was
                stale): answered, not applied twice.
  PULL_PARAM W  asks for ``unit``'s parameters after ``step``'s update.
  PARAM      N  those parameter bytes at ``offset`` (one message per chunk).
  HEARTBEAT  W/N  liveness; flag ``BYE`` when a worker is done. The node answers a
                heartbeat from a peer it does not know (still counted as a reject)
                with its ``epoch``: a worker whose node restarted learns it so.
  STATS      N  payload JSON ``{"step": s, "grad_norm": g, "skipped": b}``, to every
                worker once step s is done: the worker's metrics. The run's last step
                adds ``"spans"`` (the node's op spans: the node's row in ``--trace``).
  NORM       node shard -> shard 0 -> every shard: the partial squared gradient norms of
                ``step`` ([Note: node shards] in shards.py); ``rank`` is the sending shard.
                A shard sends its float64 partial; shard 0 answers with all k partials,
                in shard order, once it has them.
  BEGIN      W  the worker starts ``step``: the node, idle between steps, runs its plan of
                that step once one worker began it ([Note: between two steps] in steps.py).
  GET_STATE  W  asks for ``unit``'s optimizer state ``chunk`` (index in ``INIT_STATES``)
                after ``step``, the node's last step: for a checkpoint.
  STATE      N  those fp32 bytes at ``offset``, ``chunk`` = the state's index; flag
                ``LAST`` on the final one.
  ERROR      N  payload: a UTF-8 line naming the problem and the fix.
  ROLLBACK   W  another node shard restarted on its snapshot of ``step``: this shard goes back to its
                own snapshot of that step, as a new incarnation, and the workers rejoin every shard
                there ([Note: node shards that restart] in worker.py).
Type 7 was SNAPSHOT, reserved and never sent (snapshots are files: [Note: node snapshots] in snapshot.py);
it has no name now, so it decodes as an unknown type, and its number stays unused so the others keep theirs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from luwu_rt._C import crc32c
from luwu_rt.plan.dtypes import ELEMENT_BYTES

__all__ = ["CREDIT_CHUNKS", "DTYPES", "HEADER", "INIT_STATES", "MAGIC", "MAX_PAYLOAD_BYTES", "OLDEST_HEADER", "Message",
           "ProtocolError", "T", "VERSION", "F", "decode", "encode", "old_version", "peek"]

MAGIC = b"LUWU"
VERSION = 5
"""2: STATS, WELCOME with ``adam_step``, heartbeats answered with the node's epoch. 3: CRC-32C instead of
zlib's CRC32; NORM between node shards; WELCOME names the node's shard; BEGIN, GET_STATE and STATE. 4: the
manifest names the run's gradient codec, and a compressed push carries its payload bytes (dtype ``uint8``,
[Note: compressed pushes] in plan/codec.py); a HELLO of an older version is answered with an ERROR that
side can read (``encode`` with its ``version``). 5: ROLLBACK; a NORM carries its shard's epoch."""
OLDEST_HEADER = 3
"""The oldest version whose header and CRC are this one's: the node can answer its HELLO with an ERROR."""
HEADER = struct.Struct("<4sBBHIIIiIQQB3xII")
"""magic, version, type, flags, job, rank, step, unit, chunk, offset, nbytes, dtype, epoch, checksum."""
MAX_PAYLOAD_BYTES = 16 * 2**20
"""Largest payload frame accepted: the largest message chunk (1-16 MiB)."""
CREDIT_CHUNKS = 4
"""Byte-credit flow control: a worker keeps at most this many chunks of pushes and INITs unacknowledged
(the node ACKs each as it stores it), so what waits in the node's socket for its loop is bounded, and
counted in its ``--host-mem``; the node's receive high-water mark holds a peer that ignores its credit
back in TCP, not in the node's memory."""


class T:
    """Message types."""

    HELLO, WELCOME, PUSH_GRAD, PARAM, PULL_PARAM, HEARTBEAT = range(1, 7)
    # 7 was SNAPSHOT, never sent: unused, so that the types after it keep their numbers on the wire.
    ERROR, ACK, INIT, STATS, NORM, BEGIN, GET_STATE, STATE, ROLLBACK = range(8, 17)
    NAMES = {1: "HELLO", 2: "WELCOME", 3: "PUSH_GRAD", 4: "PARAM", 5: "PULL_PARAM", 6: "HEARTBEAT",
             8: "ERROR", 9: "ACK", 10: "INIT", 11: "STATS", 12: "NORM", 13: "BEGIN", 14: "GET_STATE", 15: "STATE",
             16: "ROLLBACK"}


class F:
    """Flag bits."""

    DUPLICATE = 1
    BYE = 2
    LAST = 4
    UNCHECKED = 8
    """No payload CRC: the transport (CURVE) authenticates every frame."""
    ALL = DUPLICATE | BYE | LAST | UNCHECKED


_DTYPE_CODE_NAMES = ("none", "float32", "bfloat16", "float16", "json", "utf8", "float64", "uint8")
"""The header's dtype codes, by position: the wire's numbering, appended to only. Tensor payloads are named as
in [Note: dtype names] (plan/dtypes.py), the others are bytes: none, JSON, a UTF-8 line."""
DTYPES = {code: (name, ELEMENT_BYTES.get(name, 1)) for code, name in enumerate(_DTYPE_CODE_NAMES)}
"""dtype code -> (name, bytes per element)."""
DTYPE_CODES = {name: code for code, (name, _) in DTYPES.items()}
INIT_STATES = ("master", "exp_avg", "exp_avg_sq")
"""States worker 0 sends in INIT messages, by index (the header's ``chunk``)."""
_WITH_PAYLOAD = {T.HELLO, T.WELCOME, T.PUSH_GRAD, T.PARAM, T.ERROR, T.INIT, T.STATS, T.NORM, T.STATE}


class ProtocolError(ValueError):
    """A message the node or a worker must drop; ``reason`` is the counter it is filed under."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Message:
    type: int
    flags: int = 0
    job: int = 0
    rank: int = 0
    step: int = 0
    unit: int = 0
    chunk: int = 0
    offset: int = 0
    dtype: int = 0
    epoch: int = 0
    payload: memoryview | bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @property
    def name(self) -> str:
        return T.NAMES.get(self.type, str(self.type))


def encode(msg: Message, *, checksum: bool = True, version: int = VERSION) -> list:
    """The frames of ``msg``: ``[header]`` or ``[header, payload]`` (the payload itself, not a copy).
    ``checksum=False`` (CURVE transports only) sends flag ``UNCHECKED`` instead of the payload's CRC-32C;
    ``version``: another than ``VERSION`` only for the ERROR that refuses an older peer (``old_version``)."""
    payload = msg.payload
    n = memoryview(payload).nbytes
    flags = msg.flags | (0 if checksum else F.UNCHECKED)
    header = HEADER.pack(MAGIC, version, msg.type, flags, msg.job, msg.rank, msg.step, msg.unit, msg.chunk,
                         msg.offset, n, msg.dtype, msg.epoch, crc32c(payload) if n and checksum else 0)
    return [header, payload] if n else [header]


def decode(frames: list, *, max_payload: int = MAX_PAYLOAD_BYTES, trusted: bool = False) -> Message:
    """The message in ``frames`` (bytes, or zmq frames), validated ([Note: the node protocol]); raises
    ``ProtocolError`` naming what is wrong. ``trusted``: the transport authenticates every frame (CURVE),
    so a payload flagged ``UNCHECKED`` is accepted without a CRC."""
    if not 1 <= len(frames) <= 2:
        raise ProtocolError("frames", f"{len(frames)} frames, expected a header and at most one payload")
    head = _buffer(frames[0])
    if head.nbytes != HEADER.size:
        raise ProtocolError("header", f"{head.nbytes} header bytes, expected {HEADER.size}")
    (magic, version, kind, flags, job, rank, step, unit, chunk, offset, nbytes, dtype, epoch,
     checksum) = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError("magic", f"{magic!r}")
    if version != VERSION:
        raise ProtocolError("version", f"protocol version {version}, this side speaks {VERSION}: run the same luwu_rt "
                                       f"on the node and the workers")
    if kind not in T.NAMES:
        raise ProtocolError("type", f"unknown message type {kind}")
    if flags & ~F.ALL:
        raise ProtocolError("flags", f"unknown flag bits {flags:#x}")
    if dtype not in DTYPES:
        raise ProtocolError("dtype", f"unknown dtype code {dtype}")
    if nbytes > max_payload:
        raise ProtocolError("size", f"{nbytes} payload bytes over the cap of {max_payload}")
    if nbytes and kind not in _WITH_PAYLOAD:
        raise ProtocolError("payload", f"{T.NAMES[kind]} carries no payload, got {nbytes} bytes")
    if (len(frames) == 2) != (nbytes > 0):
        raise ProtocolError("frames", f"nbytes={nbytes} with {len(frames) - 1} payload frame(s)")
    elem = DTYPES[dtype][1]
    if offset % elem or nbytes % elem:
        raise ProtocolError("alignment", f"offset {offset} / {nbytes} bytes are not whole {DTYPES[dtype][0]} elements")
    payload = _buffer(frames[1]) if nbytes else memoryview(b"")
    if payload.nbytes != nbytes:
        raise ProtocolError("length", f"payload of {payload.nbytes} bytes, header says {nbytes}")
    if flags & F.UNCHECKED:
        if not trusted:
            raise ProtocolError("checksum", "a payload without CRC-32C on a transport without CURVE")
    elif nbytes and crc32c(payload) != checksum:
        raise ProtocolError("checksum", "payload CRC-32C does not match the header")
    return Message(kind, flags & ~F.UNCHECKED, job, rank, step, unit, chunk, offset, dtype, epoch, payload)


def old_version(frames: list) -> tuple[int, int] | None:
    """``(version, rank)`` of a HELLO of another protocol version whose header is whole and whose manifest
    frame is as long as it says (nothing else of it is read): the node answers such a worker by name, not
    with silence. Anything less is no worker's HELLO and gets no answer."""
    if len(frames) != 2 or _buffer(frames[0]).nbytes != HEADER.size:
        return None
    fields = HEADER.unpack(_buffer(frames[0]))
    whole = 0 < fields[10] == _buffer(frames[1]).nbytes
    if fields[0] != MAGIC or fields[1] == VERSION or fields[2] != T.HELLO or not whole:
        return None
    return fields[1], fields[5]


def peek(frames: list) -> tuple[int, int] | None:
    """``(type, nbytes)`` of the message in ``frames`` as its header says, without checking it or reading the
    payload; None when there is no header of the right size. For the node to judge a peer it does not know
    by the header alone ([Note: strangers] in machine.py)."""
    if not frames:
        return None
    head = _buffer(frames[0])
    if head.nbytes != HEADER.size:
        return None
    fields = HEADER.unpack(head)
    return fields[2], fields[10]


def _buffer(frame) -> memoryview:
    """A read-only byte view of a frame (bytes, bytearray, memoryview or ``zmq.Frame``)."""
    buf = getattr(frame, "buffer", frame)
    view = memoryview(buf)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
