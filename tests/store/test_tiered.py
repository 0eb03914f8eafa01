"""The tiered store: whole-unit state at any home, and the check that a plan fits its layout."""

import dataclasses

import pytest
import torch

from luwu_rt.io import IOEngine
from luwu_rt.plan import Budgets, ModelSpec, Placement, UnitSpec, plan_step
from luwu_rt.store import Arena, NvmeTier, TieredStore, nvme_regions

CHUNK = 8192


def _plan(params: str, optimizer: str, *, host: int = 400_000):
    model = ModelSpec(units=(UnitSpec(name="a", num_params=5000), UnitSpec(name="b", num_params=9000)),
                      param_bytes=2, grad_bytes=4, chunk_bytes=CHUNK, max_shards_per_state=2)
    return plan_step(model, budgets=Budgets(device_bytes=1 << 20, host_bytes=host),
                     placement=Placement(params=params, optimizer=optimizer, grads="host"))


@pytest.mark.parametrize("params,optimizer", [("host", "nvme"), ("nvme", "host"), ("device", "device")])
def test_write_then_read_every_state_at_its_home(tmp_path, params, optimizer) -> None:
    plan = _plan(params, optimizer)
    with IOEngine(block_bytes=4096) as io:
        regions = nvme_regions(plan)
        nvme = NvmeTier(tmp_path, regions=regions, chunk_bytes=CHUNK, engine=io) if regions else None
        store = TieredStore(plan, arenas={t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}, nvme=nvme)
        values = {}
        for u, n in enumerate((5000, 9000)):
            for state in ("master", "exp_avg", "exp_avg_sq"):
                values[(u, state)] = torch.randn(n)
                store.write_state(u, state, values[(u, state)])
            values[(u, "param")] = torch.randn(n).to(torch.bfloat16)
            store.write_state(u, "param", values[(u, "param")])
        store.flush()
        for (u, state), expect in values.items():
            assert torch.equal(store.read_state(u, state, torch.empty_like(expect)), expect), (u, state)


def test_a_plan_with_another_layout_is_refused() -> None:
    plan = _plan("host", "host")
    store = TieredStore(plan, arenas={t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}, nvme=None)
    other = dataclasses.replace(plan, arena_bytes={**plan.arena_bytes, "host": plan.arena_bytes["host"] + 4096})
    with pytest.raises(ValueError, match="arena"):
        store.check_plan(other)
    moved = dataclasses.replace(plan, homes={**plan.homes, "param": "device"})
    with pytest.raises(ValueError, match="lays out"):
        store.check_plan(moved)
    on_nvme = _plan("host", "nvme")
    with pytest.raises(ValueError, match="NVMe"):
        TieredStore(on_nvme, arenas={t: Arena(n, tier=t) for t, n in on_nvme.arena_bytes.items()}, nvme=None)


def test_arenas_are_as_large_as_the_plans_reach_not_the_budget() -> None:
    """A budget is a limit: the store allocates (and pins) only the bytes the plan's copies reach, the
    larger of the plans that share it."""
    small, large = _plan("host", "host"), _plan("host", "host", host=800_000)
    assert large.arena_bytes["host"] < 800_000 and large.arena_bytes["host"] >= large.peak_bytes["host"]
    store = TieredStore.create(small, device=torch.device("cpu"), also=(large,))
    try:
        assert store.arenas["host"].nbytes == max(small.arena_bytes["host"], large.arena_bytes["host"])
        store.check_plan(small)
        store.check_plan(large)
    finally:
        store.close()


def test_ranks_sharing_a_disk_share_its_queue(tmp_path) -> None:
    """[Note: ranks share the disk's queue] (io/engine.py): each of N ranks on one machine keeps 1/N of the
    pieces one process would keep in flight, and the store's engine runs at the depth it is given."""
    from luwu_rt.io import QUEUE_DEPTH, rank_queue_depth

    assert rank_queue_depth(1) == QUEUE_DEPTH and rank_queue_depth(2) == QUEUE_DEPTH // 2
    assert rank_queue_depth(QUEUE_DEPTH * 4) == 1, "never below one piece"
    plan = _plan("nvme", "nvme")
    for depth, expect in ((None, QUEUE_DEPTH), (rank_queue_depth(2), QUEUE_DEPTH // 2)):
        store = TieredStore.create(plan, device=torch.device("cpu"), nvme_root=tmp_path / f"d{depth}",
                                   queue_depth=depth)
        try:
            assert store.nvme.engine.queue_depth == expect
        finally:
            store.close()
