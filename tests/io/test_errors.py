"""Every failure is an OSError(errno, message, path) or a ValueError, never a crash."""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import luwu_rt.io.engine as engine_module
from luwu_rt.io import PAGE_BYTES, IOEngine, aligned_empty


def test_read_past_end_of_file(engine, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"z" * 5000)
    for offset, nbytes in ((0, 8192), (4096, 4096), (10_000, 10), (1, 5000)):
        with pytest.raises(OSError) as info:
            engine.read(path, offset=offset, buffer=aligned_empty(nbytes))
        assert info.value.errno == errno.ENODATA
        assert "end of file" in info.value.strerror and info.value.filename == str(path)
    back = aligned_empty(5000)
    engine.read(path, offset=0, buffer=back)  # exactly up to the end is fine
    assert back.numpy().tobytes() == b"z" * 5000


def test_missing_file_and_directory(engine, tmp_path):
    missing = tmp_path / "no-such-dir" / "f.bin"
    with pytest.raises(OSError) as info:
        engine.submit_write(missing, offset=0, buffer=aligned_empty(PAGE_BYTES))
    assert info.value.errno == errno.ENOENT and info.value.filename == str(missing)
    with pytest.raises(OSError) as info:
        engine.read(tmp_path / "absent.bin", offset=0, buffer=aligned_empty(10))
    assert info.value.errno == errno.ENOENT
    assert engine.num_pending == 0


def test_path_is_a_directory(engine, tmp_path):
    for submit in (engine.submit_read, engine.submit_write):
        with pytest.raises(OSError) as info:
            submit(tmp_path, offset=0, buffer=aligned_empty(PAGE_BYTES))
        assert info.value.errno == errno.EISDIR and info.value.filename == str(tmp_path)


def test_bad_descriptor(engine):
    with pytest.raises(OSError) as info:
        engine.read(987654, offset=0, buffer=aligned_empty(10))
    assert info.value.errno == errno.EBADF and info.value.filename == "<fd 987654>"


def test_descriptor_with_wrong_access_mode(engine, tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"1" * 100)
    with open(path, "rb") as f, pytest.raises(OSError) as info:
        engine.write(f.fileno(), offset=0, buffer=aligned_empty(10))
    assert info.value.errno == errno.EBADF


_EFBIG_CHILD = textwrap.dedent(
    """
    import resource, signal, sys
    from luwu_rt.io import IOEngine, aligned_empty
    path, backend, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so the kernel answers EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    with IOEngine(backend=backend, queue_depth=4, block_bytes=64 << 10) as engine:
        second = aligned_empty(limit)
        second.fill_(9)
        try:
            engine.write(path, offset=limit // 2, buffer=second)
        except OSError as exc:
            print(exc.errno, exc.filename == path, flush=True)
            sys.exit(0)
    print("no error", flush=True)
    """
)


@pytest.mark.parametrize("preexisting", (False, True), ids=("extending", "overwriting"))
@pytest.mark.parametrize("backend", ("io_uring", "threads"))
def test_write_failing_part_way_keeps_earlier_data(tmp_path, backend, preexisting):
    """RLIMIT_FSIZE in a child process makes the kernel refuse bytes past the limit with EFBIG.

    Extending a file fails before any byte moves (the engine grows files up
    front); overwriting an already larger file fails in the middle of the
    request, after the pieces below the limit were written."""
    path, limit = tmp_path / "limited.bin", 1 << 20
    half = limit // 2
    path.write_bytes(bytes([7]) * (2 * limit if preexisting else half))
    child = subprocess.run(
        [sys.executable, "-c", _EFBIG_CHILD, str(path), backend, str(limit)],
        capture_output=True, text=True, timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == [str(errno.EFBIG), "True"]
    data = path.read_bytes()
    assert data[:half] == bytes([7]) * half  # earlier data intact
    if preexisting:
        assert data[half:limit] == bytes([9]) * half  # the pieces below the limit landed
        assert data[limit:] == bytes([7]) * limit
    else:
        assert len(data) == half  # nothing written, the file not grown


def _check_rejected(engine, path, buffer, match):
    for submit in (engine.submit_read, engine.submit_write):
        with pytest.raises(ValueError, match=match):
            submit(path, offset=0, buffer=buffer)
    assert engine.num_pending == 0


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")
def test_bad_buffers(engine, tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(bytes(PAGE_BYTES * 4))
    _check_rejected(engine, path, torch.zeros(16, dtype=torch.bool), "dtype")
    _check_rejected(engine, path, torch.quantize_per_tensor(torch.zeros(16), 1.0, 0, torch.quint8), "dtype")
    _check_rejected(engine, path, torch.empty(16, device="meta"), "device")
    _check_rejected(engine, path, torch.zeros(16, 16)[:, 0], "contiguous")
    _check_rejected(engine, path, torch.zeros(4, 4).to_sparse(), "layout")
    _check_rejected(engine, path, bytearray(16), "torch.Tensor")


def test_bad_arguments(engine, tmp_path):
    buf = aligned_empty(16)
    with pytest.raises(ValueError, match="offset"):
        engine.submit_write(tmp_path / "f", offset=-1, buffer=buf)
    with pytest.raises(ValueError, match="path_or_fd"):
        engine.submit_write(3.5, offset=0, buffer=buf)
    for kwargs in ({"backend": "aio"}, {"queue_depth": 0}, {"block_bytes": 1000}, {"num_threads": 0}):
        with pytest.raises(ValueError):
            IOEngine(**kwargs)


def test_auto_falls_back_to_threads(monkeypatch, caplog):
    """Where io_uring_setup is refused (EPERM under seccomp), "auto" logs why and uses threads."""
    from luwu_rt import _C

    real = _C.IOEngine

    def refuse_io_uring(*, backend, **kwargs):
        if backend == "io_uring":
            raise OSError(errno.EPERM, "io_uring setup failed: Operation not permitted")
        return real(backend=backend, **kwargs)

    monkeypatch.setattr(_C, "IOEngine", refuse_io_uring)
    with caplog.at_level(logging.WARNING, logger=engine_module.__name__):
        with IOEngine(backend="auto") as engine:
            assert engine.backend == "threads"
    assert "io_uring unavailable" in caplog.text and "not permitted" in caplog.text


def test_auto_prefers_io_uring_when_available():
    try:
        IOEngine(backend="io_uring").close()
        expected = "io_uring"
    except OSError:
        expected = "threads"
    with IOEngine() as engine:
        assert engine.backend == expected


def test_closed_engine(tmp_path):
    engine = IOEngine(backend="threads")
    ticket = engine.submit_write(tmp_path / "f", offset=0, buffer=aligned_empty(PAGE_BYTES))
    engine.close()  # waits for the pending write first
    engine.close()
    assert (tmp_path / "f").stat().st_size == PAGE_BYTES
    with pytest.raises(ValueError, match="IOEngine is closed"):
        engine.wait(ticket)
    with pytest.raises(ValueError, match="IOEngine is closed"):
        engine.submit_read(tmp_path / "f", offset=0, buffer=aligned_empty(PAGE_BYTES))
