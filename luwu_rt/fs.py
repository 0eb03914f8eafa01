"""File-system helpers: advisory directory locks (one run at a time in an NVMe tier or checkpoint
directory), writable-directory checks, durable renames (``fsync_dir``) and the directories a run creates
and removes again (``missing_top``, ``remove_made``, ``scratch_name``: [Note: missing directories] in
cli/dirs.py).

[Note: directory locks]
A run that shares a directory with another one destroys it: the NVMe tier is
rebuilt from scratch at start-up (the other run's live state goes), and a
checkpoint writer removes leftover partial directories (the other run's
checkpoint in progress). So a run holds ``fcntl.flock`` on ``<dir>/.luwu.lock``
for as long as it uses the directory, and a second run is refused with one line
naming the holder's pid. ``flock`` is released by the kernel when the holder
dies, however it dies, so a crashed run never leaves a stale lock behind; the
file itself stays and is harmless.

flock conflicts between two open files of one process too, so this process
keeps one ``DirLock`` per directory and hands it out again (counted): the CLI
takes the checkpoint directory's lock before training, and ``Engine.save``
takes it again without deadlocking on itself. With several ranks only rank 0
locks the checkpoint directory (it alone commits and deletes), and every rank
locks its own NVMe directory (``D/rank-<r>``).

A file that one run appends to (``--json-log``) is locked the same way but on
the file itself (``lock_file``), so that two runs never interleave their
lines: the second is refused before it builds anything. The file holds the
log, not a pid, so the holder is looked up in ``/proc/locks``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
import uuid
from pathlib import Path

__all__ = ["LOCK_FILE", "SCRATCH_PREFIX", "DirLock", "FileLock", "fsync_dir", "lock_dir", "lock_file", "missing_top",
           "remove_made", "scratch_name", "writable_dir"]

LOCK_FILE = ".luwu.lock"

SCRATCH_PREFIX = "luwu-scratch-"
"""Name prefix of the NVMe scratch directories made in the current directory (``luwu train``, ``Engine.load``)."""

_held: dict[Path, "DirLock"] = {}
_mutex = threading.Lock()


class DirLock:
    """An exclusive flock on ``<directory>/.luwu.lock``; ``release`` once per ``lock_dir`` call."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd = fd
        self._count = 1

    def release(self) -> None:
        with _mutex:
            self._count -= 1
            if self._count > 0 or self._fd < 0:
                return
            _held.pop(self.directory, None)
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = -1

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def writable_dir(path: str | os.PathLike, *, flag: str) -> Path:
    """Creates ``path`` if needed and checks that files can be created in it; raises ``OSError`` naming
    the path and ``flag`` (e.g. ``--ckpt-dir``) before any work is done rather than at the first write."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OSError(errno.ENOTDIR, f"{flag} names a file, not a directory; give a directory", str(p))
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create {flag} ({exc.strerror}); give a writable directory", str(p)) from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, f"{flag} is not writable; give a writable directory", str(p))
    return p


def lock_dir(path: str | os.PathLike, *, flag: str) -> DirLock:
    """Takes the lock of directory ``path`` (created if needed) for this process, or raises ``OSError``
    naming the pid that holds it ([Note: directory locks])."""
    directory = writable_dir(path, flag=flag).resolve()
    with _mutex:
        held = _held.get(directory)
        if held is not None:
            held._count += 1
            return held
        lock_path = directory / LOCK_FILE
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot create the lock file of {flag} ({exc.strerror})",
                          str(lock_path)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OSError(errno.EBUSY, f"{flag} is in use by another run (pid {holder}); wait for it to end "
                                           f"or give this run another directory", str(directory)) from None
            raise OSError(exc.errno, f"cannot lock {flag} ({exc.strerror})", str(lock_path)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        lock = _held[directory] = DirLock(directory, fd)
        return lock


class FileLock:
    """An exclusive flock on a file a run writes, held until ``release`` ([Note: directory locks])."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the flock
            self._fd = -1


def _flock_holder(path: Path) -> str:
    """The pid holding a flock on ``path``, from ``/proc/locks`` (``unknown`` where it cannot be read)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            rows = [line.split() for line in f if " FLOCK " in line]
    except OSError:
        return "unknown"
    exact = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    # On overlay file systems the lock names the underlying device: then the inode alone, if it is unique.
    for match in (lambda key: key == exact, lambda key: key.rsplit(":", 1)[-1] == str(st.st_ino)):
        pids = {row[4] for row in rows if len(row) > 5 and match(row[5])}
        if len(pids) == 1:
            return pids.pop()
    return "unknown"


def lock_file(path: str | os.PathLike, *, flag: str) -> FileLock:
    """Opens (creating) file ``path`` and takes an exclusive flock on it for this run, or raises ``OSError``
    naming the pid of the run that holds it ([Note: directory locks])."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot open {flag} ({exc.strerror})", str(p)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise OSError(errno.EBUSY, f"{flag} is in use by another run (pid {_flock_holder(p)}); wait for it to "
                                       f"end or give this run another file", str(p)) from None
        raise OSError(exc.errno, f"cannot lock {flag} ({exc.strerror})", str(p)) from None
    return FileLock(p, fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes the entries of directory ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def missing_top(path: str | os.PathLike) -> Path | None:
    """The outermost directory of ``path`` (made absolute) that does not exist yet, which creating ``path``
    makes; ``None`` when ``path`` exists."""
    top = None
    p = Path(path).absolute()
    while not p.exists():
        top, p = p, p.parent
    return top


def remove_made(path: str | os.PathLike, *, top: str | os.PathLike) -> None:
    """Removes the directory ``path`` with what is in it, then each directory above it up to ``top`` (which
    was made for it: ``missing_top``) that is empty by then. Ranks that share ``top`` each remove their own
    ``path`` in it; the last one out removes ``top`` ([Note: missing directories] in cli/dirs.py)."""
    p, top = Path(path).absolute(), Path(top).absolute()
    assert p == top or top in p.parents, f"{top} is not {p} or above it"
    shutil.rmtree(p, ignore_errors=True)
    while p != top:
        p = p.parent
        try:
            p.rmdir()
        except OSError:  # not empty (another rank's part is still there), or gone already
            return


def scratch_name(directory: str | os.PathLike = os.curdir) -> str:
    """A fresh name ``DIR/luwu-scratch-XXXXXXXX`` that nothing has: for a scratch directory that the one who
    creates it removes again. In the current directory by default: where a user looks for what a run left,
    and on a disk, where the system's temporary directory is often a tmpfs, which is memory."""
    while True:
        path = os.path.join(directory, f"{SCRATCH_PREFIX}{uuid.uuid4().hex[:8]}")
        if not os.path.lexists(path):
            return path
