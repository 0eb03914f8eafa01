"""Every data-parallel strategy's per-rank plans, executed together: ranks as threads, each with its own
executor and store, collectives matched by an in-process group that checks their order and shapes.
The run must finish (no deadlock), every computation must see this step's parameters, and the result
must equal the single-process step bit for bit."""

import pytest
import torch

from dist_sim import SIZES, build_node_run, build_ranks, model_spec, read_full, reference, run_step
from luwu_rt.io import IOEngine
from luwu_rt.plan import Budgets, Placement, Strategy

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "hsdp"]
OPTIM = ("master", "exp_avg", "exp_avg_sq")


def _strategy(name: str, world: int) -> Strategy:
    return Strategy(name=name, world_size=world, group_size=2 if name == "hsdp" else 0)


def _check(ranks, strategy, expect) -> None:
    for u in range(len(SIZES)):
        for state in OPTIM:
            got = read_full(ranks, strategy, u, state)
            assert torch.equal(got, expect[u][state]), (strategy.name, u, state)
        got = read_full(ranks, strategy, u, "param")
        assert torch.equal(got, expect[u]["master"]), (strategy.name, u, "param")
    for r in ranks[1:]:  # replicated states are equal on every rank
        for u in range(len(SIZES)):
            if not strategy.sharded("param"):
                assert torch.equal(r.store.read_state(u, "param", torch.empty(SIZES[u])), expect[u]["master"])


@pytest.fixture
def io():
    with IOEngine(block_bytes=4096, queue_depth=4) as engine:
        yield engine


def _simulate(tmp_path, io, strategy, placement, *, micro_batches=1, clip=False, steps=2,
              budgets=Budgets(device_bytes=1 << 20, host_bytes=1 << 20)):
    model = model_spec(micro_batches=micro_batches, clip=clip)
    history = reference(world=strategy.world_size, micro_batches=micro_batches, steps=steps, clip=clip)
    ranks = build_ranks(strategy, placement, budgets, model, tmp_path, io)
    for step in range(1, steps + 1):
        run_step(ranks, step, {u: history[step - 1][u]["master"] for u in range(len(SIZES))})
    return ranks, history


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_equals_the_single_process_step(tmp_path, io, name, world) -> None:
    strategy = _strategy(name, world)
    ranks, history = _simulate(tmp_path, io, strategy, Placement(params="host", optimizer="host", grads="host"))
    _check(ranks, strategy, history[-1])


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("placement", [Placement(params="device", optimizer="device", grads="device"),
                                       Placement(params="nvme", optimizer="nvme", grads="nvme")],
                         ids=lambda p: f"{p.params}-{p.optimizer}-{p.grads}")
def test_strategies_with_every_tier_and_accumulation(tmp_path, io, name, placement) -> None:
    strategy = _strategy(name, 4)
    ranks, history = _simulate(tmp_path, io, strategy, placement, micro_batches=3,
                               budgets=Budgets(device_bytes=1 << 20, host_bytes=600_000))
    _check(ranks, strategy, history[-1])


@pytest.mark.parametrize("name", STRATEGIES)
def test_exact_clipping_waits_for_the_global_norm(tmp_path, io, name) -> None:
    strategy = _strategy(name, 4)
    ranks, history = _simulate(tmp_path, io, strategy, Placement(params="host", optimizer="host", grads="host"),
                               clip=True, steps=1)
    expect = history[-1]
    for u in range(len(SIZES)):
        got = read_full(ranks, strategy, u, "master")
        torch.testing.assert_close(got, expect[u]["master"], rtol=1e-6, atol=1e-7)
    totals = {r.norms.total_sq for r in ranks}
    assert len(totals) == 1  # every rank clipped with the same norm


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("node_placement", [Placement(params="host", optimizer="host", grads="host"),
                                            Placement(params="nvme", optimizer="nvme", grads="host")],
                         ids=["node-host", "node-nvme"])
@pytest.mark.parametrize("chaotic", [False, True], ids=["plain", "chaos"])
def test_node_workers_and_the_node_plan_run_together(tmp_path, io, request, world, node_placement, chaotic) -> None:
    """Worker plans (push, pull) and the optimizer node's own plan (receive, update, serve) interlock without
    deadlock, also with every process drawing random delays, and the node's state after two steps is the
    single-process one."""
    request.getfixturevalue("chaos" if chaotic else "no_chaos")
    steps, model = 2, model_spec(micro_batches=2, clip=True)
    history = reference(world=world, micro_batches=2, steps=steps, clip=True)
    workers, node = build_node_run(world, Placement(params="host", optimizer="host", grads="host"), node_placement,
                                   Budgets(device_bytes=1 << 20, host_bytes=1 << 20),
                                   Budgets(device_bytes=0, host_bytes=600_000, nvme_bytes=1 << 30), model, tmp_path, io)
    for step in range(1, steps + 1):
        run_step([*workers, node], step, {u: history[step - 1][u]["master"] for u in range(len(SIZES))})
    for u in range(len(SIZES)):
        for state in OPTIM:
            torch.testing.assert_close(node.store.read_state(u, state, torch.empty(SIZES[u])), history[-1][u][state],
                                       rtol=1e-6, atol=1e-7)
        for w in workers:
            got = w.store.read_state(u, "param", torch.empty(SIZES[u]))
            assert torch.equal(got, node.store.read_state(u, "param", torch.empty(SIZES[u])))


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategies_stay_bit_exact_under_chaos(tmp_path, io, chaos, name) -> None:
    """The same multi-rank run with every rank drawing its own random delays: bit for bit the reference."""
    strategy = _strategy(name, 4)
    ranks, history = _simulate(tmp_path, io, strategy, Placement(params="host", optimizer="nvme", grads="host"),
                               micro_batches=2)
    _check(ranks, strategy, history[-1])
