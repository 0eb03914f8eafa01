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

from luwu_rt.compress import codec_for
from luwu_rt.dist import CollectiveHandlers, LocalWorld
from luwu_rt.exec import AdamWHandler, Executor, NormHandlers, WaitAll
from luwu_rt.exec.chaos import Chaos
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


def compressed_sum(grads: list[torch.Tensor], residuals: list[torch.Tensor], *, codec: str,
                   strategy: str) -> torch.Tensor:
    """The sum over ranks of their gradients ``grads[r]`` sent through ``codec`` with error feedback (each
    rank's residual updated in place), as one process that applies the codec to the same gradients: pieces
    as the strategy cuts them ([Note: codecs on the wire] in plan/codec.py), decoded and summed in rank order."""
    world, n = len(grads), grads[0].numel()
    c = codec_for(codec, chunk_numel=CHUNK // 4)
    piece = n if strategy == "ddp" else -(-n // world)
    total = torch.zeros(n)
    for first in range(0, n, piece):
        last = min(first + piece, n)
        for r in range(world):
            payload = torch.empty(c.payload_bytes(last - first), dtype=torch.uint8)
            c.encode(grads[r][first:last].contiguous(), residuals[r][first:last], payload)
            c.decode(payload, total[first:last], accumulate=r > 0)
    return total


def _grads(step: int, world: int, micro_batches: int, residuals: dict, compress: tuple[str, str] | None) -> dict:
    """Each unit's reduced gradient of ``step``: summed, or through ``compress`` = (codec, strategy)."""
    def rank_grad(u, r, mbs):
        return sum(contribution(step=step, computing=k, unit=u, rank=r, mb=mb) for mb in mbs for k in _readers(u))

    if compress is None:
        return {u: sum(rank_grad(u, r, range(micro_batches)) for r in range(world)) for u in range(len(SIZES))}
    codec, strategy = compress
    # zero2 reduces every micro-batch (its later ones added to the first's); ddp and zero1 the accumulated step.
    groups = [[mb] for mb in range(micro_batches)] if strategy == "zero2" else [list(range(micro_batches))]
    return {u: sum(compressed_sum([rank_grad(u, r, mbs) for r in range(world)], residuals[u], codec=codec,
                                  strategy=strategy) for mbs in groups) for u in range(len(SIZES))}


def reference(*, world: int, micro_batches: int, steps: int, clip: bool,
              compress: tuple[str, str] | None = None, warmup: int = 0) -> list[dict]:
    """The single-process result: per step, each unit's full master, moments and parameters before it; with
    ``compress`` = (codec, strategy), the gradients of the steps after ``warmup`` sent through the codec and
    each rank's residual after the step (``residual<r>``)."""
    state = {u: initial(u) for u in range(len(SIZES))}
    residuals = {u: [torch.zeros(SIZES[u]) for _ in range(world)] for u in state}
    history = []
    for step in range(1, steps + 1):
        history.append({u: {k: v.clone() for k, v in s.items()} for u, s in state.items()})
        grads = _grads(step, world, micro_batches, residuals, compress if step > warmup else None)
        total = sum(float(g.double().square().sum()) for g in grads.values())
        scale = min(1.0, MAX_NORM / (total ** 0.5 + 1e-6)) if clip else 1.0
        for u, s in state.items():
            adamw_step(s["master"], grads[u], s["exp_avg"], s["exp_avg_sq"], step=step, lr=HYPER.lr,
                       weight_decay=HYPER.weight_decay, grad_scale=scale)
    history.append({u: {k: v.clone() for k, v in s.items()} | {f"residual{r}": e.clone() for r, e in
                                                                 enumerate(residuals[u])} for u, s in state.items()})
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
    exact: bool = True
    """Whether they must be bit for bit the reference's (not after a clipped step)."""
    spans: list | None = None
    """The spans of the last step's ops."""


def _compute(r: "Rank"):
    shards, offsets = r.plan.shards, r.store.offsets

    def compute(op, views) -> None:
        for sid, view in views.items():
            full_copy = sid.state == "param_full" or (sid.state == "param" and not r.plan.strategy.sharded("param"))
            if full_copy:
                start, numel = offsets[sid], shards[sid].numel
                got, want = view.view(torch.float32)[:numel], r.params[sid.unit][start : start + numel]
                # Clipped runs sum the norm in another order than the reference: equal to a few ulps.
                same = torch.equal(got, want) if r.exact else torch.allclose(got, want, rtol=1e-5, atol=1e-6)
                assert same, f"rank {r.rank} {op.name} step {r.step}: {sid} does not hold this step's parameters"
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
        groups = {q: world.group(q, rank=rank, members=group_members(strategy, g, rank))
                  for q, g in plan.comm_groups.items()}
        ranks.append(build_rank(rank, plan, groups, tmp, io))
    return ranks


def build_rank(rank: int, plan, groups: dict, tmp: Path, io: IOEngine) -> Rank:
    """One rank of ``plan`` whose collectives run on ``groups`` (queue -> ``luwu_rt.dist.Group``: in-process
    groups, or ``TorchGroup``s of a real world), its initial state written."""
    r = _make_rank(rank, plan, tmp / f"rank-{rank}", io)
    r.exact = not any(op.kind == "OptimStep" and any(a.shard.unit == GLOBAL_UNIT for a in op.inputs)
                      for op in plan.ops)  # clipped updates sum the norm in another order
    comm = CollectiveHandlers(plan.shards, groups=groups, param_dtype=torch.float32, grad_dtype=torch.float32,
                              norms=r.norms)
    handlers = {"Compute": _compute(r), "OptimStep": _optim(r), "GradNorm": r.norms.grad_norm, **comm.handlers()}
    # Ranks are threads of this process here: each draws the chaos delays of its own rank.
    r.executor = Executor(plan, store=r.store, handlers=handlers, chaos=Chaos.from_env(rank=rank))
    _write_initial(r, plan.strategy)
    return r


def _write_initial(r: Rank, strategy: Strategy) -> None:
    for u in range(len(SIZES)):
        if strategy.codec(u) != "none":  # error feedback starts from nothing owed
            r.store.write_state(u, "residual", torch.zeros(SIZES[u]))
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
            r.spans = r.executor.run()
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


# -- the optimizer node: worker plans and the node's own plan, joined in-process ---------------------------


class NodeLink:
    """Pushes and pulls between worker threads and a node thread, for one step at a time: a Recv completes
    once every worker pushed the unit (summed in rank order), a Pull once the node served it."""

    def __init__(self, workers: int, *, timeout_s: float = 60.0) -> None:
        self.workers, self.timeout_s = workers, timeout_s
        self.cond = threading.Condition()
        self.pushed: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        self.served: dict[tuple[int, int], torch.Tensor] = {}

    def _until(self, ready, what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(ready, self.timeout_s):
                raise TimeoutError(f"{what} never came: deadlock")

    def push(self, key: tuple[int, int], rank: int, values: torch.Tensor) -> None:
        with self.cond:
            self.pushed.setdefault(key, {})[rank] = values.clone()
            self.cond.notify_all()

    def recv(self, key: tuple[int, int]) -> torch.Tensor:
        self._until(lambda: len(self.pushed.get(key, {})) == self.workers, f"the pushes of {key}")
        parts = self.pushed.pop(key)
        total = parts[0].clone()
        for r in range(1, self.workers):
            total += parts[r]
        return total

    def serve(self, key: tuple[int, int], values: torch.Tensor) -> None:
        with self.cond:
            self.served[key] = values.clone()
            self.cond.notify_all()

    def pull(self, key: tuple[int, int]) -> torch.Tensor:
        self._until(lambda: key in self.served, f"the parameters of {key}")
        return self.served[key]


def _pieces(views, shards, state: str) -> list[torch.Tensor]:
    ids = sorted((s for s in views if s.state == state), key=lambda s: s.chunk)
    return [views[s].view(torch.float32)[: shards[s].numel] for s in ids]


def _transfer_handlers(shards, link: NodeLink, who: "Rank", *, node: bool) -> dict:
    def send(op, views):  # worker Push / node Serve: the unit's whole buffer, joined from its shards
        state = "param" if node else "grad"
        values = torch.cat(_pieces(views, shards, state))
        (link.serve if node else lambda k, v: link.push(k, who.rank, v))((who.step, op.unit), values)
        return WaitAll()

    def receive(op, views):  # node Recv / worker Pull: completes in the wait, into the shards
        state = "grad" if node else "param"

        def finish() -> None:
            values = (link.recv if node else link.pull)((who.step, op.unit))
            start = 0
            for piece in _pieces(views, shards, state):
                piece.copy_(values[start : start + piece.numel()])
                start += piece.numel()
        return WaitAll(then=finish)

    return {"Serve": send, "Recv": receive} if node else {"Push": send, "Pull": receive}


def build_node_run(workers: int, placement: Placement, node_placement: Placement, budgets: Budgets,
                   node_budgets: Budgets, model: ModelSpec, tmp: Path, io: IOEngine) -> tuple[list[Rank], Rank]:
    """``workers`` worker ranks of strategy node and one optimizer node, linked in-process."""
    from luwu_rt.plan.node import plan_node

    link = NodeLink(workers)
    strategy = Strategy(name="node", world_size=workers)
    ranks = []
    for rank in range(workers):
        plan = plan_step(model, budgets=budgets, placement=placement, strategy=strategy)
        r = _make_rank(rank, plan, tmp / f"rank-{rank}", io)
        r.exact = not model.optimizer_waits_for_backward
        handlers = {"Compute": _compute(r), **_transfer_handlers(plan.shards, link, r, node=False)}
        r.executor = Executor(plan, store=r.store, handlers=handlers, chaos=Chaos.from_env(rank=rank))
        for u in range(len(SIZES)):
            r.store.write_state(u, "param", initial(u)["master"])
        r.store.flush()
        ranks.append(r)
    plan = plan_node(model, budgets=node_budgets, placement=node_placement, num_workers=workers)
    node = _make_rank(workers, plan, tmp / "node", io)
    handlers = {"OptimStep": _optim(node), "GradNorm": node.norms.grad_norm, "NormReduce": node.norms.norm_reduce,
                **_transfer_handlers(plan.shards, link, node, node=True)}
    node.executor = Executor(plan, store=node.store, handlers=handlers, chaos=Chaos.from_env(rank=workers))
    _write_initial(node, Strategy())
    return ranks, node


def _make_rank(rank: int, plan, directory: Path, io: IOEngine) -> Rank:
    arenas = {t: Arena(n, tier=t) for t, n in plan.arena_bytes.items()}
    for arena in arenas.values():
        arena.buffer.fill_(0xFF)
    regions = nvme_regions(plan)
    nvme = NvmeTier(directory, regions=regions, chunk_bytes=CHUNK, engine=io) if regions else None
    store = TieredStore(plan, arenas=arenas, nvme=nvme)
    norms = NormHandlers(plan.shards, grad_dtype=torch.float32)
    optim = AdamWHandler(plan.shards, param_dtype=torch.float32, grad_dtype=torch.float32)
    return Rank(rank, plan, store, None, optim, norms)  # type: ignore[arg-type]
