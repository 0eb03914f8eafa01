"""``simulate``: run any plan on simulated tiers in virtual time.

[Note: simulating ranks]
One plan: every peer is taken to run the same plan at the same times (the
cost model's assumption, exact for ranks without chaos or faults of their own:
``plan_step`` plans are rank-independent), so a collective starts when this
rank issues it and a 64-rank step costs one rank's simulation. A list of plans,
one per rank of the world (``[plan] * world_size`` for the planner's): every
rank is simulated, each with its own chaos draws and faults, and a collective
of a group starts when the last member issued it and ends with its slowest
member - which is how one stalled rank delays the others. Without chaos and
faults both give ``estimate``'s step time exactly: they share its simulation
([Note: one model of time] in plan/cost.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

from luwu_rt.plan import HardwareProfile, SwapPlan, format_size, op_seconds
from luwu_rt.plan.cost import Disturbance, Timeline, couple, step_cost, step_seconds, timelines
from luwu_rt.testing.faults import Fault, disturbance, held_op
from luwu_rt.testing.replay import replay
from luwu_rt.testing.timeline import read_timeline, spans

__all__ = ["RankResult", "SimResult", "simulate"]

_INF = math.inf


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType({k: MappingProxyType(dict(v)) if isinstance(v, Mapping) else v
                             for k, v in mapping.items()})


@dataclass(frozen=True, kw_only=True, slots=True)
class RankResult:
    """One simulated rank's step."""

    rank: int
    plan: SwapPlan = field(repr=False)
    timeline: Timeline = field(repr=False)
    """Per op: ``start``, ``end`` of its work and ``done`` (``inf``: failed or lost), seconds from the step's start."""
    delays_s: Sequence[tuple[float, float]] | None = field(repr=False)
    """Chaos delays (before, after) per op; ``None`` without chaos."""
    step_s: float
    """Step time of this rank: its last op's completion, at least its disk's busy time ([Note: one disk])."""
    busy_s: Mapping[str, float]
    """Seconds of work per queue."""
    stall_s: Mapping[str, float]
    """Seconds each queue sat idle with its next op waiting for a dependency or a peer."""
    stalled_on: Mapping[str, Mapping[str, float]]
    """queue -> what it waited for (a queue, or ``peers``) -> seconds."""
    peak_bytes: Mapping[str, int]
    """Most bytes each tier held at any instant (device: the activation reserve included)."""
    moved_bytes: Mapping[str, Mapping[str, int]]
    """tier -> {"read", "write"}: bytes the completed moves took out of and put into it."""
    failed: tuple[int, ...]
    """Ops whose work failed (``ShardIOError``)."""
    lost: tuple[int, ...] = field(repr=False)
    """Ops that never ran because something they depend on failed (or, across ranks, a peer's did)."""
    critical_path: tuple[int, ...] = field(repr=False)
    """Ops from the step's start to its last completion, each waiting on the one before (dependency or queue)."""

    def __post_init__(self) -> None:
        for name in ("busy_s", "stall_s", "stalled_on", "peak_bytes", "moved_bytes"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """A simulated step. The per-queue and per-tier figures are those of the slowest rank (``rank``);
    ``ranks`` holds every simulated rank's."""

    step_s: float
    """Step time: the slowest simulated rank's (equals ``estimate(...).predicted_step_s`` without chaos or
    faults)."""
    ranks: tuple[RankResult, ...]
    synced: bool
    """Every rank simulated, collectives synchronised ([Note: simulating ranks]); else peers symmetric."""
    chaos_seed: int | None
    chaos_max_delay_s: float

    @property
    def rank(self) -> int:
        """The slowest rank (the first of them on a tie)."""
        return max(self.ranks, key=lambda r: r.step_s).rank

    def _slowest(self) -> RankResult:
        return self.ranks[self.rank]

    @property
    def busy_s(self) -> Mapping[str, float]:
        return self._slowest().busy_s

    @property
    def stall_s(self) -> Mapping[str, float]:
        return self._slowest().stall_s

    @property
    def peak_bytes(self) -> Mapping[str, int]:
        return self._slowest().peak_bytes

    @property
    def moved_bytes(self) -> Mapping[str, Mapping[str, int]]:
        return self._slowest().moved_bytes

    @property
    def critical_path(self) -> tuple[int, ...]:
        return self._slowest().critical_path

    @property
    def bottleneck(self) -> str:
        """The queue with the most work on the slowest rank."""
        busy = self.busy_s
        return max(busy, key=busy.__getitem__) if busy else "none"

    @property
    def ok(self) -> bool:
        """Every op of every rank completed."""
        return not any(r.failed or r.lost for r in self.ranks)

    @property
    def num_ops(self) -> int:
        return sum(len(r.plan.ops) for r in self.ranks)

    def spans(self, rank: int = 0) -> list:
        """Rank ``rank``'s ops that ran, as ``luwu_rt.exec.Span`` (what ``luwu train --trace`` records)."""
        return spans(self.ranks[rank].plan, self.ranks[rank].timeline)

    def write_trace(self, path) -> None:
        """Every simulated rank's timeline as Chrome trace JSON (Perfetto, chrome://tracing), in the format of
        ``luwu train --trace``: one process per rank, one track per queue."""
        from luwu_rt.exec.trace import write_rank_traces

        write_rank_traces([self.spans(r.rank) for r in self.ranks], path)

    def summary(self) -> str:
        """One screen: step time, work and stalls by queue, bytes per tier, the critical path, faults."""
        return _summary(self)


def _plans(plan: SwapPlan | Sequence[SwapPlan]) -> tuple[list[SwapPlan], bool]:
    if isinstance(plan, SwapPlan):
        return [plan], False
    plans = list(plan)
    if not plans or not all(isinstance(p, SwapPlan) for p in plans):
        raise ValueError("simulate takes a SwapPlan, or a list of them with one per rank")
    world = plans[0].strategy.world_size
    if len(plans) != world or any(p.strategy.world_size != world for p in plans):
        raise ValueError(f"simulate got {len(plans)} plans for a world of {world} ranks: give one plan per rank "
                         f"(e.g. [plan] * {world}), or a single plan to take its peers as symmetric")
    return plans, True


def _default_max_delay(plans: list[SwapPlan], profile: HardwareProfile) -> float:
    """The longest op of the plans: delays that long let any order the dependencies allow come out."""
    unique = {id(p): p for p in plans}.values()
    return max((op_seconds(op, profile, plan=p) for p in unique for op in p.ops), default=0.0)


def simulate(plan: SwapPlan | Sequence[SwapPlan], profile: HardwareProfile = HardwareProfile(), *,
             chaos_seed: int | None = None, chaos_max_delay_s: float | None = None,
             faults: Sequence[Fault] | None = None, node: SwapPlan | None = None) -> SimResult:
    """Run ``plan`` (a planner's or one built by hand) on simulated tiers in virtual time: each queue a
    stream, bandwidths, latencies and FLOP/s from ``profile``, no torch, no tensors.

    ``plan``: one plan, its peers taken as symmetric, or one plan per rank ([Note: simulating ranks]).
    ``chaos_seed``: random delays before and after every op, the executor's chaos draws in virtual time,
    of up to ``chaos_max_delay_s`` (default: the longest op), and one op held back until all that does
    not depend on it has finished ([Note: simulated chaos]): seeds ``0 .. n-1`` hold each of the ``n`` ops
    that take time once, and together find every missing dependency. ``faults``: ``SlowTier``, ``ShardIOError``,
    ``StallRank`` ([Note: simulated faults]). ``node``: the optimizer node's plan for a worker of strategy
    ``node``, simulated beside it as ``estimate(..., node=)`` does (one plan only).

    Raises ``RaceError`` (a ``PlanError``) naming both ops when the simulated order reads or overwrites
    bytes at the wrong time ([Note: races in virtual time]); a fault's failed and lost ops are reported in
    the result, not raised."""
    plans, synced = _plans(plan)
    if node is not None and synced:
        raise ValueError("simulate(..., node=) takes a single worker plan, whose peers are symmetric")
    if chaos_max_delay_s is not None and not 0 <= chaos_max_delay_s < _INF:
        raise ValueError(f"chaos_max_delay_s must be a non-negative number of seconds, got {chaos_max_delay_s}")
    max_delay = 0.0
    if chaos_seed is not None:
        max_delay = chaos_max_delay_s if chaos_max_delay_s is not None else _default_max_delay(plans, profile)
    disturb = disturbance(plans, faults=list(faults or ()), chaos_seed=chaos_seed, chaos_max_delay_s=max_delay)
    runs, node_run = _run(plans, profile, synced=synced, disturb=disturb, node=node)
    victim = held_op(plans, chaos_seed) if chaos_seed is not None else None
    if victim is not None:  # held until everything that does not wait for it has finished
        finished = max((t for run in runs for t in run.done if t != _INF), default=0.0)
        disturb = dataclasses.replace(disturb, hold_s={victim: 2 * finished + 1e-9})
        runs, node_run = _run(plans, profile, synced=synced, disturb=disturb, node=node)
    ranks = tuple(_rank_result(r, plans[r], runs[r], disturb) for r in range(len(plans)))
    step_s = max(r.step_s for r in ranks)
    if node_run is not None:  # the node's busiest queue bounds the step too, as in estimate
        step_s = max(step_s, step_cost(runs[0], node_run).predicted_step_s)
    return SimResult(step_s=step_s, ranks=ranks, synced=synced, chaos_seed=chaos_seed,
                     chaos_max_delay_s=max_delay)


def _run(plans: list[SwapPlan], profile: HardwareProfile, *, synced: bool, disturb: Disturbance | None,
         node: SwapPlan | None) -> tuple[tuple[Timeline, ...], Timeline | None]:
    if node is None:
        return timelines(plans, profile, synced=synced, disturbance=disturb), None
    worker, node_run = couple(plans[0], node, profile, disturbance=disturb)
    return (worker,), node_run


def _rank_result(rank: int, plan: SwapPlan, run: Timeline, disturb: Disturbance | None) -> RankResult:
    delays = disturb.delays_s.get(rank) if disturb is not None else None
    peak = replay(plan, run, rank=rank).peak_bytes  # raises RaceError first
    failing = disturb.failing if disturb is not None else frozenset()
    failed = tuple(i for i in range(len(plan.ops)) if (rank, i) in failing and run.start[i] != _INF)
    lost = tuple(i for i in range(len(plan.ops)) if run.start[i] == _INF)
    held = [i for r, i in disturb.hold_s if r == rank] if disturb is not None else []
    stall_s, stalled_on, path = read_timeline(plan, run, delays, held=held)
    return RankResult(rank=rank, plan=plan, timeline=run, delays_s=delays, step_s=step_seconds(run), busy_s=run.busy,
                      stall_s=stall_s, stalled_on=stalled_on, peak_bytes=peak, moved_bytes=run.io, failed=failed,
                      lost=lost, critical_path=path)


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _path_text(r: RankResult) -> str:
    path = r.critical_path
    if not path:
        return "critical path: empty (no op completed)"
    work: dict[str, float] = {}
    for i in path:
        q = r.plan.ops[i].queue
        if q != "mem":
            work[q] = work.get(q, 0.0) + r.timeline.end[i] - r.timeline.start[i]
    span = r.timeline.done[path[-1]]
    idle = max(span - sum(work.values()), 0.0)
    parts = [f"{q} {_seconds(s)} ({s / span:.0%})" for q, s in sorted(work.items(), key=lambda kv: -kv[1]) if span]
    if idle > 1e-12 and span:
        parts.append(f"delays/waits {_seconds(idle)} ({idle / span:.0%})")
    first, last = r.plan.ops[path[0]], r.plan.ops[path[-1]]
    return (f"critical path: {len(path)} ops, op {path[0]} ({first.kind} on {first.queue}) to op {path[-1]} "
            f"({last.kind} on {last.queue}): " + ", ".join(parts))


def _summary(sim: SimResult) -> str:
    """One screen: the step, work and stalls by queue, bytes per tier, the critical path, what failed."""
    from luwu_rt.exec.trace import Span

    r = sim.ranks[sim.rank]
    who = (f"{len(sim.ranks)} ranks simulated, collectives synchronised; slowest rank {r.rank}" if sim.synced
           else f"one rank simulated, its {r.plan.strategy.world_size - 1} peers symmetric"
           if r.plan.strategy.world_size > 1 else "one rank")
    chaos = (f"; chaos seed {sim.chaos_seed}, delays up to {_seconds(sim.chaos_max_delay_s)} per op"
             if sim.chaos_seed is not None else "")
    lines = [f"simulated step {_seconds(sim.step_s)} ({who}{chaos}), {len(r.plan.ops)} ops per rank", "",
             f"{'queue':<13}{'busy':>11}{'stalled':>11}  waiting on"]
    for q in sorted(r.busy_s, key=lambda q: -r.busy_s[q]):
        on = ", ".join(f"{c} {_seconds(s)}" for c, s in sorted(r.stalled_on.get(q, {}).items(), key=lambda kv: -kv[1]))
        lines.append(f"{q:<13}{_seconds(r.busy_s[q]):>11}{_seconds(r.stall_s.get(q, 0.0)):>11}  {on}")
    lines += ["", f"{'tier':<9}{'peak':>11}{'read':>11}{'written':>11}"]
    for tier, peak in r.peak_bytes.items():
        io = r.moved_bytes[tier]
        lines.append(f"{tier:<9}{format_size(peak):>11}{format_size(io['read']):>11}{format_size(io['write']):>11}")
    lines += ["", _path_text(r)]
    for rank in sim.ranks:
        for i in rank.failed:
            op = rank.plan.ops[i]
            lines.append(f"rank {rank.rank}: op {i} ({Span.of(op, start=0.0, end=0.0).name} on {op.queue}) failed")
        if rank.lost:
            lines.append(f"rank {rank.rank}: {len(rank.lost)} op(s) never ran, depending on a failed op "
                         f"(first: op {rank.lost[0]})")
    return "\n".join(lines)
