"""Directories the commands work in: one way to treat a missing one, the scratch NVMe tier of a run that
names none, and whether a directory is on a disk that takes O_DIRECT.

[Note: missing directories]
Every command treats a directory the user names the same way: one that does not exist is created, and
the command says so on stderr (a typo should not fill another disk unnoticed); a file in its place is a
one-line error. One rule then says what happens to it: a command removes at exit what it created for
scratch, however it exits, unless told to keep it (``--keep-nvme-state``), and leaves a directory that
existed as it was but for its own files. So ``luwu train --nvme-dir D`` removes ``D`` when the run made it
(the engine that created it removes it when it closes: ``Engine`` in engine/engine.py, the tier's files
and lock file with it, each rank its ``D/rank-<r>`` and the last one ``D``), and only the tier's files
``D/luwu_state`` when ``D`` was there before (its lock file stays: [Note: directory locks] in fs.py); the
benchmarks' ``--nvme-dir`` and ``--dir`` alike (``created_dir``). ``luwu plan`` creates nothing: it plans
with the free space of the disk the directory would be made on. ``luwu train`` without ``--nvme-dir``
makes a scratch directory ``./luwu-scratch-*`` and removes it at exit (success, error or Ctrl-C), or as
soon as the plan keeps nothing on NVMe, and ``luwu plan`` without ``--nvme-dir`` plans with the free space
of the current directory's disk, so the two answer alike; ``Engine.load`` from Python, which never reuses
the saved run's NVMe directory, gives a loaded run that had one a fresh ``./luwu-scratch-*`` that it
removes when it closes. A run refused before it starts (it does not fit, a checkpoint it cannot resume)
leaves nothing behind: ``nothing_left_on_error`` removes the directories it created and the lock files
it made in existing ones.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from luwu_rt.fs import SCRATCH_PREFIX, missing_top

__all__ = ["SCRATCH_PREFIX", "Scratch", "created_dir", "disk_problem", "free_bytes", "nothing_left_on_error",
           "scratch_dir"]

# File systems that keep their files in memory: a tier there measures RAM, not a disk.
_MEMORY_FS = ("tmpfs", "ramfs", "devtmpfs")


@contextlib.contextmanager
def nothing_left_on_error(*paths: str | os.PathLike | None) -> Iterator[list]:
    """If the block raises, removes what it made of ``paths``: each one's outermost directory that did not
    exist before (when it holds nothing but lock files and empty directories, so a failure never takes
    data with it), a file that did not exist (when still empty), and the lock file of an existing
    directory that had none ([Note: missing directories]).
    Locks the block appends to the list it gets are released after their files are gone: never before,
    or another run could take a lock whose file is then removed under it."""
    from luwu_rt.fs import LOCK_FILE

    given = [Path(p) for p in paths if p]
    made = [top for p in given if (top := missing_top(p)) is not None]
    locks = [p / LOCK_FILE for p in given if p.is_dir() and not (p / LOCK_FILE).exists()]
    held: list = []
    try:
        yield held
    except BaseException:
        for lock in locks:
            lock.unlink(missing_ok=True)
        for top in made:
            if top.is_file():  # a file it created (a log): removed while it is still empty
                if top.stat().st_size == 0:
                    top.unlink()
            elif all(f.name == LOCK_FILE for f in top.rglob("*") if not f.is_dir()):
                shutil.rmtree(top, ignore_errors=True)
        for lock in held:
            lock.release()
        raise


def free_bytes(path: str | os.PathLike) -> int:
    """Free space of the disk ``path`` is on, or would be created on (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


@contextlib.contextmanager
def created_dir(path: str | os.PathLike, *, flag: str) -> Iterator[Path]:
    """``path`` as a working directory of a command that keeps nothing in it: created (and said) when
    missing, and what was created removed when the block ends, however it ends ([Note: missing
    directories])."""
    from luwu_rt.fs import writable_dir

    made = missing_top(Path(path))
    try:
        directory = writable_dir(path, flag=flag)  # a file in its place or no permission: one line, now
        if made is not None:
            print(f"creating {flag} {path} (it did not exist; removed at exit)", file=sys.stderr)
        yield directory
    finally:
        if made is not None:  # also the parents a failed mkdir made before it failed
            shutil.rmtree(made, ignore_errors=True)


_REAPER = "import shutil, sys\nsys.stdin.buffer.read()\nshutil.rmtree(sys.argv[1], ignore_errors=True)\n"
"""[Note: a scratch directory outlives no process]: waits for the end of its stdin, then removes the directory."""


class Scratch:
    """A scratch directory this process made; ``remove`` is idempotent.

    [Note: a scratch directory outlives no process]
    A process killed by SIGKILL runs no ``finally``: its scratch directory (the NVMe tier, the size of the
    model's optimizer state) would stay. So a small reaper process is started beside it, reading a pipe
    whose only writer is this process: the kernel closes the pipe when this process ends, however it ends,
    and the reaper then removes the directory. The reaper is in a session of its own, so the terminal's
    Ctrl-C does not end it first."""

    def __init__(self, path: str, *, reaper: bool = False) -> None:
        self.path = path
        self.removed = False
        self._pipe: int | None = None
        self._reaper: subprocess.Popen | None = None
        if reaper:
            read, self._pipe = os.pipe()  # not inherited by the processes this one starts (ranks, nodes)
            try:
                self._reaper = subprocess.Popen([sys.executable, "-S", "-c", _REAPER, os.path.abspath(path)],
                                                stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                start_new_session=True)
            finally:
                os.close(read)

    def remove(self) -> None:
        if not self.removed:
            shutil.rmtree(self.path, ignore_errors=True)
            self.removed = True
        self.release()

    def release(self) -> None:
        """Ends the reaper (it removes what is left of the directory, if anything)."""
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self._reaper is not None:
            try:
                self._reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._reaper = None


@contextlib.contextmanager
def scratch_dir(*, flag: str, keep: bool = False) -> Iterator[Scratch]:
    """A fresh ``./luwu-scratch-*`` directory in the current directory, removed when the block ends
    (also on an error or a KeyboardInterrupt, and when this process is killed: [Note: a scratch directory
    outlives no process]) unless ``keep``. Under the current directory because that is where a user looks
    for what a command left, and the system's temporary directory is often a tmpfs, which is memory, not a
    disk ([Note: missing directories])."""
    try:
        path = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=os.curdir)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot make the NVMe scratch directory here ({exc.strerror}); run from a "
                                 f"writable directory or pass {flag} DIR", os.getcwd()) from None
    scratch = Scratch(path, reaper=not keep)
    try:
        yield scratch
    finally:
        if not keep:
            scratch.remove()


def _fs_type(path: Path) -> str | None:
    """The file system type of the mount ``path`` is on, from /proc/self/mountinfo (``None`` if unknown)."""
    target, best, kind = str(path.resolve()), -1, None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                mount = fields[4].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > best:
                    best, kind = len(mount), line.split(" - ", 1)[1].split()[0]
    except OSError:
        return None
    return kind


def disk_problem(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` is not a real disk that takes O_DIRECT, or ``None`` when it is. The IO engine
    works either way (without O_DIRECT it goes through the page cache); this is what a run says
    about it, so that a tier in memory is never taken for a disk."""
    path = Path(directory)
    kind = _fs_type(path)
    if kind in _MEMORY_FS:
        return f"is on {kind}, which keeps files in memory, not on a disk"
    probe = path / f".luwu-direct-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # the file system has no O_DIRECT
            return f"is on a file system ({kind or 'unknown'}) without O_DIRECT"
        raise OSError(exc.errno, f"cannot create a file in the NVMe directory ({exc.strerror})", str(path)) from None
    try:
        with mmap.mmap(-1, 4096) as page:  # page-aligned, as O_DIRECT needs
            os.write(fd, page)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise OSError(exc.errno, f"cannot write in the NVMe directory ({exc.strerror})", str(path)) from None
        return f"is on a file system ({kind or 'unknown'}) that refuses O_DIRECT writes"
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
    return None
