"""Node snapshots: the node's whole state every K steps, written atomically into ``--snapshot-dir``.

[Note: node snapshots]
A snapshot is a directory ``step_<s>`` holding ``meta.json`` (the run's
manifest, the step ``s`` and the Adam step, and per file its size and SHA-256)
and one raw little-endian fp32 file per unit and state (``u<unit>.<state>``:
master, exp_avg, exp_avg_sq); no pickle, like the protocol. It is written
under a ``.tmp-`` name, every file fsynced, then renamed into place and the
directory fsynced: a node killed while writing leaves the previous snapshot
whole and a ``.tmp-`` directory that the next write removes. Only then are
older snapshots deleted. The node takes it between two steps, so the store is
quiet: pushes of the next step land in ``Pushes``' buffers, not in the store.
A node started on a directory with a snapshot resumes from the newest one that
verifies: it serves that step's parameters and WELCOMEs the workers there; the
workers replay from it ([Note: a node that restarts] in worker.py). Unlike
``--nvme-dir`` (scratch, rebuilt at start), this directory must survive
restarts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from luwu_rt.fs import fsync_dir

from .protocol import INIT_STATES

__all__ = ["Snapshot", "latest_snapshot", "unit_states", "write_snapshot"]

SNAPSHOT_VERSION = 1


class Snapshot:
    """A verified snapshot on disk: its manifest, step and Adam step; ``state(unit, name)`` reads a file."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path, self.meta = path, meta
        self.manifest: dict[str, Any] = meta["manifest"]
        self.step: int = int(meta["step"])
        self.adam_step: int = int(meta["adam_step"])

    def state(self, unit: int, name: str) -> torch.Tensor:
        data = (self.path / f"u{unit}.{name}").read_bytes()
        return torch.frombuffer(bytearray(data), dtype=torch.float32)


def write_snapshot(root: str | os.PathLike, *, manifest: dict[str, Any], step: int, adam_step: int,
                   states: Iterable[tuple[tuple[int, str], torch.Tensor]], keep: int = 1,
                   shard: list[int] | None = None) -> Path:
    """Writes ``states`` (``((unit, state), fp32 values)`` pairs, read one at a time) as ``root/step_<step>``
    atomically; keeps the
    newest ``keep`` snapshots. ``shard``: ``[i, k]`` of a node shard, its slices ([Note: node shards]).
    Returns the snapshot's path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step:08d}", root / f".tmp-step_{step:08d}"
    for stale in root.glob(".tmp-*"):  # a write a kill interrupted
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    files = {}
    for (unit, name), values in states:
        data = values.detach().to(torch.float32).contiguous().view(torch.uint8).numpy().tobytes()
        fname = f"u{unit}.{name}"
        with open(tmp / fname, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        files[fname] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta = {"snapshot_version": SNAPSHOT_VERSION, "manifest": manifest, "step": step, "adam_step": adam_step,
            "shard": shard or [0, 1], "files": files}
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if final.exists():  # the same step written again (a node that resumed here): replace it
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(root)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _verify(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("snapshot_version") != SNAPSHOT_VERSION:
            return None
        for fname, info in meta["files"].items():
            data = (path / fname).read_bytes()
            if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
                return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_snapshot(root: str | os.PathLike | None, *, log=None) -> Snapshot | None:
    """The newest snapshot under ``root`` whose files verify, or None; a damaged one is named and skipped."""
    if not root or not Path(root).is_dir():
        return None
    for path in sorted(Path(root).glob("step_*"), reverse=True):
        meta = _verify(path)
        if meta is not None:
            return Snapshot(path, meta)
        if log is not None:
            log(f"snapshot {path} is incomplete or damaged (size or SHA-256 differ): skipped")
    return None


def unit_states(numels: list[int]) -> list[tuple[int, str]]:
    """Every (unit, state) a snapshot holds."""
    return [(u, s) for u in range(len(numels)) for s in INIT_STATES]
