"""README's test command collects every test file under tests/: pytest's default ``norecursedirs`` once left out
all of tests/dist, the multi-process tests, without a word."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_file_is_collected() -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    assert files - collected == set()
