"""Faults in virtual time: what the plan's dependencies make of them - a delay, or a failed op and exactly the
ops that depend on it - never a wrong read; chaos is deterministic per seed."""

import math

import pytest

from luwu_rt.plan import HardwareProfile, Load, Placement, ShardId, Store, Strategy
from luwu_rt.testing import ShardIOError, SlowTier, StallRank, simulate

from plans import tight_plan, tiny_model

OFFLOADED = Placement(params="nvme", optimizer="nvme", grads="host")


@pytest.fixture(scope="module")
def plan():
    return tight_plan(tiny_model(), OFFLOADED)


def test_a_slow_disk_for_the_whole_step_slows_its_moves_and_the_step(plan):
    plain = simulate(plan)
    slow = simulate(plan, faults=[SlowTier(tier="nvme", factor=3.0, start_s=0.0, end_s=math.inf)])
    assert slow.busy_s["nvme_read"] == pytest.approx(3 * plain.busy_s["nvme_read"])
    assert slow.busy_s["compute"] == plain.busy_s["compute"]
    assert slow.step_s > 2 * plain.step_s and slow.ok


def test_a_slowdown_after_the_step_changes_nothing_and_one_inside_delays_it(plan):
    plain = simulate(plan)
    after_it = SlowTier(tier="host", factor=10.0, start_s=2 * plain.step_s, end_s=3 * plain.step_s)
    later = simulate(plan, faults=[after_it])
    assert later.ranks[0].timeline == plain.ranks[0].timeline
    inside = simulate(plan, faults=[SlowTier(tier="host", factor=10.0, start_s=0.0, end_s=plain.step_s / 2)])
    assert plain.step_s < inside.step_s < 10 * plain.step_s


def dependents(plan, roots) -> set[int]:
    out = set(roots)
    for i, op in enumerate(plan.ops):
        if out.intersection(op.deps):
            out.add(i)
    return out - set(roots)


def test_an_io_error_fails_the_shards_moves_and_loses_exactly_what_depends_on_them(plan):
    shard = ShardId(2, "master", 0)
    got = simulate(plan, faults=[ShardIOError(shard=shard)])  # no RaceError: nothing reads a lost write
    moves = [i for i, op in enumerate(plan.ops) if isinstance(op, (Load, Store)) and op.shard == shard]
    r = got.ranks[0]
    assert r.failed and set(r.failed) <= set(moves) and not got.ok
    assert set(r.lost) == dependents(plan, r.failed)
    assert all(math.isinf(r.timeline.done[i]) for i in r.lost + r.failed)
    assert f"op {r.failed[0]} (Load master u2.0 nvme->host on nvme_read) failed" in got.summary()
    assert got.moved_bytes["nvme"]["read"] < simulate(plan).moved_bytes["nvme"]["read"]


def test_an_io_error_on_a_tier_the_shard_never_moves_through_changes_nothing(plan):
    got = simulate(plan, faults=[ShardIOError(shard=ShardId(2, "master", 0), tier="device")])
    assert got.ok and got.step_s == simulate(plan).step_s


def test_a_stalled_rank_holds_its_peers_in_their_collectives():
    plan = tight_plan(tiny_model(), Placement(params="host", optimizer="host", grads="host"),
                      strategy=Strategy(name="zero3", world_size=2))
    plain = simulate([plan, plan])
    stall = 5 * plain.step_s
    got = simulate([plan, plan], faults=[StallRank(rank=1, start_s=0.0, duration_s=stall)])
    zero, one = got.ranks
    assert one.step_s >= stall and zero.step_s >= stall  # rank 0 cannot gather without rank 1
    assert zero.stalled_on["gather"]["peers"] > 0.9 * stall
    assert got.rank == 1 or got.ranks[0].step_s == got.ranks[1].step_s
    with pytest.raises(ValueError, match="one plan per rank"):
        simulate(plan, faults=[StallRank(rank=1, start_s=0.0, duration_s=stall)])
    symmetric = simulate(plan, faults=[StallRank(rank=0, start_s=0.0, duration_s=stall)])
    assert symmetric.step_s == pytest.approx(plain.step_s + stall)


def test_chaos_is_deterministic_per_seed(plan):
    a, b, c = (simulate(plan, chaos_seed=s) for s in (7, 7, 8))
    assert a.ranks[0].timeline == b.ranks[0].timeline and a.step_s == b.step_s
    assert a.ranks[0].timeline != c.ranks[0].timeline
    assert a.step_s > simulate(plan).step_s  # delays and a held op only ever add time


@pytest.mark.parametrize("fault", [lambda: SlowTier(tier="disk", factor=2.0, start_s=0.0, end_s=1.0),
                                   lambda: SlowTier(tier="nvme", factor=0.0, start_s=0.0, end_s=1.0),
                                   lambda: SlowTier(tier="nvme", factor=2.0, start_s=1.0, end_s=1.0),
                                   lambda: StallRank(rank=-1, start_s=0.0, duration_s=1.0),
                                   lambda: ShardIOError(shard=(0, "param", 0))])
def test_bad_faults_are_refused_with_the_reason(fault):
    with pytest.raises(ValueError):
        fault()


def test_the_profile_sets_the_pace(plan):
    fast = simulate(plan, HardwareProfile(nvme_read_gbps=30.0, nvme_write_gbps=20.0))
    assert fast.step_s < simulate(plan).step_s
