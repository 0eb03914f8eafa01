"""Facts read off a finished plan, for the engine and the reports: derived here, once.

The engine must not re-derive schedule facts from op positions on its own
(DESIGN.md, style 11); whatever it needs to know about a plan beyond running
it comes from a function here.
"""

from __future__ import annotations

from .ops import Access, Collective, Compute, Free, Op, SwapPlan
from .spec import STATE_KINDS

__all__ = ["live_bytes", "params_at_risk", "state_bytes", "wire_bytes"]


def live_bytes(plan: SwapPlan, tier: str) -> int:
    """The most bytes of shard copies live at once in ``tier``'s arena (the device's without the activation
    reserve): the least its arena could be, where ``plan.arena_bytes`` is what its slots span ([Note: arenas no
    larger than the step needs] in search.py)."""
    return plan.peak_bytes.get(tier, 0) - (plan.device_reserve_bytes if tier == "device" else 0)


def state_bytes(plan: SwapPlan) -> dict[str, int]:
    """Bytes of each state kind (``param``, ``grad``, ``master``, ``exp_avg``, ``exp_avg_sq``) this rank
    holds: the size of its share, as the ZeRO paper's memory table counts it (P + G + 12 bytes per
    parameter for ddp, P + G + 12/N for zero1, P + (G + 12)/N for zero2, (P + G + 12)/N for zero3).
    Workspaces and activations are not state; 4 KiB alignment rounds each unit's buffers up. A compressed
    unit's ``residual`` (4 bytes per parameter, on every rank) is state too."""
    out = dict.fromkeys((k for k in (*STATE_KINDS, "residual") if any(s.state == k for s in plan.shards)), 0)
    for shard, info in plan.shards.items():
        if shard.state in out:
            out[shard.state] += info.nbytes
    return out


def wire_bytes(plan: SwapPlan) -> int:
    """Bytes this process sends per step by its collectives and node transfers (``Collective.comm_bytes``:
    ring algorithms; a node pull counts what it receives); a compressed unit's as its payloads."""
    return sum(op.comm_bytes for op in plan.ops if isinstance(op, Collective))


def params_at_risk(plan: SwapPlan) -> frozenset[tuple[int, int]]:
    """``(micro_batch, unit)`` of the forwards whose device parameter copies may be overwritten before
    the unit's backward: a graph kept from F to B must copy what it saves of them ([Note: kept graphs
    in the engine] in engine/compute.py). A copy is safe when the backward reads the very same copies
    and no op in between frees or rewrites them."""
    ops = plan.ops
    position = {(op.name[0], op.micro_batch, op.unit): i for i, op in enumerate(ops) if isinstance(op, Compute)}
    risky = set()
    for (phase, mb, unit), f in position.items():
        if phase != "F":
            continue
        b = position.get(("B", mb, unit))
        copies = {a for a in ops[f].inputs if a.tier == "device" and a.shard.state in ("param", "param_full")}
        if b is None or not copies <= set(ops[b].inputs) or any(_touches(op, copies) for op in ops[f + 1 : b]):
            risky.add((mb, unit))
    return frozenset(risky)


def _touches(op: Op, copies: set[Access]) -> bool:
    """Whether ``op`` frees or writes one of ``copies`` (another shard can only take their bytes after a Free)."""
    if isinstance(op, Free):
        return Access(op.shard, op.tier, op.slot) in copies
    return any(a in copies for a in op.outputs)
