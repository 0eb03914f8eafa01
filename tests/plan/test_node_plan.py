"""The optimizer node's own plan ([Note: the node's step] in plan/node.py): valid for every placement, shard
count and clipping mode, units received and served in the order the workers push them, optimizer state read
ahead in that order, and a valid plan or a clear error for any sizes and budgets."""

import dataclasses
import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from luwu_rt.models.presets import get_preset
from luwu_rt.plan import (GLOBAL_UNIT, Budgets, DoesNotFit, GradNorm, Load, ModelSpec, NormReduce, OptimStep,
                          Placement, Push, Recv, Serve, Store, Strategy, UnitSpec, Wait, gpt_model_spec,
                          node_lower_bounds, plan_node, plan_node_auto, plan_step, push_order, validate)
from luwu_rt.plan.node import node_layout

KiB = 1024
CLEAR_ERROR = re.compile(r"too small|does not fit")
PLACEMENTS = [Placement(params=p, optimizer=o, grads=g)
              for p, o, g in [("host", "host", "host"), ("host", "nvme", "host"), ("nvme", "nvme", "nvme"),
                              ("nvme", "host", "nvme")]]


def tiny(*, clip: bool = False) -> ModelSpec:
    return dataclasses.replace(gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 * KiB),
                               optimizer_waits_for_backward=clip)


def roomy_node(model, placement, *, workers=4, shards=1, index=0, spare=4 << 20):
    bounds = node_lower_bounds(model, placement=placement, num_shards=shards)
    return plan_node(model, budgets=Budgets(device_bytes=0, host_bytes=bounds["host"] + spare),
                     placement=placement, num_workers=workers, num_shards=shards, shard_index=index)


def units_of(plan, kind) -> list[int]:
    return [op.unit for op in plan.ops if isinstance(op, kind)]


def ancestors(plan) -> list[set[int]]:
    out: list[set[int]] = []
    for op in plan.ops:
        out.append(set().union(*(out[d] | {d} for d in op.deps)) if op.deps else set())
    return out


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: f"{p.params}-{p.optimizer}-{p.grads}")
def test_node_plans_validate(placement, shards, clip):
    model = tiny(clip=clip)
    for index in range(shards):
        plan = roomy_node(model, placement, shards=shards, index=index)
        validate(plan)
        num_units = len(model.units)
        assert plan.role == "node" and plan.strategy == Strategy(name="node", world_size=4)
        assert {k: plan.count(k) for k in ("Recv", "Serve", "GradNorm", "NormReduce", "Compute")} == \
            {"Recv": num_units, "Serve": num_units, "GradNorm": num_units, "NormReduce": 1, "Compute": 0}
        # Each unit's update is one op, or pieces of it where the state streams from NVMe ([Note: an update in
        # pieces] in plan/sequence.py), which cover its elements once.
        updates = [op for op in plan.ops if isinstance(op, OptimStep)]
        assert (len(updates) > num_units) == (placement.optimizer == "nvme")
        for u in range(num_units):
            mine = sum(i.numel for s, i in plan.shards.items() if s.unit == u and s.state == "master")
            assert sum(op.num_params for op in updates if op.unit == u) == mine
        # No device tier: nothing is ever placed there.
        assert plan.peak_bytes["device"] == 0 and plan.arena_bytes["device"] == 0
        assert all(a.tier != "device" for op in plan.ops for a in op.inputs + op.outputs)
        assert dict(plan.comm_groups) == ({"push": "workers", "pull": "workers", "reduce": "nodes"} if shards > 1
                                          else {"push": "workers", "pull": "workers"})
        norm = next(op for op in plan.ops if isinstance(op, NormReduce))
        want = ("nodes", shards, "reduce") if shards > 1 else ("", 1, "optim")
        assert (norm.group, norm.group_size, norm.queue) == want
        # The optimizer state is read from NVMe when it lives there; whatever lives there is written there.
        read = {op.shard.state for op in plan.ops if isinstance(op, Load)}
        written = {op.shard.state for op in plan.ops if isinstance(op, Store)}
        assert ({"master", "exp_avg", "exp_avg_sq"} <= read) == (placement.optimizer == "nvme")
        assert ("param" in written) == (placement.params == "nvme")
        assert ("grad" in written) == (placement.grads == "nvme")


def test_node_layout_holds_this_shards_slice_in_fp32():
    model = ModelSpec(units=(UnitSpec(name="a", num_params=10_001), UnitSpec(name="b", num_params=7)),
                      param_bytes=2, grad_bytes=2, chunk_bytes=4 * KiB, max_shards_per_state=64)
    for k in (1, 3):
        per_unit = [0, 0]
        for i in range(k):
            layout = node_layout(model, shard_index=i, num_shards=k)
            for u in (0, 1):
                grad = [info for s, info in layout.items() if s.unit == u and s.state == "grad"]
                master = [info for s, info in layout.items() if s.unit == u and s.state == "master"]
                param = [info for s, info in layout.items() if s.unit == u and s.state == "param"]
                part = -(-model.units[u].num_params // k)
                assert sum(g.nbytes for g in grad) >= 4 * part and sum(g.numel for g in grad) <= part  # fp32 sums
                assert sum(p.nbytes for p in param) >= 2 * part  # the served copy in the compute dtype
                per_unit[u] += sum(m.numel for m in master)
        assert per_unit == [10_001, 7]  # the shards' slices cover every element once


@pytest.mark.parametrize("clip", [False, True])
def test_units_are_received_updated_and_served_in_push_order(clip):
    """The stated order: backward's final order, the order the workers push and their pull queue waits."""
    # Unit 1 reads unit 3's parameters, so unit 3's gradients are final only after B1: push order 2, 3, 1, 0.
    units = tuple(UnitSpec(name=f"u{i}", num_params=5000 + 1000 * i, reads=(3,) if i == 1 else ()) for i in range(4))
    model = ModelSpec(units=units, chunk_bytes=4 * KiB, optimizer_waits_for_backward=clip)
    order = [2, 3, 1, 0]
    assert list(push_order(model)) == order
    assert list(push_order(tiny())) == [5, 4, 3, 2, 1, 0]
    node = roomy_node(model, PLACEMENTS[1])
    validate(node)
    assert units_of(node, Recv) == units_of(node, GradNorm) == order
    # The state on NVMe here: each unit's update in pieces ([Note: an update in pieces] in plan/sequence.py).
    assert list(dict.fromkeys(units_of(node, OptimStep))) == units_of(node, Serve) == order
    worker = plan_step(model, budgets=Budgets(device_bytes=1 << 30, host_bytes=1 << 30), placement=PLACEMENTS[0],
                       strategy=Strategy(name="node", world_size=4))
    assert units_of(worker, Push) == order  # both sides of the group issue their transfers in one sequence
    index = {i: op for i, op in enumerate(node.ops)}
    first_update = min(i for i, op in index.items() if isinstance(op, OptimStep))
    norm = next(i for i, op in index.items() if isinstance(op, NormReduce))
    last_recv_wait = max(i for i, op in index.items() if isinstance(op, Wait) and isinstance(node.ops[op.start], Recv))
    anc = ancestors(node)
    if clip:  # exact clipping: every update reads the step's norm, which needs every push
        assert all(norm in anc[i] and last_recv_wait in anc[i] for i, op in index.items() if isinstance(op, OptimStep))
        assert all(any(a.shard.unit == GLOBAL_UNIT for a in op.inputs) for op in node.ops if isinstance(op, OptimStep))
    else:  # a unit is updated as soon as its own pushes are in
        assert first_update < norm and last_recv_wait not in anc[first_update]


def test_optimizer_state_is_read_ahead_in_serving_order():
    """Loads wait only for their slot: with room they do not wait for any push; with little room they
    still come in the order the units are updated."""
    model = tiny()
    order = list(push_order(model))
    placement = Placement(params="host", optimizer="nvme", grads="host")
    roomy = roomy_node(model, placement, spare=64 << 20)
    anc = ancestors(roomy)
    recvs = {i for i, op in enumerate(roomy.ops) if isinstance(op, Recv)}
    loads = [i for i, op in enumerate(roomy.ops) if isinstance(op, Load) and op.shard.state == "master"]
    assert loads and not any(anc[i] & recvs for i in loads)
    tight = roomy_node(model, placement, spare=256 * KiB)
    validate(tight)
    first_loads = list(dict.fromkeys(op.shard.unit for op in tight.ops if isinstance(op, Load)
                                     and op.shard.state == "master"))
    assert first_loads == order
    tight_anc = ancestors(tight)
    assert any(tight_anc[i] & {j for j, op in enumerate(tight.ops) if isinstance(op, OptimStep)}
               for i, op in enumerate(tight.ops) if isinstance(op, Load))  # some read-ahead waits for room


def test_transfers_carry_every_workers_bytes():
    model = tiny()
    workers, shards = 6, 4
    total_in = total_out = 0
    for i in range(shards):
        plan = roomy_node(model, PLACEMENTS[0], workers=workers, shards=shards, index=i)
        total_in += sum(op.comm_bytes for op in plan.ops if isinstance(op, Recv))
        total_out += sum(op.comm_bytes for op in plan.ops if isinstance(op, Serve))
        assert {op.group_size for op in plan.ops if isinstance(op, (Recv, Serve))} == {workers}
    assert total_in == workers * model.num_params * model.grad_bytes
    assert total_out == workers * model.num_params * model.param_bytes


@pytest.mark.parametrize("budgets, placement, message", [
    (Budgets(device_bytes=0, host_bytes=64 * KiB), PLACEMENTS[0],
     r"node host budget 64 KiB is too small with params on host.*needs at least [0-9.]+ MiB of host memory, or "
     r"[0-9.]+ MiB of NVMe"),
    (Budgets(device_bytes=0, host_bytes=1 << 30, nvme_bytes=0), PLACEMENTS[1],
     r"node nvme budget 0 B is too small .* needs at least [0-9.]+ MiB of nvme space"),
    (Budgets(device_bytes=1 << 20, host_bytes=1 << 30), PLACEMENTS[0], "no device tier: give it device_bytes=0"),
    (Budgets(device_bytes=0, host_bytes=1 << 30), Placement(params="device", optimizer="host", grads="host"),
     "keeps its states on host or nvme"),
])
def test_clear_errors(budgets, placement, message):
    with pytest.raises(ValueError, match=message):
        plan_node(tiny(), budgets=budgets, placement=placement, num_workers=2)


def test_bad_shard_and_model_arguments():
    roomy = Budgets(device_bytes=0, host_bytes=1 << 30)
    with pytest.raises(ValueError, match="0 <= shard_index < num_shards"):
        plan_node(tiny(), budgets=roomy, placement=PLACEMENTS[0], num_workers=2, shard_index=2, num_shards=2)
    with pytest.raises(ValueError, match="neither optimizer_only nor forward_only"):
        plan_node(dataclasses.replace(tiny(), forward_only=True), budgets=roomy, placement=PLACEMENTS[0], num_workers=2)


def test_auto_placement_prefers_memory_and_falls_back_to_nvme():
    model = tiny()
    roomy = plan_node_auto(model, budgets=Budgets(device_bytes=0, host_bytes=1 << 30), num_workers=2)
    assert roomy.placement == PLACEMENTS[0] and roomy.plan.role == "node"
    host_only = node_lower_bounds(model, placement=PLACEMENTS[0])["host"]
    small = plan_node_auto(model, budgets=Budgets(device_bytes=0, host_bytes=host_only // 2, nvme_bytes=1 << 30),
                           num_workers=2)
    assert "nvme" in (small.placement.optimizer, small.placement.params)
    validate(small.plan)
    with pytest.raises(DoesNotFit, match="optimizer node does not fit: needs at least .* of host memory or") as info:
        plan_node_auto(model, budgets=Budgets(device_bytes=0, host_bytes=host_only // 2, nvme_bytes=0), num_workers=2)
    assert info.value.needs["node_host_bytes"] == host_only and "node_nvme_bytes" in info.value.needs


# -- random sizes, budgets, workers and shards: a valid plan or a clear error ---------------------------------

@st.composite
def node_cases(draw):
    num_units = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(1, 200_000), min_size=num_units, max_size=num_units))
    tied = num_units > 2 and draw(st.booleans())
    units = tuple(UnitSpec(name=f"u{i}", num_params=n, reads=(0,) if tied and i == num_units - 1 else ())
                  for i, n in enumerate(sizes))
    elem = draw(st.sampled_from([2, 4]))
    model = ModelSpec(units=units, param_bytes=elem, grad_bytes=elem, chunk_bytes=draw(st.integers(1, 32)) * 4 * KiB,
                      max_shards_per_state=draw(st.integers(1, 4)), optimizer_waits_for_backward=draw(st.booleans()))
    shards = draw(st.integers(1, 4))
    tier = st.sampled_from(["host", "nvme"])
    placement = Placement(params=draw(tier), optimizer=draw(tier), grads=draw(tier))
    return model, placement, draw(st.integers(1, 8)), shards, draw(st.integers(0, shards - 1))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=node_cases(), data=st.data())
def test_random_node_plans_are_valid_or_a_clear_error(case, data):
    model, placement, workers, shards, index = case
    bounds = node_lower_bounds(model, placement=placement, num_shards=shards, shard_index=index)
    first = node_lower_bounds(model, placement=placement, num_shards=shards)
    assert all(bounds[t] <= first[t] for t in bounds), "process 0's bounds hold for every process"
    near = data.draw(st.booleans(), label="near the lower bounds")
    total = sum(i.nbytes for i in node_layout(model, num_shards=shards).values())
    host = data.draw(st.floats(0.9, 1.5).map(lambda f: int(f * bounds["host"])) if near else st.integers(0, 2 * total),
                     label="host")
    nvme = data.draw(st.one_of(st.none(), st.just(bounds["nvme"]) if near else st.integers(0, 2 * total)), label="nvme")
    budgets = Budgets(device_bytes=0, host_bytes=host, nvme_bytes=nvme)
    try:
        plan = plan_node(model, budgets=budgets, placement=placement, num_workers=workers, num_shards=shards,
                         shard_index=index)
    except ValueError as exc:
        assert CLEAR_ERROR.search(str(exc)), str(exc)
        event("refused")
        return
    event("planned")
    validate(plan)
    assert units_of(plan, Serve) == list(push_order(model))
    for tier in ("host", "nvme"):
        assert plan.peak_bytes[tier] >= bounds[tier], (tier, plan.peak_bytes[tier], bounds[tier])
        assert budgets.of(tier) is None or plan.peak_bytes[tier] <= budgets.of(tier)


@settings(max_examples=60, deadline=None)
@given(case=node_cases())
def test_ample_node_budgets_always_plan(case):
    model, placement, workers, shards, index = case
    total = sum(i.nbytes for i in node_layout(model, num_shards=shards).values())
    validate(plan_node(model, budgets=Budgets(device_bytes=0, host_bytes=2 * total), placement=placement,
                       num_workers=workers, num_shards=shards, shard_index=index))
