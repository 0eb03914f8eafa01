"""Faults and chaos for a simulated step, in virtual time.

[Note: simulated faults]
A fault changes how the simulated machine behaves, never the plan; what the
plan's dependencies make of it is the result:

* ``SlowTier``: for a window of virtual time, every move into or out of a tier
  runs ``factor`` times slower (a disk that throttles, a PCIe link shared with
  another job). The step is delayed by as much as the schedule cannot hide.
* ``ShardIOError``: every read or write of one shard to or from a tier fails
  (a bad sector, a full disk). The failed op never completes, nor does
  anything that depends on it, transitively: those ops are reported lost. An
  op that ran anyway and read what the failed op should have written is a
  wrong read, and fails the simulation (``RaceError``) - a missing dependency.
* ``StallRank``: one rank's process stops for a while (a page-fault storm, a
  preempted host): none of its queues makes progress, and, when every rank is
  simulated, its peers wait for it in their collectives.

[Note: simulated chaos]
Chaos draws the executor's own delays (``LUWU_CHAOS_SEED``, exec/chaos.py: one
generator per queue and rank, a delay before and after every op), scaled from
its few milliseconds to the plan's time scale (by default up to the longest
op's duration). Random delays alone find a missing dependency only by luck: a
reader with a chain of three delayed ops before it overtakes a writer with one
about once in 24 seeds. So each seed also holds one op back until every op
that does not depend on it (by a dependency or its queue's order) has
finished: the op at ``seed`` modulo the number of ops that take time, counted
over the ranks in plan order. Every op that the plan forgot to order after the
held one then runs before it, and a read of what it writes, an overwrite of
what it reads or a reuse of bytes it frees too early shows as a race
([Note: races in virtual time] in replay.py). Seeds ``0 .. n-1`` hold each op
once: together they find every pair of conflicting ops that nothing orders,
which is what ``validate`` proves absent from the dependency graph alone. The
step time under chaos is no prediction; ``simulate`` without a seed gives that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

from luwu_rt.exec.chaos import Chaos
from luwu_rt.plan import Load, ShardId, Store, SwapPlan
from luwu_rt.plan.cost import Disturbance
from luwu_rt.plan.spec import TIERS

__all__ = ["Fault", "ShardIOError", "SlowTier", "StallRank", "disturbance", "held_op"]

_TIER_QUEUES = {"device": ("h2d", "d2h"), "host": ("nvme_read", "nvme_write", "h2d", "d2h"),
                "nvme": ("nvme_read", "nvme_write")}
"""The queues whose moves read or write each tier."""


def _check_window(owner: str, start_s: float, end_s: float) -> None:
    if not 0 <= start_s < end_s:
        raise ValueError(f"{owner}: the window [{start_s}, {end_s}) s must start at 0 or later and end after it starts")


def _check_rank(owner: str, rank: int | None) -> None:
    if rank is not None and rank < 0:
        raise ValueError(f"{owner}: rank {rank} must not be negative")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowTier:
    """Moves into and out of ``tier`` run ``factor`` times slower from ``start_s`` to ``end_s``."""

    tier: str
    """``device``, ``host`` or ``nvme``."""
    factor: float
    """How many times longer a move takes inside the window (> 1 slows, < 1 speeds up)."""
    start_s: float
    """Virtual time from the step's start when the slowdown begins, seconds."""
    end_s: float
    """When it ends, seconds (``math.inf``: for the rest of the step)."""
    rank: int | None = None
    """Only on this rank; ``None``: on every rank."""

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"SlowTier: unknown tier {self.tier!r}; choose one of {', '.join(TIERS)}")
        if not self.factor > 0 or self.factor == math.inf:
            raise ValueError(f"SlowTier: factor must be a positive number, got {self.factor}; stall a rank with "
                             f"StallRank")
        _check_window("SlowTier", self.start_s, self.end_s)
        _check_rank("SlowTier", self.rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardIOError:
    """Every move of ``shard`` to or from ``tier`` fails."""

    shard: ShardId
    """The shard, e.g. ``ShardId(3, "master", 0)``."""
    tier: str = "nvme"
    """The tier whose IO fails (NVMe by default: a read or a write of the shard's file)."""
    rank: int | None = None
    """Only on this rank; ``None``: on every rank."""

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"ShardIOError: unknown tier {self.tier!r}; choose one of {', '.join(TIERS)}")
        if not isinstance(self.shard, ShardId):
            raise ValueError(f"ShardIOError: shard must be a luwu_rt.plan.ShardId, got {self.shard!r}")
        _check_rank("ShardIOError", self.rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class StallRank:
    """Rank ``rank`` makes no progress on any queue from ``start_s`` for ``duration_s``."""

    rank: int
    start_s: float
    duration_s: float

    def __post_init__(self) -> None:
        _check_rank("StallRank", self.rank)
        _check_window("StallRank", self.start_s, self.start_s + self.duration_s)


Fault = Union[SlowTier, ShardIOError, StallRank]


def _merge(windows: list[tuple[float, float, float]]) -> tuple[tuple[float, float, float], ...]:
    """Disjoint sorted windows from overlapping ones; where they overlap, their rates multiply."""
    edges = sorted({t for a, b, _ in windows for t in (a, b)})
    out = []
    for a, b in zip(edges, edges[1:]):
        rate = math.prod(r for s, e, r in windows if s <= a and b <= e)
        if any(s <= a and b <= e for s, e, _ in windows):
            out.append((a, b, rate))
    return tuple(out)


def held_op(plans: Sequence[SwapPlan], seed: int) -> tuple[int, int] | None:
    """(rank, op) that chaos seed ``seed`` holds back ([Note: simulated chaos]); None when no op takes time."""
    counts = [sum(op.queue != "mem" for op in p.ops) for p in plans]
    k = seed % sum(counts) if sum(counts) else None
    for rank, (plan, count) in enumerate(zip(plans, counts)):
        if k is not None and k < count:
            return rank, [i for i, op in enumerate(plan.ops) if op.queue != "mem"][k]
        k = None if k is None else k - count
    return None


def disturbance(plans: Sequence[SwapPlan], *, faults: Sequence[Fault], chaos_seed: int | None,
                chaos_max_delay_s: float) -> Disturbance | None:
    """The ``Disturbance`` that ``faults`` and chaos's delays make for ``plans`` (``plans[r]``: rank ``r``'s);
    the op chaos holds back (``held_op``) is added once the run without it says until when."""
    ranks = range(len(plans))
    windows: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    failing: set[tuple[int, int]] = set()
    for fault in faults:
        who = [fault.rank] if fault.rank is not None else list(ranks)
        if any(r >= len(plans) for r in who):
            raise ValueError(f"{type(fault).__name__} on rank {fault.rank}, but {len(plans)} rank(s) are simulated: "
                             f"pass one plan per rank to simulate more")
        if isinstance(fault, SlowTier):
            for r in who:
                for q in _TIER_QUEUES[fault.tier]:
                    windows.setdefault((r, q), []).append((fault.start_s, fault.end_s, 1.0 / fault.factor))
        elif isinstance(fault, StallRank):
            for q in {op.queue for op in plans[fault.rank].ops} - {"mem"}:
                windows.setdefault((fault.rank, q), []).append((fault.start_s, fault.start_s + fault.duration_s, 0.0))
        elif isinstance(fault, ShardIOError):
            for r in who:
                failing.update((r, i) for i, op in enumerate(plans[r].ops) if isinstance(op, (Load, Store))
                               and op.shard == fault.shard and fault.tier in (op.src, op.dst))
        else:
            raise ValueError(f"unknown fault {fault!r}: give SlowTier, ShardIOError or StallRank")
    delays = {}
    if chaos_seed is not None:
        delays = {r: _chaos_delays(plans[r], Chaos(seed=chaos_seed, rank=r), chaos_max_delay_s) for r in ranks}
    if not (windows or failing or delays):
        return None
    return Disturbance(delays_s=delays, rates={k: _merge(w) for k, w in windows.items()}, failing=frozenset(failing))


def _chaos_delays(plan: SwapPlan, chaos: Chaos, max_delay_s: float) -> list[tuple[float, float]]:
    """The executor's draws for each op, in plan order per queue (before, after), scaled to ``max_delay_s``;
    a ``Free`` takes no time and waits for no queue, so it gets none."""
    scale = max_delay_s / chaos.max_delay_s
    queues = {q: chaos.queue(q) for q in {op.queue for op in plan.ops}}
    delays = []
    for op in plan.ops:
        draw = queues[op.queue]
        before, after = draw.next_delay_s() * scale, draw.next_delay_s() * scale
        delays.append((0.0, 0.0) if op.queue == "mem" else (before, after))
    return delays
