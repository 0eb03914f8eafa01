"""Payloads on the wire: one way to cut a byte range into messages, one way to put it back together.

[Note: wire chunks]
Every byte range that crosses the wire - a unit's pushed gradient, worker 0's
initial state, a unit's served parameters, a checkpoint's read of an optimizer
state - is cut by ``cut`` into messages of at most ``chunk_bytes`` (the
manifest's chunk size, so the same on both sides): chunk ``i`` starts at byte
``i x chunk_bytes`` of the range and is ``chunk_bytes`` long but for the last.
The range may lie in several pieces (a node shard's slice of a unit starts
anywhere in the worker's store shards): a chunk within one piece is sent as a
view of it, without a copy; one that spans two as a copy of its parts.

The receiver puts the range back together with one ``Assembly``: it takes a
chunk only at such an offset and with exactly that length (else
``ProtocolError``, before a byte is written), writes it where it belongs (one
buffer, or the pieces of the store it fills), counts every chunk once - a
repeated chunk is reported, never counted twice, so a duplicated message can
neither complete a range early nor leave it waiting - and is complete once
every chunk arrived.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .protocol import ProtocolError

__all__ = ["Assembly", "chunk_index", "cut"]


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def cut(pieces: Sequence[tuple[int, torch.Tensor]], *, chunk_bytes: int) -> list[tuple[int, memoryview | bytes]]:
    """The range that ``pieces`` (``(byte offset, tensor)``, in order, together the whole range from byte 0)
    hold, as ``(byte offset, payload)`` wire chunks ([Note: wire chunks])."""
    out: list[tuple[int, memoryview | bytes]] = []
    parts: list[memoryview] = []
    have = start = 0
    for offset, tensor in pieces:
        assert offset == start, "pieces cover the range in order"
        data = _bytes(tensor)
        while len(data):
            take = min(len(data), chunk_bytes - have)
            parts.append(data[:take])
            data, start, have = data[take:], start + take, have + take
            if have == chunk_bytes:
                out.append((start - have, parts[0] if len(parts) == 1 else b"".join(parts)))
                parts, have = [], 0
    if parts:
        out.append((start - have, parts[0] if len(parts) == 1 else b"".join(parts)))
    return out


def chunk_index(offset: int, nbytes: int, *, total: int, chunk_bytes: int) -> int:
    """The index of the chunk at byte ``offset`` of a ``total``-byte range; ``ProtocolError`` unless the
    message is exactly that whole chunk ([Note: wire chunks])."""
    index, rest = divmod(offset, chunk_bytes)
    if rest or not 0 <= offset < total or nbytes != min(chunk_bytes, total - offset):
        raise ProtocolError("range", f"{nbytes} bytes at byte {offset} are not one whole chunk of a range of {total} "
                                     f"bytes in chunks of {chunk_bytes}")
    return index


class Assembly:
    """A byte range put back together from its wire chunks, in any order ([Note: wire chunks])."""

    def __init__(self, pieces: Sequence[tuple[int, torch.Tensor]], *, chunk_bytes: int) -> None:
        """``pieces``: where the range's bytes go, ``(byte offset, tensor)`` in order, from byte 0."""
        self.pieces = [(offset, tensor.view(torch.uint8).reshape(-1).numpy()) for offset, tensor in pieces]
        self.total = sum(p.size for _, p in self.pieces)
        self.chunk_bytes = chunk_bytes
        self.count = -(-self.total // chunk_bytes)
        """Chunks of the whole range."""
        self.got: set[int] = set()
        """Indices of the chunks that arrived."""

    @property
    def complete(self) -> bool:
        return len(self.got) == self.count

    def put(self, offset: int, payload: memoryview | bytes) -> bool:
        """Writes the chunk at byte ``offset``; False (nothing written) for a chunk that arrived before."""
        data = np.frombuffer(payload, dtype=np.uint8)
        index = chunk_index(offset, data.size, total=self.total, chunk_bytes=self.chunk_bytes)
        if index in self.got:
            return False
        end = offset + data.size
        for start, piece in self.pieces:
            lo, hi = max(start, offset), min(start + piece.size, end)
            if lo < hi:
                piece[lo - start : hi - start] = data[lo - offset : hi - offset]
        self.got.add(index)
        return True
