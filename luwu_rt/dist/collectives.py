"""Handlers of the plan's collectives (``Reduce``, ``Gather``, ``NormReduce``) over process groups, and of
compressed units' ``Encode`` and ``Decode`` (``compressed.py``).

Each communication queue of a plan owns one process group (``SwapPlan.comm_groups``;
[Note: collectives as start and wait] in plan/ops.py); ``CollectiveHandlers``
maps every collective op to calls on the group of its queue and returns the
handle its ``Wait`` completes. A group is anything with the three methods of
``Group``: ``TorchGroup`` wraps a ``torch.distributed`` process group (gloo on
the CPU, NCCL on GPUs), ``luwu_rt.dist.local.LocalWorld`` runs ranks as threads
of one process for tests.

[Note: slices of a full buffer]
A sharded state holds S = ceil(numel / W) elements per rank, and the full
buffer a reduce-scatter reads or an all-gather writes holds W x S elements in
one shard, so rank r's part is ``full[r*S : (r+1)*S]``. The slice side may be
cut into several plan shards; shard c of the slice covers slice elements
``[a, b)``, and its collective moves ``full[r*S + a : r*S + b]`` for every
rank r: one call per slice shard, each on contiguous views, no staging copy.

[Note: gradient sums]
Collectives sum. Each rank's gradients are those of its share of the global
batch's mean loss (the engine scales the loss by 1 / (world size x micro-batches)),
so the sum over ranks is the gradient of the global mean, as the single-process
run computes it. A reduce-scatter that accumulates (later micro-batches under
zero2/3/hsdp) scatters into ``grad_slice`` and its wait adds that into ``grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from luwu_rt.dist.compressed import CodecHandlers
from luwu_rt.exec.executor import DONE, Handle, Views, WaitAll
from luwu_rt.exec.norm import NormHandlers
from luwu_rt.exec.views import state_dtypes, typed_views
from luwu_rt.plan.ops import Collective, Gather, NormReduce, Reduce, ShardId, ShardInfo

__all__ = ["CollectiveHandlers", "Group", "TorchGroup"]


class Group(Protocol):
    """The collectives a plan needs, asynchronous: each returns a ``Handle``; ranks call them in the
    same order (the plan guarantees it)."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        """Sums ``tensor`` over the group, in place."""
        ...

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor]) -> Handle:
        """``output`` = the sum over ranks of their ``inputs[self.rank]``; ``output`` shares no bytes with
        ``inputs`` (gloo's form receives into it while it sends them)."""
        ...

    def all_gather(self, outputs: Sequence[torch.Tensor], input: torch.Tensor) -> Handle:
        """``outputs[r]`` = rank r's ``input``."""
        ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """Piece r of ``output`` (W equal pieces) = piece ``self.rank`` of rank r's ``input``."""
        ...


class TorchGroup:
    """A ``torch.distributed`` process group as a ``Group``.

    [Note: collectives on gloo]
    Measured on the wire (benchmarks/bench_dist.py), gloo's reduce-scatter sends
    as much as a whole all-reduce, twice the ring algorithm's (N-1)/N of the
    buffer, and its all-gather (``all_gather_single`` too) gathers into a
    flat buffer of its own, the whole unit, then copies out of it. Both of a
    unit's worth of temporaries came from the C heap each time, on gloo's and
    the queues' threads, and fragmented it: a zero3 rank of gpt-small held
    300-570 MiB in malloc for 170-200 in use (benchmarks/results/2026-12-07-rss.md).
    On gloo both collectives are therefore point-to-point, each piece sent
    straight from where it lies and received straight where it goes, the
    (N-1)/N of the ring algorithm and no staging copy: an all-gather sends
    this rank's slice to every other rank and receives each rank's piece into
    its place in the full buffer; a reduce-scatter sends piece r of the full
    buffer to rank r, receives the lowest other rank's piece into the output
    and any further rank's into a temporary (none on 2 ranks), and sums the
    pieces in rank order (what a sum of the N stacked pieces computes, bit
    for bit). Each call's messages carry a tag of their own, counted alike on
    every rank (ranks call in the same order), so two calls in flight on one
    group never take each other's pieces. NCCL's collectives write in place
    and keep their own algorithms."""

    def __init__(self, group: object | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._gloo = dist.get_backend(group) == "gloo"
        self._calls = 0  # point-to-point calls so far: their tags ([Note: collectives on gloo])

    def _tag(self) -> int:
        self._calls += 1
        return self._calls % (1 << 31)

    def _p2p(self, tensor: torch.Tensor) -> bool:
        """Whether this collective runs point to point ([Note: collectives on gloo]): gloo, on CPU tensors (a
        world the user made gloo on GPUs keeps torch's own collectives)."""
        return self._gloo and tensor.device.type == "cpu"

    def _peers(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank]

    def all_reduce(self, tensor: torch.Tensor) -> Handle:
        return self._dist.all_reduce(tensor, group=self.group, async_op=True)

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor]) -> Handle:
        if not self._p2p(output):
            return self._dist.reduce_scatter(output, list(inputs), group=self.group, async_op=True)
        if self.size == 1:
            output.copy_(inputs[0])
            return DONE
        tag, peers = self._tag(), self._peers()  # [Note: collectives on gloo]
        received = {peers[0]: output.view(-1)}
        received.update({p: torch.empty_like(output).view(-1) for p in peers[1:]})
        work = [self._dist.isend(inputs[p].reshape(-1), group=self.group, group_dst=p, tag=tag) for p in peers]
        work += [self._dist.irecv(received[p], group=self.group, group_src=p, tag=tag) for p in peers]
        received[self.rank] = inputs[self.rank].reshape(-1)

        def add_up() -> None:  # in rank order; the first two in either order (a + b is b + a exactly)
            acc = received[peers[0]]
            for r in range(self.size):
                if r != peers[0]:
                    acc.add_(received[r])

        return WaitAll(work, add_up)

    def all_gather(self, outputs: Sequence[torch.Tensor], input: torch.Tensor) -> Handle:
        if self._p2p(input):  # [Note: collectives on gloo]
            tag, flat = self._tag(), input.reshape(-1)
            outputs[self.rank].view(-1).copy_(flat)
            work = [self._dist.isend(flat, group=self.group, group_dst=p, tag=tag) for p in self._peers()]
            work += [self._dist.irecv(outputs[p].view(-1), group=self.group, group_src=p, tag=tag)
                     for p in self._peers()]
            return WaitAll(work)
        whole = _joined(outputs)
        if whole is not None:
            return self._dist.all_gather_single(whole, input, group=self.group, async_op=True)
        return self._dist.all_gather(list(outputs), input, group=self.group, async_op=True)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        return self._dist.all_to_all_single(output, input, group=self.group, async_op=True)


def _joined(pieces: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat tensor over ``pieces`` when they are consecutive contiguous runs of one storage, else None."""
    first = pieces[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.untyped_storage().data_ptr()
               == first.untyped_storage().data_ptr() for p in pieces):
        return None
    size = first.element_size()
    for a, b in zip(pieces, pieces[1:]):
        if a.data_ptr() + a.numel() * size != b.data_ptr():
            return None
    flat = first.reshape(-1)
    return flat.as_strided((sum(p.numel() for p in pieces),), (1,))


class CollectiveHandlers:
    """Executor handlers ``Reduce``, ``Gather`` and ``NormReduce`` for one rank's plan.

    ``groups``: the process group of every communication queue of the plan; ``dtypes``: element
    types of the ``param`` and ``grad`` kinds (workspaces share their kind's type)."""

    def __init__(self, shards: Mapping[ShardId, ShardInfo], *, groups: Mapping[str, Group],
                 param_dtype: torch.dtype, grad_dtype: torch.dtype, norms: NormHandlers) -> None:
        self.shards = shards
        self.groups = groups
        self.dtypes = state_dtypes(param_dtype=param_dtype, grad_dtype=grad_dtype)
        self.norms = norms

    def handlers(self) -> dict[str, Callable[[Collective, Views], Handle]]:
        """The collectives' handlers, and those of compressed units' ``Encode`` and ``Decode`` (which pieces
        this rank encodes and decodes follow from its rank in the ``reduce`` queue's group)."""
        out = {"Reduce": self.reduce, "Gather": self.gather, "NormReduce": self.norm_reduce}
        if "reduce" in self.groups:
            out.update(CodecHandlers(self.shards, rank=self.groups["reduce"].rank).handlers())
        return out

    def _kind(self, views: Views, accesses: Sequence, state: str) -> list[torch.Tensor]:
        """The typed views of the shards of ``state`` among ``accesses``, in chunk order (none: empty)."""
        if not any(a.shard.state == state for a in accesses):
            return []
        return typed_views(views, self.shards, self.dtypes, states=(state,))[state]

    def _full(self, views: Views, accesses: Sequence, state: str) -> torch.Tensor:
        """The one shard of ``state`` among ``accesses``, a unit's whole buffer, typed and with its padding
        (the W slices of [Note: slices of a full buffer] end in it)."""
        (full_id,) = [a.shard for a in accesses if a.shard.state == state]
        return views[full_id].view(self.dtypes[state])

    @staticmethod
    def _pieces(full: torch.Tensor, slices: list[torch.Tensor], ways: int):
        """(slice shard view, the W views of ``full`` that meet it) per slice shard ([Note: slices of a
        full buffer])."""
        per_rank = sum(part.numel() for part in slices)
        start = 0
        for part in slices:
            stop = start + part.numel()
            yield part, [full[r * per_rank + start : r * per_rank + stop] for r in range(ways)]
            start = stop

    def reduce(self, op: Reduce, views: Views) -> Handle:
        group = self.groups[op.queue]
        if op.collective in ("all_gather", "all_to_all"):  # payloads of a compressed unit
            return self._exchange(op, views, group)
        if op.collective == "all_reduce":
            (state,) = {a.shard.state for a in op.outputs}
            return WaitAll([group.all_reduce(part) for part in self._kind(views, op.outputs, state)])
        assert op.collective == "reduce_scatter", op
        full_kind = "grad_full" if any(a.shard.state == "grad_full" for a in op.inputs) else "grad"
        full = self._full(views, op.inputs, full_kind)
        # zero1 scatters its kept full grad into grad_slice; an accumulating scatter lands there first too.
        slices = self._kind(views, op.outputs, "grad_slice") or self._kind(views, op.outputs, "grad")
        handles = [group.reduce_scatter(part, inputs) for part, inputs in self._pieces(full, slices, group.size)]
        if not op.accumulate:
            return WaitAll(handles)
        grads = self._kind(views, op.outputs, "grad")

        def add() -> None:
            for g, s in zip(grads, slices, strict=True):
                g.add_(s)

        return WaitAll(handles, add)

    def _exchange(self, op: Reduce, views: Views, group: Group) -> Handle:
        """The payloads of a compressed unit ([Note: codecs on the wire] in plan/codec.py): ``grad_code``, one
        payload or one per rank, into ``grad_codes``, one per rank, as bytes."""
        send = self._payloads(views, op.inputs, "grad_code")
        received = self._payloads(views, op.outputs, "grad_codes")
        if op.collective == "all_gather":
            return WaitAll([group.all_gather(list(received.chunk(group.size)), send)])
        return WaitAll([group.all_to_all(received, send)])

    def _payloads(self, views: Views, accesses: Sequence, state: str) -> torch.Tensor:
        (sid,) = [a.shard for a in accesses if a.shard.state == state]
        return views[sid][: self.shards[sid].numel]

    def gather(self, op: Gather, views: Views) -> Handle:
        group = self.groups[op.queue]
        (full_kind,) = {a.shard.state for a in op.outputs}
        full = self._full(views, op.outputs, full_kind)
        slices = self._kind(views, op.inputs, op.inputs[0].shard.state)
        return WaitAll([group.all_gather(outputs, part) for part, outputs in self._pieces(full, slices, group.size)])

    def norm_reduce(self, op: NormReduce, views: Views) -> Handle:
        if op.collective == "local":
            return self.norms.norm_reduce(op, views)
        total = self.norms.local_sum(op, views)

        def record() -> None:
            self.norms.total_sq = float(total)

        return WaitAll([self.groups[op.queue].all_reduce(total)], record)

