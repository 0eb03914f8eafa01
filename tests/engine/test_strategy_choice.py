"""Which strategy a run of N ranks uses (engine/strategy.py), and the plan digest ranks compare."""

import pytest

from luwu_rt.engine.strategy import candidate_strategies, choose_plan, plan_digest
from luwu_rt.plan import Budgets, Placement
from luwu_rt.models.presets import get_preset
from luwu_rt.plan.gpt import gpt_model_spec


def test_one_rank_is_local_whatever_was_asked():
    for name in ("auto", "ddp", "zero3", "hsdp"):
        assert [s.name for s in candidate_strategies(name, world_size=1)] == ["local"]


def test_several_ranks_refuse_local_and_a_group_size_that_does_not_divide():
    with pytest.raises(ValueError, match="strategy local runs one process, but this run has 2 ranks"):
        candidate_strategies("local", world_size=2)
    with pytest.raises(ValueError, match="--shard-group-size 3 does not divide the 4 ranks"):
        candidate_strategies("hsdp", world_size=4, shard_group_size=3)


def test_hsdp_in_groups_of_one_runs_as_ddp():
    hsdp = candidate_strategies("hsdp", world_size=4, shard_group_size=1)
    assert [(s.name, s.world_size) for s in hsdp] == [("ddp", 4)]
    assert [s.name for s in candidate_strategies("auto", world_size=4, shard_group_size=1)] == ["ddp", "zero1", "zero2",
                                                                                               "zero3"]


def test_auto_considers_hsdp_only_with_groups_smaller_than_the_world():
    assert [s.name for s in candidate_strategies("auto", world_size=4)] == ["ddp", "zero1", "zero2", "zero3"]
    hsdp = candidate_strategies("auto", world_size=4, shard_group_size=2)[-1]
    assert (hsdp.name, hsdp.shard_ways, hsdp.replicas) == ("hsdp", 2, 2)


def test_auto_picks_the_fastest_that_fits_and_sharding_when_only_it_fits():
    model = gpt_model_spec(get_preset("gpt-small"), batch_size=1, seq_len=128)
    roomy = Budgets(device_bytes=2**34, host_bytes=2**34)
    strategies = candidate_strategies("auto", world_size=2)
    chosen, result = choose_plan(model, strategies=strategies, budgets=roomy, placement=Placement())
    others = [choose_plan(model, strategies=[s], budgets=roomy, placement=Placement())[1] for s in strategies]
    assert result.cost.predicted_step_s == min(o.cost.predicted_step_s for o in others)
    # Room for the parameters and gradients on the device and for 3/4 of the fp32 optimizer state (12 bytes
    # per parameter) on the host: only a strategy that shards the optimizer state over the 2 ranks fits.
    p = model.num_params
    tight = Budgets(device_bytes=model.activation_bytes + 5 * p, host_bytes=9 * p, nvme_bytes=0)
    with pytest.raises(ValueError, match="does not fit"):
        choose_plan(model, strategies=strategies[:1], budgets=tight, placement=Placement())
    chosen, _ = choose_plan(model, strategies=strategies, budgets=tight, placement=Placement())
    assert chosen.name in ("zero1", "zero2", "zero3")
    with pytest.raises(ValueError, match="does not fit"):
        choose_plan(model, strategies=strategies, budgets=Budgets(device_bytes=1, host_bytes=0), placement=Placement())


def test_digests_agree_for_equal_plans_and_differ_for_another_strategy():
    model = gpt_model_spec(get_preset("gpt-tiny"), batch_size=1, seq_len=64)
    budgets = Budgets(device_bytes=2**32, host_bytes=2**32)
    zero3 = candidate_strategies("zero3", world_size=2)
    ddp = candidate_strategies("ddp", world_size=2)
    one = plan_digest(choose_plan(model, strategies=zero3, budgets=budgets, placement=Placement())[1])
    two = plan_digest(choose_plan(model, strategies=zero3, budgets=budgets, placement=Placement())[1])
    other = plan_digest(choose_plan(model, strategies=ddp, budgets=budgets, placement=Placement())[1])
    assert one == two != other
