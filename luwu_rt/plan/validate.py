"""Invariant checker for ``SwapPlan``: replays a plan and rejects it at the first op that
breaks one of the rules of [Note: plan semantics] (ops.py).

Checked for every op, in plan order and - because an executor runs ops as soon as
their dependencies allow - also against the dependency graph:

* budgets: bytes on each tier never exceed its budget (device: reserve included);
* residency: every input is a copy holding the shard's latest version;
* no read while written: an input's writer is an ancestor of the reader, and a write
  waits for every read of the version it overwrites;
* persistence: a ``Free`` never drops the only up-to-date copy of a shard that is
  persistent or read again later, and the step ends with every persistent shard's
  latest version in its home slot and nothing else resident;
* arenas: every copy lies inside its arena, no two live copies overlap, and a copy
  reusing freed bytes depends on the ``Free`` that released them;
* collectives ([Note: collectives as start and wait] in ops.py): every start has
  the inputs and outputs its kind needs and exactly one ``Wait`` on its queue with
  the same accesses; nothing but that wait reads an output in flight; each
  communication queue issues only the collectives of the one group it owns.

``validate_ranks`` checks in addition that the plans of all ranks issue each
process group's collectives in the same sequence.
"""

from __future__ import annotations

import bisect

from .ops import (COMM_QUEUES, Collective, Free, Gather, Load, NormReduce, Op, Pull, Push, Recv, Reduce, Serve, ShardId,
                  Store, SwapPlan, Wait)
from .sequence import group_members
from .steady import periods
from .sizes import format_size
from .spec import TIERS

__all__ = ["PlanError", "validate", "validate_ranks"]


class PlanError(ValueError):
    """A plan breaks an invariant; the message names the op and the rule."""


_NEEDS = {Reduce: "io", Gather: "io", NormReduce: "io", Push: "i", Serve: "i", Pull: "o", Recv: "o"}
"""What each collective must have: inputs (``i``), outputs (``o``)."""


class _Copy:
    __slots__ = ("version", "slot", "writer", "readers", "in_flight")

    def __init__(self, version: int, slot: int | None, writer: int | None) -> None:
        self.version, self.slot, self.writer = version, slot, writer
        self.readers: list[int] = []
        self.in_flight: int | None = None
        """The collective start writing this copy until its wait."""


class _Replay:
    def __init__(self, plan: SwapPlan) -> None:
        self.plan = plan
        self.persistent = plan.persistent_kinds
        self.copies: dict[tuple[ShardId, str], _Copy] = {}
        self.latest: dict[ShardId, int] = dict.fromkeys(plan.shards, 0)
        self.used = dict.fromkeys(TIERS, 0)
        self.live: dict[str, dict[int, tuple[int, ShardId]]] = {"device": {}, "host": {}}
        self.freed: dict[str, list[tuple[int, int, int]]] = {"device": [], "host": []}
        self.anc: list[int] = []
        # Per shard, the ops that access it and whether they read it: a value is needed while the
        # next access reads it (a pure overwrite, such as a workspace gathered again, does not).
        self.accesses: dict[ShardId, list[tuple[int, bool]]] = {}
        for i, op in enumerate(plan.ops):
            reads = {a.shard for a in op.inputs}
            for shard in dict.fromkeys([a.shard for a in op.inputs + op.outputs]):
                self.accesses.setdefault(shard, []).append((i, shard in reads))
        self.unwaited: dict[int, Collective] = {}
        self.op_index = -1

    def fail(self, message: str) -> PlanError:
        if self.op_index < 0:
            return PlanError(f"initial state: {message}")
        op = self.plan.ops[self.op_index]
        return PlanError(f"op {self.op_index} ({op.kind} on {op.queue}): {message}")

    def before(self, dep: int | None) -> bool:
        """Whether op ``dep`` must finish before the current op starts."""
        return dep is None or bool((self.anc[self.op_index] >> dep) & 1)

    def budget(self, tier: str) -> int | None:
        b = self.plan.budgets.of(tier)
        if b is not None and tier == "device":
            b -= self.plan.device_reserve_bytes
        return b

    # -- copies ---------------------------------------------------------------------------
    def add(self, shard: ShardId, tier: str, slot: int | None, version: int, writer: int | None) -> _Copy:
        nbytes = self.plan.shards[shard].nbytes
        cap = self.budget(tier)
        if cap is not None and self.used[tier] + nbytes > cap:
            raise self.fail(f"{tier} would hold {format_size(self.used[tier] + nbytes)}, over its budget "
                            f"{format_size(cap)} (placing {shard})")
        self.used[tier] += nbytes
        if tier != "nvme":
            self._place(shard, tier, slot, nbytes)
        copy = self.copies[(shard, tier)] = _Copy(version, slot, writer)
        return copy

    def _place(self, shard: ShardId, tier: str, slot: int | None, nbytes: int) -> None:
        arena = self.plan.arena_bytes[tier]
        if slot is None or slot < 0 or slot + nbytes > arena:
            raise self.fail(f"{shard} on {tier} at slot {slot} does not lie inside the {arena}-byte arena")
        end = slot + nbytes
        for start, (stop, other) in self.live[tier].items():
            if start < end and slot < stop:
                raise self.fail(f"{shard} at {tier}[{slot}:{end}] overlaps live {other} at [{start}:{stop}]")
        kept = []
        for start, stop, free_op in self.freed[tier]:
            if start < end and slot < stop:
                if not self.before(free_op):
                    raise self.fail(f"{shard} reuses {tier}[{max(start, slot)}:{min(stop, end)}] without "
                                    f"depending on op {free_op}, the Free that released it")
                # The part under the new copy is now guarded by that copy's own Free.
                kept += [(a, b, free_op) for a, b in ((start, slot), (end, stop)) if a < b]
            else:
                kept.append((start, stop, free_op))
        self.freed[tier] = kept
        self.live[tier][slot] = (end, shard)

    def drop(self, shard: ShardId, tier: str) -> None:
        copy = self.copies.pop((shard, tier))
        self.used[tier] -= self.plan.shards[shard].nbytes
        if tier != "nvme":
            end, _ = self.live[tier].pop(copy.slot)
            self.freed[tier].append((copy.slot, end, self.op_index))

    def resident(self, shard: ShardId, tier: str, slot: int | None) -> _Copy:
        copy = self.copies.get((shard, tier))
        if copy is None:
            raise self.fail(f"{shard} is not resident on {tier}")
        if copy.slot != slot:
            raise self.fail(f"{shard} on {tier} lives at slot {copy.slot}, not {slot}")
        return copy

    # -- ops ------------------------------------------------------------------------------
    def step(self, i: int, op: Op) -> None:
        self.op_index = i
        anc = 0
        for d in op.deps:
            if not 0 <= d < i:
                raise self.fail(f"dependency {d} is not an earlier op")
            anc |= self.anc[d] | (1 << d)
        self.anc.append(anc)
        if isinstance(op, Free):
            return self.free(op)
        self.check_collective(i, op)
        versions = []
        for acc in op.inputs:
            copy = self.resident(acc.shard, acc.tier, acc.slot)
            if copy.version != self.latest[acc.shard]:
                raise self.fail(f"input {acc.shard} on {acc.tier} is stale (version {copy.version}, "
                                f"latest {self.latest[acc.shard]})")
            if not self.before(copy.writer):
                raise self.fail(f"reads {acc.shard} on {acc.tier} while op {copy.writer} may still be writing it")
            if copy.in_flight is not None and not (isinstance(op, Wait) and op.start == copy.in_flight):
                raise self.fail(f"reads {acc.shard} on {acc.tier} while collective op {copy.in_flight} is writing "
                                f"it; depend on its Wait")
            versions.append(copy.version)
        if isinstance(op, (Load, Store)):
            self.check_move(op)
        if op.consumes:
            self.consume(op)
        for acc in op.inputs:
            if acc not in op.consumes:
                self.copies[(acc.shard, acc.tier)].readers.append(i)
        for acc in op.outputs:
            self.write(acc, versions[0] if isinstance(op, (Load, Store)) else self.latest[acc.shard] + 1)
            self.copies[(acc.shard, acc.tier)].in_flight = i if isinstance(op, Collective) else None

    def consume(self, op: Op) -> None:
        """The op takes over the bytes of its consumed inputs for outputs at the same slots ([Note: taking over
        a copy] in ops.py): each goes without a ``Free``, once nothing else may use it."""
        for acc in op.consumes:
            if acc not in op.inputs or not any(o.tier == acc.tier and o.slot == acc.slot and
                                               self.plan.shards[o.shard].nbytes == self.plan.shards[acc.shard].nbytes
                                               for o in op.outputs):
                raise self.fail(f"consumes {acc.shard} on {acc.tier}, which is not one of its inputs with an output of "
                                f"the same size in its bytes")
            if acc.tier == self.plan.homes[acc.shard.state]:
                raise self.fail(f"consumes the home copy of {acc.shard} on {acc.tier}")
            copy = self.copies[(acc.shard, acc.tier)]
            racing = [r for r in copy.readers + [copy.writer] if not self.before(r)]
            if racing:
                raise self.fail(f"consumes {acc.shard} on {acc.tier} while op(s) {racing} may still use it")
            others = [t for (s, t), c in self._copies_of(acc.shard) if t != acc.tier and c.version == copy.version]
            if not others:
                raise self.fail(f"consumes the only up-to-date copy of {acc.shard} (on {acc.tier})")
            self.copies.pop((acc.shard, acc.tier))
            self.used[acc.tier] -= self.plan.shards[acc.shard].nbytes
            if acc.tier != "nvme":
                self.live[acc.tier].pop(acc.slot)  # the output takes these bytes now: no Free to wait for

    def check_collective(self, i: int, op: Op) -> None:
        """A start has what its kind needs and runs on the queue of its group; a wait matches one start."""
        groups = self.plan.comm_groups
        if isinstance(op, Collective):
            needs = _NEEDS[type(op)]
            if ("i" in needs and not op.inputs) or ("o" in needs and not op.outputs):
                raise self.fail(f"a {op.kind} needs {' and '.join({'i': 'inputs', 'o': 'outputs'}[c] for c in needs)}")
            if op.collective == "local":
                if op.group or op.queue in COMM_QUEUES:
                    raise self.fail("a local reduction belongs to no group and runs on no communication queue")
            elif groups.get(op.queue) != op.group:
                raise self.fail(f"a collective over {op.group!r} on queue {op.queue}, whose process group spans "
                                f"{groups.get(op.queue)!r}: each queue issues the collectives of its own group")
            self.unwaited[i] = op
        elif isinstance(op, Wait):
            start = self.unwaited.pop(op.start, None)
            if start is None:
                raise self.fail(f"waits for op {op.start}, which is not an unwaited collective start")
            if op.queue != start.queue or op.inputs != start.inputs or op.outputs != start.outputs \
                    or not self.before(op.start):
                raise self.fail(f"the wait of op {op.start} must run on its queue, list its accesses and depend on it")

    def check_move(self, op: Load | Store) -> None:
        a, b = TIERS.index(op.src), TIERS.index(op.dst)
        if abs(a - b) != 1 or (b < a) != isinstance(op, Load) or op.inputs[0].shard != op.outputs[0].shard:
            raise self.fail(f"{op.kind} from {op.src} to {op.dst} is not a one-tier move of one shard in its direction")
        if op.nbytes != self.plan.shards[op.shard].nbytes:
            raise self.fail(f"moves {op.nbytes} bytes of {op.shard}, which has {self.plan.shards[op.shard].nbytes}")

    def write(self, acc, version: int) -> None:
        copy = self.copies.get((acc.shard, acc.tier))
        if copy is None:
            copy = self.add(acc.shard, acc.tier, acc.slot, version, self.op_index)
        else:
            if copy.slot != acc.slot:
                raise self.fail(f"writes {acc.shard} on {acc.tier} at slot {acc.slot}, but it lives at {copy.slot}")
            waits = [r for r in copy.readers if r != self.op_index] + [copy.writer]
            racing = [r for r in waits if not self.before(r)]
            if racing:
                raise self.fail(f"overwrites {acc.shard} on {acc.tier} while op(s) {racing} may still use it")
            copy.version, copy.writer, copy.readers = version, self.op_index, []
        self.latest[acc.shard] = max(self.latest[acc.shard], version)

    def free(self, op: Free) -> None:
        copy = self.resident(op.shard, op.tier, op.slot)
        racing = [r for r in copy.readers + [copy.writer] if not self.before(r)]
        if racing:
            raise self.fail(f"frees {op.shard} on {op.tier} while op(s) {racing} may still use it")
        latest = self.latest[op.shard]
        needed = op.shard.state in self.persistent or self._read_next(op.shard)
        others = [t for (s, t), c in self._copies_of(op.shard) if t != op.tier and c.version == latest]
        if needed and copy.version == latest and not others:
            raise self.fail(f"drops the only up-to-date copy of {op.shard} (on {op.tier}) before it was persisted")
        self.drop(op.shard, op.tier)

    def _read_next(self, shard: ShardId) -> bool:
        """Whether the next op that accesses ``shard`` after the current one reads its value."""
        events = self.accesses.get(shard, [])
        k = bisect.bisect_right(events, (self.op_index, True))
        return k < len(events) and events[k][1]

    def _copies_of(self, shard: ShardId):
        return (((shard, t), self.copies[(shard, t)]) for t in TIERS if (shard, t) in self.copies)

    def finish(self) -> None:
        self.op_index = len(self.plan.ops)
        self.anc.append(0)
        if self.unwaited:
            raise PlanError(f"end of plan: collective op(s) {sorted(self.unwaited)} are never waited for")

        for shard in self.plan.shards:
            home = self.plan.homes[shard.state]
            for (_, tier), copy in self._copies_of(shard):
                if tier != home or shard.state not in self.persistent:
                    raise PlanError(f"end of plan: {shard} is still resident on {tier}; a step must end with "
                                    f"only home copies so that the next step starts from the same state")
            if shard.state in self.persistent:
                copy = self.copies.get((shard, home))
                if copy is None or copy.version != self.latest[shard]:
                    raise PlanError(f"end of plan: the latest version of {shard} never reached its home on {home}")


def validate(plan: SwapPlan) -> None:
    """Raise ``PlanError`` at the first op of ``plan`` that breaks an invariant; for a plan that is one period of
    a pipeline ([Note: steady state] in steady.py), also at the first op of two periods run back to back that
    does."""
    _replay(plan)
    if plan.wrap_deps or plan.tail:
        _check_tail(plan)
        try:
            _replay(periods(plan, 2))
        except PlanError as exc:
            raise PlanError(f"wrap-around into the next period (ops {len(plan.ops)}.. are the next period's): "
                            f"{exc}") from None


def _replay(plan: SwapPlan) -> None:
    for tier, nbytes in plan.arena_bytes.items():
        limit = plan.budgets.arena_limit(tier)
        if limit is not None and nbytes > limit:
            raise PlanError(f"the {tier} arena spans {format_size(nbytes)}, over its limit {format_size(limit)}")
    replay = _Replay(plan)
    for shard, slot in plan.home_slots.items():
        replay.add(shard, plan.homes[shard.state], slot, 0, None)
    for i, op in enumerate(plan.ops):
        replay.step(i, op)
    replay.finish()


def _check_tail(plan: SwapPlan) -> None:
    """A run returns before its tail has run, and the next step's handlers start while it does: only write-backs
    and frees, which call no handler, may be in it."""
    if len(plan.wrap_deps) != len(plan.ops):
        raise PlanError(f"{len(plan.wrap_deps)} lists of wrap dependencies for {len(plan.ops)} ops")
    for i in plan.tail:
        if not isinstance(plan.ops[i], (Store, Free)):
            raise PlanError(f"op {i} ({plan.ops[i].kind}) is in the tail: only Store and Free ops may be")


def _signature(op: Collective, plan: SwapPlan) -> tuple:
    sizes = tuple(plan.shards[a.shard].numel for a in op.inputs + op.outputs)
    return (op.kind, op.collective, op.unit, op.group_size, op.comm_bytes, sizes)


def validate_ranks(plans: list[SwapPlan]) -> None:
    """``validate`` every rank's plan (``plans[r]`` is rank ``r``'s), then check that the ranks of each
    process group issue its collectives in the same sequence, so no order of arrival can deadlock
    or mismatch them."""
    for plan in plans:
        validate(plan)
    for rank, plan in enumerate(plans):
        if plan.comm_groups != plans[0].comm_groups:
            raise PlanError(f"rank {rank} uses communication queues {dict(plan.comm_groups)}, rank 0 "
                            f"{dict(plans[0].comm_groups)}")
        for queue, group in plan.comm_groups.items():
            mine = [_signature(op, plan) for op in plan.ops if isinstance(op, Collective) and op.queue == queue]
            for other in group_members(plan.strategy, group, rank):
                theirs = [_signature(op, plans[other]) for op in plans[other].ops
                          if isinstance(op, Collective) and op.queue == queue]
                if mine != theirs:
                    at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                    raise PlanError(f"ranks {rank} and {other} issue different collectives on group {group!r} "
                                    f"(queue {queue}) at its collective #{at}: "
                                    f"{mine[at] if at < len(mine) else 'none'} vs "
                                    f"{theirs[at] if at < len(theirs) else 'none'}")
