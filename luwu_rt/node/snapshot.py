"""Node snapshots: the node's whole state every K steps, written atomically into ``--snapshot-dir``.

[Note: node snapshots]
A snapshot is a checkpoint of kind ``NODE_SNAPSHOT`` ([Note: kinds of
checkpoints] in ckpt/format.py), written and read by the checkpoints' own
``CheckpointWriter`` and ``CheckpointReader``: a directory ``step_<s>`` with
one raw fp32 file per unit and state (``u<unit>.<state>``: master, exp_avg,
exp_avg_sq) and a ``manifest.json`` with a CRC-32C per file and one of its own;
its ``meta`` holds the run's manifest, the step ``s``, the Adam step and the
node shard ``[i, k]``. It is written under a ``.partial_`` name, every file
fsynced, then renamed into place: a node killed while writing leaves the
previous snapshots whole. The node takes it between two steps, so the store is
quiet: pushes of the next step land in ``Pushes``' buffers, not in the store.

The newest ``KEEP_SNAPSHOTS`` snapshots are kept, so when the newest one is
damaged on disk the node falls back to the one before. A write that fails (a
full disk, an IO error) is logged with its path, its partial directory is
removed, and training goes on: the run is only less protected until a later
snapshot succeeds.

A node started on a directory with a snapshot resumes from the newest one
that verifies (every file against its checksum, every unit and state there;
with ``--resume-step s``, the one of step s, which must verify: a shard going
back to the step another shard restarted at): it serves that step's
parameters and WELCOMEs the workers there; the workers replay from it
([Note: a node that restarts] in worker.py). Unlike
``--nvme-dir`` (scratch, rebuilt at start), this directory must survive
restarts; the node holds its lock ([Note: directory locks] in fs.py) while it
runs. Snapshots of luwu_rt before this format (a ``meta.json`` per snapshot)
are refused at start, naming the path: reading them would keep a second
reader alive for a state that only protects a run in progress, and a node that
ignored them would leave the workers it cannot serve wondering why.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from luwu_rt.ckpt.format import NODE_SNAPSHOT, CheckpointReader, CheckpointWriter, list_checkpoints, step_dir
from luwu_rt.fs import DirLock, lock_dir

from .manifest import model_spec
from .protocol import INIT_STATES
from .shards import slice_of

__all__ = ["KEEP_SNAPSHOTS", "Snapshot", "SnapshotDir", "latest_snapshot", "verify_snapshot", "write_snapshot"]

KEEP_SNAPSHOTS = 2
"""Snapshots kept: the newest, and the one to fall back to when the newest is damaged."""


class Snapshot:
    """A verified snapshot on disk: the run's manifest, its step, Adam step and shard; ``state`` reads a file."""

    def __init__(self, reader: CheckpointReader) -> None:
        self._reader = reader
        self.path = reader.directory
        meta = reader.meta
        self.manifest: dict[str, Any] = meta["manifest"]
        self.step: int = reader.step
        self.adam_step: int = meta["adam_step"]
        self.shard: list[int] = meta["shard"]

    def state(self, unit: int, name: str) -> torch.Tensor:
        """``unit``'s fp32 ``name`` (one of ``INIT_STATES``), checked against its checksum."""
        return self._reader.read(f"u{unit}.{name}")


def write_snapshot(root: str | os.PathLike, *, manifest: dict[str, Any], step: int, adam_step: int,
                   states: Iterable[tuple[tuple[int, str], torch.Tensor]], shard: list[int],
                   keep: int = KEEP_SNAPSHOTS) -> Path:
    """Writes ``states`` (``((unit, state), fp32 values)`` pairs, read one at a time) as ``root/step_<step>``
    atomically, then keeps the newest ``keep`` snapshots. ``shard``: ``[i, k]`` of a node shard ([Note: node
    shards] in shards.py). Raises ``OSError`` naming the file when a write fails; nothing partial stays."""
    assert keep >= 1, keep
    with CheckpointWriter(root, step=step, kind=NODE_SNAPSHOT) as writer:
        for (unit, name), values in states:
            writer.add(f"u{unit}.{name}", values.detach().to(torch.float32))
        path = writer.commit({"manifest": manifest, "step": step, "adam_step": adam_step, "shard": list(shard)})
    _prune(Path(root), keep)
    return path


def _prune(root: Path, keep: int) -> None:
    """Deletes the snapshots older than the newest ``keep`` whose manifests read."""
    kept = 0
    for path in reversed(list_checkpoints(root)):
        if kept >= keep:
            shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            CheckpointReader(path, kind=NODE_SNAPSHOT)
            kept += 1
        except (ValueError, OSError):
            continue  # a damaged one newer than the kept ones stays: the node skips it at start


def verify_snapshot(path: str | os.PathLike) -> Snapshot:
    """The snapshot at ``path`` with every file read against its checksum and every unit's states there;
    raises ``ValueError``/``OSError`` saying what is wrong."""
    path = Path(path)
    reader = CheckpointReader(path, kind=NODE_SNAPSHOT)
    meta = reader.meta
    try:
        shard, step, adam_step = meta["shard"], meta["step"], meta["adam_step"]
        units = model_spec(meta["manifest"]).units
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: snapshot metadata lacks or garbles {exc}") from None
    if step != reader.step or not (isinstance(adam_step, int) and 0 <= adam_step <= step):
        raise ValueError(f"{path}: snapshot steps disagree (step {reader.step}, meta {step}, {adam_step})")
    if not (isinstance(shard, list) and len(shard) == 2 and 0 <= shard[0] < shard[1]):
        raise ValueError(f"{path}: snapshot names no node shard ({shard!r})")
    want = {f"u{u}.{s}": slice_of(unit.num_params, shard[0], shard[1])[1] for u, unit in enumerate(units)
            for s in INIT_STATES}
    if set(reader.tensors) != set(want):
        raise ValueError(f"{path}: snapshot holds {len(reader.tensors)} files, its run needs {len(want)}")
    for name, numel in want.items():
        if reader.read(name).numel() != numel:
            raise ValueError(f"{path}: {name} holds the wrong number of values")
    return Snapshot(reader)


def latest_snapshot(root: str | os.PathLike | None, *, log: Callable[[str], None] | None = None,
                    skipped: list[str] | None = None) -> Snapshot | None:
    """The newest snapshot under ``root`` that verifies, or None; a damaged one is named (``log``, and
    ``skipped`` gets ``"step_<s>: why"``) and the one before it tried."""
    if not root or not Path(root).is_dir():
        return None
    for path in reversed(list_checkpoints(root)):
        try:
            return verify_snapshot(path)
        except (ValueError, OSError) as exc:
            if skipped is not None:
                skipped.append(f"{path.name}: {exc}")
            if log is not None:
                log(f"snapshot {path} is incomplete or damaged ({exc}): skipped, trying the one before")
    return None


class SnapshotDir:
    """A node's ``--snapshot-dir`` ([Note: node snapshots]): locked while the node runs, checked at start,
    where the node resumes from and writes to."""

    def __init__(self, root: str | os.PathLike, *, shard: tuple[int, int], log: Callable[[str], None]) -> None:
        self.root = Path(root)
        self.shard = [shard[0], shard[1]]
        self.log = log
        self.lock: DirLock | None = lock_dir(self.root, flag="--snapshot-dir")
        try:
            self._check()
        except BaseException:
            self.close()
            raise
        self.skipped: list[str] = []
        """``"step_<s>: why"`` of each damaged snapshot the node passed over at start."""
        self.newest: Path | None = None
        """The newest snapshot on disk that the node resumed from or wrote."""
        self._writing = threading.Lock()
        """Held while a snapshot is written, and for good by ``freeze``."""

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _check(self) -> None:
        """Refuses a directory that is not this node shard's alone, or holds snapshots of the older format."""
        old = sorted(self.root.glob("step_*/meta.json"))
        if old:
            raise ValueError(f"--snapshot-dir {self.root} holds node snapshots of an older luwu_rt ({old[-1]}), "
                             f"which this version does not read: finish that run with the luwu_rt that wrote them, "
                             f"or move {self.root} aside and resume the workers from their last checkpoint "
                             f"(luwu train --resume) against a fresh node")
        for path in list_checkpoints(self.root):
            try:
                reader = CheckpointReader(path, kind=None)
            except (ValueError, OSError):
                continue  # damaged: passed over by latest()
            if reader.kind != NODE_SNAPSHOT:
                CheckpointReader(path, kind=NODE_SNAPSHOT)  # raises, naming both kinds
            if reader.meta.get("shard", self.shard) != self.shard:
                raise ValueError(f"--snapshot-dir {self.root} holds node shard "
                                 f"{'/'.join(map(str, reader.meta['shard']))}'s snapshots, this is shard "
                                 f"{'/'.join(map(str, self.shard))}: give each shard its own snapshot directory")

    def latest(self) -> Snapshot | None:
        """The snapshot to resume from: the newest that verifies ([Note: node snapshots])."""
        snap = latest_snapshot(self.root, log=self.log, skipped=self.skipped)
        self.newest = snap.path if snap is not None else None
        return snap

    def at(self, step: int) -> Snapshot:
        """The snapshot of ``step``, verified; raises ``ValueError`` naming the directory and the steps it holds
        when there is none, or it is damaged."""
        path = step_dir(self.root, step)
        try:
            snap = verify_snapshot(path)
        except (ValueError, OSError) as exc:
            held = [p.name for p in list_checkpoints(self.root)]
            raise ValueError(f"--snapshot-dir {self.root} holds no whole snapshot of step {step} ({exc}; it holds "
                             f"{', '.join(held) or 'none'})") from None
        self.newest = snap.path
        return snap

    def holds(self, step: int) -> bool:
        """Whether a committed snapshot of ``step`` is here (its manifest reads; the files are verified by
        ``at``, when a node resumes from it)."""
        try:
            CheckpointReader(step_dir(self.root, step), kind=NODE_SNAPSHOT)
        except (ValueError, OSError):
            return False
        return True

    def freeze(self) -> None:
        """Waits for a snapshot being written, and lets no other start: the node is about to go back to one
        ([Note: node shards that restart] in worker.py), whose directory must stay as it is."""
        self._writing.acquire()

    def write(self, *, manifest: dict[str, Any], step: int, adam_step: int,
              states: Iterable[tuple[tuple[int, str], torch.Tensor]]) -> Path | None:
        """Writes the snapshot of ``step``; a failed write is logged with its path and cleaned up, and
        returns None: training goes on ([Note: node snapshots])."""
        with self._writing:
            return self._write(manifest=manifest, step=step, adam_step=adam_step, states=states)

    def _write(self, *, manifest: dict[str, Any], step: int, adam_step: int,
               states: Iterable[tuple[tuple[int, str], torch.Tensor]]) -> Path | None:
        try:
            self.newest = write_snapshot(self.root, manifest=manifest, step=step, adam_step=adam_step, states=states,
                                         shard=self.shard)
        except OSError as exc:
            kept = (f"the newest snapshot is still {self.newest}" if self.newest
                    else "there is no snapshot to resume from")
            self.log(f"snapshot of step {step} failed: {exc}; its partial directory is removed and training goes "
                     f"on, less protected ({kept}) until a later snapshot succeeds")
            return None
        return self.newest

    def absence(self) -> str:
        """Why the node resumed from no snapshot, for a worker that rejoins its run."""
        if self.skipped:
            return f"every snapshot in --snapshot-dir {self.root} is damaged ({'; '.join(self.skipped)})"
        return (f"its --snapshot-dir {self.root} held no snapshot when it started (the node before it stopped "
                f"before its first --snapshot-every step, or could not write one: see that node's log)")
