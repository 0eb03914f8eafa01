"""One model of time: ``simulate`` without chaos or faults gives ``estimate``'s step time, busy time and bytes
moved - exactly, for one plan with symmetric peers and for one plan per rank with synchronised collectives -
over a sweep of models, budgets, placements, strategies, world sizes and policies."""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from luwu_rt.plan import (Budgets, HardwareProfile, ModelSpec, Placement, Strategy, UnitSpec, estimate, lower_bounds,
                          plan_node, plan_step)
from luwu_rt.testing import simulate

from plans import tiny_model

TIER = st.sampled_from(["device", "host", "nvme"])
PROFILES = st.sampled_from([HardwareProfile(), HardwareProfile(nvme_read_gbps=0.7, h2d_gbps=3.0, net_gbps=1.0,
                                                               compute_flops=5e12, host_optim_params_per_s=2e8)])


@st.composite
def models(draw) -> ModelSpec:
    if draw(st.booleans()):
        return tiny_model(batch_size=draw(st.sampled_from([1, 4])), seq_len=64,
                          num_micro_batches=draw(st.sampled_from([1, 2])))
    num_units = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(1, 200_000), min_size=num_units, max_size=num_units))
    tied = num_units > 2 and draw(st.booleans())
    units = tuple(UnitSpec(name=f"u{i}", num_params=n, flops_per_token=2 * n,
                           reads=(0,) if tied and i == num_units - 1 else ()) for i, n in enumerate(sizes))
    return ModelSpec(units=units, chunk_bytes=draw(st.integers(1, 16)) * 16 * 1024,
                     max_shards_per_state=draw(st.integers(1, 3)), tokens_per_step=draw(st.integers(0, 8)) * 12,
                     num_micro_batches=draw(st.sampled_from([1, 2, 3])), activation_bytes=32 * 1024,
                     optimizer_waits_for_backward=draw(st.booleans()))


@st.composite
def strategies_(draw) -> Strategy:
    name = draw(st.sampled_from(["local", "ddp", "zero1", "zero2", "zero3", "hsdp", "node"]))
    world = 1 if name == "local" else draw(st.sampled_from([2, 4]))
    return Strategy(name=name, world_size=world, group_size=2 if name == "hsdp" else 0)


def assert_agrees(plan, profile, **kw) -> None:
    want = estimate(plan, profile, **kw)
    for got in (simulate(plan, profile, **kw),) + ((simulate([plan] * plan.strategy.world_size, profile),)
                                                    if not kw else ()):
        assert got.step_s == want.predicted_step_s  # the issue asks 1%; one simulation makes it exact
        assert dict(got.busy_s) == dict(want.busy_s)
        assert {t: dict(v) for t, v in got.moved_bytes.items()} == {t: dict(v) for t, v in want.io_bytes.items()}
        assert got.ok and len(got.ranks) in (1, plan.strategy.world_size)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models(), strategy=strategies_(), params=TIER, optimizer=TIER, grads=TIER, profile=PROFILES,
       policy=st.sampled_from(["belady", "lru"]), factor=st.floats(1.0, 3.0))
def test_simulated_step_equals_estimate(model, strategy, params, optimizer, grads, profile, policy, factor):
    placement = Placement(params=params, optimizer=optimizer, grads=grads)
    bounds = lower_bounds(model, placement=placement, strategy=strategy)
    budgets = Budgets(device_bytes=int(bounds["device"] * factor) + 8192,
                      host_bytes=int(bounds["host"] * factor) + 8192)
    try:
        plan = plan_step(model, budgets=budgets, placement=placement, strategy=strategy, policy=policy)
    except ValueError:
        event("refused")
        return  # a budget the planner refuses has no step to time
    event(f"planned {strategy.name}")
    assert_agrees(plan, profile)


@pytest.mark.parametrize("world", [2, 4])
def test_a_worker_simulated_beside_its_optimizer_node_equals_estimate(world):
    model = tiny_model(batch_size=2, seq_len=64)
    strategy = Strategy(name="node", world_size=world)
    worker = plan_step(model, budgets=Budgets(device_bytes=1 << 30, host_bytes=1 << 30),
                       placement=Placement(params="host", optimizer="host", grads="host"), strategy=strategy)
    node = plan_node(model, budgets=Budgets(device_bytes=0, host_bytes=1 << 30, nvme_bytes=None),
                     placement=Placement(params="host", optimizer="nvme", grads="host"), num_workers=world)
    profile = HardwareProfile(node_gbps=0.5, node_optim_params_per_s=1e7)
    assert_agrees(worker, profile, node=node)
    assert simulate(worker, profile, node=node).step_s > simulate(worker, profile).step_s  # the node's pace shows
