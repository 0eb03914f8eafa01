"""Page-aligned host buffers for O_DIRECT IO."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

__all__ = ["PAGE_BYTES", "aligned_empty"]

PAGE_BYTES = 4096
"""Alignment of every buffer from :func:`aligned_empty` (and of O_DIRECT IO)."""

_log = logging.getLogger(__name__)


def _num_elements(nbytes_or_shape: int | Sequence[int], itemsize: int) -> tuple[tuple[int, ...], int]:
    if isinstance(nbytes_or_shape, int):
        if nbytes_or_shape < 0:
            raise ValueError(f"aligned_empty: nbytes must be >= 0, got {nbytes_or_shape}")
        if nbytes_or_shape % itemsize:
            raise ValueError(
                f"aligned_empty: {nbytes_or_shape} bytes is not a whole number of {itemsize}-byte elements; "
                "pass a shape instead"
            )
        count = nbytes_or_shape // itemsize
        return (count,), count
    shape = tuple(int(d) for d in nbytes_or_shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"aligned_empty: shape {shape} has a negative dimension")
    return shape, math.prod(shape)


def _pin_for_cuda(owner: object, address: int, nbytes: int) -> None:
    """Registers the memory with CUDA (page-locked, DMA-able) and unregisters it
    just before the memory is unmapped."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(address, nbytes, 0)
    if int(err) != 0:
        # Unregistered memory still works; copies to the GPU are just staged.
        _log.warning("cudaHostRegister of %d bytes failed (error %s); buffer stays pageable", nbytes, err)
        return
    owner.set_release_hook(lambda: cudart.cudaHostUnregister(address))


def aligned_empty(
    nbytes_or_shape: int | Sequence[int],
    *,
    dtype: torch.dtype = torch.uint8,
    lock: bool = True,
    huge_pages: bool = True,
) -> torch.Tensor:
    """A zero-filled CPU tensor over page-aligned memory, for O_DIRECT IO.

    ``nbytes_or_shape`` is a byte count (giving a 1-D tensor) or a shape.
    The memory is mlocked when ``lock`` and RLIMIT_MEMLOCK allow, placed on
    2 MiB huge pages when ``huge_pages`` and the buffer is at least 2 MiB
    (fewer, larger DMA segments per IO; see csrc/io/aligned_buffer.cpp), and
    registered as pinned memory when CUDA is available. It is freed when the
    last tensor or view over it dies.
    """
    from luwu_rt import _C

    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"aligned_empty: dtype must be a torch.dtype, got {dtype!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape, count = _num_elements(nbytes_or_shape, itemsize)
    nbytes = count * itemsize
    owner = _C.AlignedBuffer(nbytes, lock=lock, huge_pages=huge_pages)
    if nbytes > 0 and torch.cuda.is_available():
        _pin_for_cuda(owner, owner.address, nbytes)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # frombuffer keeps `owner` alive for as long as the tensor's storage lives.
    flat = torch.frombuffer(owner, dtype=torch.uint8)
    return flat.view(dtype).view(shape)
