"""The two halves of a double-buffered optimizer state: one plan per half, the second the mirror of the first.

A double-buffered step ([Note: speculative updates] in sequence.py) reads one
half of the optimizer state and writes the other; the next step does the
opposite. Both halves have the same sizes, homes and (NVMe) regions, so the
plan of half 1 is the plan of half 0 with the names of the halves swapped in
every access: ``mirror`` makes it, op for op, and a plan that is valid stays
valid under it. Making it by renaming rather than by planning again also
guarantees that both steps move the same bytes at the same times.
"""

from __future__ import annotations

import dataclasses

from .ops import Access, Free, Op, ShardId, SwapPlan
from .spec import SECOND_HALF

__all__ = ["mirror", "swap_halves"]

_SWAP = {**SECOND_HALF, **{b: a for a, b in SECOND_HALF.items()}}


def swap_halves(shard: ShardId) -> ShardId:
    """``shard`` of the other half (``master`` <-> ``master_b``, ...); any other shard itself."""
    other = _SWAP.get(shard.state)
    return shard if other is None else shard._replace(state=other)


def _access(acc: Access) -> Access:
    return acc._replace(shard=swap_halves(acc.shard))


def _op(op: Op) -> Op:
    changes = {name: tuple(_access(a) for a in getattr(op, name)) for name in ("inputs", "outputs", "consumes")}
    if isinstance(op, Free):
        changes["shard"] = swap_halves(op.shard)
    return dataclasses.replace(op, **changes)


def mirror(plan: SwapPlan) -> SwapPlan:
    """``plan`` with the halves of its double-buffered optimizer state swapped: the step that reads the half
    ``plan`` writes and writes the half it reads."""
    assert all(plan.homes.get(a) == plan.homes.get(b) for a, b in SECOND_HALF.items()), "halves live apart"
    return dataclasses.replace(
        plan, ops=tuple(_op(op) for op in plan.ops),
        shards={swap_halves(s): i for s, i in plan.shards.items()},
        home_slots={swap_halves(s): slot for s, slot in plan.home_slots.items()})
