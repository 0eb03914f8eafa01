"""``TorchGroup`` on real gloo ranks: the collectives it issues are torch 2.13's current API."""

from __future__ import annotations

import rank_jobs
from ranks import run_ranks


def test_all_gather_into_one_buffer_uses_no_deprecated_call() -> None:
    # Every rank printed torch's FutureWarning for all_gather_into_tensor once; warnings are errors here.
    assert run_ranks(rank_jobs.gather_into_one_buffer, 2) == [[1.0, 1.0, 2.0, 2.0]] * 2
