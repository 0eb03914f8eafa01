"""Exact clipping with speculative updates (issue 21 item 3): a double-buffered optimizer state on NVMe, each
update as its gradients are final, committed when the norm needs no clipping and redone when it does.

Both outcomes are forced: a clip threshold no norm reaches commits every step, a tiny one redoes every step; each
is compared with plain PyTorch (``clip_grad_norm_`` then AdamW) and bit for bit with the same engine whose updates
wait for the norm (no double buffer), also under chaos and across a checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.engine import engine as engine_module
from luwu_rt.models.gpt import build_gpt
from luwu_rt.optim.schedule import lr_at
from luwu_rt.plan import Budgets, HardwareProfile, Placement, estimate, gpt_model_spec, plan_step, validate
from luwu_rt.plan.halves import mirror
from luwu_rt.plan.planner import plan_restore
from luwu_rt.models.presets import get_preset

STEPS = 6
PLACEMENT = ("host", "nvme", "device")
NEVER = 1e6
"""A clip threshold no gradient norm here reaches: every speculative step commits."""
ALWAYS = 1e-6
"""One every norm exceeds: every speculative step is redone."""


def _config(tmp_path, *, clip: float, placement=PLACEMENT, **extra) -> TrainConfig:
    params, optimizer, grads = placement
    base = {"model": "gpt-tiny", "steps": STEPS, "batch_size": 2, "seq_len": 16, "seed": 3,
            "optim": {"lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 2, "grad_clip": clip},
            "offload": {"params": params, "optimizer": optimizer, "grads": grads, "device_mem": "64MiB",
                        "host_mem": "64MiB", "chunk_size": "64KiB", "nvme_dir": str(tmp_path / "nvme")}, **extra}
    return from_mapping(TrainConfig, base)


def _batches(config: TrainConfig, count: int = STEPS):
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, 256, (count, config.batch_size, config.seq_len + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _speculating(config: TrainConfig, mode: str = "always") -> Engine:
    engine = Engine(None, config)
    assert engine.speculation is not None, "the optimizer state on NVMe with clipping is double-buffered"
    engine.speculation.step.speculation = mode
    return engine


def _waiting(config: TrainConfig, monkeypatch) -> Engine:
    """The same run without a double buffer: every update waits for the norm."""
    with monkeypatch.context() as m:
        m.setattr(engine_module.Engine, "_double_buffered", lambda self, budgets: "")
        engine = Engine(None, config)
    assert engine.speculation is None
    return engine


def _state(engine: Engine) -> dict:
    out = {}
    for u in range(engine.chain.num_units):
        n = engine.chain.num_unit_params(u)
        for state in ("master", "exp_avg", "exp_avg_sq", "param"):
            dtype = engine.param_dtype if state == "param" else torch.float32
            out[u, state] = engine.store.read_state(u, state, torch.empty(n, dtype=dtype))
    return out


def _reference(config: TrainConfig, batches):
    """Plain PyTorch: autograd, ``clip_grad_norm_``, ``torch.optim.AdamW``, the engine's schedule."""
    chain = build_gpt(config.model, device="cpu", seed=config.seed)
    o = config.optim
    opt = torch.optim.AdamW(chain.model.parameters(), lr=1.0, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=config.steps)
        opt.zero_grad()
        loss = chain.forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(chain.model.parameters(), o.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    m = chain.model
    return losses, [torch.cat([p.detach().reshape(-1) for p in u.parameters()]) for u in [m.embed, *m.blocks, m.head]]


@pytest.mark.parametrize("clip, outcome", [(NEVER, "commit"), (ALWAYS, "redo")])
def test_commit_and_redo_equal_plain_pytorch_with_clip_grad_norm(tmp_path, clip, outcome) -> None:
    config = _config(tmp_path, clip=clip)
    batches = _batches(config)
    ref_losses, ref_units = _reference(config, batches)
    engine = _speculating(config)
    losses = [engine.train_step(b)["loss"] for b in batches]
    assert engine.speculation.counts[outcome] == STEPS
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for u, expect in enumerate(ref_units):
        got = engine.store.read_state(u, "master", torch.empty(expect.numel()))
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=config.optim.lr / 100)
    engine.close()


@pytest.mark.parametrize("clip, dtype", [(NEVER, "fp32"), (ALWAYS, "fp32"), (0.5, "bf16"), (NEVER, "bf16")])
def test_speculative_steps_are_bit_exact_with_waiting_ones(tmp_path, monkeypatch, clip, dtype) -> None:
    batches = _batches(_config(tmp_path, clip=clip))
    waiting = _waiting(_config(tmp_path / "wait", clip=clip, dtype=dtype), monkeypatch)
    speculating = _speculating(_config(tmp_path / "spec", clip=clip, dtype=dtype))
    for batch in batches:
        a, b = waiting.train_step(batch), speculating.train_step(batch)
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])
    assert speculating.store.half == STEPS % 2  # every applied step swapped the halves
    expect = _state(waiting)
    for key, got in _state(speculating).items():
        assert torch.equal(got, expect[key]), key
    waiting.close()
    speculating.close()


def test_adaptive_speculation_waits_after_a_clipped_step(tmp_path, monkeypatch) -> None:
    """A step after one whose norm was clipped waits for its norm; one after an unclipped step speculates."""
    engine = _speculating(_config(tmp_path, clip=1.0), mode="adaptive")
    waiting = _waiting(_config(tmp_path / "wait", clip=1.0), monkeypatch)
    norms, ends = [], []
    for batch in _batches(engine.config):
        norms.append(engine.train_step(batch)["grad_norm"])
        ends.append(engine.speculation.last)
        assert waiting.train_step(batch)["grad_norm"] == norms[-1]
    for before, norm, end in zip([0.0] + norms, norms, ends):
        assert end == ("wait" if before > 1.0 else "redo" if norm > 1.0 else "commit"), (before, norm, end)
    assert _state(engine).keys() == _state(waiting).keys()
    assert all(torch.equal(a, b) for a, b in zip(_state(engine).values(), _state(waiting).values()))


def test_a_skipped_step_puts_the_parameters_back(tmp_path, monkeypatch) -> None:
    """fp16 with a loss scale that overflows: the norm is not finite, nothing is updated, and the parameters the
    speculative updates overwrote are those of the master weights again."""
    extra = {"dtype": "fp16", "loss_scale": 2.0 ** 40}
    waiting = _waiting(_config(tmp_path / "wait", clip=1.0, **extra), monkeypatch)
    speculating = _speculating(_config(tmp_path / "spec", clip=1.0, **extra))
    before = _state(speculating)
    for batch in _batches(speculating.config, 3):
        assert waiting.train_step(batch)["skipped"] and speculating.train_step(batch)["skipped"]
    assert speculating.speculation.counts["skip"] == 3 and speculating.store.half == 0
    assert speculating.adam_step == waiting.adam_step == 0
    after = _state(speculating)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(torch.equal(after[k], v) for k, v in _state(waiting).items())


@pytest.mark.parametrize("clip", [NEVER, ALWAYS])
def test_speculation_is_bit_exact_under_chaos(tmp_path, chaos, clip) -> None:
    batches = _batches(_config(tmp_path, clip=clip))
    with chaos.off():
        plain = _speculating(_config(tmp_path / "plain", clip=clip))
    chaotic = _speculating(_config(tmp_path / "chaos", clip=clip))
    assert chaotic.executor.chaos is not None and plain.executor.chaos is None
    for batch in batches:
        assert plain.train_step(batch)["loss"] == chaotic.train_step(batch)["loss"]
    assert all(torch.equal(a, b) for a, b in zip(_state(plain).values(), _state(chaotic).values()))


def test_a_checkpoint_of_either_half_resumes_exactly(tmp_path) -> None:
    """After an odd number of committed steps the second half is current; the checkpoint holds it as the state,
    and a resumed run (which starts from the first half) goes on bit for bit."""
    batches = _batches(_config(tmp_path, clip=NEVER))
    whole = _speculating(_config(tmp_path / "whole", clip=NEVER))
    expect = [whole.train_step(b)["loss"] for b in batches]
    first = _speculating(_config(tmp_path / "first", clip=NEVER))
    got = [first.train_step(b)["loss"] for b in batches[:3]]
    assert first.store.half == 1
    path = first.save(tmp_path / "ckpt")
    first.close()
    resumed = Engine.load(path)
    resumed.speculation.step.speculation = "always"
    got += [resumed.train_step(b)["loss"] for b in batches[3:]]
    assert got == expect
    assert all(torch.equal(a, b) for a, b in zip(_state(whole).values(), _state(resumed).values()))
    resumed.close()
    whole.close()


def test_the_double_buffered_plans_move_the_bytes_of_an_update_in_place() -> None:
    """Writing the other half costs no IO beyond an update in place: the same NVMe bytes each way, and the
    speculative plan overlaps what waiting serialises. Each plan and its mirror (the other half's) is valid."""
    model = gpt_model_spec(get_preset("gpt-tiny"), chunk_bytes=64 << 10, batch_size=2, seq_len=16)
    where = dict(budgets=Budgets(device_bytes=64 << 20, host_bytes=6 << 20),
                 placement=Placement(params="host", optimizer="nvme", grads="device"))
    in_place = plan_step(model, **where)
    db = dataclasses.replace(model, double_buffer=True)
    speculate = plan_step(db, **where)
    waits = plan_step(dataclasses.replace(db, optimizer_waits_for_backward=True), **where)
    for plan in (speculate, waits, plan_restore(db, **where)):
        validate(plan)
        validate(mirror(plan))
    profile = HardwareProfile()
    nvme = {name: estimate(p, profile).io_bytes["nvme"]
            for name, p in (("in place", in_place), ("speculate", speculate))}
    assert nvme["in place"] == nvme["speculate"]
    # Every update (in pieces: [Note: an update in pieces] in plan/sequence.py) takes over its staging copies.
    takers = [op for op in speculate.ops if op.consumes]
    assert {type(op).__name__ for op in takers} == {"OptimStep"} and len(takers) == speculate.count("OptimStep")
    assert {op.unit for op in takers} == set(range(len(model.units)))
    assert estimate(speculate, profile).predicted_step_s <= estimate(waits, profile).predicted_step_s


def test_the_engine_says_why_its_updates_wait(tmp_path) -> None:
    """Where clipping makes the updates wait for the norm and they cannot speculate, the engine keeps the
    planner's reason (``luwu train`` prints it on its first line); speculating, or not waiting, it has none."""
    in_memory = Engine(None, _config(tmp_path, clip=1.0, placement=("host", "host", "device")))
    assert in_memory.speculation is None and "optimizer state is in host memory" in in_memory.why_updates_wait
    assert _speculating(_config(tmp_path, clip=1.0)).why_updates_wait == ""
    assert Engine(None, _config(tmp_path, clip=0.0)).why_updates_wait == ""
