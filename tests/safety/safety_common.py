"""Helpers of the safety tests (issue 12): `luwu train` as a subprocess, small and fast."""

import json
import subprocess
import sys
from pathlib import Path

SMALL = ["--batch-size", "2", "--seq-len", "16", "--eval-every", "0", "--quiet", "--chunk-size", "64KiB"]


def luwu(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "luwu_rt", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def losses(path: Path) -> dict[int, float]:
    """Step -> training loss of a --json-log (evaluation lines left out)."""
    return {row["step"]: row["loss"] for row in map(json.loads, open(path)) if "loss" in row}


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)
