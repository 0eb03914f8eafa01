"""The NVMe tier: shard data in files, a checksum per chunk, an atomic manifest.

Layout: one file per state kind (``param.bin``, ``master.bin``, ...). Each
unit's flat buffer of that kind is a region at a fixed, 4 KiB-aligned offset,
so a chunk's place on disk is a pure function of the model: nothing about
placement is decided at run time. ``manifest.json`` records the layout and the
CRC-32C of every chunk written; it is replaced atomically (write, fsync,
rename), so after a crash it describes either the old or the new contents.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from luwu_rt.io import PAGE_BYTES, IOEngine, IOTicket

__all__ = ["NvmeTier", "NvmeRequest"]

MANIFEST = "manifest.json"
FORMAT = "luwu_rt.nvme/1"


@dataclass(frozen=True, slots=True)
class _Region:
    path: Path
    offset: int
    nbytes: int


@dataclass(slots=True, eq=False)
class NvmeRequest:
    """One in-flight read or write of whole chunks of a unit's region."""

    ticket: IOTicket
    unit: int
    state: str
    first_chunk: int
    crcs: list[int] = field(default_factory=list)
    """For writes: checksums of the chunks being written, recorded on success."""


class NvmeTier:
    """Chunks of every ``(unit, state)`` region on files under ``directory``.

    ``regions`` maps ``(unit, state)`` to the region's size in bytes (4 KiB
    aligned). Requests cover whole chunks of ``chunk_bytes`` (the last chunk of
    a region may be shorter) and go through ``engine``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        regions: Mapping[tuple[int, str], int],
        chunk_bytes: int,
        engine: IOEngine,
        verify_reads: bool = True,
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes % PAGE_BYTES:
            raise ValueError(f"NvmeTier: chunk_bytes must be a positive multiple of {PAGE_BYTES}, got {chunk_bytes}")
        self.directory = Path(directory)
        self.chunk_bytes = chunk_bytes
        self.engine = engine
        self.verify_reads = verify_reads
        self._regions = self._lay_out(regions)
        self._make_directory()
        self._crcs: dict[tuple[int, str], list[int | None]] = {
            key: [None] * self.num_chunks(*key) for key in self._regions
        }
        self._open_directory()

    # -- layout ---------------------------------------------------------------------------------

    def _lay_out(self, regions: Mapping[tuple[int, str], int]) -> dict[tuple[int, str], _Region]:
        out: dict[tuple[int, str], _Region] = {}
        ends: dict[str, int] = {}
        for (unit, state), nbytes in sorted(regions.items()):
            if nbytes <= 0 or nbytes % PAGE_BYTES:
                raise ValueError(f"NvmeTier: region ({unit}, {state}) has {nbytes} bytes; "
                                 f"it must be a positive multiple of {PAGE_BYTES}")
            offset = ends.get(state, 0)
            out[(unit, state)] = _Region(self.directory / f"{state}.bin", offset, nbytes)
            ends[state] = offset + nbytes
        self._file_bytes = {self.directory / f"{state}.bin": end for state, end in ends.items()}
        return out

    @property
    def regions(self) -> dict[tuple[int, str], int]:
        """Bytes of each ``(unit, state)`` region this tier holds."""
        return {key: region.nbytes for key, region in self._regions.items()}

    def num_chunks(self, unit: int, state: str) -> int:
        return -(-self._regions[(unit, state)].nbytes // self.chunk_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(self._file_bytes.values())

    def _layout_json(self) -> dict:
        return {
            "chunk_bytes": self.chunk_bytes,
            "regions": [
                {"unit": u, "state": s, "file": r.path.name, "offset": r.offset, "nbytes": r.nbytes}
                for (u, s), r in sorted(self._regions.items())
            ],
        }

    def _make_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot create the NVMe directory ({exc.strerror}); pass a writable --nvme-dir",
                          str(self.directory)) from None
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise OSError(errno.EACCES, "the NVMe directory is not writable; pass a writable --nvme-dir",
                          str(self.directory))
        missing = sum(n - self._allocated_bytes(p) for p, n in self._file_bytes.items())
        free = shutil.disk_usage(self.directory).free
        if missing > free:
            raise OSError(errno.ENOSPC, f"the NVMe tier needs {missing} more bytes but only {free} are free; "
                          "free space or point --nvme-dir at a larger disk", str(self.directory))

    def _open_directory(self) -> None:
        manifest = self.directory / MANIFEST
        if manifest.exists():
            self._adopt(manifest)
        for path, nbytes in self._file_bytes.items():
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                # Reserve the space now, so a full disk fails here with a clear
                # message instead of in the middle of a step.
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot reserve {nbytes} bytes for the NVMe tier ({exc.strerror})",
                              str(path)) from None
            finally:
                os.close(fd)

    @staticmethod
    def _allocated_bytes(path: Path) -> int:
        try:
            return path.stat().st_blocks * 512
        except FileNotFoundError:
            return 0

    def _adopt(self, manifest: Path) -> None:
        """Reuse the checksums of a previous run over the same layout (resume)."""
        try:
            data = json.loads(manifest.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{manifest}: unreadable NVMe manifest ({exc}); "
                             "delete the directory to start afresh") from None
        if data.get("format") != FORMAT or data.get("layout") != self._layout_json():
            raise ValueError(
                f"{self.directory} holds NVMe state of a different model or chunk size; "
                "use an empty --nvme-dir, or delete this one to start afresh"
            )
        for entry, (key, _region) in zip(data["crc32c"], sorted(self._regions.items())):
            self._crcs[key] = list(entry)

    # -- IO -------------------------------------------------------------------------------------

    def _place(self, unit: int, state: str, first_chunk: int, nbytes: int) -> tuple[_Region, int]:
        region = self._regions.get((unit, state))
        if region is None:
            raise KeyError(f"no NVMe region for unit {unit} state {state!r}")
        start = first_chunk * self.chunk_bytes
        end = start + nbytes
        # Plans address whole chunks; anything else is a planner/executor bug.
        assert 0 <= start < region.nbytes and end <= region.nbytes, (unit, state, first_chunk, nbytes)
        assert nbytes % self.chunk_bytes == 0 or end == region.nbytes, (unit, state, first_chunk, nbytes)
        return region, region.offset + start

    def _chunk_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        flat = buffer.view(torch.uint8).reshape(-1)
        return list(flat.split(self.chunk_bytes))

    def submit_write(self, unit: int, state: str, *, first_chunk: int, buffer: torch.Tensor) -> NvmeRequest:
        """Starts writing ``buffer`` over chunks ``first_chunk...``; keep it unchanged until :meth:`wait`."""
        from luwu_rt import _C

        region, offset = self._place(unit, state, first_chunk, buffer.nbytes)
        ticket = self.engine.submit_write(region.path, offset=offset, buffer=buffer)
        # Checksummed while the disk writes it (the buffer is unchanged until wait), not before it starts.
        crcs = [_C.crc32c(v.numpy()) for v in self._chunk_views(buffer)]
        return NvmeRequest(ticket, unit, state, first_chunk, crcs)

    def submit_read(self, unit: int, state: str, *, first_chunk: int, buffer: torch.Tensor) -> NvmeRequest:
        """Starts reading chunks ``first_chunk...`` into ``buffer``; verified by :meth:`wait`."""
        region, offset = self._place(unit, state, first_chunk, buffer.nbytes)
        known = self._crcs[(unit, state)][first_chunk : first_chunk + len(self._chunk_views(buffer))]
        # A read of a chunk never written would return whatever the disk held.
        assert None not in known, f"read of never-written chunk of unit {unit} state {state}"
        ticket = self.engine.submit_read(region.path, offset=offset, buffer=buffer)
        return NvmeRequest(ticket, unit, state, first_chunk)

    def wait(self, request: NvmeRequest) -> float:
        """Completes ``request`` and returns when its transfer ended (``IOEngine.wait``); a read whose data does
        not match its checksum raises ``OSError(EIO)`` naming the file and the chunk."""
        from luwu_rt import _C

        ended = self.engine.wait(request.ticket)
        crcs = self._crcs[(request.unit, request.state)]
        if request.ticket.op == "write":
            crcs[request.first_chunk : request.first_chunk + len(request.crcs)] = request.crcs
            return ended
        if not self.verify_reads:
            return ended
        for i, view in enumerate(self._chunk_views(request.ticket.buffer)):
            chunk = request.first_chunk + i
            if _C.crc32c(view.numpy()) != crcs[chunk]:
                raise OSError(
                    errno.EIO,
                    f"checksum mismatch in chunk {chunk} of unit {request.unit} state {request.state!r} "
                    f"(file offset {request.ticket.offset + i * self.chunk_bytes}); the file is corrupt",
                    str(self._regions[(request.unit, request.state)].path),
                )
        return ended

    def flush(self) -> None:
        """Makes every completed write durable and records its checksum in the manifest atomically."""
        for path in self._file_bytes:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        data = {"format": FORMAT, "layout": self._layout_json(),
                "crc32c": [self._crcs[k] for k in sorted(self._regions)]}
        atomic_write_text(self.directory / MANIFEST, json.dumps(data))


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a crash leaves the old or the new file, never a torn one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
