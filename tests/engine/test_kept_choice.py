"""``keep_graphs=auto`` keeps the most units' graphs with which the step still plans ([Note: kept graphs chosen
by the budget] in engine/kept.py): all when they fit, fewer under a tight device budget, none rather than a
refusal, and a refusal only where recomputing every unit does not fit either."""

from dataclasses import replace

import pytest

from luwu_rt.config import from_mapping
from luwu_rt.engine import TrainConfig
from luwu_rt.engine.kept import plan_kept
from luwu_rt.engine.strategy import candidate_strategies, choose_plan
from luwu_rt.engine.workload import config_model_spec, device_budget, kept_units
from luwu_rt.models.adapt import as_unit_chain
from luwu_rt.plan import Budgets, DoesNotFit, Placement, parse_size


def _config(keep, *, device_mem: int | str = "1GiB") -> TrainConfig:
    return from_mapping(TrainConfig, {
        "model": "gpt-tiny", "batch_size": 2, "seq_len": 16, "keep_graphs": keep,
        "offload": {"params": "host", "optimizer": "host", "grads": "host", "device_mem": device_mem,
                    "host_mem": "64MiB", "chunk_size": "64KiB"}})


def _budget(keep, arena: str) -> int:
    """The device budget that holds ``keep``'s graphs beside an ``arena`` for shards."""
    return device_budget(_config(keep), arena_bytes=parse_size(arena))


def _planner(config: TrainConfig, asked: list | None = None):
    """The ``PlanFn`` of a one-rank run of ``config``, as the engine plans it (no NVMe tier)."""
    off = config.offload
    budgets = Budgets(device_bytes=off.device_mem_bytes, host_bytes=off.host_mem_bytes, nvme_bytes=0)

    def plan(model, explain):
        if asked is not None:
            asked.append(model)
        return choose_plan(model, strategies=candidate_strategies("auto", world_size=1), budgets=budgets,
                           placement=Placement(params=off.params, optimizer=off.optimizer, grads=off.grads),
                           explain=explain)

    return plan


def _plans(chain, config: TrainConfig) -> bool:
    try:
        plan_kept(chain, config, plan=_planner(config))
    except DoesNotFit:
        return False
    return True


def test_auto_keeps_every_graph_when_they_fit_and_plans_once() -> None:
    chain = as_unit_chain("gpt-tiny")
    config = _config("auto")
    asked: list = []
    kept = plan_kept(chain, config, plan=_planner(config, asked))
    assert kept.units == frozenset(range(chain.num_units - 1))
    assert len(asked) == 1 and kept.model == config_model_spec(chain, replace(config, keep_graphs="all"))


def test_auto_keeps_the_largest_count_that_plans_under_a_tight_budget() -> None:
    chain = as_unit_chain("gpt-tiny")
    most = chain.num_units - 1
    config = _config("auto", device_mem=_budget(2, "2MiB"))
    kept = plan_kept(chain, config, plan=_planner(config))
    planned = [n for n in range(most + 1) if _plans(chain, replace(config, keep_graphs=n))]
    assert most not in planned and 0 < len(kept.units) < most  # the premise: all do not fit, some do
    assert len(kept.units) == max(planned)
    assert kept.units == kept_units(len(kept.units), num_units=chain.num_units)  # the last units, N's
    assert kept.model == config_model_spec(chain, config, keep_graph=kept.units)
    assert kept.result.plan.peak_bytes["device"] <= config.offload.device_mem_bytes


def test_auto_plans_with_recomputation_rather_than_refuse() -> None:
    chain = as_unit_chain("gpt-tiny")
    config = _config("auto", device_mem=_budget("none", "2MiB"))
    assert not _plans(chain, replace(config, keep_graphs=1))  # the premise: not even one graph fits
    kept = plan_kept(chain, config, plan=_planner(config))
    assert kept.units == frozenset()
    assert kept.model == config_model_spec(chain, config, keep_graph=())


def test_auto_is_refused_as_none_is_when_recomputation_does_not_fit() -> None:
    chain = as_unit_chain("gpt-tiny")
    config = _config("auto", device_mem="1MiB")
    with pytest.raises(DoesNotFit) as auto:
        plan_kept(chain, config, plan=_planner(config))
    with pytest.raises(DoesNotFit) as none:
        plan_kept(chain, replace(config, keep_graphs="none"), plan=_planner(config))
    assert str(auto.value) == str(none.value) and "it plans with --device-mem" in str(auto.value)
    assert auto.value.needs == none.value.needs


def test_an_explicit_request_is_planned_as_asked() -> None:
    chain = as_unit_chain("gpt-tiny")
    config = _config("all", device_mem=_budget(2, "2MiB"))
    with pytest.raises(DoesNotFit, match="does not fit: needs at least"):  # refused, not fewer graphs
        plan_kept(chain, config, plan=_planner(config))
    kept = plan_kept(chain, replace(config, keep_graphs=2), plan=_planner(config))
    assert kept.units == frozenset({chain.num_units - 3, chain.num_units - 2})
