"""Simulated data-parallel execution: every rank's plan run by its own executor and store, the ranks
as threads of this process, collectives matched by ``LocalWorld`` (which checks order and shapes).

The fake compute writes known gradients and checks that every parameter copy it computes with holds
the parameters of this step, which is how a read before the gather or update that writes it shows.
Gradient contributions are small multiples of 1/32, so every sum is exact in fp32 in any order: the
result of each strategy must equal the single-process reference bit for bit, whatever the order in
which ranks and queues ran.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import torch

from luwu_rt.dist import CollectiveHandlers, LocalWorld
from luwu_rt.exec import AdamWHandler, Executor, NormHandlers
from luwu_rt.exec.optim import AdamWHyper
from luwu_rt.io import IOEngine
from luwu_rt.kernels import adamw_step
from luwu_rt.plan import Budgets, ModelSpec, Placement, Strategy, UnitSpec, plan_step
from luwu_rt.plan.ops import GLOBAL_UNIT, ShardId
from luwu_rt.plan.sequence import group_members
from luwu_rt.store import Arena, NvmeTier, TieredStore, nvme_regions

SIZES = (5000, 3001, 7000, 2048)
READS = {3: (0,)}  # the last unit reads the first one's parameters, like a tied head
CHUNK = 8192
HYPER = AdamWHyper(lr=1e-2, weight_decay=0.1)
MAX_NORM = 4.0


def model_spec(*, micro_batches: int = 1, clip: bool = False) -> ModelSpec:
    units = tuple(UnitSpec(name=f"u{i}", num_params=n, reads=READS.get(i, ()), flops_per_token=2 * n)
                  for i, n in enumerate(SIZES))
    return ModelSpec(units=units, param_bytes=4, grad_bytes=4, chunk_bytes=CHUNK, max_shards_per_state=2,
                     tokens_per_step=64 * micro_batches, num_micro_batches=micro_batches,
                     optimizer_waits_for_backward=clip)


def initial(unit: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + unit)
    n = SIZES[unit]
    return {"master": torch.randn(n, generator=g), "exp_avg": torch.randn(n, generator=g) * 0.01,
            "exp_avg_sq": torch.rand(n, generator=g) * 1e-4}


def contribution(*, step: int, computing: int, unit: int, rank: int, mb: int) -> torch.Tensor:
    """What B(``computing``) of ``rank`` adds to ``unit``'s gradient in micro-batch ``mb``: exact in fp32."""
    g = torch.Generator().manual_seed(((step * 31 + computing) * 31 + unit) * 1009 + rank * 13 + mb)
    return torch.randint(-4, 5, (SIZES[unit],), generator=g).float() / 32


def _readers(unit: int) -> list[int]:
    return [k for k in range(len(SIZES)) if k == unit or unit in READS.get(k, ())]


def reference(*, world: int, micro_batches: int, steps: int, clip: bool) -> list[dict]:
    """The single-process result: per step, each unit's full master, moments and parameters before it."""
    state = {u: initial(u) for u in range(len(SIZES))}
    history = []
    for step in range(1, steps + 1):
        history.append({u: {k: v.clone() for k, v in s.items()} for u, s in state.items()})
        grads = {u: sum(contribution(step=step, computing=k, unit=u, rank=r, mb=mb) for r in range(world)
                        for mb in range(micro_batches) for k in _readers(u)) for u in state}
        total = sum(float(g.double().square().sum()) for g in grads.values())
        scale = min(1.0, MAX_NORM / (total ** 0.5 + 1e-6)) if clip else 1.0
        for u, s in state.items():
            adamw_step(s["master"], grads[u], s["exp_avg"], s["exp_avg_sq"], step=step, lr=HYPER.lr,
                       weight_decay=HYPER.weight_decay, grad_scale=scale)
    history.append({u: {k: v.clone() for k, v in s.items()} for u, s in state.items()})
    return history


def _slice(values: torch.Tensor, *, rank: int, ways: int) -> torch.Tensor:
    per = -(-values.numel() // ways)
    padded = torch.zeros(per * ways, dtype=values.dtype)
    padded[: values.numel()] = values
    return padded[rank * per : (rank + 1) * per]


@dataclasses.dataclass
class Rank:
    rank: int
    plan: object
    store: TieredStore
    executor: Executor
    optim: AdamWHandler
    norms: NormHandlers
    step: int = 0
    params: dict | None = None
    """The full parameters every compute of this step must see."""


def _compute(r: "Rank"):
    shards, offsets = r.plan.shards, r.store.offsets

    def compute(op, views) -> None:
        for sid, view in views.items():
            full_copy = sid.state == "param_full" or (sid.state == "param" and not r.plan.strategy.sharded("param"))
            if full_copy:
                start, numel = offsets[sid], shards[sid].numel
                got = view.view(torch.float32)[:numel]
                assert torch.equal(got, r.params[sid.unit][start : start + numel]), \
                    f"rank {r.rank} {op.name} step {r.step}: {sid} does not hold this step's parameters"
        if op.name.startswith("F"):
            return
        reads_in = {a.shard for a in op.inputs}
        for acc in op.outputs:
            sid = acc.shard
            value = contribution(step=r.step, computing=op.unit, unit=sid.unit, rank=r.rank, mb=op.micro_batch)
            start, numel = offsets[sid], shards[sid].numel
            flat = views[sid].view(torch.float32)
            if sid in reads_in:
                flat[:numel] += value[start : start + numel]
            else:
                flat.zero_()  # the padding of a full buffer reduce-scatters as zeros
                flat[:numel] = value[start : start + numel]
    return compute


def _optim(r: Rank):
    def optim(op, views) -> None:
        total = views.get(ShardId(GLOBAL_UNIT, "norm", 0))
        scale = 1.0
        if total is not None:
            scale = min(1.0, MAX_NORM / (float(total.view(torch.float64)[0]) ** 0.5 + 1e-6))
        r.optim.hyper = dataclasses.replace(HYPER, grad_scale=scale)
        r.optim(op, views)
    return optim


def build_ranks(strategy: Strategy, placement: Placement, budgets: Budgets, model: ModelSpec, tmp: Path,
                io: IOEngine, *, timeout_s: float = 60.0) -> list[Rank]:
    plans = [plan_step(model, budgets=budgets, placement=placement, strategy=strategy)
             for _ in range(strategy.world_size)]
    world = LocalWorld(strategy.world_size, timeout_s=timeout_s)
    ranks = []
    for rank, plan in enumerate(plans):
        arenas = {t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}
        for arena in arenas.values():
            arena.buffer.fill_(0xFF)  # NaN everywhere: a read before a write cannot go unnoticed
        regions = nvme_regions(plan)
        nvme = NvmeTier(tmp / f"rank-{rank}", regions=regions, chunk_bytes=CHUNK, engine=io) if regions else None
        store = TieredStore(plan, arenas=arenas, nvme=nvme)
        groups = {q: world.group(q, rank=rank, members=group_members(strategy, g, rank))
                  for q, g in plan.comm_groups.items()}
        norms = NormHandlers(plan.shards, grad_dtype=torch.float32)
        comm = CollectiveHandlers(plan.shards, groups=groups, param_dtype=torch.float32, grad_dtype=torch.float32,
                                  norms=norms)
        optim = AdamWHandler(plan.shards, param_dtype=torch.float32, grad_dtype=torch.float32)
        r = Rank(rank, plan, store, None, optim, norms)  # type: ignore[arg-type]
        handlers = {"Compute": _compute(r), "OptimStep": _optim(r),
                    "GradNorm": norms.grad_norm, **comm.handlers()}
        r.executor = Executor(plan, store=store, handlers=handlers)
        _write_initial(r, strategy)
        ranks.append(r)
    return ranks


def _write_initial(r: Rank, strategy: Strategy) -> None:
    for u in range(len(SIZES)):
        for state, values in initial(u).items():
            mine = _slice(values, rank=r.rank % strategy.shard_ways, ways=strategy.shard_ways) if strategy.sharded(state) else values
            r.store.write_state(u, state, mine)
        master = initial(u)["master"]
        param = _slice(master, rank=r.rank % strategy.shard_ways, ways=strategy.shard_ways) if strategy.sharded("param") else master
        r.store.write_state(u, "param", param)
    r.store.flush()


def run_step(ranks: list[Rank], step: int, params: dict[int, torch.Tensor], *, timeout_s: float = 120.0) -> None:
    """Every rank runs its plan once, concurrently; the first failure is raised."""
    failures: list[BaseException] = []

    def go(r: Rank) -> None:
        r.step, r.params, r.optim.step = step, params, step
        try:
            r.executor.run()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=go, args=(r,), name=f"rank-{r.rank}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank did not finish: deadlock"
    if failures:
        raise failures[0]


def read_full(ranks: list[Rank], strategy: Strategy, unit: int, state: str) -> torch.Tensor:
    """A unit's whole buffer of ``state``, joined from the ranks' slices when it is sharded."""
    n = SIZES[unit]
    if not strategy.sharded(state):
        return ranks[0].store.read_state(unit, state, torch.empty(n))
    ways = strategy.shard_ways
    per = -(-n // ways)
    parts = [r.store.read_state(unit, state, torch.empty(per)) for r in ranks[:ways]]
    return torch.cat(parts)[:n]
