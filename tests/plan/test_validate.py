"""The validator rejects hand-made plans that break each invariant, and accepts a correct one."""

import pytest

from luwu_rt.plan import (Access, Budgets, Compute, Free, Load, OptimStep, PlanError, ShardId, ShardInfo, Store,
                          Strategy, SwapPlan, validate)

P = ShardId(0, "param", 0)
Q = ShardId(1, "param", 0)
M = ShardId(0, "master", 0)
N = 4096


def plan_of(*ops, shards=(P,), homes=None, home_slots=None, device=8 * N, host=8 * N, reserve=0) -> SwapPlan:
    homes = {"param": "host", "master": "nvme", **(homes or {})}
    if home_slots is None:
        home_slots = {s: (None if homes[s.state] == "nvme" else i * N) for i, s in enumerate(shards)}
    return SwapPlan(ops=tuple(ops), chunk_bytes=N, shards={s: ShardInfo(N, N // 2, 0, 1) for s in shards}, homes=homes,
                    budgets=Budgets(device_bytes=device, host_bytes=host),
                    arena_bytes={"device": 8 * N - reserve, "host": 8 * N}, device_reserve_bytes=reserve,
                    strategy=Strategy(), policy="belady", peak_bytes={}, home_slots=home_slots)


def load(shard, slot, deps=(), src=("host", 0), dst="device"):
    return Load(deps=deps, queue="h2d", nbytes=N, inputs=(Access(shard, *src),), outputs=(Access(shard, dst, slot),))


def compute(*inputs, deps=(), outputs=()):
    return Compute(deps=deps, queue="compute", name="F0", unit=0, flops=1, inputs=inputs, outputs=outputs)


def free(shard, tier, slot, deps=()):
    return Free(deps=deps, queue="mem", shard=shard, tier=tier, slot=slot)


def optim(*, inputs=(), outputs=(), deps=()):
    return OptimStep(deps=deps, queue="optim", unit=0, num_params=1, tier="host", inputs=inputs, outputs=outputs)


DEV_P = Access(P, "device", 0)


def test_a_correct_plan_passes():
    validate(plan_of(load(P, 0), compute(DEV_P, deps=(0,)), free(P, "device", 0, deps=(0, 1))))


def test_budget_exceeded():
    with pytest.raises(PlanError, match="over its budget"):
        validate(plan_of(load(P, 0), compute(DEV_P, deps=(0,)), free(P, "device", 0, deps=(1,)), device=N - 1))


def test_budget_counts_the_device_reserve():
    with pytest.raises(PlanError, match="over its budget"):
        validate(plan_of(load(P, 0), free(P, "device", 0, deps=(0,)), device=8 * N, reserve=7 * N + 1))


def test_input_not_resident():
    with pytest.raises(PlanError, match="not resident on device"):
        validate(plan_of(compute(DEV_P)))


def test_stale_input():
    # The host copy is updated after the load, so the device copy is an old version.
    ops = (load(P, 0), optim(outputs=(Access(P, "host", 0),), deps=(0,)), compute(DEV_P, deps=(0, 1)))
    with pytest.raises(PlanError, match="stale"):
        validate(plan_of(*ops))


def test_read_while_being_written():
    with pytest.raises(PlanError, match="may still be writing"):
        validate(plan_of(load(P, 0), compute(DEV_P), free(P, "device", 0, deps=(0, 1))))


def test_write_while_being_read():
    # The optimizer overwrites the host copy that the load may still be reading.
    with pytest.raises(PlanError, match="overwrites .* may still use"):
        validate(plan_of(load(P, 0), optim(outputs=(Access(P, "host", 0),))))


def test_free_while_being_read():
    with pytest.raises(PlanError, match="frees .* may still use"):
        validate(plan_of(load(P, 0), compute(DEV_P, deps=(0,)), free(P, "device", 0, deps=(0,))))


def test_dirty_shard_dropped_before_persisted():
    # Master weights updated on the host (home: NVMe) and freed without a Store.
    host_m = Access(M, "host", 0)
    ops = (load(M, 0, src=("nvme", None), dst="host"), optim(inputs=(host_m,), outputs=(host_m,), deps=(0,)),
           free(M, "host", 0, deps=(1,)))
    with pytest.raises(PlanError, match="only up-to-date copy"):
        validate(plan_of(*ops, shards=(M,)))


def test_dirty_shard_written_back_passes():
    host_m = Access(M, "host", 0)
    ops = (load(M, 0, src=("nvme", None), dst="host"), optim(inputs=(host_m,), outputs=(host_m,), deps=(0,)),
           Store(deps=(1,), queue="nvme_write", nbytes=N, inputs=(host_m,), outputs=(Access(M, "nvme", None),)),
           free(M, "host", 0, deps=(2,)))
    validate(plan_of(*ops, shards=(M,)))


def test_live_copies_overlap_in_an_arena():
    ops = (load(P, 0), load(Q, N // 2, src=("host", N)))
    with pytest.raises(PlanError, match="overlaps live"):
        validate(plan_of(*ops, shards=(P, Q)))


def test_reuse_of_freed_bytes_needs_a_dependency_on_the_free():
    ops = (load(P, 0), free(P, "device", 0, deps=(0,)), load(Q, 0, src=("host", N)))
    with pytest.raises(PlanError, match="without depending on op 1"):
        validate(plan_of(*ops, shards=(P, Q)))
    ok = (load(P, 0), free(P, "device", 0, deps=(0,)), load(Q, 0, src=("host", N), deps=(1,)),
          free(Q, "device", 0, deps=(2,)))
    validate(plan_of(*ok, shards=(P, Q)))


def test_copy_outside_its_arena():
    with pytest.raises(PlanError, match="inside the"):
        validate(plan_of(load(P, 8 * N - N // 2)))


def test_move_must_be_one_tier():
    with pytest.raises(PlanError, match="one-tier move"):
        validate(plan_of(load(P, 0, src=("nvme", None)), homes={"param": "nvme"}))


def test_step_must_end_with_only_home_copies():
    with pytest.raises(PlanError, match="still resident on device"):
        validate(plan_of(load(P, 0)))


def test_dependencies_point_backwards():
    with pytest.raises(PlanError, match="not an earlier op"):
        validate(plan_of(load(P, 0, deps=(0,))))


MB = ShardId(0, "master_b", 0)
"""The second half of ``M`` in a double-buffered layout ([Note: speculative updates] in sequence.py)."""


S = 4 * N
"""Where M's staging copy lives on the host (P's home is at 0)."""


def _double_buffered(*, racing_reader: bool = False, consume=None, output_slot: int = S):
    """M loaded from NVMe into host slot S, updated there into MB (consuming M's copy), MB written home."""
    m_host = Access(M, "host", S)
    consume = m_host if consume is None else consume
    update = optim(inputs=(m_host, Access(P, "host", 0)) if consume.shard == P else (m_host,),
                   outputs=(Access(MB, "host", output_slot),), deps=(0,))
    update = OptimStep(deps=update.deps, queue="optim", unit=0, num_params=1, tier="host", inputs=update.inputs,
                       outputs=update.outputs, consumes=(consume,))
    ops = [load(M, S, src=("nvme", None), dst="host")]
    if racing_reader:  # reads M's host copy, and the update does not wait for it
        ops.append(load(M, 2 * N, src=("host", S), deps=(0,)))
    ops += [update, Store(deps=(len(ops),), queue="nvme_write", nbytes=N, inputs=(Access(MB, "host", output_slot),),
                          outputs=(Access(MB, "nvme", None),))]
    ops.append(free(MB, "host", output_slot, deps=(len(ops) - 1,)))
    if racing_reader:
        ops.append(free(M, "device", 2 * N, deps=(1,)))
    return plan_of(*ops, shards=(P, M, MB), homes={"master_b": "nvme"})


def test_an_update_may_take_over_the_bytes_of_the_copy_it_reads():
    validate(_double_buffered())


def test_taking_over_a_copy_another_op_may_still_read_is_rejected():
    with pytest.raises(PlanError, match="consumes .* while op\\(s\\) \\[1\\] may still use it"):
        validate(_double_buffered(racing_reader=True))


def test_taking_over_a_home_copy_is_rejected():
    with pytest.raises(PlanError, match="consumes the home copy"):
        validate(_double_buffered(consume=Access(P, "host", 0), output_slot=0))


def test_a_taken_over_copy_must_become_an_output_in_its_bytes():
    with pytest.raises(PlanError, match="not one of its inputs with an output of the same size in its bytes"):
        validate(_double_buffered(output_slot=S + N))
