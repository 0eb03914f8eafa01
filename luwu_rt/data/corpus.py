"""The default corpus: the Python standard library's own source, as bytes.

Every machine that runs luwu_rt has it, so ``luwu train`` learns something
real with no download. Files are read in sorted order of their path relative
to the stdlib root, so the corpus is the same on every run of one Python
installation; reading stops at a byte cap so start-up stays quick.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

__all__ = ["DEFAULT_CORPUS_BYTES", "stdlib_corpus", "stdlib_source_files"]

DEFAULT_CORPUS_BYTES = 4 * 2**20
"""Enough text for a small model to learn from for thousands of steps, read in well under a second."""

# Third-party code lives under these in some installations; it differs between
# machines with the same Python, so it is not part of the corpus.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

# Files are separated so that no training window silently splices two files'
# tokens without a boundary a model can learn.
_FILE_SEPARATOR = b"\n\n"


def stdlib_source_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Every ``*.py`` under the stdlib root, sorted by relative path."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise OSError(f"the Python standard library directory {str(base)!r} does not exist; pass --data PATH "
                      "with a text file to train on")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        here = Path(dirpath)
        for name in filenames:
            if name.endswith(".py"):
                path = here / name
                found.append((path.relative_to(base).as_posix(), path))
    found.sort()
    return [path for _, path in found]


def stdlib_corpus(*, max_bytes: int = DEFAULT_CORPUS_BYTES, root: str | os.PathLike | None = None) -> bytes:
    """Up to ``max_bytes`` of concatenated stdlib source, deterministic for one installation."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, not {max_bytes}")
    parts: list[bytes] = []
    total = 0
    for path in stdlib_source_files(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue  # an unreadable file (permissions) is skipped; the order of the rest is unchanged
        if not data:
            continue
        parts.append(data + _FILE_SEPARATOR)
        total += len(parts[-1])
        if total >= max_bytes:
            break
    corpus = b"".join(parts)[:max_bytes]
    if not corpus:
        raise OSError(f"found no Python source under {str(root or sysconfig.get_paths()['stdlib'])!r}; "
                      "pass --data PATH with a text file to train on")
    return corpus
