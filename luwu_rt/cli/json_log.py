"""`luwu train --json-log` after a resume: one line per step.

A resume restarts after its checkpoint's step S, so the lines a run wrote past S (steps whose weights no
checkpoint kept) are dropped before it appends: the log then reads as one run whose every step, and every
evaluation, appears once, with the values of the weights the run went on with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["drop_lines_after"]


def _step(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None  # a line torn by a crash mid-write
    return record.get("step") if isinstance(record, dict) else None


def drop_lines_after(path: str | os.PathLike, step: int) -> int:
    """Removes the lines of ``path`` past ``step`` (and torn ones); returns how many went. The file is
    replaced atomically, so a crash leaves the old log or the new one."""
    path = Path(path)
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if (s := _step(line)) is not None and s <= step and line.endswith("\n")]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)
