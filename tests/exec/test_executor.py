"""The executor against an in-memory computation of the same step."""

import json

import pytest
import torch

from luwu_rt.exec import AdamWHandler, Executor, NormHandlers, write_chrome_trace
from luwu_rt.io import IOEngine
from luwu_rt.kernels import adamw_step
from luwu_rt.plan import Budgets, ModelSpec, Placement, UnitSpec, plan_step, validate
from luwu_rt.store import Arena, NvmeTier, TieredStore, nvme_regions

CHUNK = 2 * 4096
SIZES = (5000, 3001, 7000)
OPTIM = ("master", "exp_avg", "exp_avg_sq")


def _model() -> ModelSpec:
    return ModelSpec(units=tuple(UnitSpec(name=f"u{i}", num_params=n) for i, n in enumerate(SIZES)),
                     param_bytes=2, grad_bytes=4, chunk_bytes=CHUNK, max_shards_per_state=3)


def _initial(unit: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(unit)
    n = SIZES[unit]
    master = torch.randn(n, generator=g)
    return {"master": master, "exp_avg": torch.randn(n, generator=g) * 0.1,
            "exp_avg_sq": torch.rand(n, generator=g) * 0.01, "param": master.to(torch.bfloat16),
            "grad": torch.randn(n, generator=g)}


def _setup(plan, tmp_path, engine):
    arenas = {t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}
    regions = nvme_regions(plan)
    nvme = NvmeTier(tmp_path, regions=regions, chunk_bytes=CHUNK, engine=engine) if regions else None
    handler = AdamWHandler(plan.shards, param_dtype=torch.bfloat16, grad_dtype=torch.float32)
    handler.step = 3
    handler.hyper = type(handler.hyper)(lr=1e-2, weight_decay=0.1)

    def compute(op, views):
        if op.name.startswith("B"):  # backward produces this unit's gradients
            for sid, view in views.items():
                if sid.state == "grad":
                    info, start = plan.shards[sid], store.offsets[sid]
                    view.view(torch.float32)[: info.numel].copy_(_initial(sid.unit)["grad"][start : start + info.numel])

    store = TieredStore(plan, arenas=arenas, nvme=nvme)
    norms = NormHandlers(plan.shards, grad_dtype=torch.float32)
    ex = Executor(plan, store=store, handlers={"Compute": compute, "OptimStep": handler, "GradNorm": norms.grad_norm,
                                              "NormReduce": norms.norm_reduce})
    ex.norms = norms
    for u in range(len(SIZES)):
        for state, values in _initial(u).items():
            if state != "grad":
                store.write_state(u, state, values)
    store.flush()
    return ex


def _reference(unit: int) -> dict[str, torch.Tensor]:
    s = _initial(unit)
    param_out = torch.empty_like(s["param"])
    adamw_step(s["master"], s["grad"], s["exp_avg"], s["exp_avg_sq"], step=3, lr=1e-2, weight_decay=0.1,
               param_out=param_out)
    s["param"] = param_out
    return s


PLACEMENTS = [
    Placement(params="host", optimizer="nvme", grads="host"),
    Placement(params="nvme", optimizer="nvme", grads="nvme"),
    Placement(params="host", optimizer="host", grads="host"),
    Placement(params="device", optimizer="device", grads="device"),
]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: f"{p.params}-{p.optimizer}-{p.grads}")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serialised"])
def test_out_of_core_step_equals_in_memory_bit_for_bit(tmp_path, placement, overlap) -> None:
    # Tight budgets: the device holds about one unit, the host a few shards (all of it when it is home).
    device = 1 << 20 if placement.params == "device" else 200_000
    plan = plan_step(_model(), budgets=Budgets(device_bytes=device, host_bytes=400_000), placement=placement)
    validate(plan)
    with IOEngine(block_bytes=4096, queue_depth=4) as engine:
        ex = _setup(plan, tmp_path, engine)
        spans = ex.run(overlap=overlap)
        assert len(spans) == len(plan.ops)
        expect_sq = sum(float(_initial(u)["grad"].double().square().sum()) for u in range(len(SIZES)))
        assert ex.norms.total_sq == pytest.approx(expect_sq, rel=1e-6)
        for u in range(len(SIZES)):
            ref = _reference(u)
            for state in OPTIM + ("param",):
                got = ex.store.read_state(u, state, torch.empty_like(ref[state]))
                assert torch.equal(got, ref[state]), (u, state)


def test_trace_export(tmp_path) -> None:
    plan = plan_step(_model(), budgets=Budgets(device_bytes=200_000, host_bytes=400_000), placement=PLACEMENTS[0])
    with IOEngine() as engine:
        ex = _setup(plan, tmp_path / "nvme", engine)
        spans = ex.run()
    write_chrome_trace(spans, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert len(events) == len(plan.ops)
    assert {e["tid"] for e in events} >= {"nvme_read", "nvme_write", "optim"}
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)


def test_failing_handler_is_raised_not_hung(tmp_path) -> None:
    plan = plan_step(_model(), budgets=Budgets(device_bytes=200_000, host_bytes=400_000), placement=PLACEMENTS[2])

    def boom(op, views):
        raise RuntimeError(f"handler failed at {op.name}")

    store = TieredStore(plan, arenas={t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}, nvme=None)
    ex = Executor(plan, store=store, handlers={"Compute": boom, "OptimStep": boom, "GradNorm": boom, "NormReduce": boom})
    with pytest.raises(RuntimeError, match="handler failed at F0"):
        ex.run()


def test_missing_handler_is_refused() -> None:
    plan = plan_step(_model(), budgets=Budgets(device_bytes=200_000, host_bytes=400_000), placement=PLACEMENTS[2])
    with pytest.raises(ValueError, match="OptimStep"):
        store = TieredStore(plan, arenas={t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}, nvme=None)
        Executor(plan, store=store, handlers={"Compute": lambda op, v: None})
