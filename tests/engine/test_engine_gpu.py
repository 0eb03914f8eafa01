"""The engine on a CUDA GPU: the device tier is GPU memory, each queue a CUDA stream, dependencies CUDA
events, host copies pinned. The same training as plain PyTorch on the same GPU, for every home tier of
the parameters and of the optimizer state, and bit for bit alike under the chaos mode (random delays on
every queue: CUDA events alone must order the work)."""

from __future__ import annotations

import pytest
import torch

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.models.gpt import build_gpt
from luwu_rt.optim.schedule import lr_at

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 8
PLACEMENTS = [("device", "device", "device"), ("host", "host", "host"), ("nvme", "nvme", "nvme"),
              ("device", "nvme", "host"), ("host", "device", "device")]


def _config(tmp_path, placement, **extra) -> TrainConfig:
    params, optimizer, grads = placement
    base = {"model": "gpt-tiny", "steps": STEPS, "batch_size": 4, "seq_len": 32, "seed": 3, "keep_graphs": "none",
            "optim": {"lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 2, "grad_clip": 0.5},
            "offload": {"params": params, "optimizer": optimizer, "grads": grads, "device_mem": "256MiB",
                        "host_mem": "64MiB", "chunk_size": "64KiB", "nvme_dir": str(tmp_path / "nvme")}}
    base.update(extra)
    return from_mapping(TrainConfig, base)


def _batches(config: TrainConfig):
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (STEPS, config.batch_size, config.seq_len + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _reference(config: TrainConfig, batches) -> list[float]:
    """Plain PyTorch on the GPU: the same weights, AdamW, schedule and exact clipping."""
    chain = build_gpt(config.model, device="cpu", seed=config.seed)
    model = chain.model.cuda()
    o = config.optim
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=config.steps)
        opt.zero_grad()
        loss = chain.forward(x.cuda(), y.cuda())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    config = _config(tmp_path_factory.mktemp("ref"), ("host", "host", "host"))
    batches = _batches(config)
    return batches, _reference(config, batches)


@pytest.mark.parametrize("placement", PLACEMENTS, ids="-".join)
def test_gpu_placements_match_plain_pytorch_on_the_gpu(tmp_path, reference, placement, no_chaos) -> None:
    batches, ref_losses = reference
    with Engine(None, _config(tmp_path, placement)) as engine:
        assert engine.device.type == "cuda" and engine.queues.device_streams == "cuda"
        assert (engine.placement.params, engine.placement.optimizer, engine.placement.grads) == placement
        losses = [engine.train_step(b)["loss"] for b in batches]
    # GPU kernels (attention, reductions) round differently from one launch configuration to another:
    # close to the reference, not bit-equal.
    assert losses == pytest.approx(ref_losses, rel=2e-4)


@pytest.mark.parametrize("placement", [("nvme", "host", "device"), ("device", "nvme", "host")], ids="-".join)
def test_gpu_streams_alone_order_the_work_under_chaos(tmp_path, reference, placement, chaos) -> None:
    batches, _ = reference
    with chaos.off():
        plain = Engine(None, _config(tmp_path / "plain", placement))
    chaotic = Engine(None, _config(tmp_path / "chaos", placement))
    try:
        assert plain.executor.chaos is None and chaotic.executor.chaos is not None
        plain_losses = [plain.train_step(b)["loss"] for b in batches]
        losses = [chaotic.train_step(b)["loss"] for b in batches]
        assert losses == plain_losses
        for u in range(plain.chain.num_units):
            n = plain.chain.num_unit_params(u)
            for state in ("master", "exp_avg", "exp_avg_sq"):
                a = plain.store.read_state(u, state, torch.empty(n))
                b = chaotic.store.read_state(u, state, torch.empty(n))
                assert torch.equal(a, b), (u, state)
    finally:
        plain.close()
        chaotic.close()


def test_gpu_evaluate_and_checkpoint_round_trip(tmp_path, reference, no_chaos) -> None:
    batches, _ = reference
    config = _config(tmp_path, ("host", "nvme", "host"))
    with Engine(None, config) as engine:
        for b in batches[:3]:
            engine.train_step(b)
        before = engine.evaluate(batches[:2])
        saved = engine.save(tmp_path / "ckpt")
        rest = [engine.train_step(b)["loss"] for b in batches[3:5]]
    with Engine.load(saved) as resumed:
        assert resumed.evaluate(batches[:2]) == pytest.approx(before, rel=1e-6)
        assert [resumed.train_step(b)["loss"] for b in batches[3:5]] == pytest.approx(rest, rel=1e-6)
