"""Helpers for a user's own test suite: plan a step, assert it is safe, assert one schedule beats another.

Plain functions that raise ``AssertionError`` with the reason, so that pytest (or any runner) shows it; no
pytest import, no fixtures to register. docs/testing-swap-schedules.md walks through a test written with them.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from luwu_rt.plan import (Budgets, HardwareProfile, ModelSpec, Placement, PlanError, Policy, Strategy, SwapPlan,
                          plan_auto, plan_step, validate, validate_ranks)
from luwu_rt.testing.simulate import SimResult, simulate

__all__ = ["assert_faster", "assert_valid", "plan_for"]


def plan_for(model: ModelSpec, *, budgets: Budgets, policy: str | Policy = "belady",
             placement: Placement = Placement(), strategy: Strategy = Strategy(),
             profile: HardwareProfile = HardwareProfile()) -> SwapPlan:
    """One rank's plan of a step of ``model`` within ``budgets``, made with ``policy`` (a built-in's name or
    a ``Policy``), and checked by ``validate``: under ``placement`` as given, or, where a field is ``auto``
    (the default), the fastest placement that fits on ``profile``. Raises ``ValueError`` (``OutOfBudget``,
    ``DoesNotFit``) naming the memory it needs when it does not fit."""
    if placement.is_resolved:
        plan = plan_step(model, budgets=budgets, placement=placement, strategy=strategy, policy=policy)
    else:
        plan = plan_auto(model, budgets=budgets, placement=placement, strategy=strategy, profile=profile,
                         policy=policy).plan
    validate(plan)
    return plan


def assert_valid(plan: SwapPlan | Sequence[SwapPlan], *, profile: HardwareProfile = HardwareProfile(),
                 chaos_seeds: Iterable[int] = range(3)) -> SimResult:
    """Assert that ``plan`` is safe: ``validate`` (``validate_ranks`` for one plan per rank) finds no broken
    invariant, and ``simulate`` finds no race, without chaos and under each of ``chaos_seeds``. Returns the
    simulation without chaos."""
    try:
        if isinstance(plan, SwapPlan):
            validate(plan)
        else:
            validate_ranks(list(plan))
    except PlanError as exc:
        raise AssertionError(f"the plan breaks an invariant: {exc}") from None
    plain = None
    for seed in (None, *chaos_seeds):
        try:
            result = simulate(plan, profile, chaos_seed=seed)
        except PlanError as exc:  # a RaceError names the two ops
            under = "" if seed is None else f" under chaos seed {seed}"
            raise AssertionError(f"simulating the plan{under} found a race: {exc}") from None
        plain = plain or result
    return plain


def _name(plan: SwapPlan | Sequence[SwapPlan]) -> str:
    first = plan if isinstance(plan, SwapPlan) else plan[0]
    return f"the {first.policy} plan ({len(first.ops)} ops)"


def assert_faster(fast: SwapPlan | Sequence[SwapPlan], slow: SwapPlan | Sequence[SwapPlan], *,
                  profile: HardwareProfile = HardwareProfile(), by: float = 1.0) -> float:
    """Assert that ``fast``'s simulated step is shorter than ``slow``'s on ``profile``, by at least the factor
    ``by`` (1.0: any amount). Returns the speedup, ``slow``'s step time over ``fast``'s."""
    if not by >= 1.0:
        raise ValueError(f"assert_faster: by={by} must be at least 1.0 (the factor fast must beat slow by)")
    a, b = simulate(fast, profile), simulate(slow, profile)
    speedup = b.step_s / a.step_s if a.step_s > 0 else float("inf") if b.step_s > 0 else 1.0
    if not (a.step_s < b.step_s and speedup >= by):
        need = f" by at least {by:g}x" if by > 1.0 else ""
        raise AssertionError(f"{_name(fast)} is not faster{need} than {_name(slow)}: its simulated step takes "
                             f"{a.step_s:.6g} s (bottleneck {a.bottleneck}) against {b.step_s:.6g} s (bottleneck "
                             f"{b.bottleneck}), a speedup of {speedup:.4g}x")
    return speedup
