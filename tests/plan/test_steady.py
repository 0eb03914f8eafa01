"""Steady-state plans (issue 21 item 1): a step is one period of a pipeline, its tail of write-backs running
beside the next period's first ops; the validator replays two periods back to back and rejects a wrap-around
that races."""

from __future__ import annotations

import dataclasses

import pytest

from luwu_rt.models.presets import get_preset
from luwu_rt.plan import (Budgets, Free, HardwareProfile, Load, Placement, PlanError, Store, estimate, gpt_model_spec,
                          plan_step, validate)
from luwu_rt.plan.cost import steady_seconds
from luwu_rt.plan.steady import partner, periods, tail_ops, wrap_deps

PLACEMENTS = [Placement(params="host", optimizer="nvme", grads="device"),
              Placement(params="nvme", optimizer="nvme", grads="nvme"),
              Placement(params="device", optimizer="host", grads="host")]
BALANCED = HardwareProfile(nvme_read_gbps=0.2, nvme_write_gbps=0.2, compute_flops=1e9)
"""Compute and the disk about as busy as each other: a step run alone fills and drains its pipeline."""


def _plan(placement: Placement, *, double_buffer: bool = False, host: int = 6 << 20):
    model = gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 << 10, batch_size=2, seq_len=16)
    model = dataclasses.replace(model, double_buffer=double_buffer)
    return plan_step(model, budgets=Budgets(device_bytes=64 << 20, host_bytes=host), placement=placement)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: f"{p.params}-{p.optimizer}-{p.grads}")
def test_a_training_plan_is_a_valid_period_of_a_pipeline(placement) -> None:
    plan = _plan(placement, host=16 << 20)
    assert plan.tail and len(plan.wrap_deps) == len(plan.ops)
    assert all(isinstance(plan.ops[i], (Store, Free)) for i in plan.tail)
    assert plan.tail == tail_ops(plan) and plan.wrap_deps == wrap_deps(partner(plan), plan)
    validate(plan)  # which replays two periods back to back
    validate(periods(plan, 3))


def test_a_double_buffered_plan_alternates_with_its_mirror() -> None:
    plan = _plan(PLACEMENTS[0], double_buffer=True)
    other = partner(plan)
    assert other is not plan and other.wrap_deps == plan.wrap_deps
    validate(plan)
    validate(other)
    # The second period reads the half the first wrote: its first load of master_b waits for that write.
    both = periods(plan, 2)
    n = len(plan.ops)
    writes = {i for i, op in enumerate(plan.ops) if isinstance(op, Store) and op.dst == "nvme"
              and op.shard.state == "master_b"}
    reads = [i for i, op in enumerate(other.ops) if isinstance(op, Load) and op.src == "nvme"
             and op.shard.state == "master_b"]
    assert reads and all(set(both.ops[n + i].deps) & writes for i in reads[:1])


def _mutant(plan, index: int, dropped: int):
    deps = tuple(d for d in plan.wrap_deps[index] if d != dropped)
    return dataclasses.replace(plan, wrap_deps=plan.wrap_deps[:index] + (deps,) + plan.wrap_deps[index + 1:])


def test_the_validator_rejects_a_racing_wrap_around() -> None:
    """Mutation test: drop, one at a time, each wrap dependency on the previous period's tail; every mutant whose
    op would reuse bytes the tail still uses, or read a home copy the tail is still writing, is rejected."""
    plan = _plan(PLACEMENTS[1], double_buffer=True)
    rejected = 0
    for i, deps in enumerate(plan.wrap_deps):
        for d in deps:
            if d not in plan.tail:
                continue  # the previous period's run returned after it: ordered without this dependency
            try:
                validate(_mutant(plan, i, d))
            except PlanError as exc:
                assert "wrap-around into the next period" in str(exc)
                rejected += 1
            else:  # only where another path of dependencies orders the two all the same
                both = periods(_mutant(plan, i, d), 2)
                assert d in _ancestors(both, len(plan.ops) + i), f"dropping op {i}'s wrap dependency on op {d} " \
                                                                 f"went unnoticed"
    assert rejected >= 5


def _ancestors(plan, index: int) -> set[int]:
    seen, todo = set(), [index]
    while todo:
        for d in plan.ops[todo.pop()].deps:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_a_reuse_of_the_tails_bytes_without_waiting_for_its_free_is_named() -> None:
    plan = _plan(PLACEMENTS[0])
    n = len(plan.ops)
    i, d = next((i, d) for i, deps in enumerate(plan.wrap_deps) for d in deps
                if isinstance(plan.ops[d], Free) and d in plan.tail and plan.ops[i].outputs)
    with pytest.raises(PlanError, match=rf"wrap-around .* op {n + i} .* without depending on op {d}, the Free"):
        validate(_mutant(plan, i, d))


def test_in_steady_state_the_tail_overlaps_the_next_step() -> None:
    """A step in steady state is shorter than one run alone (its write-backs no longer hold the next step's start),
    and no shorter than the disk's or the compute's busy time."""
    plan = _plan(PLACEMENTS[0])
    cold = estimate(plan, BALANCED).predicted_step_s
    steady = estimate(plan, BALANCED, steady=True)
    disk = steady.busy_s.get("nvme_read", 0) + steady.busy_s.get("nvme_write", 0)
    assert max(disk, steady.busy_s["compute"]) <= steady.predicted_step_s < cold
    assert steady_seconds(plan, BALANCED) == steady.predicted_step_s
