"""Asynchronous file IO between host tensors and files (see DESIGN.md, csrc/io/)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from luwu_rt.io.buffers import PAGE_BYTES

__all__ = ["BACKENDS", "BLOCK_BYTES", "IOEngine", "IOTicket", "QUEUE_DEPTH", "rank_queue_depth"]

BACKENDS = ("auto", "io_uring", "threads")
"""Accepted values of ``IOEngine(backend=...)``."""

_MAX_BLOCK_BYTES = 1 << 30  # one io_uring SQE carries a 32-bit length
_NUM_CACHED_FILES = 128
QUEUE_DEPTH = 64
"""Pieces in flight per direction by default. An AdamW step of 256M parameters with its state on NVMe
(``luwu bench offload-step``, 2 GiB host budget) took 0.88x the time at 64 that it took at 32, 7 of 8
interleaved pairs faster (benchmarks/results/2026-12-06-queue-depth.md)."""
BLOCK_BYTES = 1 << 20
"""Bytes per piece by default."""


def rank_queue_depth(local_ranks: int) -> int:
    """[Note: ranks share the disk's queue]
    Pieces in flight per direction for each of ``local_ranks`` ranks whose NVMe tiers share one disk (one
    ``--nvme-dir``): ``QUEUE_DEPTH`` for the machine, divided among them, so the disk sees the depth one process
    was tuned to. Two ranks at 64 each kept 128 MiB of writes queued ahead of the next step's first reads:
    gpt-small zero3 x2 with its state on NVMe at batch 1 x 64 (``luwu bench e2e``) waited 43 ms at each step's
    start for 1 MB of parameters, and stepped in 0.528-0.535 s against 0.453-0.479 s at 8, 16 or 32 each (three
    interleaved pairs each way, 2 cores, virtio disk). Two processes each writing 240 MB and then reading 60 MB
    behind the writes saw the reads end after 51-68 ms at 32 or 64 each and 24-38 ms at 16."""
    return max(1, QUEUE_DEPTH // max(1, local_ranks))
# Raw bytes are read into these; reading arbitrary bytes into bool or
# quantized tensors would create invalid values.
_REJECTED_DTYPES = frozenset({torch.bool, torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})

_log = logging.getLogger(__name__)

PathOrFd = str | os.PathLike | int


_PERF_MINUS_STEADY = time.perf_counter() - time.monotonic()
"""The engine stamps completions on C++'s steady clock, which is ``time.monotonic``'s (CLOCK_MONOTONIC on Linux,
as is ``perf_counter``: 0 there, give or take the microsecond between the two reads)."""


@dataclass(kw_only=True, slots=True, eq=False)
class IOTicket:
    """Handle of one submitted request; pass it to :meth:`IOEngine.wait`."""

    id: int
    """Engine-internal request number."""
    op: str
    """``"read"`` or ``"write"``."""
    path: str
    """The file, or ``"<fd N>"`` for a caller's descriptor."""
    offset: int
    """File offset of the request."""
    nbytes: int
    """Size of the request."""
    buffer: torch.Tensor = field(repr=False)
    """Kept referenced until the request completes, so its memory cannot be freed under the IO."""


def _check_buffer(buffer: object, what: str) -> torch.Tensor:
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"{what}: buffer must be a torch.Tensor (e.g. from luwu_rt.io.aligned_empty), "
                         f"got {type(buffer).__name__}")
    if buffer.device.type != "cpu":
        raise ValueError(f"{what}: buffer must live in host memory, got device {buffer.device}; "
                         "use a pinned CPU tensor and copy")
    if buffer.layout != torch.strided:
        raise ValueError(f"{what}: buffer must be a dense (strided) tensor, got layout {buffer.layout}")
    if not buffer.is_contiguous():
        raise ValueError(f"{what}: buffer must be contiguous; call .contiguous() or read into a contiguous tensor")
    if buffer.dtype in _REJECTED_DTYPES:
        raise ValueError(f"{what}: buffer dtype {buffer.dtype} cannot hold raw file bytes; "
                         "use torch.uint8 or a numeric dtype")
    return buffer


def _check_offset(offset: object, what: str) -> int:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{what}: offset must be an int >= 0, got {offset!r}")
    return offset


class IOEngine:
    """Asynchronous reads and writes between CPU tensors and files.

    Requests are split into ``block_bytes`` pieces kept in flight up to
    ``queue_depth`` per direction (reads and writes have separate queues).
    Aligned pieces use O_DIRECT; unaligned heads, tails and buffers go through
    the page cache, so any offset and size works. Files named by path are
    opened by the engine (created for writing, never truncated) and their
    descriptors cached; an int is a descriptor the caller owns.

    ``backend``: ``"io_uring"``, ``"threads"`` (pread/pwrite pool of
    ``num_threads`` per direction, default ``min(queue_depth, 8)``), or
    ``"auto"``: io_uring, falling back to threads when the kernel or a
    container forbids it. Every failure raises ``OSError(errno, message, path)``
    from :meth:`wait` (or from submit, when the file cannot be opened).
    """

    def __init__(
        self,
        *,
        backend: str = "auto",
        queue_depth: int = QUEUE_DEPTH,
        block_bytes: int = BLOCK_BYTES,
        num_threads: int | None = None,
    ) -> None:
        from luwu_rt import _C

        if backend not in BACKENDS:
            raise ValueError(f"IOEngine: backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(queue_depth, int) or not 1 <= queue_depth <= 4096:
            raise ValueError(f"IOEngine: queue_depth must be an int in [1, 4096], got {queue_depth!r}")
        if (not isinstance(block_bytes, int) or block_bytes < PAGE_BYTES or block_bytes % PAGE_BYTES
                or block_bytes > _MAX_BLOCK_BYTES):
            raise ValueError(
                f"IOEngine: block_bytes must be a multiple of {PAGE_BYTES} in [{PAGE_BYTES}, {_MAX_BLOCK_BYTES}], "
                f"got {block_bytes!r}"
            )
        if num_threads is None:
            num_threads = min(queue_depth, 8)
        if not isinstance(num_threads, int) or not 1 <= num_threads <= 1024:
            raise ValueError(f"IOEngine: num_threads must be an int in [1, 1024] or None, got {num_threads!r}")
        self.queue_depth = queue_depth
        self.block_bytes = block_bytes
        self.num_threads = num_threads
        kwargs = dict(queue_depth=queue_depth, block_bytes=block_bytes, num_threads=num_threads,
                      num_cached_files=_NUM_CACHED_FILES)
        self._tickets: dict[int, IOTicket] = {}
        self._impl = self._open(_C, backend, kwargs)

    @staticmethod
    def _open(native, backend: str, kwargs: dict):
        if backend != "auto":
            return native.IOEngine(backend=backend, **kwargs)
        try:
            return native.IOEngine(backend="io_uring", **kwargs)
        except OSError as exc:
            # Containers often block io_uring with seccomp (EPERM) and old
            # kernels lack it (ENOSYS); the thread pool works everywhere.
            _log.warning("io_uring unavailable (%s); using the thread-pool backend", exc)
            return native.IOEngine(backend="threads", **kwargs)

    def _native(self):
        if self._impl is None:
            raise ValueError("IOEngine is closed")
        return self._impl

    @property
    def backend(self) -> str:
        """The active backend: ``"io_uring"`` or ``"threads"``."""
        return self._native().backend

    def submit_read(self, path_or_fd: PathOrFd, *, offset: int, buffer: torch.Tensor) -> IOTicket:
        """Starts reading ``buffer.nbytes`` bytes at ``offset`` into ``buffer``.
        Reading past the end of the file fails with ``OSError(ENODATA)``."""
        return self._submit("read", path_or_fd, offset, buffer, False)

    def submit_write(
        self, path_or_fd: PathOrFd, *, offset: int, buffer: torch.Tensor, durable: bool = False
    ) -> IOTicket:
        """Starts writing ``buffer`` at ``offset``; ``durable`` adds an fdatasync
        before the ticket completes. Do not modify ``buffer`` until then."""
        return self._submit("write", path_or_fd, offset, buffer, durable)

    def _submit(self, op: str, path_or_fd: PathOrFd, offset: int, buffer: torch.Tensor, durable: bool) -> IOTicket:
        from luwu_rt import _C

        what = f"submit_{op}"
        buffer = _check_buffer(buffer, what)
        offset = _check_offset(offset, what)
        if isinstance(path_or_fd, bool) or not isinstance(path_or_fd, (int, str, os.PathLike)):
            raise ValueError(f"{what}: path_or_fd must be a path or an int descriptor, got {type(path_or_fd).__name__}")
        if isinstance(path_or_fd, int):
            fd, path, shown = path_or_fd, "", f"<fd {path_or_fd}>"
        else:
            fd, path = -1, os.fspath(path_or_fd)
            shown = path
        nbytes = buffer.numel() * buffer.element_size()
        native_op = _C.IOOp.READ if op == "read" else _C.IOOp.WRITE
        try:
            ticket_id = self._native().submit(
                op=native_op, path=path, fd=fd, buf=buffer.data_ptr(), offset=offset, nbytes=nbytes, durable=durable
            )
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, shown) from None
        ticket = IOTicket(id=ticket_id, op=op, path=shown, offset=offset, nbytes=nbytes, buffer=buffer)
        self._tickets[ticket_id] = ticket
        return ticket

    def wait(self, ticket: IOTicket) -> float:
        """Blocks until ``ticket`` completes (the GIL is released meanwhile) and returns when the transfer
        ended, on ``time.perf_counter``'s clock, however long before this call that was ([Note: when a transfer
        ended] in csrc/io/engine.cpp); raises ``OSError(errno, message, path)`` if it failed."""
        native = self._native()
        if not isinstance(ticket, IOTicket) or self._tickets.get(ticket.id) is not ticket:
            raise ValueError(f"wait: {ticket!r} is not a pending ticket of this engine (already waited for?)")
        err, msg, done_s = native.wait(ticket.id)
        if err == -1:  # another thread is waiting for it or already did
            raise ValueError(f"wait: {ticket!r} is already being waited for by another thread")
        self._tickets.pop(ticket.id, None)
        if err != 0:
            raise OSError(err, msg, ticket.path)
        return done_s + _PERF_MINUS_STEADY

    def done(self, ticket: IOTicket) -> bool:
        """True once ``ticket`` has completed (successfully or not); never blocks."""
        return self._native().done(ticket.id)

    def wait_all(self) -> None:
        """Waits for every pending ticket; raises the first failure after all have completed."""
        first: OSError | None = None
        for ticket in list(self._tickets.values()):
            try:
                self.wait(ticket)
            except OSError as exc:
                first = first or exc
        if first is not None:
            raise first

    def read(self, path_or_fd: PathOrFd, *, offset: int, buffer: torch.Tensor) -> None:
        """Synchronous :meth:`submit_read` + :meth:`wait`."""
        self.wait(self.submit_read(path_or_fd, offset=offset, buffer=buffer))

    def write(self, path_or_fd: PathOrFd, *, offset: int, buffer: torch.Tensor, durable: bool = False) -> None:
        """Synchronous :meth:`submit_write` + :meth:`wait`."""
        self.wait(self.submit_write(path_or_fd, offset=offset, buffer=buffer, durable=durable))

    def forget(self, path: str | os.PathLike) -> None:
        """Closes the cached descriptors of ``path`` (e.g. before deleting it)."""
        self._native().forget(os.fspath(path))

    @property
    def num_pending(self) -> int:
        """Tickets submitted and not yet waited for."""
        return len(self._tickets)

    def close(self) -> None:
        """Waits for pending requests (discarding their errors), then stops the
        engine and closes its descriptors. Idempotent."""
        impl = getattr(self, "_impl", None)
        if impl is None:
            return
        for ticket in list(self._tickets.values()):
            impl.wait(ticket.id)
        self._tickets.clear()
        impl.close()
        self._impl = None

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
