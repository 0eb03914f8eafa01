"""Atomic, checksummed checkpoints (DESIGN.md, "Checkpoints").

A checkpoint is a directory ``<root>/step_<N>/`` holding one raw file per
tensor and ``manifest.json`` (step, free-form metadata, and per tensor its
file, dtype, shape and CRC-32C). It is written under a temporary name, every
file fsynced, and made visible by one ``rename`` of the directory; the parent
directory is fsynced after. A crash at any instant therefore leaves either the
previous checkpoints alone or the new one complete, never a torn one, and
loading verifies every checksum before handing data out.

Tensors are streamed in one at a time (``CheckpointWriter.add``), so a model
much larger than RAM checkpoints unit by unit.

[Note: checkpoints of several ranks]
With N ranks every rank writes its own files into one partial directory that
rank 0 created: a state a strategy shards is saved as the slices of the first
replica (``<name>.slice<i>of<W>``, each rank its own), a replicated one by rank
0 alone. Each rank fsyncs its files; rank 0 gathers every rank's entries (file,
dtype, shape, checksum), writes the manifest and renames the directory, and
only then do the ranks go on (a barrier). ``read_joined`` puts a unit's slices
back together, so a checkpoint carries no trace of the strategy or the number
of ranks that wrote it: any strategy on any number of ranks loads it, and
export reads it as one state dict.

[Note: the manifest protects itself]
Checksums of the data files protect the data, but the manifest decides how the
data is read (dtype, shape, which file) and where training continues (step,
Adam's t, the learning rate in the config). So the manifest carries a CRC-32C
of its own canonical JSON (sorted keys, without the checksum field), and every
entry the size of its file: an edited, truncated or hand-merged manifest is
refused with its path before anything is read. ``meta.run_id`` names the run
that wrote a checkpoint, so retention deletes only that run's checkpoints and a
new run does not mistake a directory of another run's checkpoints for its own.

[Note: older formats]
Format 1 manifests (no checksum, no run id, no file sizes) are still read, but
only as format 1 wrote them: without a field format 1 did not have (the
manifest's ``checksum``, ``meta.run_id``, ``meta.kind``, an entry's ``bytes``
or any other key). Otherwise changing ``format`` to format 1 and deleting the
checksum would let any edit of a newer manifest pass. ``CheckpointReader.lacks``
names the protections an older checkpoint goes without, and ``luwu ckpt
verify`` and a resume say them.

[Note: kinds of checkpoints]
The optimizer node's snapshots ([Note: node snapshots] in node/snapshot.py) are
written and read by this same writer and reader: one manifest format, one
checksum scheme, one temporary-directory-and-rename rule. ``meta.kind`` tells
them apart: absent in a training checkpoint (every checkpoint written before
kinds existed is one), ``"node_snapshot"`` in a node snapshot. A reader is
opened for one kind and refuses the other with a line naming both, so a node
never resumes from a ``--ckpt-dir`` and ``luwu train --resume`` never from a
``--snapshot-dir``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from luwu_rt.fs import fsync_dir

__all__ = ["NODE_SNAPSHOT", "TRAINING", "CheckpointReader", "CheckpointWriter", "latest_checkpoint", "list_checkpoints",
           "new_run_id", "run_checkpoints", "slice_name", "step_dir"]

MANIFEST = "manifest.json"
FORMAT = "luwu_rt.checkpoint/2"
_FORMAT_1 = "luwu_rt.checkpoint/1"
_FORMATS = (_FORMAT_1, FORMAT)
_ENTRY_KEYS = {"file": str, "dtype": str, "shape": list, "crc32c": int}
_FORMAT_1_KEYS = {"format", "step", "meta", "tensors"}
"""[Note: older formats]: what a format 1 manifest holds; its entries hold ``_ENTRY_KEYS``."""
_SINCE_FORMAT_2 = ("run_id", "kind")
"""``meta`` keys format 2 added ([Note: older formats])."""
_FORMAT_1_LACKS = ("a checksum of the manifest itself (an edit of it goes unnoticed)",
                   "a run id (retention and --resume cannot tell its run's checkpoints from another's)",
                   "the size of each file")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
TRAINING = "training"
"""The kind of a ``luwu train`` checkpoint ([Note: kinds of checkpoints]): its manifest's ``meta`` has no ``kind``."""
NODE_SNAPSHOT = "node_snapshot"
"""The kind of an optimizer node's snapshot (``luwu node serve --snapshot-dir``)."""
_KIND_NAMES = {TRAINING: "checkpoint", NODE_SNAPSHOT: "node snapshot"}
"""Kind -> the noun its errors use."""
_KIND_TEXTS = {TRAINING: "a training checkpoint (luwu train --ckpt-dir)",
               NODE_SNAPSHOT: "an optimizer node's snapshot (luwu node serve --snapshot-dir)"}


def _crc(tensor: torch.Tensor) -> int:
    from luwu_rt import _C

    return _C.crc32c(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else 0


def new_run_id() -> str:
    """A fresh run id ([Note: the manifest protects itself])."""
    return uuid.uuid4().hex[:12]


def _manifest_crc(manifest: dict[str, Any]) -> int:
    from luwu_rt import _C
    import numpy as np

    body = {k: v for k, v in manifest.items() if k != "checksum"}
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return _C.crc32c(np.frombuffer(raw, dtype=np.uint8)) if raw else 0


def _io_error(exc: OSError, doing: str, path: Path) -> OSError:
    """``exc`` as one line naming the operation and the path (a full disk says which one)."""
    return OSError(exc.errno, f"{doing} failed: {exc.strerror}", str(path))


def _write_file(path: Path, data: memoryview | bytes) -> None:
    """Writes ``data`` as the new file ``path`` and fsyncs it: every file of a checkpoint goes through here."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _kind_name(kind: str) -> str:
    return _KIND_NAMES.get(kind, f"checkpoint of kind {kind!r}")


def _kind_text(kind: str) -> str:
    return _KIND_TEXTS.get(kind, f"a checkpoint of kind {kind!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint names unknown dtype {name!r}")
    return dtype


class CheckpointWriter:
    """Writes ``<root>/step_<step>`` atomically: ``add`` tensors, then ``commit``.

    Use as a context manager: leaving the block by an exception removes the
    partial directory and leaves earlier checkpoints untouched.
    """

    def __init__(self, root: str | os.PathLike, *, step: int, partial: str | os.PathLike | None = None,
                 kind: str = TRAINING) -> None:
        """``partial``: join the partial directory another rank's writer created (that writer commits;
        [Note: checkpoints of several ranks]). ``kind``: ``TRAINING`` or ``NODE_SNAPSHOT`` ([Note: kinds of
        checkpoints])."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        assert kind in _KIND_NAMES, kind
        self.root = Path(root)
        self.step = step
        self.kind = kind
        self.final = step_dir(self.root, step)
        self._tensors: dict[str, dict[str, Any]] = {}
        if partial is not None:
            self.partial = Path(partial)
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot create the checkpoint directory ({exc.strerror}); "
                                     "pass a writable --ckpt-dir", str(self.root)) from None
        # Leftovers of a writer killed mid-checkpoint are never visible as
        # checkpoints; one trainer owns a root, so they can go.
        for stale in self.root.glob(".partial_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in self.root.glob(".old_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        self.partial = self.root / f".partial_step_{step:08d}_{uuid.uuid4().hex[:8]}"
        try:
            self.partial.mkdir()
        except OSError as exc:
            raise _io_error(exc, f"creating a {_kind_name(kind)}", self.partial) from None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Writes ``tensor`` (a CPU tensor) as ``<name>.bin`` and fsyncs it."""
        if not _NAME.match(name) or name in self._tensors:
            raise ValueError(f"checkpoint tensor name {name!r} is invalid or already used")
        data = tensor.detach().contiguous()
        if data.device.type != "cpu":
            data = data.cpu()
        path = self.partial / f"{name}.bin"
        try:
            _write_file(path, memoryview(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else b"")
        except OSError as exc:
            raise _io_error(exc, f"writing a {_kind_name(self.kind)} file", path) from None
        self._tensors[name] = {"file": path.name, "dtype": _dtype_name(data.dtype), "shape": list(data.shape),
                               "bytes": data.numel() * data.element_size(), "crc32c": _crc(data)}

    @property
    def entries(self) -> dict[str, dict[str, Any]]:
        """The manifest entries of the tensors this writer added."""
        return dict(self._tensors)

    def merge(self, entries: dict[str, dict[str, Any]]) -> None:
        """Adds another rank's entries (files it wrote into this partial directory) to the manifest."""
        clash = sorted(set(entries) & set(self._tensors))
        if clash:
            raise ValueError(f"checkpoint tensors {clash[:3]} were written by two ranks")
        self._tensors.update(entries)

    def commit(self, meta: dict[str, Any]) -> Path:
        """Writes the manifest and makes the checkpoint visible; returns its directory."""
        if self.kind != TRAINING:  # [Note: kinds of checkpoints]
            meta = {**meta, "kind": self.kind}
        manifest = {"format": FORMAT, "step": self.step, "meta": meta, "tensors": self._tensors}
        manifest["checksum"] = _manifest_crc(manifest)  # [Note: the manifest protects itself]
        path, doing = self.partial / MANIFEST, f"writing the {_kind_name(self.kind)} manifest"
        try:
            _write_file(path, json.dumps(manifest, indent=1).encode())
            fsync_dir(self.partial)
            path, doing = self.final, f"committing a {_kind_name(self.kind)}"
            if self.final.exists():
                # Re-saving a step (after a resume replayed it): the old copy is
                # complete and equivalent; replace it in two renames, never in place.
                trash = self.root / f".old_{self.final.name}_{uuid.uuid4().hex[:8]}"
                os.rename(self.final, trash)
                os.rename(self.partial, self.final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(self.partial, self.final)
            path = self.root
            fsync_dir(self.root)
        except OSError as exc:
            raise _io_error(exc, doing, path) from None
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


class CheckpointReader:
    """A committed checkpoint: its manifest, and tensors verified against their checksums."""

    def __init__(self, directory: str | os.PathLike, *, kind: str | None = TRAINING) -> None:
        """``kind``: the kind the caller reads, another is refused ([Note: kinds of checkpoints]); ``None``
        reads any kind."""
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{self.directory} is not a complete checkpoint (no {MANIFEST})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: corrupt checkpoint manifest ({exc}); resume from an older checkpoint") from None
        except OSError as exc:
            raise _io_error(exc, "reading the checkpoint manifest", path) from None
        if not isinstance(manifest, dict) or manifest.get("format") not in _FORMATS:
            fmt = manifest.get("format") if isinstance(manifest, dict) else None
            raise ValueError(f"{path}: not a luwu_rt checkpoint (format {fmt!r})")
        if manifest["format"] == FORMAT and manifest.get("checksum") != _manifest_crc(manifest):
            raise ValueError(f"{path}: the manifest does not match its checksum (edited or corrupt); "
                             f"resume from an older checkpoint")
        if manifest["format"] == _FORMAT_1:
            _check_format_1(manifest, path)
        _check_manifest(manifest, path)
        self.format: str = manifest["format"]
        self.lacks: tuple[str, ...] = _FORMAT_1_LACKS if self.format == _FORMAT_1 else ()
        """The protections this checkpoint goes without, being of an older format ([Note: older formats])."""
        self.step: int = manifest["step"]
        self.meta: dict[str, Any] = manifest["meta"]
        self.tensors: dict[str, dict[str, Any]] = manifest["tensors"]
        self.run_id: str | None = self.meta.get("run_id")
        self.kind: str = self.meta.get("kind", TRAINING)
        if kind is not None and self.kind != kind:
            raise ValueError(f"{self.directory} is {_kind_text(self.kind)}, not {_kind_text(kind)}: keep the two "
                             f"in separate directories")

    @property
    def settings(self) -> dict[str, Any]:
        """The saved run's config as a resumed run starts from it: without the optimizer node's address and
        key, which were that session's (a spawned node's port is gone); a resume gives them again, or none."""
        return {**self.meta["config"], "node": None, "node_key": None}

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``; ``OSError(EIO)`` naming the file if its bytes do not match the checksum."""
        entry = self.tensors.get(name)
        if entry is None:
            raise KeyError(f"checkpoint {self.directory} has no tensor {name!r}")
        path = self.directory / entry["file"]
        dtype, shape = _dtype_of(entry["dtype"]), entry["shape"]
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise _io_error(exc, "reading a checkpoint file", path) from None
        out = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if out.numel() != numel * itemsize or out.numel() != entry.get("bytes", out.numel()):
            raise OSError(errno.EIO, f"checkpoint file has {out.numel()} bytes, expected {numel * itemsize}", str(path))
        tensor = out.view(dtype).reshape(shape)
        if _crc(tensor) != entry["crc32c"]:
            raise OSError(errno.EIO, f"checkpoint file does not match its checksum; the checkpoint is corrupt (move "
                                     f"{self.directory.name} aside to resume from the one before)", str(path))
        return tensor

    def parts(self, name: str) -> list[str]:
        """The entries holding tensor ``name``: itself, or its full set of slices in order; ``ValueError``
        naming the checkpoint when neither is there."""
        if name in self.tensors:
            return [name]
        slices = sorted((int(m.group(1)), int(m.group(2)), key) for key in self.tensors
                        if (m := re.fullmatch(re.escape(name) + r"\.slice(\d+)of(\d+)", key)))
        counts = {count for _, count, _ in slices}
        if not slices or len(counts) != 1 or [i for i, _, _ in slices] != list(range(counts.pop())):
            raise ValueError(f"checkpoint {self.directory} has no tensor {name!r} (whole or a full set of slices); "
                             f"it is incomplete, resume from an older checkpoint")
        return [key for _, _, key in slices]

    def read_joined(self, name: str, numel: int) -> torch.Tensor:
        """The flat tensor ``name`` of ``numel`` elements, saved whole or as slices by several ranks
        ([Note: checkpoints of several ranks])."""
        parts = self.parts(name)
        flat = (torch.cat([self.read(key).reshape(-1) for key in parts]) if len(parts) > 1
                else self.read(parts[0]).reshape(-1))
        if flat.numel() < numel:
            raise ValueError(f"checkpoint {self.directory}: {name} holds {flat.numel()} values, "
                             f"the model needs {numel}")
        return flat[:numel]


def _check_format_1(manifest: dict[str, Any], path: Path) -> None:
    """Raises ``ValueError`` naming ``path`` when a manifest that says format 1 holds what format 1 did not
    have ([Note: older formats])."""
    meta, tensors = manifest.get("meta"), manifest.get("tensors")
    newer = sorted(set(manifest) - _FORMAT_1_KEYS)
    if isinstance(meta, dict):
        newer += [f"meta.{key}" for key in _SINCE_FORMAT_2 if key in meta]
    if isinstance(tensors, dict):
        keys = {key for entry in tensors.values() if isinstance(entry, dict) for key in entry}
        extra = sorted(keys - set(_ENTRY_KEYS))
        newer += [f"an entry's {key}" for key in extra]
    if newer:
        raise ValueError(f"{path}: says {_FORMAT_1} but holds {', '.join(newer[:4])}, which that format did not have: "
                         f"the manifest was edited (its format lowered to drop its checksum); resume from an older "
                         f"checkpoint")


def _check_manifest(manifest: dict[str, Any], path: Path) -> None:
    """Raises ``ValueError`` naming ``path`` unless the manifest has the fields readers rely on, with
    their types: a malformed manifest is refused here, never a ``KeyError`` deep inside a load."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: malformed checkpoint manifest ({what}); resume from an older checkpoint")

    step, meta, tensors = manifest.get("step"), manifest.get("meta"), manifest.get("tensors")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise bad(f"step {step!r}")
    if not isinstance(meta, dict) or not isinstance(tensors, dict):
        raise bad("no meta or tensors table")
    if not isinstance(meta.get("kind", TRAINING), str):
        raise bad(f"kind {meta['kind']!r}")
    for name, entry in tensors.items():
        if not isinstance(entry, dict) or any(not isinstance(entry.get(k), t) for k, t in _ENTRY_KEYS.items()):
            raise bad(f"entry {name!r}")
        if "/" in entry["file"] or entry["file"].startswith(".") or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"]):
            raise bad(f"entry {name!r}")
        try:
            _dtype_of(entry["dtype"])
        except ValueError:
            raise bad(f"entry {name!r} has dtype {entry['dtype']!r}") from None


def run_checkpoints(root: str | os.PathLike, run_id: str) -> list[Path]:
    """The committed checkpoints under ``root`` that run ``run_id`` wrote, oldest first; unreadable ones
    are nobody's ([Note: the manifest protects itself])."""
    out = []
    for path in list_checkpoints(root):
        try:
            if CheckpointReader(path).run_id == run_id:
                out.append(path)
        except (ValueError, OSError):
            continue
    return out


def slice_name(name: str, index: int, count: int) -> str:
    """The name of slice ``index`` of ``count`` of the tensor ``name``."""
    return f"{name}.slice{index}of{count}"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` under ``root`` is committed."""
    return Path(root) / f"step_{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Committed checkpoint directories under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).exists()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The committed checkpoint with the highest step, or ``None``."""
    found = list_checkpoints(root)
    return found[-1] if found else None
