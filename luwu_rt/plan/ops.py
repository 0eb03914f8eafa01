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

[Note: collectives as start and wait]
Communication is two ops: a start (``Reduce``, ``Gather``, ``NormReduce``,
``Push``, ``Pull``, ``Recv``, ``Serve``) and the ``Wait`` that completes it, on
the same queue, listing the same accesses. The start reads its inputs and
begins writing its outputs; between the two its inputs must not change and its
outputs must not be read, so every consumer depends on the ``Wait``, and
whatever runs on other queues in between overlaps the transfer. Each
communication queue owns one process group (``SwapPlan.comm_groups``), created
identically on every rank, and issues that group's collectives in plan order:
every rank's plan lists them in the same sequence (``validate_ranks``), so the
order in which ranks issue them never depends on timing.

[Note: planned workspaces]
Buffers that exist only for communication or for the norm are shards like any
other, of the kinds in ``WORKSPACE_KINDS``, with arena slots, lifetimes and
dependencies that the validator checks: ``param_full`` (a unit's parameters
gathered in full, zero3/hsdp), ``grad_full`` (a unit's full gradient as backward
writes it, before its reduce-scatter, zero2/3/hsdp), ``grad_slice`` (zero1:
this rank's reduce-scattered part of the full gradients it keeps),
``param_slice`` (zero1/2: this rank's updated part of the parameters, before
the all-gather), ``norm`` (the squared gradient norm of one unit, and of the
whole step at unit ``GLOBAL_UNIT``), and for a compressed unit ``grad_code``
(the payloads this rank encoded, bytes) and ``grad_codes`` (the payloads it
received, one per rank): [Note: codecs on the wire] in codec.py. A compressed
unit also has ``residual``, persistent fp32 state (error feedback) planned like
the moments.

[Note: taking over a copy]
An op may list input copies in ``consumes``: it writes its output of the same
tier and slot into their very bytes, so the input copy ceases to exist as the
op starts writing, without a ``Free``. A double-buffered update does this
([Note: speculative updates] in sequence.py): the staging copy of the current
half, loaded from NVMe, is updated in place and becomes the staging copy of
the other half, which is then written to its own home; the current half's home
stays untouched. A consumed copy is never a home copy, never the only
up-to-date copy of its shard, and the op must wait for every other op that
uses it (``validate.py`` checks all three).

Data moves only between neighbouring tiers. ``Load`` moves toward the device
(nvme -> host, host -> device), ``Store`` away from it; which one persists dirty
data depends on the state's home tier, not on the op's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence

from .spec import PERSISTENT_KINDS, Budgets, Strategy

__all__ = [
    "ShardId", "ShardInfo", "Access", "Op", "Load", "Store", "Free", "Compute", "OptimStep", "GradNorm",
    "Collective", "Reduce", "Gather", "NormReduce", "Push", "Pull", "Recv", "Serve", "Wait", "SwapPlan", "Encode",
    "Decode",
    "QUEUES", "COMM_QUEUES", "GLOBAL_UNIT", "WORKSPACE_KINDS", "format_ops",
]

QUEUES = {
    "nvme_read": "NVMe -> host reads (own IO queue so reads never wait behind writes)",
    "nvme_write": "host -> NVMe write-back",
    "h2d": "host -> device copies",
    "d2h": "device -> host copies",
    "compute": "forward/backward kernels (and the optimizer when its state lives on the device)",
    "optim": "host CPU optimizer and gradient norms, overlapping backward",
    "gather": "parameter all-gathers: prefetched during forward and backward, never behind a reduction",
    "reduce": "gradient all-reduces and reduce-scatters, and the global norm's all-reduce",
    "reduce_cross": "hsdp: all-reduce of gradient slices across replica groups, beside the next reduce-scatter",
    "encode": "compressed units: encode gradients with error feedback as each unit's become final, beside backward",
    "decode": "compressed units: decode and sum received payloads, never holding up the next unit's encode",
    "push": "node: gradient pushes to the optimizer node (worker) / their aggregation (node)",
    "pull": "node: parameter pulls from the optimizer node (worker) / serving them (node); never behind a push",
    "mem": "bookkeeping: frees take no time but order arena reuse",
}
COMM_QUEUES = ("gather", "reduce", "reduce_cross", "push", "pull")
"""Queues that run collectives or node transfers: each owns one process group ([Note: collectives as
start and wait])."""
GLOBAL_UNIT = -1
"""Unit index of step-wide buffers (the total gradient norm), which belong to no unit."""
WORKSPACE_KINDS = ("param_full", "grad_full", "grad_slice", "param_slice", "norm", "grad_code", "grad_codes")
"""Transient shard kinds of communication and the norm ([Note: planned workspaces])."""


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
    consumes: tuple[Access, ...] = ()
    """Input copies whose bytes the op takes over for the output copy at the same slot: once it starts writing,
    they are gone, with no ``Free`` of their own ([Note: taking over a copy])."""

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
class GradNorm(Op):
    """Squared L2 norm of this rank's final gradients of one unit (its ``grad``, or ``grad_slice``
    under zero1) into the unit's ``norm`` buffer, as float64."""

    unit: int
    num_params: int
    tier: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Collective(Op):
    """The start of a collective or node transfer; a ``Wait`` completes it ([Note: collectives as
    start and wait])."""

    unit: int
    """The unit whose buffers move (``GLOBAL_UNIT`` for the norm)."""
    collective: str
    """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``send``, ``recv`` or ``local`` (no traffic)."""
    group: str
    """Ranks of the queue's process group: ``world``, ``shard`` (a hsdp sharding group), ``replica`` (ranks
    holding the same slice in different hsdp groups), ``node`` (worker <-> optimizer node), ``workers``
    (node side), ``nodes`` (node shards among themselves); empty for ``local``."""
    group_size: int
    """Processes in the group."""
    comm_bytes: int
    """Bytes this process sends for it (received bytes for ``recv``); ring algorithms for collectives."""
    accumulate: bool = False
    """A reduce-scatter that adds its result to what the output holds (gradient accumulation):
    it scatters into ``grad_slice`` and the wait adds that into ``grad``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reduce(Collective):
    """Sum gradients across ranks: all-reduce in place, or reduce-scatter a full buffer into this rank's
    slice."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Gather(Collective):
    """All-gather parameters: the full unit before compute (zero3/hsdp), or the full compute copy after
    the sharded update (zero1/2)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NormReduce(Collective):
    """Sum every unit's ``norm`` into the step's total (``norm`` of ``GLOBAL_UNIT``), then across the ranks
    that hold different gradient slices; exact clipping and the fp16 overflow check read the total."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Push(Collective):
    """Worker: send a unit's gradients to the optimizer node (strategy ``node``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pull(Collective):
    """Worker: receive a unit's updated parameters from the optimizer node."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Recv(Collective):
    """Optimizer node: receive every worker's push of a unit and sum them into its fp32 gradient."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Serve(Collective):
    """Optimizer node: send a unit's updated parameters to every worker."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Codec(Op):
    unit: int
    codec: str
    """The codec's name (``plan/codec.py``), e.g. ``onebit`` or ``topk:0.01``."""
    chunk_numel: int
    """Elements per codec chunk: payload sizes follow from it ([Note: codecs on the wire] in codec.py)."""
    numel: int
    """Elements of the unit's gradient."""
    piece_numel: int
    """Elements per piece: the unit's (ddp) or one rank's slice S (zero1/zero2)."""
    pieces: int
    """Pieces the gradient is cut into: 1 (one payload, all-gathered) or W (piece s goes to rank s)."""

    @property
    def name(self) -> str:
        return f"{self.codec} u{self.unit}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Encode(_Codec):
    """Encode this rank's final gradient of a unit (``grad``, or ``grad_full`` under zero2) with error
    feedback: per piece x = grad + residual, its payload into ``grad_code``, residual = x - decode(payload)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Decode(_Codec):
    """Decode the ``payloads`` received in ``grad_codes`` (this rank's piece from every rank) and sum them in
    rank order into the unit's reduced gradient (``grad``, or ``grad_slice`` under zero1); with
    ``accumulate`` into ``grad_slice`` and then added to ``grad`` (zero2's later micro-batches)."""

    payloads: int
    """Payloads received: one per rank."""
    accumulate: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Wait(Op):
    """Completes the collective started by op ``start``: same queue, same accesses."""

    start: int


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
    """Name of the policy that made the plan (policy.py): ``belady``, ``lru`` or a ``Policy`` of one's own."""

    peak_bytes: Mapping[str, int]
    """Most bytes in use on each tier at any point of the plan (device: reserve included)."""
    comm_groups: Mapping[str, str] = field(default_factory=dict)
    """Communication queue -> the ranks of the process group it owns (``Collective.group``): every queue
    has a process group of its own, created identically on every rank, even where two span the same
    ranks, so that collectives of different queues never wait for each other's order."""
    role: str = "worker"
    """``worker``: one training rank's step; ``node``: the optimizer node's step (``plan_node``)."""
    home_slots: Mapping[ShardId, int | None]
    """Arena slot of the home copy of each shard that exists before the first op (None on NVMe):
    every persistent shard, whose home copy stays there for the whole step and after it, and in
    an optimizer-only plan also the gradients."""
    tail: frozenset[int] = frozenset()
    """Ops a run may leave running when it returns: write-backs and frees no other op waits for ([Note: steady
    state] in steady.py)."""
    wrap_deps: tuple[tuple[int, ...], ...] = ()
    """Per op, the ops of the previous period it waits for when it runs while that period's tail still does
    ([Note: steady state] in steady.py); empty: a plan of one step, run only after the previous one ended."""

    def __post_init__(self) -> None:
        for name in ("shards", "homes", "arena_bytes", "peak_bytes", "home_slots", "comm_groups"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    @property
    def persistent_kinds(self) -> frozenset[str]:
        """State kinds whose home copies outlive the step: the persistent ones, and what else exists before the
        first op (an optimizer-only plan's gradients, given anew before every step)."""
        return PERSISTENT_KINDS | {s.state for s in self.home_slots}

    def count(self, kind: str) -> int:
        """Number of ops of one kind, e.g. ``plan.count("Load")``."""
        return sum(1 for op in self.ops if op.kind == kind)


def _access(acc: Access) -> str:
    shard = acc.shard
    where = acc.tier if acc.slot is None else f"{acc.tier}@{acc.slot}"
    return f"{shard.state}[{shard.unit}.{shard.chunk}]:{where}"


def _label(op: Op) -> str:
    if isinstance(op, Free):
        return _access(Access(op.shard, op.tier, op.slot))
    if isinstance(op, Wait):
        return f"of {op.start}"
    if isinstance(op, Collective):
        return f"{op.collective} unit {op.unit}" + (f" over {op.group}/{op.group_size}" if op.group else "")
    return getattr(op, "name", None) or (f"unit {op.unit}" if hasattr(op, "unit") else "")


def format_ops(plan: SwapPlan, *, start: int = 0, stop: int | None = None,
               times: Sequence[tuple[float, float]] | None = None) -> str:
    """One line per op of ``plan.ops[start:stop]``: index, kind, queue, reads (``*``: consumed) -> writes, deps; with
    ``times`` (per op ``(start_s, end_s)``, e.g. ``cost.op_times``) also when it runs."""
    lines = []
    for i, op in enumerate(plan.ops[start:stop], start):
        reads = " ".join(_access(a) + ("*" if a in op.consumes else "") for a in op.inputs)
        writes = " ".join(_access(a) for a in op.outputs)
        moves = f" {reads} -> {writes}" if reads or writes else ""
        when = f"{times[i][0] * 1e3:10.3f} {times[i][1] * 1e3:10.3f} " if times is not None else ""
        lines.append(f"{i:6d} {when}{op.kind:<10} {op.queue:<12} {_label(op)}{moves}  after {list(op.deps)}")
    return "\n".join(lines)
