"""The data-parallel strategies as plans: ZeRO's memory table, every rank's plan valid and issuing each
group's collectives in one order, collectives with their buffers, gathers prefetched during backward."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luwu_rt.models.presets import get_preset
from luwu_rt.plan import (STRATEGIES, Budgets, Collective, Compute, Gather, ModelSpec, NormReduce, OptimStep, Placement,
                          Reduce, Strategy, UnitSpec, Wait, gpt_model_spec, plan_step)
from luwu_rt.plan.analysis import state_bytes
from luwu_rt.plan.validate import PlanError, validate_ranks

ALIGN = 4096
SEVERAL_RANKS = [s for s in STRATEGIES if s != "local"]
"""Every strategy that runs on several ranks (workers, for node)."""
ROOMY = Budgets(device_bytes=1 << 40, host_bytes=1 << 40)
ON_DEVICE = Placement(params="device", optimizer="device", grads="device")


@pytest.mark.parametrize("world", [1, 2, 8, 64])
@pytest.mark.parametrize("elem", [2, 4], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3"])
def test_state_bytes_per_rank_follow_the_zero_table(name, world, elem) -> None:
    model = ModelSpec(units=tuple(UnitSpec(name=f"u{i}", num_params=n) for i, n in
                                  enumerate([3_000_000, 1_250_001, 1_250_001, 777_777, 2_000_000])),
                      param_bytes=elem, grad_bytes=elem, chunk_bytes=1 << 20)
    plan = plan_step(model, budgets=ROOMY, placement=ON_DEVICE, strategy=Strategy(name=name, world_size=world))
    got = sum(state_bytes(plan).values())
    p = g = elem
    per_param = {"ddp": p + g + 12, "zero1": p + g + 12 / world, "zero2": p + (g + 12) / world,
                 "zero3": (p + g + 12) / world}[name]
    want = per_param * model.num_params
    # 1%, plus each unit's buffers rounded up to 4 KiB and to a multiple of the world size.
    slack = len(model.units) * 5 * (ALIGN + 4 * world)
    assert abs(got - want) <= 0.01 * want + slack, (got, want)


def test_zero1_keeps_full_gradients_and_zero2_shards_them() -> None:
    model = gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 << 10)
    plans = {n: plan_step(model, budgets=ROOMY, placement=ON_DEVICE, strategy=Strategy(name=n, world_size=4))
             for n in ("zero1", "zero2")}
    one, two = state_bytes(plans["zero1"]), state_bytes(plans["zero2"])
    assert one["param"] == two["param"] and one["master"] == two["master"]
    assert one["grad"] > 3 * two["grad"]
    # zero1 reduce-scatters its kept gradients once, after the last micro-batch; zero2 as backward goes.
    kinds = {n: {a.shard.state for op in p.ops if isinstance(op, Reduce) for a in op.inputs} for n, p in plans.items()}
    assert kinds == {"zero1": {"grad"}, "zero2": {"grad_full"}}


def _strategy(name: str, world: int) -> Strategy:
    return Strategy(name=name, world_size=world, group_size=2 if name == "hsdp" else 0)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("name", SEVERAL_RANKS)
def test_every_rank_plan_validates_and_collectives_have_buffers(name, world) -> None:
    model = gpt_model_spec(get_preset("gpt-tiny"), batch_size=2, seq_len=64, num_micro_batches=2,
                           chunk_bytes=64 << 10)
    budgets = Budgets(device_bytes=24 << 20, host_bytes=64 << 20)
    placement = Placement(params="host", optimizer="host", grads="host")
    plans = [plan_step(model, budgets=budgets, placement=placement, strategy=_strategy(name, world))
             for _ in range(world)]
    validate_ranks(plans)
    plan = plans[0]
    starts = [op for op in plan.ops if isinstance(op, Collective)]
    assert starts and all(op.inputs or op.outputs for op in starts)
    assert plan.count("Wait") == len(starts)
    assert all(op.queue in plan.comm_groups or op.collective == "local" for op in starts)


def test_gathers_are_prefetched_during_backward() -> None:
    """zero3: the gather for B(k-1) depends only on its slice and its workspace's free, so it can start
    while B(k) computes; and no reduce-scatter sits in front of it (separate queues)."""
    model = gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 << 10)
    plan = plan_step(model, budgets=Budgets(device_bytes=64 << 20, host_bytes=64 << 20),
                     placement=Placement(params="host", optimizer="host", grads="host"),
                     strategy=Strategy(name="zero3", world_size=8))
    ops = plan.ops
    position = {op.name: i for i, op in enumerate(ops) if isinstance(op, Compute)}
    ancestors: list[set[int]] = []
    for op in ops:
        ancestors.append(set(op.deps).union(*(ancestors[d] for d in op.deps)))
    last = len(model.units) - 1
    for k in range(last, 1, -1):
        gather = next(i for i, op in enumerate(ops) if isinstance(op, Gather) and op.unit == k - 1
                      and i > position[f"B{k + 1}" if k < last else f"F{last - 1}"] and i < position[f"B{k - 1}"])
        assert position[f"B{k}"] not in ancestors[gather], f"the gather for B{k - 1} waits for B{k}"
        # Nor for the reduce-scatter of B(k)'s gradients: it runs on its own queue and group.
        assert ops[gather].queue == "gather"
        assert not any(isinstance(ops[d], Reduce) and ops[d].unit == k for d in ancestors[gather])


@st.composite
def _cases(draw):
    num_units = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 200_000), min_size=num_units, max_size=num_units))
    tied = num_units > 2 and draw(st.booleans())
    units = tuple(UnitSpec(name=f"u{i}", num_params=n, reads=(0,) if tied and i == num_units - 1 else ())
                  for i, n in enumerate(sizes))
    elem = draw(st.sampled_from([2, 4]))
    micro = draw(st.sampled_from([1, 2, 3]))
    model = ModelSpec(units=units, param_bytes=elem, grad_bytes=elem, chunk_bytes=draw(st.integers(1, 16)) * ALIGN,
                      max_shards_per_state=draw(st.integers(1, 3)), tokens_per_step=6 * micro,
                      num_micro_batches=micro, optimizer_waits_for_backward=draw(st.booleans()))
    name = draw(st.sampled_from(SEVERAL_RANKS))
    world = draw(st.sampled_from([2, 4, 8]))
    tiers = st.sampled_from(["device", "host", "nvme"])
    placement = Placement(params=draw(tiers), optimizer=draw(tiers), grads=draw(tiers))
    budgets = Budgets(device_bytes=draw(st.integers(0, 4 << 20)), host_bytes=draw(st.integers(0, 8 << 20)))
    return model, _strategy(name, world), placement, budgets


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_random_strategies_give_valid_rank_plans_or_a_clear_error(case) -> None:
    model, strategy, placement, budgets = case
    try:
        plan = plan_step(model, budgets=budgets, placement=placement, strategy=strategy)
    except ValueError as exc:
        assert "too small" in str(exc) or "smaller than" in str(exc), str(exc)
        return
    validate_ranks([plan] * strategy.world_size)
    starts = [i for i, op in enumerate(plan.ops) if isinstance(op, Collective)]
    waits = [op.start for op in plan.ops if isinstance(op, Wait)]
    assert sorted(waits) == starts


def test_ranks_issuing_a_group_in_different_orders_are_rejected() -> None:
    model = gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 << 10)
    budgets, placement = Budgets(device_bytes=64 << 20, host_bytes=64 << 20), ON_DEVICE
    zero3 = plan_step(model, budgets=budgets, placement=placement, strategy=Strategy(name="zero3", world_size=2))
    zero2 = plan_step(model, budgets=budgets, placement=placement, strategy=Strategy(name="zero2", world_size=2))
    with pytest.raises(PlanError, match="different collectives on group 'world'"):
        validate_ranks([zero3, zero2])


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3"])
def test_an_update_overlaps_the_next_units_collectives_when_clipping_is_off(name) -> None:
    """Clipping off: unit k's optimizer step depends on its own reduction only, and unit k-1's reduction
    depends on no optimizer step, so both can be in flight at once; with clipping on every update waits
    for the norm's all-reduce, which waits for every reduction."""
    for clip in (False, True):
        model = replace(gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 << 10), optimizer_waits_for_backward=clip)
        plan = plan_step(model, budgets=ROOMY, placement=Placement(params="device", optimizer="host", grads="host"),
                         strategy=Strategy(name=name, world_size=2))
        ops = plan.ops
        ancestors: list[set[int]] = []
        for op in ops:
            ancestors.append(set(op.deps).union(*(ancestors[d] for d in op.deps)))
        for k in range(len(model.units) - 1, 0, -1):
            step = next(i for i, op in enumerate(ops) if isinstance(op, OptimStep) and op.unit == k)
            reduce_prev = next(i for i, op in enumerate(ops) if isinstance(op, Reduce) and op.unit == k - 1)
            norm = next(i for i, op in enumerate(ops) if isinstance(op, NormReduce))
            if clip:
                assert norm in ancestors[step], f"{name}: the update of unit {k} does not wait for the norm"
            else:
                assert reduce_prev not in ancestors[step], \
                    f"{name}: the update of unit {k} waits for unit {k - 1}'s reduce"
                assert not any(isinstance(ops[d], OptimStep) for d in ancestors[reduce_prev] | {reduce_prev}), \
                    f"{name}: unit {k - 1}'s reduce waits for an optimizer step"
