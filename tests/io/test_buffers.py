"""aligned_empty: alignment, shapes, lifetime and CUDA registration."""

from __future__ import annotations

import gc

import pytest
import torch

from luwu_rt import _C
from luwu_rt.io import PAGE_BYTES, aligned_empty


@pytest.mark.parametrize("spec, dtype, shape", [
    (1, torch.uint8, (1,)),
    ((1 << 20) + 3, torch.uint8, ((1 << 20) + 3,)),
    (64, torch.float32, (16,)),
    ((3, 5, 7), torch.bfloat16, (3, 5, 7)),
    ((), torch.float64, ()),
])
def test_shape_dtype_alignment(spec, dtype, shape):
    t = aligned_empty(spec, dtype=dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % PAGE_BYTES == 0
    t.fill_(1)  # writable
    assert bool((t == 1).all())


@pytest.mark.parametrize("huge_pages", (True, False))
def test_large_buffers(huge_pages):
    nbytes = (4 << 20) + PAGE_BYTES
    t = aligned_empty(nbytes, huge_pages=huge_pages)
    assert t.numel() == nbytes and t.data_ptr() % PAGE_BYTES == 0
    if huge_pages:
        assert t.data_ptr() % (2 << 20) == 0  # huge-page boundary
    assert int(t.sum()) == 0  # zero-filled, every page mapped
    t[-1] = 5
    assert int(t.sum()) == 5


def test_empty_sizes():
    assert aligned_empty(0).numel() == 0
    assert aligned_empty((4, 0), dtype=torch.float32).shape == (4, 0)


def test_bad_requests():
    with pytest.raises(ValueError, match="whole number"):
        aligned_empty(6, dtype=torch.float32)
    with pytest.raises(ValueError, match=">= 0"):
        aligned_empty(-1)
    with pytest.raises(ValueError, match="negative"):
        aligned_empty((2, -1))
    with pytest.raises(ValueError, match="dtype"):
        aligned_empty(8, dtype="float32")


def test_native_buffer_is_released_with_its_last_view():
    """The memory lives exactly as long as some tensor views it."""
    released = []
    owner = _C.AlignedBuffer(PAGE_BYTES * 3, lock=True, huge_pages=False)
    owner.set_release_hook(lambda: released.append(True))
    t = torch.frombuffer(owner, dtype=torch.uint8)
    assert t.data_ptr() == owner.address and owner.nbytes == PAGE_BYTES * 3
    view = t[100:200]
    del owner, t
    gc.collect()
    assert released == []
    view.fill_(3)
    del view
    gc.collect()
    assert released == [True]


class _FakeCudart:
    """Records host registrations the way torch.cuda.cudart() would perform them."""

    def __init__(self):
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, address, nbytes, flags):
        assert address % PAGE_BYTES == 0 and flags == 0
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address):
        del self.registered[address]
        return 0


def test_pinned_with_cuda_and_unpinned_when_freed(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    t = aligned_empty((256, 64), dtype=torch.float32)
    assert fake.registered == {t.data_ptr(): 256 * 64 * 4}
    del t
    gc.collect()
    assert fake.registered == {}


def test_no_cuda_calls_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: pytest.fail("cudart used without CUDA"))
    aligned_empty(PAGE_BYTES)
