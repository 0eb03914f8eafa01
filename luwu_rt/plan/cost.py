"""Cost model: a plan and a hardware profile in, a predicted step time out.

Each op takes its bytes over the bandwidth of its link, its FLOPs over the
device's FLOP/s or its parameters over the optimizer's rate; a collective pays
latency and bandwidth terms ([Note: collective cost]). Ops start when their
dependencies ended and their queue is free (one op at a time per queue, in plan
order: an executor issues them in that order), so the predicted step time is the
critical path through dependencies and queue serialisation. The bottleneck is
the queue busy for longest. A worker plan of strategy ``node`` can be simulated
together with the optimizer node's plan ([Note: worker and node together]).
The one simulation behind all of it (``timelines``, [Note: one model of time])
also runs every rank of a plan, with chaos delays and faults, for
``luwu_rt.testing.simulate``: with neither, it gives ``estimate``'s times exactly.

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

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence

from .codec import codec_seconds
from .ops import (Collective, Compute, Decode, Encode, Free, GradNorm, Load, NormReduce, Op, OptimStep, Pull, Push,
                  Recv, Serve, Store, SwapPlan, Wait)
from .sequence import group_members
from .spec import TIERS, HardwareProfile
from .steady import periods

__all__ = ["Disturbance", "SHARED_CORE_QUEUES", "SYNCED_GROUPS", "StepCost", "Timeline", "collective_seconds",
           "couple", "estimate", "op_seconds", "op_times", "period_times", "steady_seconds", "step_cost",
           "step_seconds", "timelines"]

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
        if op.collective in ("reduce_scatter", "all_gather") and op.group in ("world", "replica", "shard"):
            seconds *= p.shard_collective_factor
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


class Timeline(NamedTuple):
    """One rank's simulated step ([Note: one model of time]): per op of its plan, when its work starts and
    ends, and when it completes (its event: after the work and any delay after it; ``inf`` for an op that
    failed or never ran)."""

    start: list[float]
    end: list[float]
    done: list[float]
    busy: dict[str, float]
    """Seconds of work per queue (delays around ops not counted; a slowed or stalled op's whole span)."""
    io: dict[str, dict[str, int]]
    """tier -> {"read", "write"} bytes moved by the moves that completed."""
    cpu_overlap: float = 1.0
    """The profile's ``cpu_overlap``, for the step's bound of shared cores ([Note: shared cores])."""
    nvme_overlap: float = 0.0
    """The profile's ``nvme_overlap``, for the step's bound of one disk ([Note: one disk])."""
    nvme_core_s_per_gb: float = 0.0
    """The profile's ``nvme_core_s_per_gb``: the cores' share of the disk's traffic ([Note: shared cores])."""

    @property
    def times(self) -> tuple[tuple[float, float], ...]:
        """``(start_s, end_s)`` of every op."""
        return tuple(zip(self.start, self.end))


@dataclass(frozen=True, kw_only=True, slots=True)
class Disturbance:
    """What makes a simulated step differ from the plan's prediction: chaos delays and faults, in
    virtual time (``luwu_rt.testing.simulate`` builds these)."""

    delays_s: Mapping[int, Sequence[tuple[float, float]]] = field(default_factory=dict)
    """rank -> per op of its plan, seconds its queue idles before and after the op's work (chaos)."""
    rates: Mapping[tuple[int, str], Sequence[tuple[float, float, float]]] = field(default_factory=dict)
    """(rank, queue) -> disjoint windows ``(start_s, end_s, rate)``, sorted, in which that queue works at
    ``rate`` times its speed (0: the rank is stalled)."""
    failing: frozenset[tuple[int, int]] = frozenset()
    """(rank, op index) whose work fails: it never completes, nor does anything that depends on it."""
    hold_s: Mapping[tuple[int, int], float] = field(default_factory=dict)
    """(rank, op index) -> the earliest its work may start (an op held back)."""


SYNCED_GROUPS = ("world", "shard", "replica")
"""Groups whose collectives, when every rank is simulated, start once the last member issued them; a
worker's transfers to an optimizer node (``node``) are not held by other workers."""
_UNTIMED = -1.0


def _finish(start: float, work: float, windows: Sequence[tuple[float, float, float]]) -> float:
    """When ``work`` seconds of work started at ``start`` end, through windows of changed speed."""
    t, left = start, work
    for a, b, rate in windows:
        if b <= t:
            continue
        if a > t:
            if t + left <= a:
                return t + left
            left, t = left - (a - t), a
        if rate > 0.0:
            if t + left / rate <= b:
                return t + left / rate
            left -= (b - t) * rate
        t = b  # work left at the window's end; a stalled rank completes nothing in it, not even an op of no work
    return t + left


def _work(start: float, seconds: float, end: float) -> float:
    """Busy time of an op of ``seconds`` of work that ran from ``start`` to ``end``: its seconds, unless a
    window of changed speed stretched it (then all of it, to the bit as the plain sum where none did)."""
    return seconds if end == start + seconds else end - start


class _Lane:
    """One simulated rank: its plan's ops, their times so far and its queues' state."""

    def __init__(self, rank: int, plan: SwapPlan, seconds: list[float], disturbance: Disturbance | None) -> None:
        self.rank, self.plan, self.ops, self.seconds = rank, plan, plan.ops, seconds
        n = len(plan.ops)
        self.start, self.end, self.done = [0.0] * n, [0.0] * n, [_UNTIMED] * n
        self.order: dict[str, list[int]] = {}  # queue -> its ops in plan order (first-use order of queues)
        for i, op in enumerate(plan.ops):
            self.order.setdefault(op.queue, []).append(i)
        self.cursor = dict.fromkeys(self.order, 0)
        self.free_at = dict.fromkeys(self.order, 0.0)
        self.busy = {q: 0.0 for q in self.order if q != "mem"}
        self.io = {t: {"read": 0, "write": 0} for t in TIERS}
        self.waiters: dict[int, list[str]] = {}
        d = disturbance
        self.delays = d.delays_s.get(rank) if d is not None else None
        self.rates = {q: w for (r, q), w in d.rates.items() if r == rank and w} if d is not None else {}
        self.failing = {i for r, i in d.failing if r == rank} if d is not None else set()
        self.hold = {i: t for (r, i), t in d.hold_s.items() if r == rank} if d is not None else {}
        assert self.delays is None or len(self.delays) == n

    def timeline(self) -> Timeline:
        return Timeline(self.start, self.end, self.done, self.busy, self.io)


class _Play:
    """[Note: one model of time]
    ``estimate``, ``op_times`` and ``luwu_rt.testing.simulate`` all time a step here. Each queue runs its
    ops one at a time in plan order (an executor's queue thread issues them so); an op starts when its
    queue is free and its dependencies completed, waits any delay before its work (chaos), works for
    ``_Costs.seconds`` (stretched through windows of changed speed), and completes after any delay after
    it. A ``Free`` (queue ``mem``) takes no time and waits for no queue. Queues advance independently,
    each until an op needs a dependency not yet timed, and resume when it is: what order the queues are
    advanced in cannot change a time. With one plan per rank (``synced``), a collective of a group in
    ``SYNCED_GROUPS`` starts when the last member issued it and ends when its slowest member's part
    does (a stalled rank holds its peers); with one plan for all ranks, every peer is taken to run the
    same plan at the same times, so a collective starts when this rank issues it: the cost model's
    assumption, and exact for ranks without chaos or faults. An op that fails never completes, nor does
    anything waiting for it (its queue goes on); an op held back starts no earlier than its hold.
    Without a ``Disturbance`` none of that enters the arithmetic: the times are a plain critical path
    through dependencies and queues, and equal, to the bit, whichever caller asks."""

    def __init__(self, lanes: list[_Lane], *, synced: bool, not_before: Mapping[int, float]) -> None:
        self.lanes, self.synced, self.not_before = lanes, synced, not_before
        self.stack: list[tuple[_Lane, str]] = [(lane, q) for lane in reversed(lanes) for q in reversed(lane.order)]
        self.pending: dict[tuple, dict[int, tuple[int, float]]] = {}
        self.seq = [self._collective_seq(lane) for lane in lanes] if synced else []

    def _collective_seq(self, lane: _Lane) -> dict[int, int]:
        """Op index -> its place among the synced collectives of its queue."""
        seen: dict[str, int] = {}
        out = {}
        for i, op in enumerate(lane.ops):
            if self._synced(op):
                out[i] = seen[op.queue] = seen.get(op.queue, -1) + 1
        return out

    def _synced(self, op: Op) -> bool:
        return self.synced and isinstance(op, Collective) and op.group in SYNCED_GROUPS and op.group_size > 1

    def run(self) -> None:
        while self.stack:
            lane, queue = self.stack.pop()
            self.advance(lane, queue)
        stuck = [f"rank {lane.rank} op {lane.order[q][k]} ({lane.ops[lane.order[q][k]].kind} on {q})"
                 for lane in self.lanes for q, k in lane.cursor.items() if k < len(lane.order[q])]
        if stuck:
            raise ValueError(f"the ranks' plans wait on each other: {', '.join(stuck[:6])} never start; "
                             f"every rank must issue each group's collectives in the same order (validate_ranks)")

    def advance(self, lane: _Lane, queue: str) -> None:
        order, ops, done = lane.order[queue], lane.ops, lane.done
        k = lane.cursor[queue]
        while k < len(order):
            i = order[k]
            op = ops[i]
            ready = 0.0
            for d in op.deps:
                t = done[d]
                if t < 0.0:  # not timed yet: resume when it is
                    lane.waiters.setdefault(d, []).append(queue)
                    lane.cursor[queue] = k
                    return
                if t > ready:
                    ready = t
            if queue == "mem":
                lane.start[i] = lane.end[i] = done[i] = ready
            elif self.synced and self._synced(op):
                if not self._arrive(lane, i, op, max(ready, lane.free_at[queue])):
                    lane.cursor[queue] = k
                    return
            else:
                self._time(lane, i, op, max(ready, lane.free_at[queue]))
            self._wake(lane, i)
            k += 1
        lane.cursor[queue] = k

    def _wake(self, lane: _Lane, i: int) -> None:
        queues = lane.waiters.pop(i, None)
        if queues:
            self.stack.extend((lane, q) for q in queues)

    def _time(self, lane: _Lane, i: int, op: Op, t0: float) -> None:
        """Times op ``i``, whose queue is free and dependencies complete at ``t0``."""
        if t0 == math.inf:  # a dependency never completes: neither does this op, which never runs
            lane.start[i] = lane.end[i] = lane.done[i] = math.inf
            return
        seconds = lane.seconds[i]
        before, after = lane.delays[i] if lane.delays is not None else (0.0, 0.0)
        start = t0 + before if before else t0
        if lane.hold and i in lane.hold:
            start = max(start, lane.hold[i])
        windows = lane.rates.get(op.queue)
        end = start + seconds if windows is None else _finish(start, seconds, windows)
        work = _work(start, seconds, end)
        bound = self.not_before.get(i)
        if bound is not None:  # waiting for the other side of a transfer: not work
            end = max(end, bound)
        self._record(lane, i, op, start, end, after, work)

    def _record(self, lane: _Lane, i: int, op: Op, start: float, end: float, after: float, work: float) -> None:
        lane.start[i], lane.end[i] = start, end
        lane.free_at[op.queue] = end + after if after else end
        lane.busy[op.queue] += work
        if i in lane.failing:
            lane.done[i] = math.inf
            return
        lane.done[i] = lane.free_at[op.queue]
        if isinstance(op, (Load, Store)):
            lane.io[op.src]["read"] += op.nbytes
            lane.io[op.dst]["write"] += op.nbytes

    def _arrive(self, lane: _Lane, i: int, op: Collective, t0: float) -> bool:
        """Rank ``lane`` issues a synced collective at ``t0``; once every member has, times it on all of them
        (True for the last to arrive; the others' queues resume)."""
        members = group_members(lane.plan.strategy, op.group, lane.rank)
        if members[-1] >= len(self.lanes):
            raise ValueError(f"rank {lane.rank}'s {op.kind} over {op.group!r} spans ranks {list(members)}, but "
                             f"{len(self.lanes)} plan(s) were given: give one plan per rank of the world")
        before = lane.delays[i][0] if lane.delays is not None else 0.0
        key = (op.queue, self.seq[lane.rank][i], members)
        arrived = self.pending.setdefault(key, {})
        arrived[lane.rank] = (i, max(t0 + before, lane.hold.get(i, 0.0)))
        if len(arrived) < len(members):
            return False
        del self.pending[key]
        begin = max(t for _, t in arrived.values())
        work = {}  # each member's own part: its seconds, stretched through its own windows
        for rank, (j, _) in arrived.items():
            peer = self.lanes[rank]
            seconds = peer.seconds[j]
            windows = peer.rates.get(op.queue)
            work[rank] = seconds if windows is None else _work(begin, seconds, _finish(begin, seconds, windows))
        end = max(begin + w for w in work.values())  # the slowest member's part holds everyone's
        for rank, (j, _) in arrived.items():
            peer = self.lanes[rank]
            if begin == math.inf:
                peer.start[j] = peer.end[j] = peer.done[j] = math.inf
            else:
                after = peer.delays[j][1] if peer.delays is not None else 0.0
                self._record(peer, j, peer.ops[j], begin, end, after, work[rank])
            if peer is not lane:
                peer.cursor[op.queue] += 1
                self.stack.append((peer, op.queue))
                self._wake(peer, j)
        return True


def timelines(plans: Sequence[SwapPlan], profile: HardwareProfile, *, synced: bool = False,
              disturbance: Disturbance | None = None, not_before: Mapping[int, float] | None = None,
              node_shards: int = 1) -> tuple[Timeline, ...]:
    """The simulated step of each of ``plans`` ([Note: one model of time]). ``synced``: ``plans[r]`` is rank
    ``r``'s and collectives wait for every member of their group; otherwise each plan's peers are taken to
    run as it does. ``disturbance``: chaos delays and faults; ``not_before[i]``: op ``i`` cannot end earlier
    (a transfer whose other side is simulated separately); ``node_shards``: optimizer node processes that
    share the workers' traffic ([Note: collective cost])."""
    seconds: dict[int, list[float]] = {}  # ranks running the same plan object share its op times
    for plan in plans:
        if id(plan) not in seconds:
            costs = _Costs(profile, plan, node_shards=node_shards)
            seconds[id(plan)] = [0.0 if op.queue == "mem" else costs.seconds(op) for op in plan.ops]
    lanes = [_Lane(r, plan, seconds[id(plan)], disturbance) for r, plan in enumerate(plans)]
    _Play(lanes, synced=synced, not_before=not_before or {}).run()
    return tuple(lane.timeline()._replace(cpu_overlap=profile.cpu_overlap, nvme_overlap=profile.nvme_overlap,
                                          nvme_core_s_per_gb=profile.nvme_core_s_per_gb) for lane in lanes)


def step_seconds(run: Timeline) -> float:
    """Step time of one simulated rank: when its last op completes, and at least the time its disk is busy
    reading and writing ([Note: one disk]) and its shared cores are busy ([Note: shared cores])."""
    last = max((t for t in run.done if t != math.inf), default=0.0)
    load = _queue_load(run)
    return max(last, load.get("nvme", 0.0), load.get("cores", 0.0))


def _waits(plan: SwapPlan, kind: type) -> dict[int, int]:
    """Unit -> index of the ``Wait`` completing that unit's ``kind`` transfer."""
    return {plan.ops[op.start].unit: i for i, op in enumerate(plan.ops)
            if isinstance(op, Wait) and isinstance(plan.ops[op.start], kind)}


def _node_shards(node: SwapPlan) -> int:
    """Node processes splitting the chunks: the group its norm all-reduce spans (one when local)."""
    return max((op.group_size for op in node.ops if isinstance(op, NormReduce) and op.group == "nodes"), default=1)


def couple(plan: SwapPlan, node: SwapPlan, profile: HardwareProfile, *,
           disturbance: Disturbance | None = None) -> tuple[Timeline, Timeline]:
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
    shards = _node_shards(node)
    served: dict[int, float] = {}
    for _ in range(2 * len(serve) + 3):
        worker, = timelines([plan], profile, disturbance=disturbance, node_shards=shards,
                            not_before={pull[u]: t for u, t in served.items()})
        node_run, = timelines([node], profile, not_before={recv[u]: worker.end[i] for u, i in push.items()})
        now = {u: node_run.end[i] for u, i in serve.items()}
        if now == served:
            return worker, node_run
        served = now
    raise ValueError("the worker and node plans wait on each other (their times never settle): "
                     "plan both for the same model and check the order of pushes and serves")


def _runs(plan: SwapPlan, profile: HardwareProfile, node: SwapPlan | None) -> tuple[Timeline, Timeline | None]:
    if node is None:
        return timelines([plan], profile)[0], None
    return couple(plan, node, profile)


def op_times(plan: SwapPlan, profile: HardwareProfile, *,
             node: SwapPlan | None = None) -> tuple[tuple[float, float], ...]:
    """Predicted ``(start_s, end_s)`` of every op of ``plan`` from the step's start (for ``format_ops``);
    with ``node``, the worker plan's times simulated together with the optimizer node's plan."""
    return _runs(plan, profile, node)[0].times


def estimate(plan: SwapPlan, profile: HardwareProfile, *, node: SwapPlan | None = None,
             steady: bool = False) -> StepCost:
    """Predicted step time, per-queue busy time and bytes moved per tier for ``plan``; with ``node`` (the
    optimizer node's plan, ``plan_node``) for a worker of strategy ``node``, both simulated together
    ([Note: worker and node together]) and the node's busy time reported beside the worker's. ``steady``: the
    time of a step in steady state, each beside the previous one's tail ([Note: steady state] in steady.py),
    for a plan that has wrap dependencies (a first step, or one after a checkpoint, takes the plain time)."""
    run, node_run = _runs(plan, profile, node)
    cost = step_cost(run, node_run)
    if steady and plan.wrap_deps and node is None:
        cost = dataclasses.replace(cost, predicted_step_s=_steady_step(run, steady_seconds(plan, profile)))
    return cost


def _steady_step(run: Timeline, chain: float) -> float:
    """A step in steady state: its chain (``steady_seconds``), and at least what its cold ``run`` needs of the
    disk and the shared cores: the pipeline hides the tail, not the work."""
    load = _queue_load(run)
    return max(chain, load.get("nvme", 0.0), load.get("cores", 0.0))


def period_times(plan: SwapPlan, profile: HardwareProfile) -> tuple[float, float, float]:
    """For a plan with wrap dependencies, each simulation run once: its predicted step in steady state
    (``estimate(..., steady=True)``), the chain under it (``steady_seconds``), and when a period started cold
    returns: the last completion of an op outside its tail (the updates, not their write-backs), with no bound
    of a shared resource under it."""
    run, = timelines([plan], profile)
    chain = steady_seconds(plan, profile)
    returned = max((t for i, t in enumerate(run.done) if i not in plan.tail), default=0.0)
    return _steady_step(run, chain), chain, returned


def steady_seconds(plan: SwapPlan, profile: HardwareProfile) -> float:
    """Seconds between the ends of two steps in steady state: three periods simulated back to back, each started
    when the one before it returned (all but its tail done), and the time from the second's end to the third's."""
    run, = timelines([periods(plan, 3, barrier=True)], profile)
    n = len(plan.ops)
    ends = [max((run.done[k * n + i] for i in range(n) if i not in plan.tail), default=0.0) for k in range(3)]
    return ends[2] - ends[1]


def step_cost(run: Timeline, node_run: Timeline | None = None) -> StepCost:
    """The ``StepCost`` of a simulated worker rank (``timelines``), with the optimizer node's run beside it."""
    candidates = _queue_load(run)
    predicted = step_seconds(run)
    node_fields = {}
    if node_run is not None:
        node_load = _queue_load(node_run, NODE_PREFIX)
        candidates.update(node_load)
        # Once per step the node must get through its busiest queue and its disk, whatever overlaps.
        predicted = max(predicted, max(node_load.values(), default=0.0))
        node_fields = dict(node_step_s=max(node_run.done, default=0.0), node_busy_s=node_run.busy,
                           node_io_bytes=node_run.io)
    bottleneck = max(candidates, key=candidates.__getitem__) if candidates else "none"
    return StepCost(predicted_step_s=predicted, bottleneck=bottleneck, busy_s=run.busy, io_bytes=run.io, **node_fields)


def _queue_load(run: Timeline, prefix: str = "") -> dict[str, float]:
    """Busy seconds per queue of ``run``, ``nvme`` for the disk ([Note: one disk]) and ``cores`` for the shared
    cores ([Note: shared cores]), each when it is busier than any queue.

    [Note: one disk] Reads and writes have their own queues so that neither waits behind the
    other, but one NVMe device serves both from one budget of time. How much of it they share is the
    disk's: ``nvme_overlap`` of the shorter direction's time hides behind the longer one, so a step
    takes at least ``sum - nvme_overlap * (sum - max)`` of the two queues' busy times, however well
    they overlap. 0 (the default) is the sum, as a disk measured here once took (luwu bench
    offload-step); ``luwu calibrate`` measures it from a read and a write at once against each alone:
    0.37 on this project's development disk in December 2026 (3.07 GB each way: 1.10 s read alone,
    0.93 s written alone, 1.69 s at once)."""
    busy = run.busy
    load = {prefix + q: s for q, s in busy.items()}
    busiest = max(busy.values(), default=0.0)
    read_s, write_s = busy.get("nvme_read", 0.0), busy.get("nvme_write", 0.0)
    disk_s = read_s + write_s - run.nvme_overlap * min(read_s, write_s)
    if disk_s > busiest:
        load[prefix + "nvme"] = disk_s
    if run.cpu_overlap < 1.0:  # 1: no bound, and not a rounding of one either
        disk_bytes = sum(run.io.get("nvme", {}).values())
        shared = [busy.get(q, 0.0) for q in SHARED_CORE_QUEUES] + [run.nvme_core_s_per_gb * disk_bytes / _GB]
        cores_s = sum(shared) - run.cpu_overlap * (sum(shared) - max(shared))
        if cores_s > busiest:
            load[prefix + "cores"] = cores_s
    return load


SHARED_CORE_QUEUES = ("compute", "optim", "h2d", "d2h", "gather", "reduce", "reduce_cross", "push", "pull", "encode",
                      "decode")
"""[Note: shared cores]
Queues whose work may run on the host's cores: the optimizer on the host, and, where the device is the CPU itself,
the compute, the copies between the "device" arena and the host, the gradient codecs, and the collectives and node
transfers (gloo and ZeroMQ reduce and copy on the CPU; over loopback the transfer itself is a copy). Each queue is
timed at the rate measured alone, but on a machine with few cores the queues running at once share them: measured on
2 cores (``luwu calibrate``), a matmul, the fused optimizer and a copy together took about the sum of their times
alone. So, like the disk, a step takes at least ``sum - cpu_overlap * (sum - max)`` of these queues' busy times:
with ``cpu_overlap`` 1 (a GPU machine: the device computes, DMA engines copy, NCCL reduces) only the busiest, with 0
their sum. A bound on the whole step, not a slower op: where the work overlaps within the step is left to the
critical path. The disk's traffic takes the cores too, though not its queues' time: the store checksums every
chunk it reads or writes (CRC-32C, about 12 GB/s on one core here), so ``nvme_core_s_per_gb`` seconds per GB
moved count as one more of these queues (gpt-small out of core moves 0.96 GB to and from the disk a step)."""
