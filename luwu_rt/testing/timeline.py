"""Reading a simulated step: stalls by queue, the critical path, trace spans and the one-screen summary.

Every figure is recomputed from the times ``timelines`` produced, with the same
arithmetic (an op becomes ready at the latest completion of its dependencies,
its queue frees when its previous op and the delay after it end), so what is
found equal here is equal there, to the bit.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from luwu_rt.plan import SwapPlan, format_size
from luwu_rt.plan.cost import Timeline

if TYPE_CHECKING:
    from luwu_rt.testing.simulate import RankResult, SimResult

__all__ = ["read_timeline", "spans", "summary"]

_INF = math.inf
_NO_DELAY = (0.0, 0.0)


def _ready(plan: SwapPlan, run: Timeline, i: int) -> tuple[float, int | None]:
    """When op ``i``'s dependencies had all completed, and the one that completed last."""
    ready, last = 0.0, None
    for d in plan.ops[i].deps:
        if run.done[d] > ready:
            ready, last = run.done[d], d
    return ready, last


def _cause(plan: SwapPlan, run: Timeline, d: int | None) -> str:
    """The queue an op waited for through dependency ``d`` (through a ``Free``, what the free waited for)."""
    while d is not None and plan.ops[d].queue == "mem":
        d = _ready(plan, run, d)[1]
    return "start" if d is None else plan.ops[d].queue


def _walk(plan: SwapPlan, run: Timeline, delays: Sequence[tuple[float, float]] | None):
    """Yields ``(i, ready, last_dep, queue_free, previous_on_queue, issued)`` for each op that ran on a
    queue, in plan order: ``issued`` is when it would start without peers (its delay before included)."""
    free: dict[str, float] = {}
    previous: dict[str, int] = {}
    for i, op in enumerate(plan.ops):
        if op.queue == "mem" or run.start[i] == _INF:
            continue
        ready, last = _ready(plan, run, i)
        at = free.get(op.queue, 0.0)
        before, after = delays[i] if delays is not None else _NO_DELAY
        t0 = max(ready, at)
        yield i, ready, last, at, previous.get(op.queue), (t0 + before if before else t0)
        free[op.queue] = run.end[i] + after if after else run.end[i]
        previous[op.queue] = i


def read_timeline(plan: SwapPlan, run: Timeline, delays: Sequence[tuple[float, float]] | None
                  ) -> tuple[dict[str, float], dict[str, dict[str, float]], tuple[int, ...]]:
    """Seconds each queue sat idle waiting (for a dependency, or for its peers in a collective), what it
    waited for, and the critical path."""
    stall = {q: 0.0 for q in dict.fromkeys(op.queue for op in plan.ops) if q != "mem"}
    on: dict[str, dict[str, float]] = {}
    walked = {}
    for i, ready, last, at, prev, issued in _walk(plan, run, delays):
        walked[i] = (ready, last, at, prev, issued)
        q = plan.ops[i].queue
        waits = [(ready - at, _cause(plan, run, last))] if ready > at else []
        if run.start[i] > issued:
            waits.append((run.start[i] - issued, "peers"))
        for seconds, cause in waits:
            stall[q] += seconds
            on.setdefault(q, {})[cause] = on.get(q, {}).get(cause, 0.0) + seconds
    return stall, on, _critical_path(plan, run, walked)


def _critical_path(plan: SwapPlan, run: Timeline, walked: dict) -> tuple[int, ...]:
    """Ops from the step's start to its last completion, each starting when the one before it completed:
    a dependency, or the op before it on its queue (a wait for peers ends the walk: the path goes on on
    another rank)."""
    finished = [i for i in range(len(plan.ops)) if run.done[i] != _INF]
    if not finished:
        return ()
    # The last completion; among ops completing at that instant a real op before a Free (which only follows).
    i: int | None = max(finished, key=lambda j: (run.done[j], plan.ops[j].queue != "mem", j))
    path = []
    while i is not None:
        path.append(i)
        if plan.ops[i].queue == "mem":
            i = _ready(plan, run, i)[1]
            continue
        ready, last, at, prev, issued = walked[i]
        if run.start[i] > issued or max(ready, at) == 0.0:
            break
        i = last if ready >= at else prev
    return tuple(reversed(path))


def spans(result: "RankResult") -> list:
    """The rank's ops that ran, as the executor's ``Span`` (a failed op's name says so)."""
    from luwu_rt.exec.trace import Span

    run, out = result.timeline, []
    for i, op in enumerate(result.plan.ops):
        if run.start[i] == _INF:
            continue
        span = Span.of(op, start=run.start[i], end=run.end[i])
        if run.done[i] == _INF:
            span = Span(f"{span.name} FAILED", span.queue, span.start_s, span.end_s, span.nbytes, span.tier)
        out.append(span)
    return out


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _path_text(r: "RankResult") -> str:
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


def summary(sim: "SimResult") -> str:
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
