"""Kept graphs in the engine ([Note: kept graphs in the engine] in engine/compute.py): a unit whose
forward keeps its autograd graph trains exactly like a recomputed one, also when the plan reuses the
unit's parameter slot on the device between its forward and its backward."""

import math
import threading
from dataclasses import replace

import pytest
import torch

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.engine.workload import device_budget
from luwu_rt.plan import parse_size
from luwu_rt.plan.analysis import params_at_risk
from luwu_rt.plan.ops import Compute, Load

STEPS = 4


def _config(tmp_path, *, keep, params="host", arena="2MiB", grad_accum=1) -> TrainConfig:
    # A 2 MiB device arena holds about two gpt-tiny blocks: parameter slots are recycled. The budget
    # adds what the run's activations reserve.
    config = from_mapping(TrainConfig, {
        "model": "gpt-tiny", "steps": STEPS, "batch_size": 2, "seq_len": 16, "seed": 5, "keep_graphs": keep,
        "grad_accum": grad_accum, "optim": {"lr": 3e-3, "warmup_steps": 1, "grad_clip": 0.0},
        "offload": {"params": params, "optimizer": "host", "grads": "host", "device_mem": "1GiB",
                    "host_mem": "64MiB", "chunk_size": "64KiB", "nvme_dir": str(tmp_path / "nvme")}})
    budget = device_budget(config, arena_bytes=parse_size(arena))
    return replace(config, offload=replace(config.offload, device_mem_bytes=budget))


def _batches(config: TrainConfig):
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, 256, (STEPS, config.grad_accum, config.batch_size, config.seq_len + 1), generator=g)
    return [[(mb[:, :-1], mb[:, 1:]) for mb in d] for d in data]


def _slot_reused_between_f_and_b(engine: Engine, unit: int) -> bool:
    """Whether the plan loads other bytes over unit ``unit``'s forward parameter slot before its backward."""
    ops = engine.plan.ops
    index = {op.name: i for i, op in enumerate(ops) if isinstance(op, Compute) and op.micro_batch == 0}
    f_op = ops[index[f"F{unit}"]]
    access = next(a for a in f_op.inputs if a.shard.unit == unit and a.shard.state == "param")
    slot, end = access.slot, access.slot + engine.plan.shards[access.shard].nbytes
    for op in ops[index[f"F{unit}"] + 1 : index[f"B{unit}"]]:
        if isinstance(op, Load) and op.outputs[0].tier == "device":
            dst = op.outputs[0]
            if dst.slot < end and slot < dst.slot + engine.plan.shards[dst.shard].nbytes:
                return True
    return False


def _train(config: TrainConfig) -> tuple[Engine, list[dict]]:
    engine = Engine(None, config)
    return engine, [engine.train_step(b) for b in _batches(config)]


@pytest.fixture(params=[False, True], ids=["plain", "chaos"])
def chaotic(request):
    """Each equivalence test runs plain and under chaos; under chaos, ``check_chaos`` also requires
    the chaotic run to equal a plain one bit for bit."""
    chaos = request.getfixturevalue("chaos" if request.param else "no_chaos")  # no_chaos gives None

    def check(config: TrainConfig, engine: Engine, metrics: list[dict]) -> None:
        if chaos is None:
            return
        assert engine.executor.chaos is not None
        with chaos.off():
            plain, plain_metrics = _train(replace(config, offload=replace(
                config.offload, nvme_dir=config.offload.nvme_dir + "-plain")))
        assert [m["loss"] for m in metrics] == [m["loss"] for m in plain_metrics]
        for u in range(engine.chain.num_units):
            n = engine.chain.num_unit_params(u)
            for state in ("master", "exp_avg", "exp_avg_sq", "param"):
                assert torch.equal(engine.store.read_state(u, state, torch.empty(n)),
                                   plain.store.read_state(u, state, torch.empty(n))), (u, state)

    return check


def _assert_same_training(a: Engine, a_metrics, b: Engine, b_metrics) -> None:
    assert [m["loss"] for m in a_metrics] == pytest.approx([m["loss"] for m in b_metrics], rel=1e-6)
    for u in range(a.chain.num_units):
        n = a.chain.num_unit_params(u)
        torch.testing.assert_close(a.store.read_state(u, "master", torch.empty(n)),
                                   b.store.read_state(u, "master", torch.empty(n)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_kept_graphs_equal_recomputation_when_param_slots_are_reused(tmp_path, grad_accum, chaotic) -> None:
    config = _config(tmp_path / "k", keep="all", grad_accum=grad_accum)
    kept, kept_metrics = _train(config)
    chaotic(config, kept, kept_metrics)
    recomputed, rec_metrics = _train(_config(tmp_path / "r", keep="none", grad_accum=grad_accum))
    last = kept.chain.num_units - 1
    assert kept.compute.config.keep_graph == frozenset(range(last))
    assert recomputed.compute.config.keep_graph == frozenset()
    # The premise: under this budget some kept unit's parameter bytes are overwritten before its backward,
    # and the plan analysis flags every such forward.
    reused = {u for u in range(last) if _slot_reused_between_f_and_b(kept, u)}
    assert reused and {(0, u) for u in reused} <= params_at_risk(kept.plan)
    _assert_same_training(kept, kept_metrics, recomputed, rec_metrics)
    # fp32 linears save their weights (views of the arena): B reads them again from the slots the plan loads
    # them into for it, so no graph holds a copy of them ([Note: kept graphs in the engine]); it had 2.4 MB.
    assert kept.compute.snapshot_bytes == 0
    assert all(m["kept_bytes"] > 0 for m in kept_metrics)
    assert all(m["kept_bytes"] == 0 for m in rec_metrics)


def test_device_resident_params_need_no_snapshot(tmp_path, chaotic) -> None:
    config = _config(tmp_path / "k", keep="all", params="device", arena="64MiB")
    kept, kept_metrics = _train(config)
    chaotic(config, kept, kept_metrics)
    recomputed, rec_metrics = _train(_config(tmp_path / "r", keep="none", params="device", arena="64MiB"))
    assert kept.compute.snapshot_bytes == 0
    # Activations only: the parameters the graphs save are the arena's own bytes.
    assert all(0 < m["kept_bytes"] < kept.store.arenas["device"].nbytes / 4 for m in kept_metrics)
    _assert_same_training(kept, kept_metrics, recomputed, rec_metrics)


def test_params_kept_resident_from_f_to_b_need_no_snapshot(tmp_path, chaotic) -> None:
    # A roomy device budget: the plan loads each unit's parameters once and frees them after its backward.
    config = _config(tmp_path / "k", keep="all", arena="64MiB")
    kept, kept_metrics = _train(config)
    chaotic(config, kept, kept_metrics)
    recomputed, rec_metrics = _train(_config(tmp_path / "r", keep="none", arena="64MiB"))
    assert kept.placement.params == "host" and params_at_risk(kept.plan) == frozenset()
    assert kept.compute.snapshot_bytes == 0
    _assert_same_training(kept, kept_metrics, recomputed, rec_metrics)


def test_auto_under_a_tight_budget_keeps_the_last_graphs_that_fit_and_trains_as_none_and_all(tmp_path,
                                                                                              chaotic) -> None:
    """[Note: kept graphs chosen by the budget]: with room for two graphs beside a 2 MiB arena, auto keeps the
    two units before the last (all of them no longer fit) and trains as recomputation and as kept graphs do."""
    config = replace(_config(tmp_path / "a", keep=2), keep_graphs="auto")
    auto, auto_metrics = _train(config)
    chaotic(config, auto, auto_metrics)
    last = auto.chain.num_units - 1
    assert auto.keep_graph == auto.compute.config.keep_graph == frozenset({last - 2, last - 1})
    assert all(m["kept_bytes"] > 0 for m in auto_metrics)
    for keep in ("none", "all"):
        other, other_metrics = _train(_config(tmp_path / keep, keep=keep))
        _assert_same_training(auto, auto_metrics, other, other_metrics)


def test_kept_units_from_config(tmp_path) -> None:
    last = Engine(None, _config(tmp_path, keep="none")).chain.num_units - 1
    for keep, expect in [("all", range(last)), ("none", ()), (2, range(last - 2, last)), (0, ()),
                         (99, range(last)), ("auto", range(last))]:  # auto: all, which the budget holds
        engine = Engine(None, _config(tmp_path, keep=keep), materialize=False)
        assert engine.compute.config.keep_graph == frozenset(expect), keep


@pytest.mark.parametrize("bad", ["some", -1, 1.5, True])
def test_bad_keep_graphs_is_a_clear_error(tmp_path, bad) -> None:
    with pytest.raises(ValueError, match="keep_graphs"):
        _config(tmp_path, keep=bad)


def test_units_compute_on_one_persistent_queue_thread_and_errors_reach_the_caller(tmp_path) -> None:
    engine = Engine(None, _config(tmp_path, keep="all", arena="64MiB"))
    threads: list[threading.Thread] = []
    run = engine.chain.run

    def recording(index, x, ctx):
        threads.append(threading.current_thread())
        return run(index, x, ctx)

    engine.chain.run = recording
    batches = _batches(engine.config)
    for batch in batches[:2]:
        engine.train_step(batch)
    engine.evaluate([batches[2][0]])
    # Training and evaluation compute on the compute queue's thread, the same one step after step.
    assert len(set(threads)) == 1 and threads[0] is engine.queues.threads()["compute"]
    assert threads[0] is not threading.current_thread()

    def boom(index, x, ctx):
        raise RuntimeError(f"boom in unit {index}")

    engine.chain.run = boom
    with pytest.raises(RuntimeError, match="boom in unit 0"):
        engine.train_step(batches[3])
    queue_threads = engine.queues.threads().values()
    assert all(t.is_alive() for t in queue_threads)  # a failed step leaves the queues to the next one
    engine.chain.run = run
    assert math.isfinite(engine.evaluate([batches[3][0]]))
    with engine:
        pass  # the context manager closes it
    assert not any(t.is_alive() for t in queue_threads)
    with pytest.raises(RuntimeError, match="closed"):
        engine.train_step(batches[0])
