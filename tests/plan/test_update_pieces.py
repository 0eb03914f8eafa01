"""[Note: an update in pieces] (plan/sequence.py): where the optimizer state streams from NVMe a unit's update
runs as several ops, each over whole shards covering one run of elements of every kind; elsewhere one op."""

from collections import defaultdict

import pytest

from luwu_rt.plan import (Budgets, ModelSpec, OptimStep, Placement, Strategy, UnitSpec, lower_bounds, plan_step,
                          validate)
from luwu_rt.plan.spec import base_kind

UNITS, NUMEL, CHUNK = 3, 3 * 2**19 + 1000, 2**20  # a ragged last chunk


def _plan(optimizer: str, *, strategy: Strategy = Strategy(), double_buffer: bool = False):
    model = ModelSpec(units=tuple(UnitSpec(name=f"u{i}", num_params=NUMEL) for i in range(UNITS)), param_bytes=2,
                      grad_bytes=4, chunk_bytes=CHUNK, optimizer_only=strategy.name == "local",
                      double_buffer=double_buffer)
    placement = Placement(params="host", optimizer=optimizer, grads="host")
    low = lower_bounds(model, placement=placement, strategy=strategy)
    plan = plan_step(model, budgets=Budgets(device_bytes=3 * low["device"], host_bytes=3 * low["host"]),
                     placement=placement, strategy=strategy)
    validate(plan)
    return plan


def _updates(plan) -> dict[int, list[OptimStep]]:
    by_unit: dict[int, list[OptimStep]] = defaultdict(list)
    for op in plan.ops:
        if isinstance(op, OptimStep):
            by_unit[op.unit].append(op)
    return by_unit


def _elements(plan, op: OptimStep) -> dict[str, int]:
    """Elements of each kind the op touches (read or written)."""
    out: dict[str, int] = defaultdict(int)
    for sid in {a.shard for a in op.inputs + op.outputs}:
        out[sid.state] += plan.shards[sid].numel
    return dict(out)


@pytest.mark.parametrize("double_buffer", [False, True])
def test_state_on_nvme_updates_in_pieces_that_cover_the_unit_once(double_buffer):
    plan = _plan("nvme", double_buffer=double_buffer)
    for unit, ops in _updates(plan).items():
        # Plan shards of 512 Ki elements in every kind (bf16 params: one 1 MiB chunk each; fp32 kinds: two, as
        # a state has at most max_shards_per_state shards), and the ragged last 1000.
        assert [op.num_params for op in ops] == [2**19] * 3 + [1000]
        touched: dict[str, list] = defaultdict(list)
        for op in ops:
            elements = _elements(plan, op)
            assert {base_kind(k) for k in elements} == {"grad", "master", "exp_avg", "exp_avg_sq", "param"}
            assert set(elements.values()) == {op.num_params}, elements  # one run of elements in every kind
            for a in op.inputs + op.outputs:
                touched[a.shard.state].append(a.shard)
            if double_buffer:  # reads one half, writes the other
                assert {a.shard.state for a in op.inputs} >= {"master", "exp_avg", "exp_avg_sq"}
                assert {a.shard.state for a in op.outputs} >= {"master_b", "exp_avg_b", "exp_avg_sq_b"}
        assert sum(op.num_params for op in ops) == NUMEL
        for state, sids in touched.items():
            mine = [s for s in plan.shards if s.unit == unit and s.state == state]
            assert sorted(set(sids)) == sorted(mine), state  # every shard of the unit, in some piece


def test_resident_state_updates_each_unit_in_one_op():
    assert all(len(ops) == 1 for ops in _updates(_plan("host")).values())


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_sharded_updates_go_in_pieces_of_this_ranks_slice(name):
    plan = _plan("nvme", strategy=Strategy(name=name, world_size=2))
    ops = [op for ops in _updates(plan).values() for op in ops]
    assert len(ops) > UNITS
    for op in ops:
        assert set(_elements(plan, op).values()) == {op.num_params}

