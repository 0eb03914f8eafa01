"""``TorchGroup`` on real gloo ranks: the collectives it issues are torch 2.13's current API, and its gloo
reduce-scatter and all-gather (point to point) compute what the collectives define."""

from __future__ import annotations

import rank_jobs
from ranks import run_ranks


def test_all_gather_into_one_buffer_uses_no_deprecated_call() -> None:
    # Every rank printed torch's FutureWarning for all_gather_into_tensor once; warnings are errors here.
    assert run_ranks(rank_jobs.gather_into_one_buffer, 2) == [[1.0, 1.0, 2.0, 2.0]] * 2


def test_gloo_reduce_scatter_and_all_gather_are_exact_on_three_ranks_and_a_subgroup() -> None:
    results = run_ranks(rank_jobs.point_to_point_collectives, 3)
    assert results[1] == {"world reduce_scatter": True, "world all_gather": True}
    for r in (0, 2):
        assert results[r] == {"world reduce_scatter": True, "world all_gather": True,
                              "subgroup reduce_scatter": True, "subgroup all_gather": True}
