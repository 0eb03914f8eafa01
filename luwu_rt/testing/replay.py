"""A simulated step replayed against the plan's accesses: races, and the bytes each tier holds over time.

[Note: races in virtual time]
``validate`` proves from the dependency graph that no order an executor may
pick can go wrong. The simulation checks the order it did pick: it replays the
ops in plan order, as ``validate`` does, keeping for every copy (shard, tier,
slot) the op that wrote its current version and the ops that read it, and for
every freed range of an arena when it was freed - and compares their simulated
times. An op's data is read and written during its work, between its start
and end; a collective's outputs are complete only when its ``Wait`` ends. A
run fails (``RaceError``, naming both ops) when:

* an op reads a copy before the op writing that version ends, or after that
  op failed or never ran (a wrong read);
* an op overwrites a copy, or a ``Free`` releases it, while an op that read or
  wrote its previous version is still working;
* an op writes a new copy into arena bytes before the ``Free`` of what held
  them happened.

Chaos moves ops in time as far as the dependencies allow, so that a missing one
shows up as one of these. A queue runs its ops one at a time in plan order, so
ops of one queue never race here even where ``validate``, which asks for a
dependency between them, rejects the plan.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

from luwu_rt.plan import Collective, Free, PlanError, ShardId, SwapPlan, Wait
from luwu_rt.plan.cost import Timeline

__all__ = ["RaceError", "Replay", "replay"]

_INF = math.inf


class RaceError(PlanError):
    """A simulated step read or overwrote bytes at the wrong time ([Note: races in virtual time]): the
    message names both ops; the plan lacks a dependency between them."""


class Replay(NamedTuple):
    peak_bytes: dict[str, int]
    """Most bytes each tier held at any instant of the simulated step (device: the reserve included)."""


class _Freed:
    """Disjoint freed byte ranges of one arena, sorted, each with when and by which ``Free`` it was freed."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.info: list[tuple[float, int]] = []

    def take(self, a: int, b: int) -> list[tuple[float, int]]:
        """The (time, free op) of every freed range overlapping ``[a, b)``; those bytes are no longer free."""
        k = bisect.bisect_right(self.ends, a)
        hit, keep = [], []
        while k < len(self.starts) and self.starts[k] < b:
            s, e, info = self.starts.pop(k), self.ends.pop(k), self.info.pop(k)
            hit.append(info)
            keep += [(x, y, info) for x, y in ((s, a), (b, e)) if x < y]
        for x, y, info in keep:
            self.add(x, y, info)
        return hit

    def add(self, a: int, b: int, info: tuple[float, int]) -> None:
        k = bisect.bisect_left(self.starts, a)
        self.starts.insert(k, a)
        self.ends.insert(k, b)
        self.info.insert(k, info)


class _Copy:
    __slots__ = ("slot", "writer", "readers")

    def __init__(self, slot: int | None, writer: int | None) -> None:
        self.slot, self.writer = slot, writer
        self.readers: list[int] = []


class _Replayer:
    def __init__(self, plan: SwapPlan, run: Timeline, rank: int) -> None:
        self.plan, self.ops, self.rank = plan, plan.ops, rank
        self.start, self.end, self.done = run.start, run.end, run.done
        self.copies: dict[tuple[ShardId, str], _Copy] = {}
        self.freed = {"device": _Freed(), "host": _Freed()}
        self.events: dict[str, list[tuple[float, int]]] = {"device": [], "host": [], "nvme": []}
        self.wait_of = {op.start: i for i, op in enumerate(plan.ops) if isinstance(op, Wait)}

    def name(self, i: int) -> str:
        op = self.ops[i]
        label = getattr(op, "name", "") or (f" unit {op.unit}" if hasattr(op, "unit") else "")
        return f"op {i} ({op.kind}{' ' + label.strip() if label.strip() else ''} on {op.queue})"

    def race(self, message: str) -> RaceError:
        return RaceError(f"rank {self.rank}: {message}; the plan lacks a dependency between them")

    def ready_at(self, w: int) -> float:
        """When the version op ``w`` writes is complete: its end, its ``Wait``'s for a collective, never if
        it failed or never ran."""
        if self.done[w] == _INF:
            return _INF
        if isinstance(self.ops[w], Collective):
            wait = self.wait_of.get(w)
            return _INF if wait is None else self.ready_at(wait)
        return self.end[w]

    def run(self) -> Replay:
        for shard, slot in self.plan.home_slots.items():
            tier = self.plan.homes[shard.state]
            self.copies[(shard, tier)] = _Copy(slot, None)
            self.events[tier].append((0.0, self.plan.shards[shard].nbytes))
        for i, op in enumerate(self.ops):
            if isinstance(op, Free):
                self.free(i, op)
            elif self.start[i] == _INF:  # never ran: its outputs hold nothing valid
                for acc in op.outputs:
                    self.write(i, acc.shard, acc.tier, acc.slot, ran=False)
            else:
                for acc in op.inputs:
                    self.read(i, op, acc.shard, acc.tier)
                for acc in op.outputs:
                    self.write(i, acc.shard, acc.tier, acc.slot, ran=True)
        return Replay(peak_bytes=self.peaks())

    def read(self, i: int, op, shard: ShardId, tier: str) -> None:
        copy = self.copies.get((shard, tier))
        if copy is None:
            later = next((j for j in range(i + 1, len(self.ops)) if any(
                a.shard == shard and a.tier == tier for a in self.ops[j].outputs)), None)
            if later is None:
                raise PlanError(f"rank {self.rank}: {self.name(i)} reads {shard} on {tier}, which no op writes")
            raise self.race(f"{self.name(i)} reads {shard} on {tier} at {self.start[i]:.6g} s, before "
                            f"{self.name(later)} writes it")
        w = copy.writer
        if w is not None and not (isinstance(op, Wait) and op.start == w):
            ready = self.ready_at(w)
            if self.start[i] < ready:
                when = "which never completes (it failed or depends on a failure)" if ready == _INF \
                    else f"which completes only at {ready:.6g} s"
                raise self.race(f"{self.name(i)} reads {shard} on {tier} at {self.start[i]:.6g} s, written by "
                                f"{self.name(w)}, {when}")
        copy.readers.append(i)

    def write(self, i: int, shard: ShardId, tier: str, slot: int | None, *, ran: bool) -> None:
        copy = self.copies.get((shard, tier))
        if copy is None:
            copy = self.copies[(shard, tier)] = _Copy(slot, i)
            if ran:
                self.allocate(i, shard, tier, slot)
            return
        if ran:
            for p in copy.readers + ([copy.writer] if copy.writer is not None else []):
                if p != i and self.start[p] != _INF and self.end[p] > self.start[i]:
                    raise self.race(f"{self.name(i)} overwrites {shard} on {tier} at {self.start[i]:.6g} s while "
                                    f"{self.name(p)} still uses it until {self.end[p]:.6g} s")
        copy.writer, copy.readers = i, []

    def allocate(self, i: int, shard: ShardId, tier: str, slot: int | None) -> None:
        nbytes = self.plan.shards[shard].nbytes
        self.events[tier].append((self.start[i], nbytes))
        if tier not in self.freed or slot is None:
            return
        for when, f in self.freed[tier].take(slot, slot + nbytes):
            if when > self.start[i]:
                at = "never (it did not run)" if when == _INF else f"only at {when:.6g} s"
                raise self.race(f"{self.name(i)} writes {shard} into {tier}[{slot}:{slot + nbytes}] at "
                                f"{self.start[i]:.6g} s, bytes that {self.name(f)} frees {at}")

    def free(self, i: int, op: Free) -> None:
        copy = self.copies.pop((op.shard, op.tier), None)
        if copy is None:
            raise PlanError(f"rank {self.rank}: {self.name(i)} frees {op.shard} on {op.tier}, which is not resident")
        when = self.done[i]
        for p in copy.readers + ([copy.writer] if copy.writer is not None else []):
            if self.start[p] != _INF and self.end[p] > when:
                raise self.race(f"{self.name(i)} frees {op.shard} on {op.tier} at {when:.6g} s while "
                                f"{self.name(p)} still uses it until {self.end[p]:.6g} s")
        if when != _INF:
            self.events[op.tier].append((when, -self.plan.shards[op.shard].nbytes))
        if op.tier in self.freed and copy.slot is not None:
            nbytes = self.plan.shards[op.shard].nbytes
            self.freed[op.tier].take(copy.slot, copy.slot + nbytes)
            self.freed[op.tier].add(copy.slot, copy.slot + nbytes, (when, i))

    def peaks(self) -> dict[str, int]:
        out = {}
        for tier, events in self.events.items():
            held = peak = 0
            for _, delta in sorted(events):  # at one instant, releases (negative) before allocations
                held += delta
                peak = max(peak, held)
            out[tier] = peak
        out["device"] += self.plan.device_reserve_bytes
        return out


def replay(plan: SwapPlan, run: Timeline, *, rank: int = 0) -> Replay:
    """Replays rank ``rank``'s simulated step ``run`` of ``plan``: raises ``RaceError`` at the first race
    ([Note: races in virtual time]), else returns the bytes each tier held at its fullest."""
    return _Replayer(plan, run, rank).run()
