"""The access sequence of one training step, before any placement decision.

``build_layout`` cuts every unit's buffers into shards; ``build_steps`` lists
the logical ops of one step in order (F0..F(L-2), B(L-1)..B0 once per
micro-batch - the last unit's forward is fused into its backward - and after
the backward op that makes a unit's gradients final, its collectives, its
gradient norm and its optimizer step) with the shard copies each one reads or
writes and on which tier. The planner turns this list into a ``SwapPlan`` by
adding the moves and frees, and each collective into a start and a wait.

[Note: strategies as access sequences]
Per rank, a strategy changes which states are sharded (the rank holds
S = ceil(numel / ways) elements of them, ``Strategy.sharded``), which
workspaces exist ([Note: planned workspaces] in ops.py) and which collectives
run, each on the queue that owns its process group:
  local   -
  ddp     backward accumulates full grads; Reduce all-reduces them in place.
  zero1   backward accumulates full grads (kept, as ZeRO-1 does); Reduce
          reduce-scatters them into ``grad_slice``; the update writes
          ``param_slice``; Gather all-gathers it into the full ``param``.
  zero2   backward writes ``grad_full`` per micro-batch, reduce-scattered
          into the sharded ``grad`` (accumulating through ``grad_slice``);
          update and Gather as zero1.
  zero3   also ``param`` sharded: a Gather before each F and B assembles
          ``param_full``; the update writes the parameter slice itself.
  hsdp    zero3 inside groups of G ranks; after the last micro-batch the
          gradient slice is also all-reduced across the world / G replicas.
  node    no optimizer state on the worker: Push sends the unit's grads to
          the optimizer node, Pull receives its updated parameters (after
          the last push when the node waits for the step's norm).
A compressed unit (``Strategy.compress``, ddp/zero1/zero2) replaces its
gradient's Reduce by Encode (queue ``encode``: grad + residual -> ``grad_code``),
a Reduce of the payloads (``all_gather`` or ``all_to_all`` of ``grad_code`` into
``grad_codes``) and Decode (queue ``decode``: ``grad_codes`` -> the reduced
gradient); [Note: codecs on the wire] in codec.py.
Full buffers that a reduce-scatter reads or an all-gather writes hold W x S
elements (padded) in one shard, so that every rank's part is one slice of it.
Every strategy but node computes each unit's squared gradient norm (GradNorm)
and their sum (NormReduce, an all-reduce where gradients are sliced across
ranks); exact clipping and fp16's overflow check make every update read it.

[Note: the compute queue does not wait for a collective]
A queue issues its ops in plan order, so an op listed on the compute queue
right after a unit's collective would hold the next backward op until that
collective completes: with the optimizer on the device, each unit's gradient
norm (and an update that does not wait for the whole backward) read the
reduced gradient. They are listed after the next backward op instead, which
then overlaps the collective; the last unit's come after B0. On 2 ranks of
gpt-small on the CPU this stall had taken 90 ms of a 455 ms step.

[Note: speculative updates]
Exact global-norm clipping needs the norm of all gradients before any update,
which is known only after the whole backward ([Note: clipping] in
exec/step.py). Waiting for it serialises the optimizer (and, with its state on
NVMe, its reads and writes) behind the backward. A double-buffered layout
(``ModelSpec.double_buffer``) removes the wait: the optimizer state on NVMe has
two halves (``master`` and ``master_b``, ``exp_avg`` and ``exp_avg_b``, ...),
and an update reads the current half (``state_half``) and writes the other,
so the current half stays untouched on disk. The update then runs as soon as
the unit's gradients are final, with clip factor 1: the staging copy of the
current half, loaded from NVMe, is updated in place and becomes the staging
copy of the other half, which is written to its own files ([Note: taking over
a copy] in ops.py); no byte more moves than in an update in place. After the
step the norm is known: when its clip factor is exactly 1 (and the norm
finite) the updates were the exact ones, and the halves swap roles (commit);
otherwise the step is redone from the untouched half with the true factor
(exec/step.py). The plan of the other half is the same plan with the halves'
names swapped (``halves.mirror``). Only optimizer state on NVMe is
double-buffered: there the second half costs disk space only, where in memory
it would cost a second copy of the state.

[Note: an update in pieces]
AdamW is elementwise, so a unit's update may run as several ``OptimStep`` ops,
each over whole shards that cover one run of its elements in every kind it
reads and writes (the gradient, the three states, the compute copy; cut where
all their shard boundaries meet: with one 16 MiB chunk per shard, every 8 Mi
elements for a bf16 copy beside fp32 state). Where the state streams from NVMe this turns a
unit's read, update and write into a pipeline: a piece's write-back starts as
soon as its own loads are updated, and its staging slots then take the next
loads, where one op per unit left the disk idle while a whole unit's state was
updated and wrote nothing until all of it was read (an AdamW step over 256M
parameters with its state on NVMe: 16 units of 192 MB staged, the read queue
idle 15-20 ms and the write queue 35-45 ms around each update). Where the state
stays resident the update stays one op: pieces would only add per-op cost.
The values are the same: the fused kernel runs per shard run either way.

[Note: updates after the norm]
Where the updates wait for the step's norm, they run in the order of the next
forward (unit 0 first), not of the backward that made the gradients final: in
steady state ([Note: steady state] in steady.py) the next step's first load of
a unit's parameters waits for this step's write-back of them, and written in
backward's order unit 0 came last, after every other unit's state. On
gpt-small with everything on NVMe and clipping on, the next forward had waited
130 ms of a 1.5 s step for that write queue. The node keeps backward's order:
it serves the units in the order the workers pushed them ([Note: the node's
step] in node.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .codec import parse_codec, scheme
from .dtypes import ELEMENT_BYTES, FIXED_STATE_DTYPES
from .ops import (GLOBAL_UNIT, Compute, Decode, Encode, Gather, GradNorm, NormReduce, OptimStep, Pull, Push, Reduce,
                  ShardId, ShardInfo)
from .spec import (OPTIMIZER_KINDS, SECOND_HALF, STATE_KINDS, ModelSpec, Placement, Strategy, align_up, base_kind,
                   ceil_div, half_kind)

__all__ = ["Need", "Step", "build_layout", "build_restore_steps", "build_steps", "check_double_buffer", "comm_groups",
           "element_bytes", "final_points", "group_members", "home_of", "piece_bytes"]

NORM_BYTES = ELEMENT_BYTES[FIXED_STATE_DTYPES["norm"]]
"""A squared norm is one float64."""


@dataclass(frozen=True, slots=True)
class Need:
    shard: ShardId
    tier: str
    mode: str
    """``r`` (read the latest version), ``w`` (overwrite: no load needed) or ``rw``."""
    into: ShardId | None = None
    """A ``w`` need only: write the copy into the bytes of this shard's copy on the same tier, which the step
    also reads and then consumes ([Note: taking over a copy] in ops.py)."""


@dataclass(frozen=True, slots=True)
class Step:
    """A logical op: the planner emits ``op_type(**fields)`` with deps and accesses filled in."""

    op_type: type
    queue: str
    fields: dict
    needs: tuple[Need, ...]
    after: tuple[int, ...] = ()
    """Earlier steps that must finish first for a reason other than data (e.g. Pull after Push)."""


def final_points(reads: Sequence[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """``final_points(reads)[k]``: the units whose gradients are final right after B(k), highest first,
    for a chain whose unit ``i`` reads the parameters of units ``reads[i]``.

    [Note: final gradients]
    Backward runs from the last unit down, and a unit's gradients collect contributions from its
    own backward and from the backward of every unit that reads it (a tied head reads the
    embedding). So unit ``j`` is final after the lowest-numbered unit among ``j`` and its readers.
    This is the one place that fact is derived: the step sequence below, the ``Compute`` ops'
    ``final_units`` and ``unitwise_step``'s ``grads_final`` hook all read it from here."""
    points: list[list[int]] = [[] for _ in reads]
    for unit in reversed(range(len(reads))):
        readers = [i for i, r in enumerate(reads) if unit in r]
        points[min((unit, *readers))].append(unit)
    return tuple(tuple(p) for p in points)


def element_bytes(model: ModelSpec, state: str) -> int:
    """Bytes per element of shard kind ``state`` ([Note: dtype names] in dtypes.py)."""
    if state.startswith("param"):
        return model.param_bytes
    if state.startswith("grad"):
        return model.grad_bytes
    return ELEMENT_BYTES[FIXED_STATE_DTYPES[base_kind(state)]]  # both halves of a double-buffered kind alike


def home_of(state: str, placement: Placement, *, pushes: bool = False) -> str:
    """Home tier of any shard kind: the placement's for states; workspaces live where they are made
    (communication buffers on the device, the updated slice and norms with the optimizer). ``pushes``: a
    ``node`` worker's, whose payloads are encoded on the host, where its pushes read them."""
    if base_kind(state) in STATE_KINDS or state == "residual":
        return placement.home(state)  # a residual is fp32 state beside the moments
    if pushes and state == "grad_code":
        return "host"
    return "device" if state in ("param_full", "grad_full", "grad_slice", "grad_code", "grad_codes") \
        else placement.optim_tier


def _workspaces(model: ModelSpec, strategy: Strategy) -> tuple[str, ...]:
    kinds = {"zero1": ("grad_slice", "param_slice"), "zero2": ("grad_full", "param_slice"),
             "zero3": ("grad_full", "param_full"), "hsdp": ("grad_full", "param_full")}.get(strategy.name, ())
    if strategy.sharded("grad") and model.num_micro_batches > 1:
        kinds += ("grad_slice",)  # accumulating reduce-scatters land here first
    return kinds


def _tracks_norm(model: ModelSpec, strategy: Strategy) -> bool:
    return strategy.name != "node" and not model.optimizer_only


def _one_shard(state: str, strategy: Strategy) -> bool:
    """Full buffers a reduce-scatter reads or an all-gather writes are one shard: every rank's part
    of them is then one slice."""
    return state in ("param_full", "grad_full") or (strategy.name in ("zero1", "zero2") and state == "param") \
        or (strategy.name == "zero1" and state == "grad")


def build_layout(model: ModelSpec, strategy: Strategy) -> dict[ShardId, ShardInfo]:
    """Every shard of this rank, sized per the strategy and grouped into plan shards."""
    layout: dict[ShardId, ShardInfo] = {}
    ways = strategy.shard_ways
    states = ("param", "grad") if strategy.name == "node" else STATE_KINDS
    if model.double_buffer:
        states += tuple(SECOND_HALF.values())  # [Note: speculative updates]
    for u, unit in enumerate(model.units):
        part = ceil_div(unit.num_params, ways)
        for state in states + _workspaces(model, strategy):
            elem = element_bytes(model, state)
            sliced = strategy.sharded(state) or state in ("grad_slice", "param_slice")
            numel = part if sliced else unit.num_params
            total = align_up((part if sliced else part * ways) * elem)
            max_shards = 1 if _one_shard(state, strategy) else model.max_shards_per_state
            _cut(layout, ShardId(u, state, 0), numel=numel, total=total, elem=elem, chunk=model.chunk_bytes,
                 max_shards=max_shards)
        if strategy.codec(u) != "none":
            _codec_shards(layout, model, strategy, u)
        if _tracks_norm(model, strategy):
            layout[ShardId(u, "norm", 0)] = ShardInfo(align_up(NORM_BYTES), 1, 0, 1)
    if _tracks_norm(model, strategy):
        layout[ShardId(GLOBAL_UNIT, "norm", 0)] = ShardInfo(align_up(NORM_BYTES), 1, 0, 1)
    return layout


def codec_chunk_numel(model: ModelSpec) -> int:
    """Elements per codec chunk: one storage chunk of the gradient ([Note: codecs on the wire] in codec.py)."""
    return model.chunk_bytes // model.grad_bytes


def codec_pieces(model: ModelSpec, strategy: Strategy, unit: int) -> tuple[int, int]:
    """``(pieces, piece_numel)`` a compressed unit's gradient is encoded as: one piece of the whole unit
    (ddp, all-gathered), or W pieces of S elements, piece s for rank s (zero1/zero2, all-to-all)."""
    numel, ways = model.units[unit].num_params, strategy.world_size
    if strategy.name == "node":  # piece j for node shard j ([Note: compressed pushes] in codec.py)
        return strategy.node_shards, ceil_div(numel, strategy.node_shards)
    return (1, numel) if scheme(strategy.name) == "all_gather" else (ways, ceil_div(numel, ways))


def piece_bytes(model: ModelSpec, strategy: Strategy, unit: int) -> tuple[int, ...]:
    """The payload bytes of each piece of a compressed unit as sent: a last piece past the unit's end is
    shorter, or empty ([Note: codecs on the wire] in codec.py)."""
    pieces, piece = codec_pieces(model, strategy, unit)
    numel, spec = model.units[unit].num_params, parse_codec(strategy.codec(unit))
    return tuple(spec.payload_bytes(max(0, min(piece, numel - p * piece)), codec_chunk_numel(model))
                 for p in range(pieces))


def _codec_shards(layout: dict, model: ModelSpec, strategy: Strategy, u: int) -> None:
    """A compressed unit's residual (fp32, one shard: every piece of it is one contiguous run) and its two
    payload workspaces, each one shard of bytes."""
    numel = model.units[u].num_params
    layout[ShardId(u, "residual", 0)] = ShardInfo(align_up(numel * 4), numel, 0, ceil_div(numel * 4, model.chunk_bytes))
    pieces, piece = codec_pieces(model, strategy, u)
    one = parse_codec(strategy.codec(u)).payload_bytes(piece, codec_chunk_numel(model))
    received = () if strategy.name == "node" else (("grad_codes", strategy.world_size * one),)  # the node decodes
    for state, nbytes in (("grad_code", pieces * one), *received):
        layout[ShardId(u, state, 0)] = ShardInfo(align_up(max(nbytes, 1)), nbytes, 0,
                                                 ceil_div(max(nbytes, 1), model.chunk_bytes))


def _cut(layout: dict, first: ShardId, *, numel: int, total: int, elem: int, chunk: int, max_shards: int) -> None:
    """Plan shards of whole chunks covering one ``total``-byte buffer of ``numel`` elements."""
    num_chunks = ceil_div(total, chunk)
    per_shard = ceil_div(num_chunks, min(max_shards, num_chunks))
    elems_per_chunk = chunk // elem
    for i, start in enumerate(range(0, num_chunks, per_shard)):
        count = min(per_shard, num_chunks - start)
        nbytes = min(count * chunk, total - start * chunk)
        shard_numel = min(count * elems_per_chunk, numel - start * elems_per_chunk)
        layout[first._replace(chunk=i)] = ShardInfo(nbytes, max(shard_numel, 0), start, count)


def comm_groups(model: ModelSpec, strategy: Strategy) -> dict[str, str]:
    """The process group each communication queue of this strategy owns."""
    if strategy.name == "node":
        return {"push": "node", "pull": "node"}
    groups = {"ddp": {"reduce": "world"}, "hsdp": {"gather": "shard", "reduce": "shard"}}.get(strategy.name)
    if groups is None:
        groups = {"gather": "world", "reduce": "world"} if strategy.name.startswith("zero") else {}
    if strategy.name == "hsdp" and strategy.replicas > 1:
        groups["reduce_cross"] = "replica"
    return dict(groups)


def group_members(strategy: Strategy, group: str, rank: int) -> tuple[int, ...]:
    """World ranks of the ``group`` (a ``Collective.group`` name) that ``rank`` belongs to: hsdp's
    ``shard`` groups are runs of G consecutive ranks, its ``replica`` groups the ranks G apart."""
    ways, world = strategy.shard_ways, strategy.world_size
    if group == "shard":
        first = rank // ways * ways
        return tuple(range(first, first + ways))
    if group == "replica":
        return tuple(range(rank % ways, world, ways))
    return tuple(range(world))


def _group_size(strategy: Strategy, group: str) -> int:
    return {"world": strategy.world_size, "shard": strategy.shard_ways, "replica": strategy.replicas,
            "node": 2}.get(group, 1)


def _ring(num_bytes: int, ways: int, collective: str) -> int:
    """Bytes each rank sends in a ring ``collective`` over ``ways`` ranks of a ``num_bytes`` buffer."""
    sent = num_bytes * (ways - 1) // ways
    return 2 * sent if collective == "all_reduce" else sent


class _Sequence:
    """Builds the step list of one plan; see [Note: strategies as access sequences]."""

    def __init__(self, model: ModelSpec, strategy: Strategy, placement: Placement,
                 layout: dict[ShardId, ShardInfo]) -> None:
        self.model, self.strategy, self.placement, self.layout = model, strategy, placement, layout
        self.groups = comm_groups(model, strategy)
        self.shards_of: dict[tuple[int, str], list[ShardId]] = {}
        for sid in layout:
            self.shards_of.setdefault((sid.unit, sid.state), []).append(sid)
        self.steps: list[Step] = []
        self.pushes: dict[int, int] = {}  # node: unit -> the step that pushes its gradients
        self.optim_tier = placement.optim_tier
        self.optim_queue = "compute" if self.optim_tier == "device" else "optim"
        self.gkind = "grad_slice" if strategy.name == "zero1" else "grad"  # what the update reads
        self.pkind = "param_slice" if strategy.name in ("zero1", "zero2") else "param"  # what it writes

    def needs(self, units: Sequence[int], state: str, tier: str, mode: str) -> tuple[Need, ...]:
        return tuple(Need(s, tier, mode) for u in units for s in self.shards_of[(u, state)])

    def reads(self, k: int) -> tuple[int, ...]:
        return (k,) + self.model.units[k].reads

    def elements(self, u: int, state: str) -> int:
        return sum(self.layout[s].numel for s in self.shards_of[(u, state)])

    def add(self, op_type: type, queue: str, fields: dict, needs: tuple[Need, ...], after: tuple[int, ...] = ()) -> int:
        self.steps.append(Step(op_type, queue, fields, needs, after))
        return len(self.steps) - 1

    def collective(self, op_type: type, queue: str, unit: int, collective: str, nbytes: int,
                   needs: tuple[Need, ...], *, after: tuple[int, ...] = (), accumulate: bool = False) -> int:
        """A collective of ``nbytes`` (the whole buffer) on ``queue``'s group; ``local`` runs on the
        optimizer's queue and moves nothing."""
        group = "" if collective == "local" else self.groups[queue]
        size = 1 if collective == "local" else _group_size(self.strategy, group)
        comm = nbytes if collective in ("send", "recv") else _ring(nbytes, size, collective)
        fields = dict(unit=unit, collective=collective, group=group, group_size=size, comm_bytes=comm,
                      accumulate=accumulate)
        return self.add(op_type, self.optim_queue if collective == "local" else queue, fields, needs, after)

    def full_bytes(self, u: int, state: str) -> int:
        """Bytes of unit ``u``'s whole buffer of ``state`` as collectives move it (W x S elements)."""
        ways = self.strategy.shard_ways
        return ceil_div(self.model.units[u].num_params, ways) * ways * element_bytes(self.model, state)

    # -- forward and backward ------------------------------------------------------------------

    def compute(self, phase: str, k: int, mb: int, grad_needs: tuple[Need, ...], final: tuple[int, ...] = ()) -> None:
        """F(k) or B(k); under zero3/hsdp each unit it reads is gathered first."""
        param_needs: tuple[Need, ...] = ()
        for r in self.reads(k):
            if self.strategy.sharded("param"):
                self.collective(Gather, "gather", r, "all_gather", self.full_bytes(r, "param"),
                                self.needs((r,), "param", "device", "r")
                                + self.needs((r,), "param_full", "device", "w"))
                param_needs += self.needs((r,), "param_full", "device", "r")
            else:
                param_needs += self.needs((r,), "param", "device", "r")
        tokens = self.model.tokens_per_step // self.model.num_micro_batches
        flops = self.model.units[k].flops_per_token * tokens * (1 if phase == "F" else 3)
        self.add(Compute, "compute", dict(name=f"{phase}{k}", unit=k, micro_batch=mb, flops=flops, final_units=final),
                 param_needs + grad_needs)

    def backward_pass(self, mb: int, finals: tuple[tuple[int, ...], ...], written: set[int],
                      on_final: Callable[[int], None], after_final: Callable[[int], None]) -> None:
        """B(L-1)..B0 of micro-batch ``mb``. In the last micro-batch, as soon as unit ``u``'s gradients are final,
        ``on_final(u)`` adds its collectives and ``after_final(u)`` the work that reads their result (its gradient
        norm, an update that does not wait for the whole backward): on the compute queue only after the next
        backward op ([Note: the compute queue does not wait for a collective]). ``written``: units whose
        accumulating gradient buffer already holds this step's values."""
        sharded = self.strategy.sharded("grad")
        kind = "grad_full" if sharded else "grad"
        if sharded:
            written = set()  # a full workspace lives for one micro-batch
        last_mb = mb == self.model.num_micro_batches - 1
        held: list[int] = []
        for k in reversed(range(len(self.model.units))):
            grad_needs = tuple(n for u in self.reads(k)
                               for n in self.needs((u,), kind, "device", "rw" if u in written else "w"))
            self.compute("B", k, mb, grad_needs, finals[k] if last_mb else ())
            for u in held:
                after_final(u)
            held = []
            written.update(self.reads(k))
            for u in finals[k]:
                if sharded and self.encodes(u):
                    self.compressed(u, source="grad_full", first=mb == 0)
                elif sharded:
                    self.reduce_scatter(u, first=mb == 0)
                if last_mb:
                    on_final(u)
                    if self.optim_queue == "compute":
                        held.append(u)
                    else:
                        after_final(u)
        for u in held:
            after_final(u)

    def encodes(self, u: int) -> bool:
        """Whether unit ``u``'s gradient goes through its codec this step (not in a warm-up's uncompressed step,
        ``ModelSpec.uncompressed``, whose layout still holds the codec's shards)."""
        return self.strategy.codec(u) != "none" and not self.model.uncompressed

    def reduce_scatter(self, u: int, *, first: bool) -> None:
        """This micro-batch's full gradient of ``u`` into this rank's slice: written by the first
        micro-batch, added to by the others (through ``grad_slice``)."""
        needs = self.needs((u,), "grad_full", "device", "r")
        if first:
            needs += self.needs((u,), "grad", "device", "w")
        else:
            needs += self.needs((u,), "grad_slice", "device", "w") + self.needs((u,), "grad", "device", "rw")
        self.collective(Reduce, "reduce", u, "reduce_scatter", self.full_bytes(u, "grad"), needs, accumulate=not first)

    def compressed(self, u: int, *, source: str, first: bool = True) -> None:
        """Unit ``u``'s gradient (``source``: ``grad``, or zero2's ``grad_full`` of one micro-batch) encoded with
        its residual, the payloads exchanged, and decoded into the reduced gradient: ddp's ``grad``, zero1's
        ``grad_slice``, zero2's ``grad`` (its later micro-batches through ``grad_slice``, added in)."""
        codec, ways = self.strategy.codec(u), self.strategy.world_size
        pieces, piece = codec_pieces(self.model, self.strategy, u)
        fields = dict(unit=u, codec=codec, chunk_numel=codec_chunk_numel(self.model),
                      numel=self.model.units[u].num_params, piece_numel=piece)
        self.add(Encode, "encode", dict(fields, pieces=pieces),
                 self.needs((u,), source, "device", "r") + self.needs((u,), "residual", "device", "rw")
                 + self.needs((u,), "grad_code", "device", "w"))
        self.collective(Reduce, "reduce", u, scheme(self.strategy.name), self.layout[ShardId(u, "grad_codes", 0)].numel,
                        self.needs((u,), "grad_code", "device", "r") + self.needs((u,), "grad_codes", "device", "w"))
        if self.strategy.name == "zero1":
            out = self.needs((u,), "grad_slice", "device", "w")
        elif first:
            out = self.needs((u,), "grad", "device", "w")
        else:
            out = self.needs((u,), "grad_slice", "device", "w") + self.needs((u,), "grad", "device", "rw")
        self.add(Decode, "decode", dict(fields, pieces=pieces, payloads=ways, accumulate=not first),
                 self.needs((u,), "grad_codes", "device", "r") + out)

    def encoded_push(self, u: int) -> int:
        """A compressed unit under node: its gradient encoded with its residual, one piece per node shard, and
        the payloads pushed ([Note: compressed pushes] in codec.py); returns the push's step."""
        pieces, piece = codec_pieces(self.model, self.strategy, u)
        self.add(Encode, "encode", dict(unit=u, codec=self.strategy.codec(u), chunk_numel=codec_chunk_numel(self.model),
                                        numel=self.model.units[u].num_params, piece_numel=piece, pieces=pieces),
                 self.needs((u,), "grad", "host", "r") + self.needs((u,), "residual", "host", "rw")
                 + self.needs((u,), "grad_code", "host", "w"))
        return self.collective(Push, "push", u, "send", sum(piece_bytes(self.model, self.strategy, u)),
                               self.needs((u,), "grad_code", "host", "r"))

    # -- after a unit's gradients are final -------------------------------------------------

    def post_backward(self, u: int) -> None:
        """The collectives of unit ``u`` once its gradients are final."""
        name = self.strategy.name
        if name == "node":
            self.pushes[u] = self.collective(Push, "push", u, "send", self.full_bytes(u, "grad"),
                                             self.needs((u,), "grad", "host", "r")) \
                if not self.encodes(u) else self.encoded_push(u)
            if not self.model.optimizer_waits_for_backward:
                self.pull(u)
            return
        if name in ("ddp", "zero1") and self.encodes(u):
            self.compressed(u, source="grad")
        elif name == "ddp":
            self.collective(Reduce, "reduce", u, "all_reduce", self.full_bytes(u, "grad"),
                            self.needs((u,), "grad", "device", "rw"))
        elif name == "zero1":
            self.collective(Reduce, "reduce", u, "reduce_scatter", self.full_bytes(u, "grad"),
                            self.needs((u,), "grad", "device", "r") + self.needs((u,), "grad_slice", "device", "w"))
        elif name == "hsdp" and "reduce_cross" in self.groups:
            self.collective(Reduce, "reduce_cross", u, "all_reduce", self.elements(u, "grad") * self.model.grad_bytes,
                            self.needs((u,), "grad", "device", "rw"))

    def grad_norm(self, u: int) -> None:
        """The squared norm of unit ``u``'s final gradients, where the step tracks it."""
        if self.strategy.name != "node" and _tracks_norm(self.model, self.strategy):
            self.add(GradNorm, self.optim_queue,
                     dict(unit=u, num_params=self.elements(u, self.gkind), tier=self.optim_tier),
                     self.needs((u,), self.gkind, self.optim_tier, "r")
                     + self.needs((u,), "norm", self.optim_tier, "w"))

    def pull(self, u: int) -> None:
        """Unit ``u``'s updated parameters back from the optimizer node, after its push."""
        self.collective(Pull, "pull", u, "recv", self.full_bytes(u, "param"),
                        self.needs((u,), "param", "host", "w"), after=(self.pushes[u],))

    def optimizer(self, u: int) -> None:
        """The update of this rank's part of unit ``u``, in pieces where its state streams from NVMe ([Note: an
        update in pieces]); zero1/2 then gather the full parameters."""
        tier, waits = self.optim_tier, self.model.optimizer_waits_for_backward
        norm = self.needs((GLOBAL_UNIT,), "norm", tier, "r") \
            if waits and _tracks_norm(self.model, self.strategy) else ()  # [Note: clipping] in exec/step.py
        for piece in self.update_pieces(u, (self.gkind, self.pkind)):
            self.add(OptimStep, self.optim_queue, dict(unit=u, num_params=self.numel(piece["master"]), tier=tier),
                     update_needs(self.model, piece, tier, grad=self.gkind, param=self.pkind) + norm)
        if self.pkind == "param_slice":
            self.collective(Gather, "gather", u, "all_gather", self.full_bytes(u, "param"),
                            self.needs((u,), "param_slice", "device", "r") + self.needs((u,), "param", "device", "w"))

    def update_pieces(self, u: int, kinds: tuple[str, ...]) -> list[dict[str, list[ShardId]]]:
        return update_pieces(self.model, self.layout, self.shards_of, u, kinds,
                             streamed=self.placement.optimizer == "nvme")

    def numel(self, sids: list[ShardId]) -> int:
        return sum(self.layout[s].numel for s in sids)

    def restore(self, u: int) -> None:
        """The compute copy of ``u``'s parameters from the current half of its master weights (what they were
        before a speculative update overwrote them); zero1/2 then gather them."""
        tier = self.optim_tier
        for piece in self.update_pieces(u, (self.pkind,)):
            needs = tuple(Need(s, tier, "r") for s in piece["master"])
            needs += tuple(Need(s, tier, "w") for s in piece[self.pkind])
            self.add(OptimStep, self.optim_queue, dict(unit=u, num_params=self.numel(piece["master"]), tier=tier),
                     needs)
        if self.pkind == "param_slice":
            self.collective(Gather, "gather", u, "all_gather", self.full_bytes(u, "param"),
                            self.needs((u,), "param_slice", "device", "r") + self.needs((u,), "param", "device", "w"))

    def norm_reduce(self) -> None:
        """The step's squared gradient norm from every unit's; summed across ranks where they hold
        different slices of the gradients."""
        units = range(len(self.model.units))
        sliced = self.strategy.sharded("grad") or self.strategy.name == "zero1"
        needs = (self.needs(units, "norm", self.optim_tier, "r")
                 + self.needs((GLOBAL_UNIT,), "norm", self.optim_tier, "w"))
        self.collective(NormReduce, "reduce", GLOBAL_UNIT, "all_reduce" if sliced else "local", NORM_BYTES, needs)


def update_pieces(model: ModelSpec, layout: dict[ShardId, ShardInfo], shards_of: dict[tuple[int, str], list[ShardId]],
                  u: int, kinds: tuple[str, ...], *, streamed: bool) -> list[dict[str, list[ShardId]]]:
    """Unit ``u``'s update as pieces ([Note: an update in pieces]): each maps ``kinds`` and the optimizer's state
    kinds (by their names, ``master``...: the shards of the half the update reads under double buffering) to
    whole shards covering one run of elements. One piece unless the state is ``streamed`` from NVMe."""
    half = model.state_half if model.double_buffer else 0
    shards = {k: shards_of[(u, k)] for k in kinds} | {k: shards_of[(u, half_kind(k, half))] for k in OPTIMIZER_KINDS}
    if not streamed:
        return [shards]
    starts: dict[str, list[int]] = {}
    for kind, sids in shards.items():
        pos, starts[kind] = 0, []
        for sid in sids:
            starts[kind].append(pos)
            pos += layout[sid].numel
        starts[kind].append(pos)
    if len({run[-1] for run in starts.values()}) != 1:
        return [shards]  # kinds of different lengths (none today): one piece
    cuts = sorted(set.intersection(*(set(run) for run in starts.values())))
    return [{kind: [sid for sid, at in zip(sids, starts[kind]) if a <= at < b] for kind, sids in shards.items()}
            for a, b in zip(cuts, cuts[1:])]


def update_needs(model: ModelSpec, piece: dict[str, list[ShardId]], tier: str, *, grad: str,
                 param: str) -> tuple[Need, ...]:
    """What an update of ``piece`` reads and writes: its gradient (kind ``grad``), the optimizer state in place or
    from the current half into the other one, taking over the staging copies ([Note: speculative updates]),
    and the compute copy of its parameters (kind ``param``)."""
    if not model.double_buffer:
        state = tuple(Need(s, tier, "rw") for kind in OPTIMIZER_KINDS for s in piece[kind])
    else:
        other = 1 - model.state_half
        state = tuple(n for kind in OPTIMIZER_KINDS for a in piece[kind]
                      for n in (Need(a, tier, "r"), Need(a._replace(state=half_kind(kind, other)), tier, "w", into=a)))
    return tuple(Need(s, tier, "r") for s in piece[grad]) + state + tuple(Need(s, tier, "w") for s in piece[param])


def check_double_buffer(model: ModelSpec, strategy: Strategy, placement: Placement) -> None:
    """Raises ``ValueError`` unless ``model``'s optimizer state may be double-buffered under ``placement``
    ([Note: speculative updates]): it lives on NVMe, on workers that hold it."""
    if not model.double_buffer:
        return
    if strategy.name == "node" or placement.optimizer != "nvme":
        raise ValueError(f"a double-buffered optimizer state lives on NVMe, in the process that runs the optimizer: "
                         f"not under strategy {strategy.name} with the optimizer state on {placement.optimizer}")


def build_restore_steps(model: ModelSpec, strategy: Strategy, placement: Placement,
                        layout: dict[ShardId, ShardInfo]) -> list[Step]:
    """The steps that put back the parameters a speculative update overwrote, from the current half of the
    master weights, unit by unit ([Note: speculative updates]): before a step is redone."""
    check_double_buffer(model, strategy, placement)
    assert model.double_buffer, "only a double-buffered layout keeps the master weights a step started from"
    seq = _Sequence(model, strategy, placement, layout)
    for u in reversed(range(len(model.units))):
        seq.restore(u)
    return seq.steps


def build_steps(model: ModelSpec, strategy: Strategy, placement: Placement,
                layout: dict[ShardId, ShardInfo]) -> list[Step]:
    """The logical ops of one step, in the order the plan lists them."""
    check_double_buffer(model, strategy, placement)
    seq = _Sequence(model, strategy, placement, layout)
    num_units = len(model.units)
    if model.optimizer_only:
        if strategy.name != "local":
            raise ValueError(f"an optimizer-only plan runs one process (strategy local), not {strategy.name}")
        for u in reversed(range(num_units)):
            seq.optimizer(u)
        return seq.steps
    if model.forward_only:
        for k in range(num_units):
            seq.compute("F", k, 0, ())
        return seq.steps
    finals = final_points(tuple(u.reads for u in model.units))
    written: set[int] = set()
    deferred: list[int] = []

    def after_final(u: int) -> None:
        seq.grad_norm(u)
        if model.optimizer_waits_for_backward:
            deferred.append(u)
        elif strategy.name != "node":
            seq.optimizer(u)

    for mb in range(model.num_micro_batches):
        # The last unit's forward is fused into its backward: its output only feeds the loss,
        # which B(L-1) computes anyway ([Note: the last unit runs once] in engine/compute.py).
        for k in range(num_units - 1):
            seq.compute("F", k, mb, ())
        seq.backward_pass(mb, finals, written, seq.post_backward, after_final)
    if _tracks_norm(model, strategy):
        seq.norm_reduce()
    if strategy.name != "node":
        # Every gradient is final by now, so the updates may run in any order: the next step's forward reads
        # unit 0 first ([Note: updates after the norm]).
        deferred.sort()
    for u in deferred:
        if strategy.name != "node":
            seq.optimizer(u)
        else:
            # A node that waits for the step's norm serves nothing before every worker pushed every unit
            # ([Note: the node's step]), so no pull completes during backward. Listed there, a pull's output
            # would take host memory that a later backward's loads reuse once it is written back: a backward
            # op waiting on the node, which waits on that backward's push (a deadlock, and couple() never
            # settles). After the last push, pulls wait on nothing that waits on them.
            seq.pull(u)
    return seq.steps
