"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from luwu_rt.exec.chaos import CHAOS_ENV

try:
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:  # hypothesis comes with the test extra; the tests that use it import it themselves
    pass
else:
    import os
    import tempfile

    # Hypothesis keeps its example database (and caches) in ./.hypothesis by default: in the system's temporary
    # directory instead, so that running the tests leaves the working tree as it was.
    set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), f"luwu-hypothesis-{os.getuid()}"))

CHAOS_SEED = 20240611


class ChaosSwitch:
    """The chaos mode (luwu_rt/exec/chaos.py) switched on through ``LUWU_CHAOS_SEED``
    for the test; executors and engines created meanwhile run with random delays around every op.
    ``off()`` builds the plain run to compare against."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
        self._monkeypatch = monkeypatch
        self.seed = seed
        self.set(seed)

    def set(self, seed: int) -> None:
        """Switches to another seed (for executors created from now on)."""
        self.seed = seed
        self._monkeypatch.setenv(CHAOS_ENV, str(seed))

    @contextmanager
    def off(self) -> Iterator[None]:
        """Executors and engines created inside the block run without chaos."""
        with self._monkeypatch.context() as m:
            m.delenv(CHAOS_ENV, raising=False)
            yield


@pytest.fixture
def chaos(monkeypatch: pytest.MonkeyPatch) -> ChaosSwitch:
    """Chaos mode on, with a fixed seed (``chaos.set(seed)`` for another)."""
    return ChaosSwitch(monkeypatch, CHAOS_SEED)



@pytest.fixture
def no_chaos(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chaos mode off for the test, even in a run started with ``LUWU_CHAOS_SEED`` set: the plain side
    of a plain/chaos pair."""
    monkeypatch.delenv(CHAOS_ENV, raising=False)



# [Note: which profile] in engine/hwprofile.py: `luwu plan`, `luwu train` and the engine plan with this machine's
# cached calibration when there is one. The tests (and the processes they start, which inherit the environment)
# get an empty cache of their own, so that a `luwu calibrate` run on this machine changes no prediction they check.
import os as _os  # noqa: E402
import tempfile as _tempfile  # noqa: E402

_os.environ["LUWU_CACHE_DIR"] = _tempfile.mkdtemp(prefix="luwu-test-cache-")
