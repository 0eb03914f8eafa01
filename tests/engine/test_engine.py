"""The out-of-core engine against a plain PyTorch training loop on the same model."""

import contextlib
import functools
import itertools
import math
from dataclasses import replace

import pytest
import torch

from luwu_rt.config import from_mapping
from luwu_rt.engine import Engine, TrainConfig
from luwu_rt.optim.schedule import lr_at
from luwu_rt.engine.workload import device_budget
from luwu_rt.exec import Queues
from luwu_rt.models.gpt import build_gpt

STEPS = 20
TIERS = ("device", "host", "nvme")


def _config(tmp_path, placement, **extra) -> TrainConfig:
    params, optimizer, grads = placement
    base = {"model": "gpt-tiny", "steps": STEPS, "batch_size": 2, "seq_len": 16, "seed": 3,
            "optim": {"lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 3, "grad_clip": 0.5},
            "offload": {"params": params, "optimizer": optimizer, "grads": grads, "device_mem": "64MiB",
                        "host_mem": "64MiB", "chunk_size": "64KiB", "nvme_dir": str(tmp_path / "nvme")}}
    for key, value in extra.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return from_mapping(TrainConfig, base)


def _reference_losses(config: TrainConfig, batches) -> tuple[list[float], torch.nn.Module]:
    chain = build_gpt(config.model, device="cpu", seed=config.seed)
    model = chain.model
    o = config.optim
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    losses = []
    for step, (x, y) in enumerate(batches, start=1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=config.steps)
        opt.zero_grad()
        loss = chain.forward(x, y)
        loss.backward()
        if o.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model


def _batches(config: TrainConfig):
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (STEPS, config.batch_size, config.seq_len + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def config_lr(engine: Engine) -> float:
    return engine.config.optim.lr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    config = _config(tmp_path_factory.mktemp("ref"), ("host", "host", "host"))
    batches = _batches(config)
    losses, model = _reference_losses(config, batches)
    return batches, losses, model


@pytest.mark.parametrize("placement", list(itertools.product(TIERS, TIERS, TIERS)), ids="-".join)
def test_every_placement_matches_plain_pytorch(tmp_path, reference, placement) -> None:
    batches, ref_losses, ref_model = reference
    engine = Engine(None, _config(tmp_path, placement))
    assert (engine.placement.params, engine.placement.optimizer, engine.placement.grads) == placement
    losses = [engine.train_step(b)["loss"] for b in batches]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # Final master weights against the reference model's parameters, unit by unit. Adam
    # normalises each gradient by its own magnitude, so for weights whose gradients are ~0 the
    # last-bit differences of a unit-wise recomputation move the update by up to ~lr/100.
    ref_units = [ref_model.embed, *ref_model.blocks, ref_model.head]
    for u, module in enumerate(ref_units):
        expect = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        got = engine.store.read_state(u, "master", torch.empty(expect.numel()))
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=config_lr(engine) / 100)


def _state(engine: Engine) -> dict[tuple[int, str], torch.Tensor]:
    """Every unit's persistent state, read through the store."""
    out = {}
    for u in range(engine.chain.num_units):
        n = engine.chain.num_unit_params(u)
        for state in ("master", "exp_avg", "exp_avg_sq", "param"):
            dtype = engine.param_dtype if state == "param" else torch.float32
            out[u, state] = engine.store.read_state(u, state, torch.empty(n, dtype=dtype))
    return out


def _assert_bit_exact(a: Engine, b: Engine) -> None:
    expect = _state(a)
    for key, got in _state(b).items():
        assert torch.equal(got, expect[key]), key


def _plain_and_chaotic(chaos, make):
    """``make(tag)`` twice: without chaos, then with it."""
    with chaos.off():
        plain = make("plain")
    chaotic = make("chaos")
    assert plain.executor.chaos is None and chaotic.executor.chaos is not None
    assert chaotic.eval_executor.chaos is not None
    return plain, chaotic


def _deferred_device_streams(monkeypatch) -> None:
    """Engines built from now on run their device queues on deferred streams (work runs some time after
    it was issued, as on a GPU)."""
    from luwu_rt.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "Queues", functools.partial(Queues, device_streams="deferred"))


CHAOS_STEPS = 8
CHAOS_PLACEMENTS = [(("nvme", "nvme", "nvme"), "host"), (("device", "host", "nvme"), "deferred"),
                    (("host", "device", "host"), "deferred"), (("nvme", "host", "device"), "host")]


@pytest.mark.parametrize("placement, streams", CHAOS_PLACEMENTS,
                         ids=lambda v: "-".join(v) if isinstance(v, tuple) else v)
def test_placements_train_bit_for_bit_alike_under_chaos(tmp_path, reference, chaos, monkeypatch, placement,
                                                        streams) -> None:
    batches, ref_losses, _ = reference
    if streams == "deferred":
        _deferred_device_streams(monkeypatch)
    plain, chaotic = _plain_and_chaotic(chaos, lambda tag: Engine(None, _config(tmp_path / tag, placement)))
    assert chaotic.queues.device_streams == streams
    plain_losses = [plain.train_step(b)["loss"] for b in batches[:CHAOS_STEPS]]
    losses = [chaotic.train_step(b)["loss"] for b in batches[:CHAOS_STEPS]]
    assert losses == plain_losses
    assert losses == pytest.approx(ref_losses[:CHAOS_STEPS], rel=1e-5)
    _assert_bit_exact(plain, chaotic)


@pytest.mark.parametrize("chaotic", [False, True], ids=["plain", "chaos"])
def test_tight_budgets_force_everything_through_nvme(tmp_path, request, reference, chaotic) -> None:
    batches, ref_losses, _ = reference
    request.getfixturevalue("chaos" if chaotic else "no_chaos")
    config = _config(tmp_path, ("auto", "auto", "auto"), offload={"host_mem": "6MiB"})
    budget = device_budget(config, arena_bytes=4 << 20)
    config = replace(config, offload=replace(config.offload, device_mem_bytes=budget))
    engine = Engine(None, config)
    assert (engine.executor.chaos is not None) == chaotic
    assert "nvme" in (engine.placement.params, engine.placement.optimizer, engine.placement.grads)
    assert engine.plan.count("Load") > 0
    losses = [engine.train_step(b)["loss"] for b in batches[:5]]
    assert losses == pytest.approx(ref_losses[:5], rel=1e-5)


def test_grad_accumulation_equals_the_large_batch(tmp_path) -> None:
    one = _config(tmp_path / "a", ("host", "host", "host"), batch_size=4)
    two = _config(tmp_path / "b", ("host", "host", "host"), batch_size=2, grad_accum=2)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (3, 4, one.seq_len + 1), generator=g)
    e1, e2 = Engine(None, one), Engine(None, two)
    for d in data:
        x, y = d[:, :-1], d[:, 1:]
        m1 = e1.train_step((x, y))
        m2 = e2.train_step([(x[:2], y[:2]), (x[2:], y[2:])])
        assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)


def test_grad_accumulation_is_bit_exact_under_chaos(tmp_path, chaos) -> None:
    plain, chaotic = _plain_and_chaotic(chaos, lambda tag: Engine(None, _config(
        tmp_path / tag, ("host", "nvme", "host"), batch_size=2, grad_accum=3)))
    for _ in range(3):
        expect, got = plain.train_step(), chaotic.train_step()
        for key in ("loss", "grad_norm", "lr", "skipped", "kept_bytes"):  # all but the timings
            assert got[key] == expect[key], key
    _assert_bit_exact(plain, chaotic)


@pytest.mark.parametrize("chaotic", [False, True], ids=["plain", "chaos"])
def test_resume_is_exact(tmp_path, request, chaotic) -> None:
    config = _config(tmp_path, ("host", "nvme", "host"), steps=8)
    chaos = request.getfixturevalue("chaos" if chaotic else "no_chaos")  # no_chaos gives None
    with chaos.off() if chaos else contextlib.nullcontext():  # under chaos: the plain run against a chaotic one
        straight = Engine(None, _config(tmp_path / "straight", ("host", "nvme", "host"), steps=8))
    straight_losses = [straight.train_step()["loss"] for _ in range(8)]
    first = Engine(None, config)
    losses = [first.train_step()["loss"] for _ in range(4)]
    path = first.save(tmp_path / "ckpt")
    resumed = Engine.load(path)
    assert resumed.step == 4
    losses += [resumed.train_step()["loss"] for _ in range(4)]
    assert losses == straight_losses
    assert (resumed.executor.chaos is not None) == chaotic
    _assert_bit_exact(straight, resumed)


def test_evaluate_is_finite_and_learning_lowers_it(tmp_path) -> None:
    engine = Engine(None, _config(tmp_path, ("host", "host", "host"), steps=40, batch_size=8, seq_len=32))
    before = engine.evaluate(num_batches=2)
    for _ in range(40):
        engine.train_step()
    after = engine.evaluate(num_batches=2)
    assert math.isfinite(before) and after < before


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_compute_with_fp32_master(tmp_path, dtype) -> None:
    config = _config(tmp_path, ("host", "nvme", "host"), dtype=dtype, steps=30, batch_size=8, seq_len=32,
                     optim={"lr": 3e-3})
    engine = Engine(None, config)
    assert engine.param_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    metrics = [engine.train_step() for _ in range(30)]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert sum(m["loss"] for m in metrics[-5:]) < sum(m["loss"] for m in metrics[:5])
    # The compute copy is the master weights rounded to the compute dtype.
    n = engine.chain.num_unit_params(1)
    master = engine.store.read_state(1, "master", torch.empty(n))
    param = engine.store.read_state(1, "param", torch.empty(n, dtype=engine.param_dtype))
    assert torch.equal(param, master.to(engine.param_dtype))


@pytest.mark.parametrize("placement", [("host", "host", "host"), ("nvme", "host", "host")], ids="-".join)
def test_fp16_overflow_skips_the_step(tmp_path, placement) -> None:
    config = _config(tmp_path, placement, dtype="fp16", loss_scale=1e30)
    engine = Engine(None, config)
    n = engine.chain.num_unit_params(1)
    before = {s: engine.store.read_state(1, s, torch.empty(n, dtype=torch.float16 if s == "param" else torch.float32))
              for s in ("master", "exp_avg", "param")}
    m = engine.train_step()
    assert m["skipped"] and not math.isfinite(m["grad_norm"]) and engine.adam_step == 0 and engine.step == 1
    for state, value in before.items():  # nothing changed, the compute copy included
        assert torch.equal(engine.store.read_state(1, state, torch.empty_like(value)), value), state


@pytest.mark.parametrize("placement", [("nvme", "nvme", "nvme"), ("host", "host", "host"), ("device", "host", "host")],
                         ids="-".join)
def test_evaluate_runs_a_forward_plan_over_the_training_store(tmp_path, reference, placement) -> None:
    from luwu_rt.engine.compute import bind_unit_params

    batches, _, _ = reference
    engine = Engine(None, _config(tmp_path, placement))
    for batch in batches[:2]:
        engine.train_step(batch)
    plan = engine.eval_plan
    assert plan.count("Compute") == engine.chain.num_units and plan.count("OptimStep") == 0
    assert dict(plan.home_slots) == dict(engine.plan.home_slots)  # one store serves both plans
    # The same weights in a plain model, read through the store's own API.
    chain = build_gpt(engine.config.model, device="cpu")
    for u in range(chain.num_units):
        flat = engine.store.read_state(u, "param", torch.empty(chain.num_unit_params(u)))
        bind_unit_params(chain, u, flat)
    x, y = batches[5]
    with torch.no_grad():
        expect = float(chain.forward(x, y))
    assert engine.evaluate([(x, y)]) == pytest.approx(expect, rel=1e-6)


@pytest.mark.parametrize("streams", ["host", "deferred"])
def test_evaluate_is_bit_exact_under_chaos(tmp_path, reference, chaos, monkeypatch, streams) -> None:
    batches, _, _ = reference
    if streams == "deferred":
        _deferred_device_streams(monkeypatch)
    plain, chaotic = _plain_and_chaotic(chaos, lambda tag: Engine(None, _config(tmp_path / tag,
                                                                                ("nvme", "host", "host"))))
    for engine in (plain, chaotic):
        for batch in batches[:2]:
            engine.train_step(batch)
    assert chaotic.evaluate(batches[5:7]) == plain.evaluate(batches[5:7])
