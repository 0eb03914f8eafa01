"""Helpers for a user's own test suite: plan a step, assert it is safe, assert one schedule beats another.

Plain functions that raise ``AssertionError`` with the reason, so that pytest (or any runner) shows it; no
pytest import, no fixtures to register. docs/testing-swap-schedules.md walks through a test written with them.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from luwu_rt.plan import (Budgets, Collective, HardwareProfile, ModelSpec, Op, Placement, PlanError, Policy, ShardId,
                          ShardInfo, Strategy, SwapPlan, plan_auto, plan_step, validate, validate_ranks)
from luwu_rt.plan.spec import PERSISTENT_KINDS
from luwu_rt.testing.simulate import SimResult, simulate

__all__ = ["assert_faster", "assert_valid", "hand_plan", "plan_for"]


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


def hand_plan(ops: Sequence[Op], *, shards: Mapping[ShardId, int], homes: Mapping[str, str], budgets: Budgets,
              strategy: Strategy = Strategy(), home_slots: Mapping[ShardId, int | None] | None = None,
              device_reserve_bytes: int = 0) -> SwapPlan:
    """A ``SwapPlan`` of ``ops`` built by hand, for ``validate`` and ``simulate``. ``shards``: the bytes of every
    shard the ops touch; ``homes``: each state kind's home tier. The home copy of each persistent shard
    (``param``, ``master``, ``exp_avg``, ``exp_avg_sq``) exists before the first op, at ``home_slots[shard]``
    or, by default, packed from the start of its tier's arena in the order of ``shards``. Each communication
    queue's process group is the one its collectives name."""
    missing = sorted({s.state for s in shards} - set(homes))
    if missing:
        raise ValueError(f"hand_plan: no home tier for state(s) {missing}; add them to homes=")
    if home_slots is None:
        home_slots, top = {}, {"device": 0, "host": 0}
        for shard, nbytes in shards.items():
            if shard.state in PERSISTENT_KINDS:
                tier = homes[shard.state]
                home_slots[shard] = top.get(tier)
                if tier in top:
                    top[tier] += nbytes
    groups = {op.queue: op.group for op in ops if isinstance(op, Collective) and op.group}
    return SwapPlan(ops=tuple(ops), shards={s: ShardInfo(n, n // 2, 0, 1) for s, n in shards.items()},
                    homes=dict(homes), chunk_bytes=max(shards.values(), default=4096), budgets=budgets,
                    arena_bytes={"device": budgets.device_bytes - device_reserve_bytes, "host": budgets.host_bytes},
                    device_reserve_bytes=device_reserve_bytes, strategy=strategy, policy="hand", peak_bytes={},
                    comm_groups=groups, home_slots=home_slots)


def assert_valid(plan: SwapPlan | Sequence[SwapPlan], *, profile: HardwareProfile = HardwareProfile(),
                 chaos_seeds: Iterable[int] = range(8)) -> SimResult:
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
