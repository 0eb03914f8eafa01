"""The planner's output: an immutable ``SwapPlan`` of ops with explicit dependencies.

[Note: plan semantics]
A plan is a tuple of ops in one valid execution order. Each op names the ops it
depends on (indices of earlier ops) and the queue that runs it; an executor may
start an op as soon as its dependencies finished and its queue is free, in any
order that respects that, and must decide nothing else. Every op reads and
writes *copies* of shards: ``Access(shard, tier, slot)``, where ``slot`` is the
byte offset of the copy in that tier's arena (``None`` on NVMe, whose files are
addressed by shard). An output into a tier that holds no copy of the shard
allocates one at ``slot``; ``Free`` releases a copy. The dependencies alone
order every conflicting pair: a read after the write it needs, a write after the
reads of the version it overwrites, a ``Free`` after every read of the copy and
an allocation after the ``Free`` of whatever held those arena bytes before.
``validate.py`` checks all of it. Issuing each queue's ops in plan order is
always safe: dependencies point to earlier ops only, so it cannot deadlock.
``Free`` ops (queue ``mem``) take no time; an executor performs them inline.

Data moves only between neighbouring tiers. ``Load`` moves toward the device
(nvme -> host, host -> device), ``Store`` away from it; which one persists dirty
data depends on the state's home tier, not on the op's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple

from .spec import Budgets, Strategy

__all__ = [
    "ShardId", "ShardInfo", "Access", "Op", "Load", "Store", "Free", "Compute", "OptimStep",
    "Reduce", "Gather", "Push", "Pull", "SwapPlan", "QUEUES", "format_ops",
]

QUEUES = {
    "nvme_read": "NVMe -> host reads (own IO queue so reads never wait behind writes)",
    "nvme_write": "host -> NVMe write-back",
    "h2d": "host -> device copies",
    "d2h": "device -> host copies",
    "compute": "forward/backward kernels (and the optimizer when its state lives on the device)",
    "optim": "host CPU optimizer, overlapping backward",
    "comm": "collectives and optimizer-node traffic",
    "mem": "bookkeeping: frees take no time but order arena reuse",
}


class ShardId(NamedTuple):
    unit: int
    state: str
    chunk: int
    """Index of the plan shard within the unit's buffer of this state (see ShardInfo)."""


class ShardInfo(NamedTuple):
    nbytes: int
    """Bytes of the shard, 4 KiB aligned."""
    numel: int
    """Elements (parameters) the shard covers."""
    first_chunk: int
    """First storage chunk of the unit's buffer that the shard covers."""
    num_chunks: int
    """Storage chunks covered: a plan shard groups whole chunks."""


class Access(NamedTuple):
    shard: ShardId
    tier: str
    slot: int | None
    """Byte offset in the tier's arena; None on NVMe."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """Common part of every op. ``inputs`` must hold the latest version of their shard when the
    op starts; ``outputs`` become the latest version when it ends (read-modify-write ops list a
    copy in both)."""

    deps: tuple[int, ...]
    """Indices of ops that must finish before this one starts."""
    queue: str
    """Which of ``QUEUES`` runs it; ops on one queue run one at a time."""
    inputs: tuple[Access, ...] = ()
    outputs: tuple[Access, ...] = ()

    @property
    def kind(self) -> str:
        return type(self).__name__


@dataclass(frozen=True, kw_only=True, slots=True)
class _Move(Op):
    nbytes: int

    @property
    def shard(self) -> ShardId:
        return self.outputs[0].shard

    @property
    def src(self) -> str:
        return self.inputs[0].tier

    @property
    def dst(self) -> str:
        return self.outputs[0].tier

    @property
    def slot(self) -> int | None:
        return self.outputs[0].slot


@dataclass(frozen=True, kw_only=True, slots=True)
class Load(_Move):
    """Copy a shard one tier toward the device."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Store(_Move):
    """Copy a shard one tier away from the device."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Free(Op):
    """Release one copy; its arena bytes may be reused by ops that depend on this one."""

    shard: ShardId
    tier: str
    slot: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Compute(Op):
    """Forward (``F``) or backward-with-recompute (``B``) of one unit."""

    name: str
    unit: int
    flops: int
    micro_batch: int = 0
    """Which micro-batch of the step (gradient accumulation); grads of later ones add up."""
    final_units: tuple[int, ...] = ()
    """Units whose gradients are final once this op ends ([Note: final gradients] in sequence.py):
    set on the backward ops of the last micro-batch only."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimStep(Op):
    """The optimizer update of this rank's part of one unit."""

    unit: int
    num_params: int
    tier: str


@dataclass(frozen=True, kw_only=True, slots=True)
class _Collective(Op):
    unit: int
    collective: str
    """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``hierarchical`` or ``p2p``."""
    comm_bytes: int
    """Bytes this rank sends (= receives) for it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reduce(_Collective):
    """Sum gradients across ranks (all-reduce or reduce-scatter)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Gather(_Collective):
    """All-gather parameters: before compute (zero3/hsdp) or after the sharded update (zero1/2)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Push(_Collective):
    """Send a unit's gradients to the optimizer node (strategy ``node``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pull(_Collective):
    """Receive a unit's updated parameters from the optimizer node."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SwapPlan:
    """One training step of one rank, planned: see [Note: plan semantics]."""

    ops: tuple[Op, ...]
    shards: Mapping[ShardId, ShardInfo]
    """Every shard the plan touches (per-rank sizes when the strategy shards a state)."""
    homes: Mapping[str, str]
    """State kind -> home tier. Persistent kinds start and end the step there."""
    chunk_bytes: int
    """Storage chunk size the shards are cut into (``ModelSpec.chunk_bytes``): the unit of IO."""
    budgets: Budgets
    arena_bytes: Mapping[str, int]
    """Arena capacity per tier with an arena (device: its budget less the reserve; host)."""
    device_reserve_bytes: int
    """Device memory kept out of the arena for activations and collective workspaces."""
    strategy: Strategy
    policy: str
    """Eviction policy that made the plan: ``belady`` or ``lru``."""

    peak_bytes: Mapping[str, int]
    """Most bytes in use on each tier at any point of the plan (device: reserve included)."""
    home_slots: Mapping[ShardId, int | None]
    """Arena slot of the home copy of each shard that exists before the first op (None on NVMe):
    every persistent shard, whose home copy stays there for the whole step and after it, and in
    an optimizer-only plan also the gradients."""

    def __post_init__(self) -> None:
        for name in ("shards", "homes", "arena_bytes", "peak_bytes", "home_slots"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def count(self, kind: str) -> int:
        """Number of ops of one kind, e.g. ``plan.count("Load")``."""
        return sum(1 for op in self.ops if op.kind == kind)


def _access(acc: Access) -> str:
    shard = acc.shard
    where = acc.tier if acc.slot is None else f"{acc.tier}@{acc.slot}"
    return f"{shard.state}[{shard.unit}.{shard.chunk}]:{where}"


def format_ops(plan: SwapPlan, *, start: int = 0, stop: int | None = None) -> str:
    """One line per op of ``plan.ops[start:stop]``: index, kind, queue, reads -> writes, deps."""
    lines = []
    for i, op in enumerate(plan.ops[start:stop], start):
        label = getattr(op, "name", None) or (f"unit {op.unit}" if hasattr(op, "unit") else "")
        if isinstance(op, Free):
            label = _access(Access(op.shard, op.tier, op.slot))
        reads = " ".join(_access(a) for a in op.inputs)
        writes = " ".join(_access(a) for a in op.outputs)
        moves = f" {reads} -> {writes}" if reads or writes else ""
        lines.append(f"{i:6d} {op.kind:<9} {op.queue:<10} {label}{moves}  after {list(op.deps)}")
    return "\n".join(lines)
