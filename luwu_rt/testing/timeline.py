"""Reading a simulated step: stalls by queue, the critical path and trace spans.

Every figure is recomputed from the times ``timelines`` produced, with the same
arithmetic (an op becomes ready at the latest completion of its dependencies,
its queue frees when its previous op and the delay after it end), so what is
found equal here is equal there, to the bit.
"""

from __future__ import annotations

import math
from typing import Collection, Sequence

from luwu_rt.plan import SwapPlan
from luwu_rt.plan.cost import Timeline

__all__ = ["read_timeline", "spans"]

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


def read_timeline(plan: SwapPlan, run: Timeline, delays: Sequence[tuple[float, float]] | None, *,
                  held: Collection[int] = ()) -> tuple[dict[str, float], dict[str, dict[str, float]], tuple[int, ...]]:
    """Seconds each queue sat idle waiting (for a dependency, for its peers in a collective, or held back by
    chaos: the ops in ``held``), what it waited for, and the critical path."""
    stall = {q: 0.0 for q in dict.fromkeys(op.queue for op in plan.ops) if q != "mem"}
    on: dict[str, dict[str, float]] = {}
    walked = {}
    for i, ready, last, at, prev, issued in _walk(plan, run, delays):
        walked[i] = (ready, last, at, prev, issued)
        q = plan.ops[i].queue
        waits = [(ready - at, _cause(plan, run, last))] if ready > at else []
        if run.start[i] > issued:
            waits.append((run.start[i] - issued, "held by chaos" if i in held else "peers"))
        for seconds, cause in waits:
            stall[q] += seconds
            on.setdefault(q, {})[cause] = on.get(q, {}).get(cause, 0.0) + seconds
    return stall, on, _critical_path(plan, run, walked)


def _critical_path(plan: SwapPlan, run: Timeline, walked: dict) -> tuple[int, ...]:
    """Ops from the step's start to its last completion, each starting when the one before it completed:
    a dependency, or the op before it on its queue (a wait for peers ends the walk: the path goes on on
    another rank; so does an op chaos held back)."""
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


def spans(plan: SwapPlan, run: Timeline) -> list:
    """The ops of ``plan`` that ran, as the executor's ``Span`` (a failed op's name says so)."""
    from luwu_rt.exec.trace import Span

    out = []
    for i, op in enumerate(plan.ops):
        if run.start[i] == _INF:
            continue
        span = Span.of(op, start=run.start[i], end=run.end[i])
        if run.done[i] == _INF:
            span = Span(f"{span.name} FAILED", span.queue, span.start_s, span.end_s, span.nbytes, span.tier)
        out.append(span)
    return out
