"""The project's static and test-run settings hold: ``ruff check`` (its rules in pyproject.toml) passes on the
package, its tests, its benchmarks and tools, and a warning raised from the package's own code fails a test."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str] | None:
    if importlib.util.find_spec("ruff") is not None:  # the package pip installs, with its binary
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    return [found] if found else None


def test_ruff_comes_with_the_test_extra() -> None:
    """CI installs the test extra, so there the lint test below runs rather than skips."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "ruff" for dep in extras["test"]), extras["test"]


@pytest.mark.skipif(_ruff() is None, reason="ruff is not installed: pip install 'luwu_rt[test]'")
def test_ruff_check_passes() -> None:
    result = subprocess.run([*_ruff(), "check", "--no-cache", "luwu_rt", "tests", "benchmarks", "tools"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_warning_from_the_package_fails_the_test() -> None:
    """pyproject.toml's filterwarnings: raised from a ``luwu_rt`` module, a warning is an error; raised by a
    library about itself it stays a warning."""
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("deprecated", DeprecationWarning, "luwu_rt/engine/engine.py", 1,
                               module="luwu_rt.engine.engine")
    with pytest.raises(UserWarning):
        warnings.warn_explicit("suspicious", UserWarning, "luwu_rt/exec/step.py", 1, module="luwu_rt.exec.step")
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit("about itself", UserWarning, "torch/x.py", 1, module="torch.x")
    assert [str(w.message) for w in seen] == ["about itself"]
