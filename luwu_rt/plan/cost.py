"""Cost model: a plan and a hardware profile in, a predicted step time out.

Each op takes its bytes over the bandwidth of its link, its FLOPs over the
device's FLOP/s or its parameters over the optimizer's rate; a collective pays
latency and bandwidth terms ([Note: collective cost]). Ops start when their
dependencies ended and their queue is free (one op at a time per queue, in plan
order: an executor issues them in that order), so the predicted step time is the
critical path through dependencies and queue serialisation. The bottleneck is
the queue busy for longest. A worker plan of strategy ``node`` can be simulated
together with the optimizer node's plan ([Note: worker and node together]).

[Note: collective cost]
The alpha-beta model: a message step costs a latency alpha plus its bytes over
the link's bandwidth (beta = 1 / bandwidth). For a buffer of M bytes over p ranks:
  reduce-scatter, all-gather  (p-1) alpha + (p-1)/p M beta       (ring: p-1 steps)
  all-to-all                  (p-1) alpha + (p-1)/p M beta       (p-1 pieces out, one per peer)
  all-reduce, ring            2(p-1) alpha + 2(p-1)/p M beta     (reduce-scatter + all-gather)
  all-reduce, tree            2 ceil(log2 p) alpha + 2 M beta     (pipelined double binary tree, as NCCL)
  send, recv                  alpha + bytes beta
All-reduce takes the faster of ring and tree: the tree wins for small buffers
on many ranks (the norm's 8 bytes), the ring for large ones; they cross at
M = p alpha (p - 1 - ceil(log2 p)) / beta. The link is the one of the op's group
(``Collective.group``): ``world`` and ``replica`` use the network between ranks
(``net_*``), hsdp's ``shard`` group the faster link inside a server (``group_*``),
so hsdp's cost is hierarchical: reduce-scatters and all-gathers inside the
server, and only the slice's all-reduce across servers. ``node`` (a worker's
pushes and pulls) and ``workers`` (the node's side of them) use the node's NIC,
which all N workers share: a worker gets min(net, node x shards / N) of
bandwidth, and a node moves the N workers' bytes at min(node, N x net). Its
shards exchange their partial norms over ``nodes``. A ``Wait`` takes no time of
its own: its start occupies the queue for the whole transfer, and the wait,
next on that queue, ends when the transfer does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple

from .codec import codec_seconds
from .ops import (Collective, Compute, Decode, Encode, Free, GradNorm, Load, NormReduce, Op, OptimStep, Pull, Push, Recv,
                  Serve, Store, SwapPlan, Wait)
from .spec import TIERS, HardwareProfile

__all__ = ["StepCost", "collective_seconds", "estimate", "op_seconds", "op_times"]

_GB = 1e9
_LINK = {"nvme_read": "nvme_read_gbps", "nvme_write": "nvme_write_gbps", "h2d": "h2d_gbps", "d2h": "d2h_gbps"}
_NODE_LINK = {"nvme_read": "node_nvme_read_gbps", "nvme_write": "node_nvme_write_gbps"}
_AGGREGATE_BYTES = 8
"""Per pushed element the node reads and writes its fp32 sum (4 + 4 bytes) besides reading the push."""
NODE_PREFIX = "node:"
"""``StepCost.bottleneck`` names a queue of the optimizer node as ``node:<queue>`` (``node:nvme``: its disk)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    predicted_step_s: float
    """Critical path of one step; with the optimizer node simulated beside it, at least the node's
    busiest queue and disk, which it must get through once per step."""
    bottleneck: str
    """Queue with the most busy time (``compute`` means the step is compute bound), or ``nvme``
    when reads and writes together keep the disk busier than any queue ([Note: one disk]); a
    ``node:`` queue (or ``node:nvme``) when the optimizer node is busier than every worker queue."""
    busy_s: Mapping[str, float]
    """Seconds each queue is busy per step."""
    io_bytes: Mapping[str, Mapping[str, int]]
    """tier -> {"read": bytes moved out of it, "write": bytes moved into it} per step."""
    node_step_s: float = 0.0
    """The optimizer node's own critical path (0 without a node plan): its last op, write-back
    included, which may end after the workers' step while they run the next forward."""
    node_busy_s: Mapping[str, float] = field(default_factory=dict)
    """Seconds each queue of the optimizer node is busy per step (empty without a node plan)."""
    node_io_bytes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Like ``io_bytes``, on the optimizer node."""

    def __post_init__(self) -> None:
        for name in ("busy_s", "node_busy_s"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        for name in ("io_bytes", "node_io_bytes"):
            frozen = {t: MappingProxyType(dict(v)) for t, v in getattr(self, name).items()}
            object.__setattr__(self, name, MappingProxyType(frozen))


def collective_seconds(collective: str, *, nbytes: float, ranks: int, latency_s: float, gbps: float,
                       algorithm: str = "best") -> float:
    """Seconds of one ``collective`` of an ``nbytes`` buffer over ``ranks`` processes on a link of
    ``gbps`` GB/s and ``latency_s`` per message step ([Note: collective cost]). ``algorithm``
    (all-reduce only): ``ring``, ``tree`` or ``best`` (the faster)."""
    if collective == "local" or ranks <= 1:
        return 0.0
    beta = 1.0 / (gbps * _GB)
    if collective in ("send", "recv"):
        return latency_s + nbytes * beta
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (ranks - 1) * latency_s + nbytes * (ranks - 1) / ranks * beta
    if collective != "all_reduce":
        raise ValueError(f"unknown collective {collective!r}")
    ring = 2 * (ranks - 1) * latency_s + 2 * nbytes * (ranks - 1) / ranks * beta
    tree = 2 * math.ceil(math.log2(ranks)) * latency_s + 2 * nbytes * beta
    choices = {"ring": ring, "tree": tree, "best": min(ring, tree)}
    if algorithm not in choices:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; choose ring, tree or best")
    return choices[algorithm]


def _buffer_bytes(op: Collective) -> float:
    """M of [Note: collective cost], from the bytes a rank sends (``comm_bytes``, ring algorithms)."""
    p = op.group_size
    if op.collective in ("send", "recv") or p <= 1:
        return op.comm_bytes
    share = op.comm_bytes * p / (p - 1)
    return share / 2 if op.collective == "all_reduce" else share


class _Costs:
    """Seconds each op of one plan keeps its queue busy, under one profile. ``node_shards``: how many
    optimizer node processes share the workers' traffic (each with its own NIC)."""

    def __init__(self, profile: HardwareProfile, plan: SwapPlan | None, *, node_shards: int = 1) -> None:
        self.p = profile
        self.plan = plan
        self.on_node = plan is not None and plan.role == "node"
        self.workers = plan.strategy.world_size if plan is not None else 1
        self.node_shards = node_shards

    def seconds(self, op: Op) -> float:
        p = self.p
        if isinstance(op, (Load, Store)):
            link = (_NODE_LINK if self.on_node else _LINK)[op.queue]
            return op.nbytes / (getattr(p, link) * _GB)
        if isinstance(op, Compute):
            return op.flops / p.compute_flops
        if isinstance(op, OptimStep):
            if op.tier == "device":
                return op.num_params / p.device_optim_params_per_s
            return op.num_params / (p.node_optim_params_per_s if self.on_node else p.host_optim_params_per_s)
        if isinstance(op, GradNorm):
            gbps = p.device_mem_gbps if op.tier == "device" else p.node_mem_gbps if self.on_node else p.host_mem_gbps
            return self._grad_bytes(op) / (gbps * _GB)
        if isinstance(op, Collective):
            return self.collective(op)
        if isinstance(op, Encode):
            return codec_seconds(op.codec, numel=op.numel, encode=True, profile=p)
        if isinstance(op, Decode):  # every payload decoded into this rank's piece
            return codec_seconds(op.codec, numel=op.payloads * op.piece_numel, encode=False, profile=p)
        assert isinstance(op, (Free, Wait)), op
        return 0.0

    def _grad_bytes(self, op: GradNorm) -> float:
        if self.plan is None:
            return op.num_params * 4  # no plan to size the inputs: assume fp32 gradients
        return sum(self.plan.shards[a.shard].nbytes for a in op.inputs if a.shard.state != "norm")

    def collective(self, op: Collective) -> float:
        p = self.p
        if op.collective == "local":
            return 0.0
        if op.group == "shard":
            latency, gbps = p.group_latency_s, p.group_gbps
        elif op.group == "node":  # a worker's share of the node NICs
            latency, gbps = p.node_latency_s, min(p.net_gbps, p.node_gbps * self.node_shards / self.workers)
        elif op.group == "workers":  # the node moves every worker's bytes through its NIC
            latency, gbps = p.node_latency_s, min(p.node_gbps, p.net_gbps * self.workers)
        elif op.group == "nodes":
            latency, gbps = p.node_latency_s, p.node_gbps
        else:  # world, replica
            latency, gbps = p.net_latency_s, p.net_gbps
        nbytes = _buffer_bytes(op)
        ranks = 2 if op.collective in ("send", "recv") else op.group_size
        seconds = collective_seconds(op.collective, nbytes=nbytes, ranks=ranks, latency_s=latency, gbps=gbps)
        if isinstance(op, Recv) and self.plan is not None:
            # Summing arrives chunk by chunk beside the transfer: the slower of the two sets the pace.
            numel = sum(self.plan.shards[a.shard].numel for a in op.outputs)
            aggregate = (op.comm_bytes + _AGGREGATE_BYTES * self.workers * numel) / (p.node_mem_gbps * _GB)
            seconds = max(seconds, latency + aggregate)
        return seconds


def op_seconds(op: Op, profile: HardwareProfile, *, plan: SwapPlan | None = None) -> float:
    """Time ``op`` keeps its queue busy. ``plan`` (the op's own) sizes gradient passes and tells a node's
    ops from a worker's; without it a worker and fp32 gradients are assumed."""
    return _Costs(profile, plan).seconds(op)


class _Run(NamedTuple):
    times: tuple[tuple[float, float], ...]
    busy: dict[str, float]
    io: dict[str, dict[str, int]]


def _simulate(plan: SwapPlan, costs: _Costs, *, not_before: Mapping[int, float]) -> _Run:
    """Start and end of every op; ``not_before[i]``: op ``i`` cannot end earlier (a transfer whose other
    side is simulated separately)."""
    times: list[tuple[float, float]] = []
    queue_free: dict[str, float] = {}
    busy: dict[str, float] = {}
    io = {t: {"read": 0, "write": 0} for t in TIERS}
    for i, op in enumerate(plan.ops):
        ready = max((times[d][1] for d in op.deps), default=0.0)
        if op.queue == "mem":
            times.append((ready, ready))  # bookkeeping only: never waits for a queue
            continue
        seconds = costs.seconds(op)
        start = max(ready, queue_free.get(op.queue, 0.0))
        end = max(start + seconds, not_before.get(i, 0.0))
        times.append((start, end))
        queue_free[op.queue] = end
        busy[op.queue] = busy.get(op.queue, 0.0) + seconds
        if isinstance(op, (Load, Store)):
            io[op.src]["read"] += op.nbytes
            io[op.dst]["write"] += op.nbytes
    return _Run(tuple(times), busy, io)


def _waits(plan: SwapPlan, kind: type) -> dict[int, int]:
    """Unit -> index of the ``Wait`` completing that unit's ``kind`` transfer."""
    return {plan.ops[op.start].unit: i for i, op in enumerate(plan.ops)
            if isinstance(op, Wait) and isinstance(plan.ops[op.start], kind)}


def _node_shards(node: SwapPlan) -> int:
    """Node processes splitting the chunks: the group its norm all-reduce spans (one when local)."""
    return max((op.group_size for op in node.ops if isinstance(op, NormReduce) and op.group == "nodes"), default=1)


def _couple(plan: SwapPlan, node: SwapPlan, profile: HardwareProfile) -> tuple[_Run, _Run]:
    """[Note: worker and node together]
    Every worker runs the same plan, and every node shard the same one, so one of each stands for
    all. A node's Recv(u) cannot end before the workers' Push(u) ended, and a worker's Pull(u) cannot
    complete (its Wait) before the node's Serve(u) ended. Each side is simulated with the other's
    end times as bounds, alternately, from no bounds at all: bounds only grow, times only grow, and
    they stop changing after at most one round per link of the longest chain of hand-overs, unless
    the two plans wait on each other, which is an error in them."""
    if plan.strategy.name != "node" or node.role != "node" or plan.role != "worker":
        raise ValueError(f"estimate(..., node=) couples a worker plan of strategy node with a node plan (plan_node); "
                         f"got a {plan.role} plan of strategy {plan.strategy.name} and a {node.role} plan")
    push, pull = _waits(plan, Push), _waits(plan, Pull)
    recv, serve = _waits(node, Recv), _waits(node, Serve)
    if set(push) != set(recv) or set(pull) != set(serve):
        raise ValueError(f"the node plan receives units {sorted(recv)} and serves {sorted(serve)}, but the workers "
                         f"push {sorted(push)} and pull {sorted(pull)}: plan both for the same model")
    if node.strategy.world_size != plan.strategy.world_size:
        raise ValueError(f"the node plan expects {node.strategy.world_size} workers, the worker plan has "
                         f"{plan.strategy.world_size}")
    worker_costs = _Costs(profile, plan, node_shards=_node_shards(node))
    node_costs = _Costs(profile, node)
    served: dict[int, float] = {}
    for _ in range(2 * len(serve) + 3):
        worker = _simulate(plan, worker_costs, not_before={pull[u]: t for u, t in served.items()})
        node_run = _simulate(node, node_costs, not_before={recv[u]: worker.times[i][1] for u, i in push.items()})
        now = {u: node_run.times[i][1] for u, i in serve.items()}
        if now == served:
            return worker, node_run
        served = now
    raise ValueError("the worker and node plans wait on each other (their times never settle): "
                     "plan both for the same model and check the order of pushes and serves")


def _runs(plan: SwapPlan, profile: HardwareProfile, node: SwapPlan | None) -> tuple[_Run, _Run | None]:
    if node is None:
        return _simulate(plan, _Costs(profile, plan), not_before={}), None
    return _couple(plan, node, profile)


def op_times(plan: SwapPlan, profile: HardwareProfile, *,
             node: SwapPlan | None = None) -> tuple[tuple[float, float], ...]:
    """Predicted ``(start_s, end_s)`` of every op of ``plan`` from the step's start (for ``format_ops``);
    with ``node``, the worker plan's times simulated together with the optimizer node's plan."""
    return _runs(plan, profile, node)[0].times


def estimate(plan: SwapPlan, profile: HardwareProfile, *, node: SwapPlan | None = None) -> StepCost:
    """Predicted step time, per-queue busy time and bytes moved per tier for ``plan``; with ``node`` (the
    optimizer node's plan, ``plan_node``) for a worker of strategy ``node``, both simulated together
    ([Note: worker and node together]) and the node's busy time reported beside the worker's."""
    run, node_run = _runs(plan, profile, node)
    candidates = _queue_load(run.busy, "")
    predicted = max(max((e for _, e in run.times), default=0.0), candidates.get("nvme", 0.0))
    node_fields = {}
    if node_run is not None:
        node_load = _queue_load(node_run.busy, NODE_PREFIX)
        candidates.update(node_load)
        # Once per step the node must get through its busiest queue and its disk, whatever overlaps.
        predicted = max(predicted, max(node_load.values(), default=0.0))
        node_fields = dict(node_step_s=max((e for _, e in node_run.times), default=0.0), node_busy_s=node_run.busy,
                           node_io_bytes=node_run.io)
    bottleneck = max(candidates, key=candidates.__getitem__) if candidates else "none"
    return StepCost(predicted_step_s=predicted, bottleneck=bottleneck, busy_s=run.busy, io_bytes=run.io, **node_fields)


def _queue_load(busy: Mapping[str, float], prefix: str) -> dict[str, float]:
    """Busy seconds per queue, and ``nvme`` for the disk ([Note: one disk]) when it is busier than any queue.

    [Note: one disk] Reads and writes have their own queues so that neither waits behind the
    other, but one NVMe device serves both from one budget of time: measured here (luwu bench
    offload-step), reading and writing at once took about the sum of the two alone. So a step
    takes at least the two queues' busy time together, however well they overlap."""
    load = {prefix + q: s for q, s in busy.items()}
    disk_s = busy.get("nvme_read", 0.0) + busy.get("nvme_write", 0.0)
    if disk_s > max(busy.values(), default=0.0):
        load[prefix + "nvme"] = disk_s
    return load
