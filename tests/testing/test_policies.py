"""Policies as plug-ins: the built-ins by name or as objects give the same plans; a policy of one's own plans,
validates and simulates like them; a policy's mistakes are named."""

import pytest

from luwu_rt.models.presets import get_preset
from luwu_rt.plan import (LRU, POLICIES, Belady, Budgets, Load, Placement, Policy, Strategy, as_policy,
                          gpt_model_spec, lower_bounds, plan_auto, plan_node, plan_step, validate)
from luwu_rt.plan.planner import OutOfBudget
from luwu_rt.testing import assert_faster, assert_valid, simulate

from plans import KeepEmbedding, NoPrefetch, tight_plan, tiny_model

HOST = Placement(params="host", optimizer="host", grads="host")
NVME = Placement(params="nvme", optimizer="nvme", grads="host")


def small_gpt():
    return gpt_model_spec(get_preset("gpt-small"), batch_size=4, seq_len=256)


@pytest.mark.parametrize("name,cls", [("belady", Belady), ("lru", LRU)])
def test_a_builtin_by_name_and_as_an_object_plans_the_same(name, cls):
    model = tiny_model(batch_size=4, seq_len=64)
    assert POLICIES == ("belady", "lru") and as_policy(name).name == name
    by_name = tight_plan(model, NVME, factor=1.05, policy=name)
    by_object = tight_plan(model, NVME, factor=1.05, policy=cls())
    assert by_name == by_object and by_name.policy == name


def test_unknown_names_and_nameless_policies_are_refused():
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'; choose one of belady, lru"):
        plan_step(tiny_model(), budgets=Budgets(device_bytes=1 << 30, host_bytes=1 << 30), placement=HOST,
                  policy="fifo")

    class Nameless(Belady):
        name = ""

    with pytest.raises(ValueError, match="has no name"):
        as_policy(Nameless())


def test_keeping_the_embedding_loads_it_once_and_is_no_slower():
    model = small_gpt()
    mine, belady = (tight_plan(model, NVME, factor=1.05, host_factor=1.5, policy=p)
                    for p in (KeepEmbedding(), "belady"))
    assert mine.policy == "keep-embedding"
    assert_valid(mine)

    def embedding_loads(plan):
        return sum(1 for op in plan.ops if isinstance(op, Load) and op.shard.unit == 0 and op.dst == "device")

    assert embedding_loads(mine) < embedding_loads(belady)
    assert simulate(mine).step_s <= simulate(belady).step_s


def test_a_policy_that_keeps_too_much_does_not_fit_and_says_which_tier():
    model = gpt_model_spec(get_preset("gpt-125m"), batch_size=4, seq_len=256)
    bounds = lower_bounds(model, placement=HOST, strategy=Strategy())
    budgets = Budgets(device_bytes=int(bounds["device"] * 1.05), host_bytes=int(bounds["host"] * 1.5))
    plan_step(model, budgets=budgets, placement=HOST)  # Belady fits by evicting the embedding
    with pytest.raises(OutOfBudget, match="device budget"):
        plan_step(model, budgets=budgets, placement=HOST, policy=KeepEmbedding())


def test_a_bounded_prefetch_depth_is_valid_and_slower():
    model = small_gpt()
    eager, lazy = (tight_plan(model, HOST, factor=1.2, policy=p) for p in ("belady", NoPrefetch()))
    assert_valid(lazy)
    assert assert_faster(eager, lazy, by=1.1) > 1.1


def test_a_victim_not_offered_is_named():
    class Wrong(Belady):
        name = "wrong"

        def victim(self, candidates, view):
            return candidates[0]._replace(chunk=999)

    with pytest.raises(ValueError, match="policy 'wrong' chose .* which is not one of the candidates"):
        tight_plan(tiny_model(), NVME, factor=1.05, policy=Wrong())


def test_a_bad_prefetch_depth_is_named():
    class Negative(Belady):
        name = "negative"

        def prefetch_depth(self, shard, view):
            return -1

    with pytest.raises(ValueError, match="prefetch_depth must be None or a non-negative int, got -1"):
        tight_plan(tiny_model(), NVME, policy=Negative())


def test_the_search_and_the_node_planner_take_a_policy_object():
    model = tiny_model()
    result = plan_auto(model, budgets=Budgets(device_bytes=1 << 30, host_bytes=1 << 30), policy=KeepEmbedding())
    assert result.plan.policy == "keep-embedding"
    node = plan_node(model, budgets=Budgets(device_bytes=0, host_bytes=1 << 30), placement=HOST, num_workers=2,
                     policy=LRU())
    validate(node)
    assert node.policy == "lru" and issubclass(KeepEmbedding, Policy)
