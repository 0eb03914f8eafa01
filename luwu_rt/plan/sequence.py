"""The access sequence of one training step, before any placement decision.

``build_layout`` cuts every unit's state buffers into shards; ``build_steps``
lists the logical ops of one step in order (F0..F(L-2), B(L-1)..B0 once per
micro-batch — the last unit's forward is fused into its backward — and after the backward op that makes a unit's gradients final, its
collective and its optimizer step) with the shard copies each one needs and on
which tier. The planner turns this list into a ``SwapPlan`` by adding the moves
and frees.

[Note: strategies as access sequences]
Per rank, a strategy changes two things: which states are sharded (the rank
holds ceil(numel / ways) elements of them) and which collectives run.
  local   -
  ddp     Reduce (all-reduce) of each unit's grads, in place on the device.
  zero1/2 grads and optimizer state sharded: backward writes full grads into a
          device workspace, Reduce (reduce-scatter) leaves this rank's slice in
          the store, OptimStep updates the slice, Gather (all-gather) rebuilds
          the full parameters on the device. ZeRO-1 keeps full-size gradient
          buffers, so its workspace holds all of them.
  zero3   also parameters sharded: a Gather before each F and B assembles the
          unit in a (double-buffered) workspace; OptimStep writes the slice.
  hsdp    zero3 inside groups of G ranks; Reduce also all-reduces the slice
          across the world_size / G groups.
  node    no optimizer state on the worker: Push sends grads to the optimizer
          node, Pull receives the updated parameters (after the node stepped).
Workspaces are not planned shard by shard: they are reserved on the device
beside the activations (``workspace_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from .ops import Compute, Gather, OptimStep, Pull, Push, Reduce, ShardId, ShardInfo
from .spec import OPTIMIZER_KINDS, STATE_KINDS, ModelSpec, Placement, Strategy, align_up, ceil_div

__all__ = ["Need", "Step", "build_layout", "build_steps", "final_points", "workspace_bytes", "full_bytes"]


@dataclass(frozen=True, slots=True)
class Need:
    shard: ShardId
    tier: str
    mode: str
    """``r`` (read the latest version), ``w`` (overwrite: no load needed) or ``rw``."""


@dataclass(frozen=True, slots=True)
class Step:
    """A logical op: the planner emits ``op_type(**fields)`` with deps and accesses filled in."""

    op_type: type
    queue: str
    fields: dict
    needs: tuple[Need, ...]
    after: tuple[int, ...] = ()
    """Earlier steps that must finish first for a reason other than data (e.g. Pull after Push)."""


def _states(strategy: Strategy) -> tuple[str, ...]:
    return ("param", "grad") if strategy.name == "node" else STATE_KINDS


def build_layout(model: ModelSpec, strategy: Strategy) -> dict[ShardId, ShardInfo]:
    """Every shard of this rank, sized per the strategy and grouped into plan shards."""
    layout: dict[ShardId, ShardInfo] = {}
    ways = strategy.shard_ways
    for u, unit in enumerate(model.units):
        for state in _states(strategy):
            elem = model.element_bytes(state)
            numel = ceil_div(unit.num_params, ways) if strategy.sharded(state) else unit.num_params
            total = align_up(numel * elem)
            num_chunks = ceil_div(total, model.chunk_bytes)
            per_shard = ceil_div(num_chunks, min(model.max_shards_per_state, num_chunks))
            elems_per_chunk = model.chunk_bytes // elem
            for i, first in enumerate(range(0, num_chunks, per_shard)):
                count = min(per_shard, num_chunks - first)
                nbytes = min(count * model.chunk_bytes, total - first * model.chunk_bytes)
                shard_numel = min(count * elems_per_chunk, numel - first * elems_per_chunk)
                layout[ShardId(u, state, i)] = ShardInfo(nbytes, max(shard_numel, 0), first, count)
    return layout


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


def full_bytes(model: ModelSpec, unit: int, state: str) -> int:
    """Bytes of one unit's whole (unsharded) buffer of ``state``."""
    return align_up(model.units[unit].num_params * model.element_bytes(state))


def _reads(model: ModelSpec, k: int) -> tuple[int, ...]:
    return (k,) + model.units[k].reads


def workspace_bytes(model: ModelSpec, strategy: Strategy) -> int:
    """Device bytes outside the planned store that the strategy's collectives need."""
    units = range(len(model.units))
    grad_ws = max(full_bytes(model, u, "grad") for u in units)
    tied = {r for u in units for r in model.units[u].reads}
    # A tied unit's full gradient accumulates across several backward ops before its reduce.
    grad_ws += sum(full_bytes(model, u, "grad") for u in tied)
    unit_params = max(sum(full_bytes(model, r, "param") for r in _reads(model, k)) for k in units)
    return {
        "zero1": sum(full_bytes(model, u, "grad") for u in units),
        "zero2": grad_ws,
        "zero3": grad_ws + 2 * unit_params,
        "hsdp": grad_ws + 2 * unit_params,
    }.get(strategy.name, 0)


def build_steps(model: ModelSpec, strategy: Strategy, placement: Placement,
                layout: dict[ShardId, ShardInfo]) -> list[Step]:
    """The logical ops of one step, in the order the plan lists them."""
    shards_of: dict[tuple[int, str], list[ShardId]] = {}
    for sid in layout:
        shards_of.setdefault((sid.unit, sid.state), []).append(sid)

    def needs(units: tuple[int, ...], state: str, tier: str, mode: str) -> tuple[Need, ...]:
        return tuple(Need(s, tier, mode) for u in units for s in shards_of[(u, state)])

    def numel(u: int, state: str) -> int:
        return sum(layout[s].numel for s in shards_of[(u, state)])

    num_units = len(model.units)
    gathers = strategy.name in ("zero3", "hsdp")
    steps: list[Step] = []

    tokens = model.tokens_per_step // model.num_micro_batches

    def compute(phase: str, k: int, mb: int, grad_needs: tuple[Need, ...], final: tuple[int, ...] = ()) -> None:
        after: tuple[int, ...] = ()
        param_needs = needs(_reads(model, k), "param", "device", "r")
        if gathers:
            comm = sum(full_bytes(model, r, "param") for r in _reads(model, k))
            steps.append(Step(Gather, "comm", dict(unit=k, collective="all_gather",
                                                  comm_bytes=_ring(comm, strategy.shard_ways)), param_needs))
            after, param_needs = (len(steps) - 1,), ()
        flops = model.units[k].flops_per_token * tokens * (1 if phase == "F" else 3)
        steps.append(Step(Compute, "compute", dict(name=f"{phase}{k}", unit=k, micro_batch=mb, flops=flops,
                                                   final_units=final),
                          param_needs + grad_needs, after))

    if model.optimizer_only:
        if strategy.name != "local":
            raise ValueError(f"an optimizer-only plan runs one process (strategy local), not {strategy.name}")
        for u in reversed(range(num_units)):
            _post_backward(model, strategy, placement, u, needs, numel, steps)
        return steps
    if model.forward_only:
        for k in range(num_units):
            compute("F", k, 0, ())
        return steps
    finals = final_points(tuple(u.reads for u in model.units))
    written: set[int] = set()  # units whose grads this step's backward already wrote (accumulate: rw)
    reduced: set[int] = set()  # units whose sharded grads a reduce-scatter already wrote
    deferred: list[int] = []
    for mb in range(model.num_micro_batches):
        # The last unit's forward is fused into its backward: its output only feeds the loss,
        # which B(L-1) computes anyway (engine/unitwise.py, [Note: the last unit runs once]).
        for k in range(num_units - 1):
            compute("F", k, mb, ())
        for k in reversed(range(num_units)):
            grad_needs: tuple[Need, ...] = ()
            if not strategy.sharded("grad"):
                grad_needs = tuple(n for u in _reads(model, k)
                                   for n in needs((u,), "grad", "device", "rw" if u in written else "w"))
            last_mb = mb == model.num_micro_batches - 1
            compute("B", k, mb, grad_needs, finals[k] if last_mb else ())
            backward = len(steps) - 1
            for u in finals[k]:
                if strategy.sharded("grad"):
                    # Sharded grads are reduce-scattered every micro-batch into this rank's slice.
                    mode = "rw" if u in reduced else "w"
                    _reduce_scatter(model, strategy, u, needs((u,), "grad", "device", mode), backward, steps)
                    reduced.add(u)
                if mb < model.num_micro_batches - 1:
                    continue
                if model.optimizer_waits_for_backward:
                    deferred.append(u)
                else:
                    _post_backward(model, strategy, placement, u, needs, numel, steps)
            written.update(_reads(model, k))
    end_of_backward = len(steps) - 1
    for u in deferred:
        first = len(steps)
        _post_backward(model, strategy, placement, u, needs, numel, steps)
        steps[first:] = [replace(s, after=s.after + (end_of_backward,)) if s.op_type is OptimStep else s
                         for s in steps[first:]]
    return steps


def _ring(num_bytes: int, ways: int) -> int:
    """Bytes each rank sends in a ring all-gather / reduce-scatter of ``num_bytes``."""
    return num_bytes * (ways - 1) // ways


def _reduce_scatter(model: ModelSpec, strategy: Strategy, u: int, grad_needs: tuple[Need, ...], backward: int,
                    steps: list[Step]) -> None:
    """Reduce unit ``u``'s full grads (in the device workspace, written by step ``backward``) into
    this rank's slice; hsdp then all-reduces the slice across groups."""
    grad_full, ways, world = full_bytes(model, u, "grad"), strategy.shard_ways, strategy.world_size
    comm = _ring(grad_full, ways)
    if strategy.name == "hsdp" and world > ways:
        comm += 2 * _ring(ceil_div(grad_full, ways), world // ways)
    collective = "hierarchical" if strategy.name == "hsdp" else "reduce_scatter"
    steps.append(Step(Reduce, "comm", dict(unit=u, collective=collective, comm_bytes=comm), grad_needs, (backward,)))


def _post_backward(model: ModelSpec, strategy: Strategy, placement: Placement, u: int,
                   needs: Callable[..., tuple[Need, ...]], numel: Callable[[int, str], int], steps: list[Step]) -> None:
    """Collectives and the optimizer step of unit ``u`` once its gradients are final (after the
    last micro-batch)."""
    name, world = strategy.name, strategy.world_size
    grad_full = full_bytes(model, u, "grad")
    if name == "node":
        steps.append(Step(Push, "comm", dict(unit=u, collective="p2p", comm_bytes=grad_full),
                          needs((u,), "grad", "device", "r")))
        steps.append(Step(Pull, "comm", dict(unit=u, collective="p2p", comm_bytes=full_bytes(model, u, "param")),
                          needs((u,), "param", "device", "w"), (len(steps) - 1,)))
        return
    if name == "ddp":  # once per step, after the last micro-batch (like DDP's no_sync)
        steps.append(Step(Reduce, "comm", dict(unit=u, collective="all_reduce", comm_bytes=2 * _ring(grad_full, world)),
                          needs((u,), "grad", "device", "rw")))
    tier = placement.optim_tier
    optim_needs = needs((u,), "grad", tier, "r") + tuple(n for s in OPTIMIZER_KINDS for n in needs((u,), s, tier, "rw"))
    writes_param = name not in ("zero1", "zero2")
    if writes_param:
        optim_needs += needs((u,), "param", tier, "w")
    steps.append(Step(OptimStep, "compute" if tier == "device" else "optim",
                      dict(unit=u, num_params=numel(u, "master"), tier=tier), optim_needs))
    if not writes_param:
        steps.append(Step(Gather, "comm", dict(unit=u, collective="all_gather",
                                               comm_bytes=_ring(full_bytes(model, u, "param"), strategy.shard_ways)),
                          needs((u,), "param", "device", "w"), (len(steps) - 1,)))
