"""The executor against an in-memory computation of the same step."""

import dataclasses
import json
import threading

import pytest
import torch

from luwu_rt.exec import AdamWHandler, Executor, NormHandlers, Queues, write_chrome_trace
from luwu_rt.exec.streams import DeferredStream, HostEvent
from luwu_rt.io import IOEngine
from luwu_rt.kernels import adamw_step
from luwu_rt.plan import Budgets, ModelSpec, Placement, PlanError, UnitSpec, plan_step, validate
from luwu_rt.plan.ops import Compute, Load
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


def _setup(plan, tmp_path, engine, *, queues: Queues | None = None):
    arenas = {t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}
    for arena in arenas.values():
        arena.buffer.fill_(0xFF)  # NaN everywhere: a read before the write it needs cannot go unnoticed
    regions = nvme_regions(plan)
    nvme = NvmeTier(tmp_path, regions=regions, chunk_bytes=CHUNK, engine=engine) if regions else None
    handler = AdamWHandler(plan.shards, param_dtype=torch.bfloat16, grad_dtype=torch.float32)
    handler.step = 3
    handler.hyper = type(handler.hyper)(lr=1e-2, weight_decay=0.1)

    def compute(op, views):
        for acc in op.inputs:  # computes with this step's parameters, loaded before
            if acc.shard.state == "param":
                info, start = plan.shards[acc.shard], store.offsets[acc.shard]
                expect = _initial(acc.shard.unit)["param"][start : start + info.numel]
                assert torch.equal(views[acc.shard].view(torch.bfloat16)[: info.numel], expect), \
                    f"{op.name} read {acc.shard} before it was loaded"
        if op.name.startswith("B"):  # backward produces this unit's gradients
            for sid, view in views.items():
                if sid.state == "grad":
                    info, start = plan.shards[sid], store.offsets[sid]
                    view.view(torch.float32)[: info.numel].copy_(_initial(sid.unit)["grad"][start : start + info.numel])

    store = TieredStore(plan, arenas=arenas, nvme=nvme)
    norms = NormHandlers(plan.shards, grad_dtype=torch.float32)
    ex = Executor(plan, store=store, queues=queues,
                  handlers={"Compute": compute, "OptimStep": handler, "GradNorm": norms.grad_norm,
                            "NormReduce": norms.norm_reduce})
    ex.norms = norms
    _write_initial(store)
    return ex


def _write_initial(store: TieredStore) -> None:
    """The state before the step (``_reference`` is the state after it)."""
    for u in range(len(SIZES)):
        for state, values in _initial(u).items():
            if state != "grad":
                store.write_state(u, state, values)
    store.flush()


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


def _plan(placement: Placement):
    # Tight budgets: the device holds about one unit, the host a few shards (all of it when it is home).
    device = 1 << 20 if placement.params == "device" else 200_000
    return plan_step(_model(), budgets=Budgets(device_bytes=device, host_bytes=400_000), placement=placement)


def _equals_in_memory(ex: Executor) -> bool:
    """Whether the store holds, bit for bit, what the in-memory step computes."""
    for u in range(len(SIZES)):
        ref = _reference(u)
        for state in OPTIM + ("param",):
            if not torch.equal(ex.store.read_state(u, state, torch.empty_like(ref[state])), ref[state]):
                return False
    return True


@pytest.fixture
def queues(request):
    """``Queues`` whose device queues run on ``request.param`` streams (``host`` or ``deferred``)."""
    with Queues(device_streams=getattr(request, "param", "host")) as q:
        yield q


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: f"{p.params}-{p.optimizer}-{p.grads}")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "serialised"])
@pytest.mark.parametrize("queues", ["host", "deferred"], indirect=True)
@pytest.mark.parametrize("chaotic", [False, True], ids=["plain", "chaos"])
def test_out_of_core_step_equals_in_memory_bit_for_bit(tmp_path, request, placement, overlap, queues,
                                                       chaotic) -> None:
    request.getfixturevalue("chaos" if chaotic else "no_chaos")
    plan = _plan(placement)
    validate(plan)
    with IOEngine(block_bytes=4096, queue_depth=4) as engine:
        ex = _setup(plan, tmp_path, engine, queues=queues)
        assert (ex.chaos is not None) == chaotic
        spans = ex.run(overlap=overlap)
        assert len(spans) == len(plan.ops)
        expect_sq = sum(float(_initial(u)["grad"].double().square().sum()) for u in range(len(SIZES)))
        assert ex.norms.total_sq == pytest.approx(expect_sq, rel=1e-6)
        for u in range(len(SIZES)):
            ref = _reference(u)
            for state in OPTIM + ("param",):
                got = ex.store.read_state(u, state, torch.empty_like(ref[state]))
                assert torch.equal(got, ref[state]), (u, state)


SEEDS = range(1, 17)
"""Seeds for the runs that must fail: a race shows under some delays, not all (the missing dependency
below under about 60% of them); the search stops at the first failure."""


def _first_failure(plan, tmp_path, chaos, *, streams: str) -> int | None:
    """The first seed in ``SEEDS`` under which running ``plan`` does not give the in-memory result."""
    for seed in SEEDS:
        chaos.set(seed)
        with IOEngine(block_bytes=4096, queue_depth=4) as engine, Queues(device_streams=streams) as queues:
            ex = _setup(plan, tmp_path / f"s{seed}", engine, queues=queues)
            try:
                ex.run()
            except Exception:  # an error is as good a catch as a wrong result
                return seed
            if not _equals_in_memory(ex):
                return seed
    return None


def test_an_op_taken_as_done_when_enqueued_fails_here(tmp_path, chaos, monkeypatch) -> None:
    # The bug a GPU would hit: a deferred stream's event complete as soon as it is recorded, so the
    # queues that wait on it go ahead while its copies and kernels have not run yet.
    plan = _plan(PLACEMENTS[2])
    assert _first_failure(plan, tmp_path / "right", chaos, streams="deferred") is None

    def enqueued_is_done(self):
        self._items.put(("record", HostEvent()))
        return HostEvent(done=True)

    monkeypatch.setattr(DeferredStream, "record", enqueued_is_done)
    assert _first_failure(plan, tmp_path / "wrong", chaos, streams="deferred") is not None


def test_a_plan_missing_one_dependency_fails_in_the_validator_and_under_chaos(tmp_path, chaos) -> None:
    plan = _plan(PLACEMENTS[2])
    # Drop the dependency of the first compute (F0) on the last load of its parameters to the device.
    i, op = next((i, op) for i, op in enumerate(plan.ops) if isinstance(op, Compute))
    load = max(d for d in op.deps if isinstance(plan.ops[d], Load) and plan.ops[d].outputs[0].shard.state == "param")
    broken = dataclasses.replace(plan, ops=plan.ops[:i] + (dataclasses.replace(op, deps=tuple(
        d for d in op.deps if d != load)),) + plan.ops[i + 1:])
    with pytest.raises(PlanError, match=f"op {i} "):
        validate(broken)
    assert _first_failure(broken, tmp_path, chaos, streams="host") is not None


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


@pytest.mark.parametrize("queues", ["host", "deferred"], indirect=True)
def test_failing_handler_is_raised_not_hung_and_the_queues_live_on(tmp_path, queues) -> None:
    # Other tests' engines may still have threads that the garbage collector has not ended yet: only what
    # this test started is its to check.
    before = set(threading.enumerate())
    plan = plan_step(_model(), budgets=Budgets(device_bytes=200_000, host_bytes=400_000), placement=PLACEMENTS[2])
    ran = []

    def boom(op, views):
        ran.append(op.name if isinstance(op, Compute) else op.kind)
        raise RuntimeError(f"handler failed at {ran[-1]}")

    store = TieredStore(plan, arenas={t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}, nvme=None)
    ex = Executor(plan, store=store, queues=queues,
                  handlers={"Compute": boom, "OptimStep": boom, "GradNorm": boom, "NormReduce": boom})
    with pytest.raises(RuntimeError, match="handler failed at F0"):
        ex.run()
    assert ran[0] == "F0" and "B0" not in ran  # what depends on the failure never ran
    threads = queues.threads()
    assert threads and all(t.is_alive() for t in threads.values())
    # The same threads serve the next run; a plan without failures completes on them.
    good = _setup(plan, tmp_path, None, queues=queues)
    for overlap in (True, False):
        _write_initial(good.store)
        good.run(overlap=overlap)
        assert _equals_in_memory(good)
    assert queues.threads() == threads
    queues.close()
    assert not any(t.is_alive() for t in threads.values())
    assert not [t for t in threading.enumerate() if t.name.startswith("luwu-") and t not in before]


def test_an_executor_owns_its_queues_unless_given_some(tmp_path) -> None:
    plan = plan_step(_model(), budgets=Budgets(device_bytes=200_000, host_bytes=400_000), placement=PLACEMENTS[2])
    with _setup(plan, tmp_path, None) as ex:
        ex.run()
        threads = ex.queues.threads()
        assert set(threads) == {op.queue for op in plan.ops} - {"mem"}  # frees have no thread of their own
        _write_initial(ex.store)
        ex.run()
        assert ex.queues.threads() == threads and _equals_in_memory(ex)  # no thread per run
    assert not any(t.is_alive() for t in threads.values())


def test_missing_handler_is_refused() -> None:
    plan = plan_step(_model(), budgets=Budgets(device_bytes=200_000, host_bytes=400_000), placement=PLACEMENTS[2])
    with pytest.raises(ValueError, match="OptimStep"):
        store = TieredStore(plan, arenas={t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}, nvme=None)
        Executor(plan, store=store, handlers={"Compute": lambda op, v: None})
