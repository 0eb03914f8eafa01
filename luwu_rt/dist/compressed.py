"""Handlers of a compressed unit's ``Encode`` and ``Decode`` ops ([Note: codecs on the wire] in plan/codec.py).

``Encode`` reads the unit's gradient and residual and writes ``grad_code``: piece p of the gradient (the
whole unit under ddp; under zero1/zero2 the S elements of rank p's slice) at offset p x P(S), where
P(S) is a piece's payload size. A piece's last elements may lie past the unit's N (the padding of the
last slice); they are neither encoded nor decoded, so the padding of a reduced slice stays exactly 0,
as the norm and the update of the padded slice expect. ``Decode`` reads the W payloads of this rank's
piece that the exchange put into ``grad_codes`` (rank r's at offset r x P) and sums their values in rank
order into the reduced gradient: the first written, the others added, the same bits on every rank and
in a single process that applies the codec to the same gradients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from luwu_rt.compress import codec_for
from luwu_rt.exec.executor import Handler, Views
from luwu_rt.plan.ops import Decode, Encode, ShardId, ShardInfo

__all__ = ["CodecHandlers"]


class CodecHandlers:
    """``Encode`` and ``Decode`` for the plan of the rank at position ``rank`` of the world it compresses over."""

    def __init__(self, shards: Mapping[ShardId, ShardInfo], *, rank: int) -> None:
        self.shards = shards
        self.rank = rank

    def handlers(self) -> dict[str, Handler]:
        return {"Encode": self.encode, "Decode": self.decode}

    def _flat(self, views: Views, accesses: Sequence, state: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The unit's buffer of ``state`` among ``accesses`` as one flat tensor of its elements: the shard's own
        memory when it is one shard, else a joined copy (write it back with ``_scatter``)."""
        ids = sorted((a.shard for a in accesses if a.shard.state == state), key=lambda s: s.chunk)
        if not ids:
            return None
        parts = [views[s].view(dtype)[: self.shards[s].numel] for s in ids]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _scatter(self, views: Views, accesses: Sequence, state: str, values: torch.Tensor) -> None:
        """``values`` back into the shards of ``state`` when ``_flat`` joined several."""
        ids = sorted((a.shard for a in accesses if a.shard.state == state), key=lambda s: s.chunk)
        if len(ids) > 1:
            start = 0
            for s in ids:
                n = self.shards[s].numel
                views[s].view(values.dtype)[:n].copy_(values[start : start + n])
                start += n

    def encode(self, op: Encode, views: Views) -> None:
        codec = codec_for(op.codec, chunk_numel=op.chunk_numel)
        source = "grad_full" if any(a.shard.state == "grad_full" for a in op.inputs) else "grad"
        grad = self._flat(views, op.inputs, source, torch.float32)
        residual = self._flat(views, op.outputs, "residual", torch.float32)
        code = self._flat(views, op.outputs, "grad_code", torch.uint8)
        assert grad is not None and residual is not None and code is not None, op
        size = codec.payload_bytes(op.piece_numel)
        for p in range(op.pieces):
            first = p * op.piece_numel
            last = min(first + op.piece_numel, op.numel)
            if last > first:
                codec.encode(grad[first:last], residual[first:last],
                             code[p * size : p * size + codec.payload_bytes(last - first)])
        self._scatter(views, op.outputs, "residual", residual)

    def decode(self, op: Decode, views: Views) -> None:
        codec = codec_for(op.codec, chunk_numel=op.chunk_numel)
        codes = self._flat(views, op.inputs, "grad_codes", torch.uint8)
        target = "grad_slice" if any(a.shard.state == "grad_slice" for a in op.outputs) else "grad"
        out = self._flat(views, op.outputs, target, torch.float32)
        assert codes is not None and out is not None, op
        mine = self.rank if op.pieces > 1 else 0
        valid = max(0, min(op.piece_numel, op.numel - mine * op.piece_numel))
        size = codec.payload_bytes(op.piece_numel)
        out[valid:].zero_()
        for r in range(op.payloads):  # rank order: the same sum everywhere
            codec.decode(codes[r * size : r * size + codec.payload_bytes(valid)], out[:valid], accumulate=r > 0)
        self._scatter(views, op.outputs, target, out)
        if op.accumulate:  # zero2's later micro-batches: into grad_slice first, then added to grad
            grad = self._flat(views, op.outputs, "grad", torch.float32)
            grad.add_(out)
            self._scatter(views, op.outputs, "grad", grad)
