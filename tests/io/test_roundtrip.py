"""Data written and read by the engine matches plain Python file IO."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from luwu_rt.io import PAGE_BYTES, IOEngine, aligned_empty

SIZES = (0, 1, 4095, 4096, (1 << 20) + 3, 64 << 20)
OFFSETS = (0, 2 * PAGE_BYTES, PAGE_BYTES + 1)  # aligned, aligned, unaligned


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("nbytes", SIZES)
def test_write_then_read(engine, tmp_path, nbytes, offset, random_bytes):
    path = tmp_path / "data.bin"
    data = random_bytes(nbytes, seed=nbytes + offset)
    engine.write(path, offset=offset, buffer=data)
    raw = path.read_bytes() if path.exists() else b""
    assert raw[offset:] == data.numpy().tobytes()  # reference: the file as Python reads it
    assert raw[:offset] == bytes(len(raw[:offset]))  # the hole before the offset stays zero
    back = aligned_empty(nbytes)
    engine.read(path, offset=offset, buffer=back)
    assert torch.equal(back, data)


@pytest.mark.parametrize("shift", (1, 100, PAGE_BYTES - 1))
def test_unaligned_buffer_address(engine, tmp_path, shift, random_bytes):
    """A buffer whose address is not page-aligned (a view into a larger one)."""
    nbytes = (1 << 20) + 5
    path = tmp_path / "data.bin"
    host = aligned_empty(nbytes + shift)
    data = random_bytes(nbytes, seed=shift)
    host[shift:].copy_(data)
    engine.write(path, offset=3 * PAGE_BYTES, buffer=host[shift:])
    assert path.read_bytes()[3 * PAGE_BYTES :] == data.numpy().tobytes()
    other = aligned_empty(nbytes + shift)
    engine.read(path, offset=3 * PAGE_BYTES, buffer=other[shift:])
    assert torch.equal(other[shift:], data)


def test_typed_buffers(engine, tmp_path):
    """Any numeric dtype is raw bytes to the engine."""
    path = tmp_path / "typed.bin"
    data = torch.randn(3, 1000, dtype=torch.float32)
    engine.write(path, offset=0, buffer=data)
    back = aligned_empty((3, 1000), dtype=torch.float32)
    engine.read(path, offset=0, buffer=back)
    assert torch.equal(back, data)
    halves = torch.empty(6000, dtype=torch.bfloat16)
    engine.read(path, offset=0, buffer=halves)
    assert torch.equal(halves.view(torch.float32).view(3, 1000), data)


def test_hundreds_of_concurrent_tickets(engine, tmp_path, random_bytes):
    """Many requests in flight at once, waited for in random order."""
    num_requests, nbytes = 300, 20_000  # unaligned size: every request has head/tail pieces
    path = tmp_path / "many.bin"
    data = random_bytes(num_requests * nbytes, seed=7)
    writes = [engine.submit_write(path, offset=i * nbytes, buffer=data[i * nbytes : (i + 1) * nbytes])
              for i in range(num_requests)]
    order = list(range(num_requests))
    random.Random(0).shuffle(order)
    for i in order:
        engine.wait(writes[i])
    assert path.read_bytes() == data.numpy().tobytes()
    back = aligned_empty(num_requests * nbytes)
    reads = [engine.submit_read(path, offset=i * nbytes, buffer=back[i * nbytes : (i + 1) * nbytes])
             for i in range(num_requests)]
    assert engine.num_pending == num_requests
    engine.wait_all()
    assert engine.num_pending == 0 and all(engine.done(t) for t in reads)
    assert torch.equal(back, data)


def test_reads_and_writes_in_flight_together(engine, tmp_path, random_bytes):
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    data = random_bytes(8 << 20, seed=3)
    src.write_bytes(data.numpy().tobytes())
    back = aligned_empty(8 << 20)
    tickets = [engine.submit_read(src, offset=0, buffer=back), engine.submit_write(dst, offset=0, buffer=data)]
    for t in reversed(tickets):
        engine.wait(t)
    assert torch.equal(back, data)
    assert dst.read_bytes() == data.numpy().tobytes()


def test_durable_writes(engine, tmp_path, random_bytes):
    path = tmp_path / "durable.bin"
    data = random_bytes(3 * PAGE_BYTES + 17, seed=1)
    engine.write(path, offset=0, buffer=data, durable=True)
    engine.write(path, offset=0, buffer=aligned_empty(0), durable=True)  # a bare fdatasync
    assert path.read_bytes() == data.numpy().tobytes()


def test_writes_never_truncate(engine, tmp_path):
    path = tmp_path / "keep.bin"
    path.write_bytes(b"x" * 10_000)
    engine.write(path, offset=100, buffer=torch.zeros(10, dtype=torch.uint8))
    assert path.read_bytes() == b"x" * 100 + bytes(10) + b"x" * 9_890


@pytest.mark.parametrize("direct", (False, True))
def test_caller_owned_descriptor(engine, tmp_path, direct, random_bytes):
    path = tmp_path / "fd.bin"
    data = random_bytes(PAGE_BYTES * 5 + 11, seed=5)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o644)
    try:
        engine.write(fd, offset=PAGE_BYTES - 3, buffer=data)  # unaligned head and tail
        back = aligned_empty(data.numel())
        engine.read(fd, offset=PAGE_BYTES - 3, buffer=back)
        assert torch.equal(back, data)
        os.fstat(fd)  # still open: the engine never closes a caller's descriptor
    finally:
        os.close(fd)
    assert path.read_bytes()[PAGE_BYTES - 3 :] == data.numpy().tobytes()


def test_replaced_file_is_reopened(engine, tmp_path):
    """The descriptor cache notices a path that now names another file (atomic rename)."""
    path, tmp = tmp_path / "f.bin", tmp_path / "f.tmp"
    path.write_bytes(b"a" * PAGE_BYTES)
    back = aligned_empty(PAGE_BYTES)
    engine.read(path, offset=0, buffer=back)
    tmp.write_bytes(b"b" * PAGE_BYTES)
    os.replace(tmp, path)
    engine.read(path, offset=0, buffer=back)
    assert back.numpy().tobytes() == b"b" * PAGE_BYTES


def test_tickets_are_per_request(tmp_path, random_bytes):
    """Waiting on one ticket does not consume the others; a ticket is waited for once."""
    with IOEngine(backend="threads", queue_depth=2, block_bytes=PAGE_BYTES) as engine:
        a = engine.submit_write(tmp_path / "a", offset=0, buffer=random_bytes(64 << 10, seed=1))
        b = engine.submit_write(tmp_path / "b", offset=0, buffer=random_bytes(64 << 10, seed=2))
        engine.wait(b)
        assert engine.num_pending == 1
        with pytest.raises(ValueError, match="not a pending ticket"):
            engine.wait(b)
        engine.wait(a)
        assert (tmp_path / "a").stat().st_size == 64 << 10


def test_many_threads_share_one_engine(engine, tmp_path, random_bytes):
    """Submitters and waiters on several threads at once (the GIL is released while waiting)."""
    from concurrent.futures import ThreadPoolExecutor

    data = random_bytes(300_001, seed=11)

    def worker(k: int) -> bool:
        path = tmp_path / f"t{k}.bin"
        ok = True
        for i in range(20):
            engine.write(path, offset=i * 1000 + k, buffer=data)
            back = aligned_empty(data.numel())
            engine.read(path, offset=i * 1000 + k, buffer=back)
            ok &= torch.equal(back, data)
        return ok

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert all(pool.map(worker, range(4)))


def test_a_late_wait_returns_when_the_transfer_ended(engine, tmp_path, random_bytes):
    """[Note: when a transfer ended] (csrc/io/engine.cpp): the time a transfer ended, on perf_counter's clock,
    not the time its waiter came."""
    data = random_bytes(1 << 20)
    for submit in (lambda: engine.submit_write(tmp_path / "f", offset=0, buffer=data),
                   lambda: engine.submit_read(tmp_path / "f", offset=0, buffer=data)):
        submitted = time.perf_counter()
        ticket = submit()
        while not engine.done(ticket):
            time.sleep(0.001)
        time.sleep(0.2)
        waited = time.perf_counter()
        ended = engine.wait(ticket)
        assert submitted <= ended <= waited - 0.15, (submitted, ended, waited)
