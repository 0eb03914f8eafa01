"""What every benchmark's report shares: the machine it ran on, and printing (and saving) the markdown."""

from __future__ import annotations

import contextlib


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo."""
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return "unknown CPU"


def emit(lines: list[str], out: str | None) -> None:
    """Prints the report and, with ``out``, writes it there too."""
    report = "\n".join(lines)
    print(report)
    if out:
        with open(out, "w") as f:
            f.write(report + "\n")
