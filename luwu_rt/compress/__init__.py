"""Gradient codecs with error feedback: the encode and decode of a compressed unit's synchronisation.

What a plan knows of a codec (its name, payload sizes, cost) is ``luwu_rt.plan.codec``; this package does
the work. ``codec_for(name, chunk_numel=C)`` returns a ``Codec`` whose ``encode(grad, residual, payload)``
writes the payload of ``grad + residual`` and leaves the error in ``residual``, and whose
``decode(payload, out, accumulate=...)`` writes (or adds) the values a payload holds. Tensors on the CPU
run the Numba kernels (``_numba.py``); powersgd, and tensors on a GPU, run the same definitions in torch
(``torch_codecs.py``), which the kernels are tested against. Numba CUDA kernels for onebit and topk (a
chunk per block) would save torch's intermediate tensors on a GPU; they are future work.

    codec = codec_for("onebit", chunk_numel=1024)
    payload = torch.empty(codec.payload_bytes(grad.numel()), dtype=torch.uint8)
    codec.encode(grad, residual, payload)   # residual: zeros before the first step
    codec.decode(payload, out)
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from luwu_rt.compress import torch_codecs
from luwu_rt.plan.codec import CodecSpec, parse_codec

__all__ = ["Codec", "codec_for"]

_NUMBA = ("bf16", "fp16", "onebit", "topk")
"""Families with Numba CPU kernels."""


def _np(t: torch.Tensor, dtype: type) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU tensor's bytes as ``dtype``."""
    return t.detach().view(-1).numpy().view(dtype)


class Codec:
    """One codec at one chunk size ([Note: codecs on the wire] in plan/codec.py)."""

    def __init__(self, spec: CodecSpec, *, chunk_numel: int) -> None:
        assert spec.family != "none", "uncompressed units have no codec"
        self.spec = spec
        self.chunk = spec.codec_chunk(chunk_numel)
        """Elements per codec chunk (onebit: its scale block)."""
        assert self.chunk > 0 and self.chunk % 32 == 0, f"a codec chunk of {self.chunk} elements: a multiple of 32"

    @property
    def name(self) -> str:
        return self.spec.name

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the payload of ``numel`` elements."""
        return self.spec.payload_bytes(numel, self.chunk)  # codec_chunk(self.chunk) is self.chunk

    def _check(self, values: tuple[torch.Tensor, ...], payload: torch.Tensor) -> None:
        numel = values[0].numel()
        assert all(v.dtype == torch.float32 and v.is_contiguous() and v.numel() == numel for v in values), \
            "codecs take contiguous fp32 pieces of equal length"
        assert payload.dtype == torch.uint8 and payload.numel() == self.payload_bytes(numel), \
            f"{self.name}: a payload of {payload.numel()} bytes for {numel} elements, needs {self.payload_bytes(numel)}"

    def _numba(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and self.spec.family in _NUMBA

    def encode(self, grad: torch.Tensor, residual: torch.Tensor, payload: torch.Tensor) -> None:
        """``payload`` := the code of ``grad + residual``; ``residual`` := what the code leaves out."""
        self._check((grad, residual), payload)
        if grad.numel() == 0:
            return
        if not self._numba(grad):
            torch_codecs.encode(self.spec, grad, residual, payload, chunk=self.chunk)
            return
        from luwu_rt.compress import _numba as nb

        g, e, family = _np(grad, np.float32), _np(residual, np.float32), self.spec.family
        if family in ("bf16", "fp16"):
            payload[2 * grad.numel() :].zero_()  # an odd count's padding: the same bytes everywhere
            getattr(nb, f"{family}_encode")(g, e, _np(payload, np.uint16))
        elif family == "onebit":
            nb.onebit_encode(g, e, _np(payload, np.uint32), self.chunk)
        else:
            nb.topk_encode(g, e, _np(payload, np.uint32), self.chunk, *self._topk(grad.numel()))

    def decode(self, payload: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False) -> None:
        """``out`` := (or ``+=`` with ``accumulate``) the values ``payload`` holds."""
        self._check((out,), payload)
        if out.numel() == 0:
            return
        if not self._numba(out):
            torch_codecs.decode(self.spec, payload, out, chunk=self.chunk, accumulate=accumulate)
            return
        from luwu_rt.compress import _numba as nb

        o, family = _np(out, np.float32), self.spec.family
        if family in ("bf16", "fp16"):
            getattr(nb, f"{family}_decode")(_np(payload, np.uint16), o, accumulate)
        elif family == "onebit":
            nb.onebit_decode(_np(payload, np.uint32), o, self.chunk, accumulate)
        else:
            nb.topk_decode(_np(payload, np.uint32), o, self.chunk, *self._topk(out.numel()), accumulate)

    def _topk(self, numel: int) -> tuple[int, int]:
        """Values kept of a full chunk and of the piece's last chunk."""
        return self.spec.topk_count(self.chunk), self.spec.topk_count(numel % self.chunk or self.chunk)


@functools.cache
def codec_for(name: str, *, chunk_numel: int) -> Codec:
    """The ``Codec`` of ``name`` (``plan.codec.parse_codec``'s names) on chunks of ``chunk_numel`` elements."""
    return Codec(parse_codec(name), chunk_numel=chunk_numel)
