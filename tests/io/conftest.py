"""Shared fixtures of the IO engine tests."""

from __future__ import annotations

import pytest
import torch

from luwu_rt.io import IOEngine, aligned_empty

BACKENDS = ("io_uring", "threads")


@pytest.fixture(params=BACKENDS)
def engine(request):
    """An engine of each backend; small blocks so a few MiB already spans many pieces."""
    with IOEngine(backend=request.param, queue_depth=8, block_bytes=256 << 10) as e:
        assert e.backend == request.param
        yield e


def _random_bytes(nbytes: int, *, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = aligned_empty(nbytes)
    out.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    return out


@pytest.fixture
def random_bytes():
    """``random_bytes(nbytes, seed=...)``: a deterministic payload in an aligned buffer."""
    return _random_bytes
