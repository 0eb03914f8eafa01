"""`luwu bench io`: O_DIRECT write and read throughput of the IO engine on a directory."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass

__all__ = ["IOBenchResult", "add_arguments", "measure", "run", "sweep"]

_SWEEP_BLOCK_KB = (256, 1024, 4096, 16384)
_SWEEP_QUEUE_DEPTHS = (4, 8, 16, 32, 64)


@dataclass(kw_only=True, slots=True)
class IOBenchResult:
    """One write-then-read measurement."""

    backend: str
    """Backend that ran ("io_uring" or "threads")."""
    block_bytes: int
    """Piece size of each IO."""
    queue_depth: int
    """Pieces in flight per direction."""
    size_bytes: int
    """File size written and read."""
    write_gbps: float
    """Write throughput, 1e9 bytes/s, without a final fdatasync (O_DIRECT already bypasses the cache)."""
    read_gbps: float
    """Read throughput, 1e9 bytes/s."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True,
                        help="directory on the disk to measure (a temporary file is created and removed); created "
                             "if missing, and then removed at exit")
    parser.add_argument("--size-mb", type=int, default=1024, help="file size in MiB (default 1024)")
    parser.add_argument("--block-kb", type=int, default=1024,
                        help="IO piece size in KiB, a multiple of 4 (default 1024)")
    parser.add_argument("--queue-depth", type=int, default=None,
                        help="pieces in flight per direction (default: the IO engine's, luwu_rt.io.QUEUE_DEPTH)")
    parser.add_argument("--backend", default="auto", choices=("auto", "io_uring", "threads"),
                        help="IO backend (default auto)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--sweep", action="store_true", help="try several block sizes and queue depths; print the best")
    parser.add_argument("--profile-out", default=None, metavar="FILE",
                        help="also write the measured nvme_read_gbps and nvme_write_gbps into FILE, a hardware "
                             "profile for `luwu plan --profile FILE` (other keys already in FILE are kept)")


def measure(
    directory: str,
    *,
    size_bytes: int,
    block_bytes: int,
    queue_depth: int,
    backend: str = "auto",
    buffer=None,
    read_buffer=None,
) -> IOBenchResult:
    """Writes then reads one ``size_bytes`` file in ``directory`` and removes it.
    ``buffer`` (the data written) and ``read_buffer`` (where it is read back),
    uint8 tensors of ``size_bytes``, default to fresh :func:`aligned_empty` ones."""
    import torch

    from luwu_rt.io import IOEngine, aligned_empty

    if not os.path.isdir(directory):
        raise OSError(2, "benchmark directory does not exist", directory)
    if size_bytes <= 0:
        raise ValueError(f"size must be > 0 bytes, got {size_bytes}")
    if buffer is None:
        buffer = aligned_empty(size_bytes)
        buffer.copy_(torch.randint(0, 256, (size_bytes,), dtype=torch.uint8))
    path = os.path.join(directory, f".luwu-bench-io-{uuid.uuid4().hex}")
    with IOEngine(backend=backend, queue_depth=queue_depth, block_bytes=block_bytes) as engine:
        try:
            start = time.perf_counter()
            engine.write(path, offset=0, buffer=buffer)
            write_s = time.perf_counter() - start
            check = aligned_empty(size_bytes) if read_buffer is None else read_buffer
            start = time.perf_counter()
            engine.read(path, offset=0, buffer=check)
            read_s = time.perf_counter() - start
            if not torch.equal(check, buffer):
                raise OSError(5, "data read back differs from data written", path)
        finally:
            engine.forget(path)
            if os.path.exists(path):
                os.unlink(path)
        return IOBenchResult(
            backend=engine.backend, block_bytes=block_bytes, queue_depth=queue_depth, size_bytes=size_bytes,
            write_gbps=size_bytes / write_s / 1e9, read_gbps=size_bytes / read_s / 1e9,
        )


def sweep(directory: str, *, size_bytes: int, backend: str = "auto", log=print) -> tuple[IOBenchResult, IOBenchResult]:
    """Measures every block size x queue depth; returns the best (for write, for read)."""
    import torch

    from luwu_rt.io import aligned_empty

    buffer = aligned_empty(size_bytes)
    buffer.copy_(torch.randint(0, 256, (size_bytes,), dtype=torch.uint8))
    results = []
    for block_kb in _SWEEP_BLOCK_KB:
        if block_kb * 1024 > size_bytes:
            continue
        for depth in _SWEEP_QUEUE_DEPTHS:
            r = measure(directory, size_bytes=size_bytes, block_bytes=block_kb * 1024, queue_depth=depth,
                        backend=backend, buffer=buffer)
            log(f"block {block_kb:6d} KiB  queue depth {depth:3d}: write {r.write_gbps:6.2f} GB/s  "
                f"read {r.read_gbps:6.2f} GB/s")
            results.append(r)
    if not results:
        raise ValueError(f"size {size_bytes} bytes is smaller than the smallest swept block ({_SWEEP_BLOCK_KB[0]} KiB)")
    return max(results, key=lambda r: r.write_gbps), max(results, key=lambda r: r.read_gbps)


def _describe(r: IOBenchResult) -> str:
    return (
        f"backend {r.backend}, {r.size_bytes / 2**20:.0f} MiB, block {r.block_bytes // 1024} KiB, "
        f"queue depth {r.queue_depth}: write {r.write_gbps:.2f} GB/s, read {r.read_gbps:.2f} GB/s"
    )


def run(args: argparse.Namespace) -> int:
    if args.size_mb <= 0:
        raise ValueError(f"--size-mb must be > 0, got {args.size_mb}")
    if args.block_kb <= 0 or args.block_kb % 4:
        raise ValueError(f"--block-kb must be a positive multiple of 4, got {args.block_kb}")
    from luwu_rt.cli.dirs import created_dir
    from luwu_rt.io import QUEUE_DEPTH

    args.queue_depth = QUEUE_DEPTH if args.queue_depth is None else args.queue_depth
    with created_dir(args.dir, flag="--dir"):  # as luwu train treats --nvme-dir ([Note: missing directories])
        return _run(args, size_bytes=args.size_mb << 20)


def _run(args: argparse.Namespace, *, size_bytes: int) -> int:
    if args.sweep:
        best_write, best_read = sweep(args.dir, size_bytes=size_bytes, backend=args.backend,
                                      log=(lambda _line: None) if args.json else print)
        _write_profile(args.profile_out, write_gbps=best_write.write_gbps, read_gbps=best_read.read_gbps)
        if args.json:
            print(json.dumps({"best_write": asdict(best_write), "best_read": asdict(best_read)}))
        else:
            print(f"best for writes: --block-kb {best_write.block_bytes // 1024} --queue-depth {best_write.queue_depth}"
                  f" ({best_write.write_gbps:.2f} GB/s)")
            print(f"best for reads:  --block-kb {best_read.block_bytes // 1024} --queue-depth {best_read.queue_depth}"
                  f" ({best_read.read_gbps:.2f} GB/s)")
        return 0
    result = measure(args.dir, size_bytes=size_bytes, block_bytes=args.block_kb * 1024,
                     queue_depth=args.queue_depth, backend=args.backend)
    _write_profile(args.profile_out, write_gbps=result.write_gbps, read_gbps=result.read_gbps)
    print(json.dumps(asdict(result)) if args.json else _describe(result))
    return 0


def _write_profile(path: str | None, *, write_gbps: float, read_gbps: float) -> None:
    if path is None:
        return
    from luwu_rt.cli.profile_out import merge_profile

    merge_profile(path, {"nvme_read_gbps": read_gbps, "nvme_write_gbps": write_gbps})
    # On stderr, so that --json keeps stdout to its one object.
    print(f"wrote nvme_read_gbps and nvme_write_gbps to {path}; use it with `luwu plan --profile {path}`",
          file=sys.stderr)
