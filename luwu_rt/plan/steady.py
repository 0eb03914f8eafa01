"""Steady-state plans: a step planned as one period of a repeating schedule.

[Note: steady state]
A plan starts and ends with every persistent shard at its home and nothing
else resident ([Note: step boundaries] in planner.py), so one plan runs step
after step. Run strictly one after the other, though, the disk idles at both
ends of each step: the last units' updated state is still being written back
while the compute waits for the step to end, and the next step's first loads
wait for that. So a step's plan is also one period of a pipeline:

* its **tail** (``SwapPlan.tail``): the write-backs and frees that no other
  kind of op waits for. A run may return once everything else is done (the
  step's loss, norm and updates are in), leaving the tail running;
* its **wrap dependencies** (``SwapPlan.wrap_deps``): for each op, the ops of
  the previous period it must wait for when that period's tail is still
  running. They are derived from the plan itself (``wrap_deps``): an op that
  places a copy in arena bytes the plan has not used yet this period waits for
  the previous period's last ``Free`` of those bytes; the first read of a home
  copy waits for the previous period's last write of it, and the first write
  for that write and the reads after it. Everything else is ordered within the
  period, or by a queue's own order (a queue runs one period's ops and then the
  next's).

The next period's first loads, its forward and its prefetches then run while
the previous tail is written back, within the budgets: the periods share the
arenas, and no byte is used by both at once. A double-buffered plan
([Note: speculative updates] in sequence.py) alternates with its mirror, so its
next period is the mirror (``partner``). The validator replays two periods
back to back with only these dependencies between them (``periods``): a plan
whose wrap-around races is rejected like any other racing plan. A period runs
after another only when the previous one was a period of the same pipeline;
the first step, and a step after a checkpoint or an evaluation (which wait for
the tail), start cold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from .halves import mirror
from .ops import Free, Op, ShardId, Store, SwapPlan, Wait
from .spec import SECOND_HALF

__all__ = ["partner", "periods", "steady", "tail_ops", "wrap_deps"]


def tail_ops(plan: SwapPlan) -> frozenset[int]:
    """Indices of the ops no op other than a ``Store`` or ``Free`` depends on, directly or not: the write-backs and
    frees a run may leave running when it returns ([Note: steady state])."""
    needed = [False] * len(plan.ops)
    for i in reversed(range(len(plan.ops))):
        op = plan.ops[i]
        if needed[i] or not isinstance(op, (Store, Free)):
            for d in op.deps:
                needed[d] = True
    return frozenset(i for i, n in enumerate(needed) if not n and isinstance(plan.ops[i], (Store, Free)))


def partner(plan: SwapPlan) -> SwapPlan:
    """The plan of the period after ``plan``: its mirror when the optimizer state is double-buffered (the halves
    take turns), else ``plan`` itself."""
    return mirror(plan) if any(s.state in SECOND_HALF.values() for s in plan.shards) else plan


class _Bytes:
    """Per arena byte, the last op that freed it: a sorted list of ``(start, end, op)`` runs."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int]] = []

    def set(self, start: int, end: int, op: int) -> None:
        kept = [r for r in self.runs if r[1] <= start or r[0] >= end]
        kept += [(a, start, f) for a, b, f in self.runs if a < start < b]
        kept += [(end, b, f) for a, b, f in self.runs if a < end < b]
        kept.append((start, end, op))
        self.runs = sorted(kept)

    def overlapping(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        return ((max(a, start), min(b, end), f) for a, b, f in self.runs if a < end and start < b)


class _Homes:
    """Whether a copy is the home copy of a shard that outlives the step."""

    def __init__(self, plan: SwapPlan) -> None:
        self.kinds, self.homes = plan.persistent_kinds, plan.homes

    def __call__(self, shard: ShardId, tier: str) -> bool:
        return shard.state in self.kinds and self.homes[shard.state] == tier


def _end_state(prev: SwapPlan) -> tuple[dict[str, _Bytes], dict[ShardId, int], dict[ShardId, list[int]]]:
    """What ``prev`` leaves for the next period: per arena the last ``Free`` of every byte it used, and per
    persistent shard the last write of its home copy and the reads of that version."""
    freed = {t: _Bytes() for t in prev.arena_bytes}
    is_home = _Homes(prev)
    writer: dict[ShardId, int] = {}
    readers: dict[ShardId, list[int]] = {}
    for i, op in enumerate(prev.ops):
        if isinstance(op, Free):
            if op.tier in freed:
                freed[op.tier].set(op.slot, op.slot + prev.shards[op.shard].nbytes, i)
            continue
        for acc in op.inputs:
            if is_home(acc.shard, acc.tier) and not isinstance(op, Wait):
                readers.setdefault(acc.shard, []).append(i)
        for acc in op.outputs:
            if is_home(acc.shard, acc.tier):
                writer[acc.shard], readers[acc.shard] = i, []
    return freed, writer, readers


def wrap_deps(prev: SwapPlan, nxt: SwapPlan) -> tuple[tuple[int, ...], ...]:
    """For each op of ``nxt``, the ops of ``prev`` it waits for when ``nxt`` runs right after ``prev`` with
    ``prev``'s tail still running ([Note: steady state])."""
    freed, writer, readers = _end_state(prev)
    is_home = _Homes(nxt)
    used: dict[str, _Bytes] = {t: _Bytes() for t in nxt.arena_bytes}  # bytes this period has placed a copy in
    live = {(s, nxt.homes[s.state]) for s in nxt.home_slots}
    written: set[ShardId] = set()
    out: list[tuple[int, ...]] = []
    for op in nxt.ops:
        deps: set[int] = set()
        if isinstance(op, Free):
            live.discard((op.shard, op.tier))
            out.append(())
            continue
        for acc in op.consumes:
            live.discard((acc.shard, acc.tier))
        for acc in op.inputs:
            if is_home(acc.shard, acc.tier) and acc.shard not in written and acc.shard in writer:
                deps.add(writer[acc.shard])
        for acc in op.outputs:
            if is_home(acc.shard, acc.tier) and acc.shard not in written:
                written.add(acc.shard)
                deps.update(readers.get(acc.shard, ()))
                if acc.shard in writer:
                    deps.add(writer[acc.shard])
            if (acc.shard, acc.tier) in live or acc.tier not in used:
                continue
            live.add((acc.shard, acc.tier))
            start, end = acc.slot, acc.slot + nxt.shards[acc.shard].nbytes
            for a, b in _gaps(used[acc.tier], start, end):  # bytes this period places its first copy in
                deps.update(f for _, _, f in freed[acc.tier].overlapping(a, b))
            used[acc.tier].set(start, end, 0)
        out.append(tuple(sorted(deps)))
    return tuple(out)


def _gaps(used: _Bytes, start: int, end: int) -> list[tuple[int, int]]:
    """The parts of ``[start, end)`` that no run of ``used`` covers."""
    gaps, pos = [], start
    for a, b, _ in used.overlapping(start, end):
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < end:
        gaps.append((pos, end))
    return gaps


def steady(plan: SwapPlan) -> SwapPlan:
    """``plan`` as one period of a pipeline ([Note: steady state]): its tail and wrap dependencies filled in (the
    latter against ``partner(plan)``, which shares them)."""
    return dataclasses.replace(plan, tail=tail_ops(plan), wrap_deps=wrap_deps(partner(plan), plan))


def periods(plan: SwapPlan, count: int = 2, *, barrier: bool = False) -> SwapPlan:
    """``count`` periods of ``plan``'s pipeline as one plan (``plan``, ``partner(plan)``, ``plan``, ...): each
    period's ops after the previous one's, waiting for it through the wrap dependencies only (``barrier``: and
    its first op of every queue also for every op of the previous period outside its tail, as a run that
    returns before the next one starts; for timing it). For validating the wrap-around and for the cost of a
    step in steady state."""
    assert plan.wrap_deps, "a plan of one step only (no wrap dependencies)"
    ops: list[Op] = []
    other = partner(plan)
    sinks = _sinks(plan)
    for k in range(count):
        period = plan if k % 2 == 0 else other
        base = len(ops)
        first_on: set[str] = set()
        for i, op in enumerate(period.ops):
            deps = [base + d for d in op.deps]
            if k:
                deps += [base - len(period.ops) + d for d in period.wrap_deps[i]]
                if barrier and op.queue not in first_on:
                    deps += [base - len(period.ops) + d for d in sinks]
            first_on.add(op.queue)
            changes = dict(deps=tuple(sorted(set(deps))))
            if isinstance(op, Wait):
                changes["start"] = base + op.start
            ops.append(dataclasses.replace(op, **changes))
    return dataclasses.replace(plan, ops=tuple(ops), tail=frozenset(), wrap_deps=())


def _sinks(plan: SwapPlan) -> list[int]:
    """The ops outside the tail that no op outside the tail depends on: every op a run waits for before it returns
    is one of them or an ancestor of one."""
    depended = {d for i, op in enumerate(plan.ops) if i not in plan.tail for d in op.deps}
    return [i for i in range(len(plan.ops)) if i not in plan.tail and i not in depended]
