"""The pytest helpers as a user's suite calls them: plan_for, assert_valid, assert_faster, hand_plan."""

import pytest

from luwu_rt.plan import Budgets, HardwareProfile, Placement, Strategy, estimate, validate
from luwu_rt.testing import assert_faster, assert_valid, plan_for

from plans import KeepEmbedding, NoPrefetch, load_then_compute, tiny_model

BUDGETS = Budgets(device_bytes=96 << 20, host_bytes=64 << 20, nvme_bytes=1 << 30)


def test_plan_for_picks_the_fastest_placement_or_takes_the_one_given():
    model = tiny_model()
    auto = plan_for(model, budgets=BUDGETS)
    given = plan_for(model, budgets=BUDGETS, placement=Placement(params="nvme", optimizer="nvme", grads="host"),
                     policy=KeepEmbedding())
    validate(auto)
    assert given.homes["param"] == "nvme" and given.policy == "keep-embedding"
    assert estimate(auto, HardwareProfile()).predicted_step_s <= estimate(given, HardwareProfile()).predicted_step_s
    with pytest.raises(ValueError, match="does not fit"):
        plan_for(model, budgets=Budgets(device_bytes=1 << 20, host_bytes=1 << 20))


def test_assert_valid_passes_a_planner_plan_for_every_rank_and_returns_its_simulation():
    plan = plan_for(tiny_model(), budgets=BUDGETS, strategy=Strategy(name="zero2", world_size=2))
    assert assert_valid(plan).step_s == estimate(plan, HardwareProfile()).predicted_step_s
    assert assert_valid([plan, plan], chaos_seeds=[0, 1]).ok


def test_assert_valid_fails_a_plan_missing_a_dependency_naming_both_ops():
    plan = load_then_compute(forget=True)
    with pytest.raises(AssertionError, match=r"breaks an invariant: op 2 .* op 0"):
        assert_valid(plan)


def test_assert_faster_returns_the_speedup_and_fails_with_both_times():
    model = tiny_model(batch_size=8, seq_len=128)
    eager = plan_for(model, budgets=BUDGETS, placement=Placement(params="host", optimizer="host", grads="host"))
    lazy = plan_for(model, budgets=BUDGETS, placement=Placement(params="host", optimizer="host", grads="host"),
                    policy=NoPrefetch())
    assert assert_faster(eager, lazy) > 1.0
    with pytest.raises(AssertionError, match=r"the no-prefetch plan .* is not faster than the belady plan .* takes "
                                             r"[\d.e-]+ s \(bottleneck \w+\) against"):
        assert_faster(lazy, eager)
    with pytest.raises(AssertionError, match="by at least 100x"):
        assert_faster(eager, lazy, by=100.0)
    with pytest.raises(ValueError, match="by=0.5 must be at least 1.0"):
        assert_faster(eager, lazy, by=0.5)
