"""Steps in steady state (issue 21 item 1): a step returns with its tail of write-backs still running and the next
step starts beside it; evaluation, checkpoints and whatever reads the store wait for it first; the results are
those of steps run one after the other, bit for bit, also under chaos."""

from __future__ import annotations

import pytest
import torch

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig

STEPS = 5


def _config(tmp_path, placement=("host", "nvme", "device"), **extra) -> TrainConfig:
    params, optimizer, grads = placement
    return from_mapping(TrainConfig, {
        "model": "gpt-tiny", "steps": STEPS, "batch_size": 2, "seq_len": 16, "seed": 5, "eval_batches": 1,
        "optim": {"lr": 2e-3, "warmup_steps": 1, "grad_clip": 0.0},
        "offload": {"params": params, "optimizer": optimizer, "grads": grads, "device_mem": "64MiB",
                    "host_mem": "64MiB", "chunk_size": "64KiB", "nvme_dir": str(tmp_path / "nvme")}, **extra})


def _batches(count: int = STEPS):
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (count, 2, 17), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _state(engine: Engine) -> list[torch.Tensor]:
    return [engine.store.read_state(u, s, torch.empty(engine.chain.num_unit_params(u)))
            for u in range(engine.chain.num_units) for s in ("master", "exp_avg", "exp_avg_sq")]


def test_a_step_leaves_its_tail_running_and_the_next_one_starts_beside_it(tmp_path) -> None:
    engine = Engine(None, _config(tmp_path))
    assert engine.plan.tail and engine.plan.wrap_deps
    engine.train_step(_batches()[0])
    assert engine.queues.pending is not None and engine.queues.pending.executor is engine.executor
    engine.train_step(_batches()[1])  # warm: beside the first step's tail
    assert engine.queues.pending is not None
    engine.evaluate(num_batches=1)  # waits for the tail first: evaluation starts cold
    assert engine.queues.pending is None
    engine.train_step(_batches()[2])
    engine.save(tmp_path / "ckpt")  # so does a checkpoint
    assert engine.queues.pending is None
    engine.close()


@pytest.mark.parametrize("placement",
                         [("host", "nvme", "device"), ("nvme", "nvme", "nvme"), ("device", "host", "host")],
                         ids="-".join)
def test_steps_in_steady_state_equal_steps_one_after_the_other_under_chaos(tmp_path, chaos, placement) -> None:
    with chaos.off():
        alone = Engine(None, _config(tmp_path / "alone", placement))
    pipelined = Engine(None, _config(tmp_path / "pipelined", placement))
    for batch in _batches():
        a = alone.train_step(batch)["loss"]
        alone.queues.drain()  # the next step starts cold
        assert alone.queues.pending is None
        assert pipelined.train_step(batch)["loss"] == a
    assert all(torch.equal(x, y) for x, y in zip(_state(alone), _state(pipelined)))
    alone.close()
    pipelined.close()


def test_a_failing_tail_is_raised_by_what_waits_for_it(tmp_path, monkeypatch) -> None:
    """A write-back of the tail that fails surfaces in the next step (or the drain), not never."""
    engine = Engine(None, _config(tmp_path))
    engine.train_step(_batches()[0])
    engine.queues.drain()
    nvme = engine.store.nvme
    real = nvme.submit_write
    tail_stores = {(op.shard.unit, op.shard.state) for i, op in enumerate(engine.plan.ops)
                   if i in engine.plan.tail and op.kind == "Store" and op.dst == "nvme"}
    assert tail_stores

    def failing(unit, state, **kw):
        if (unit, state) in tail_stores:
            raise OSError(28, "No space left on device (test)")
        return real(unit, state, **kw)

    monkeypatch.setattr(nvme, "submit_write", failing)
    with pytest.raises(OSError, match="No space left"):
        engine.train_step(_batches()[1])
        engine.queues.drain()
    monkeypatch.setattr(nvme, "submit_write", real)
    engine.close()
