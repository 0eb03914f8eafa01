"""The codecs in plain torch: the definition the Numba kernels are tested against, the path of tensors on a
GPU (the same code, run by torch's CUDA kernels), and powersgd everywhere (its work is matrix products,
which torch's BLAS does best).

Each function takes one piece: ``grad`` and ``residual`` (fp32, contiguous, equal length m), a ``payload``
of ``spec.payload_bytes(m, chunk)`` bytes, and the codec chunk in elements; full chunks are processed as
one batch, the shorter last chunk on its own ([Note: codecs on the wire] in plan/codec.py).
"""

from __future__ import annotations

import torch

from luwu_rt.plan.codec import CodecSpec

__all__ = ["decode", "encode"]


def _finite(r: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(r), r, torch.zeros((), dtype=r.dtype, device=r.device))


def _groups(m: int, chunk: int) -> list[tuple[int, int, int]]:
    """``(first element, chunks, elements per chunk)`` of the full chunks and of a shorter last one."""
    full, rest = divmod(m, chunk)
    out = [(0, full, chunk)] if full else []
    return out + ([(full * chunk, 1, rest)] if rest else [])


def encode(spec: CodecSpec, grad: torch.Tensor, residual: torch.Tensor, payload: torch.Tensor, *, chunk: int) -> None:
    """Encodes ``grad + residual`` into ``payload`` and leaves the error in ``residual``."""
    x = residual.add_(grad)
    if spec.family in ("bf16", "fp16"):
        payload[2 * x.numel() :].zero_()  # an odd count's padding
        low = payload.view(_HALF[spec.family])[: x.numel()]
        low.copy_(x)
        x.copy_(_finite(x - low.float()))
        return
    offset = 0
    for first, count, n in _groups(x.numel(), chunk):
        size = spec.chunk_bytes(n)
        xs = x[first : first + count * n].view(count, n)
        part = payload[offset : offset + count * size].view(count, size)
        xs.copy_(_ENCODE[spec.family](spec, xs, part))
        offset += count * size


def decode(spec: CodecSpec, payload: torch.Tensor, out: torch.Tensor, *, chunk: int, accumulate: bool) -> None:
    """``out`` (+)= the values ``payload`` holds for ``out.numel()`` elements."""
    if spec.family in ("bf16", "fp16"):
        values = payload.view(_HALF[spec.family])[: out.numel()].float()
        out.add_(values) if accumulate else out.copy_(values)
        return
    offset = 0
    for first, count, n in _groups(out.numel(), chunk):
        size = spec.chunk_bytes(n)
        values = _DECODE[spec.family](spec, payload[offset : offset + count * size].view(count, size), n)
        target = out[first : first + count * n].view(count, n)
        target.add_(values) if accumulate else target.copy_(values)
        offset += count * size


_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


# -- per family, a batch of equal chunks (count x n) -> the residual it leaves ------------------------------

def _onebit_encode(spec: CodecSpec, x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    count, n = x.shape
    scale = (x.abs().sum(dim=1, dtype=torch.float64) / n).float()
    positive = x >= 0
    words = -(-n // 32)
    bits = torch.zeros(count, words * 32, dtype=torch.int64, device=x.device)
    bits[:, :n] = positive.long()
    shifts = torch.arange(32, device=x.device, dtype=torch.int64)
    packed = (bits.view(count, words, 32) << shifts).sum(dim=2)  # < 2**32: wraps into int32 as uint32 bits
    body = part.view(torch.int32)
    body[:, 0] = scale.view(torch.int32)
    body[:, 1:] = packed.to(torch.int32)
    return _finite(torch.where(positive, x - scale[:, None], x + scale[:, None]))


def _onebit_decode(spec: CodecSpec, part: torch.Tensor, n: int) -> torch.Tensor:
    count = part.shape[0]
    scale = part.view(torch.float32)[:, :1]
    words = part.view(torch.int32)[:, 1:].long() & 0xFFFFFFFF
    shifts = torch.arange(32, device=part.device, dtype=torch.int64)
    bits = ((words[:, :, None] >> shifts) & 1).view(count, -1)[:, :n]
    return torch.where(bits.bool(), scale, -scale)


def _topk_encode(spec: CodecSpec, x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    k = spec.topk_count(x.shape[1])
    order = torch.sort(-x.abs(), dim=1, stable=True).indices[:, :k]  # ties: the lowest index first
    index = torch.sort(order, dim=1).values
    part.view(torch.int32)[:, :k] = index.to(torch.int32)
    part.view(torch.float32)[:, k:] = torch.gather(x, 1, index)
    return _finite(x.scatter(1, index, 0.0))


def _topk_decode(spec: CodecSpec, part: torch.Tensor, n: int) -> torch.Tensor:
    k = spec.topk_count(n)
    out = torch.zeros(part.shape[0], n, dtype=torch.float32, device=part.device)
    return out.scatter_add_(1, part.view(torch.int32)[:, :k].long(), part.view(torch.float32)[:, k:])


def _start(x: torch.Tensor, cols: int, q: int) -> torch.Tensor:
    """powersgd's start Q0 (cols x q) for the chunks ``x``: drawn afresh from a seed that is the exact integer
    sum of their bits, so that every rank and a single process draw the same one for the same values, and a
    direction that one draw misses (a residual whose rows are orthogonal to Q0, which a fixed Q0 would never
    send) is not missed at the next (PowerSGD proper warm-starts Q from the last step's, which is state)."""
    seed = int(x.view(torch.int32).sum(dtype=torch.int64)) % (1 << 62) + cols * 1009 + q
    return torch.randn(cols, q, generator=torch.Generator().manual_seed(seed)).to(x.device)


def _powersgd_encode(spec: CodecSpec, x: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    count, n = x.shape
    rows, cols, q = spec.matrix(n)
    matrix = torch.zeros(count, rows * cols, dtype=torch.float32, device=x.device)
    matrix[:, :n] = x
    matrix = matrix.view(count, rows, cols)
    p = torch.linalg.qr(matrix @ _start(x, cols, q)).Q  # orthonormal columns spanning M Q0
    factors = part.view(torch.float32).view(count, rows + cols, q)
    factors[:, :rows] = p
    factors[:, rows:] = matrix.transpose(1, 2) @ p
    return _finite(x - _powersgd_decode(spec, part, n))


def _powersgd_decode(spec: CodecSpec, part: torch.Tensor, n: int) -> torch.Tensor:
    rows, cols, q = spec.matrix(n)
    factors = part.view(torch.float32).view(part.shape[0], rows + cols, q)
    return (factors[:, :rows] @ factors[:, rows:].transpose(1, 2)).reshape(part.shape[0], -1)[:, :n]


_ENCODE = {"onebit": _onebit_encode, "topk": _topk_encode, "powersgd": _powersgd_encode}
_DECODE = {"onebit": _onebit_decode, "topk": _topk_decode, "powersgd": _powersgd_decode}
