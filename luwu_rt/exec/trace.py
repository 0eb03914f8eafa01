"""Spans of executed ops and their export as Chrome trace JSON (Perfetto, chrome://tracing)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from luwu_rt.plan.ops import Op

__all__ = ["Span", "busy_by_queue", "covered_s", "moved_by_tier", "write_chrome_trace", "write_rank_traces"]


@dataclass(frozen=True, slots=True)
class Span:
    name: str
    """e.g. ``Load param u3.0 nvme->host`` or ``Compute B3``."""
    queue: str
    start_s: float
    end_s: float
    nbytes: int
    tier: str

    @classmethod
    def of(cls, op: Op, *, start: float, end: float) -> "Span":
        access = (op.outputs or op.inputs or (None,))[0]
        tier = access.tier if access is not None else getattr(op, "tier", "")
        nbytes = getattr(op, "nbytes", 0) or getattr(op, "comm_bytes", 0)
        label = getattr(op, "name", "") or (f"{access.shard.state} u{access.shard.unit}.{access.shard.chunk}"
                                            if access else "")
        if op.inputs and op.outputs and op.kind in ("Load", "Store"):
            label += f" {op.inputs[0].tier}->{op.outputs[0].tier}"
        return cls(f"{op.kind} {label}".strip(), op.queue, start, end, nbytes, tier)


def busy_by_queue(spans: Iterable[Span]) -> dict[str, float]:
    """Seconds each queue spent with at least one of its ops in flight: what a step's metrics break its time
    into. Spans of one queue may overlap (an IO queue keeps several reads in flight), so a queue's busy time
    is the length of the union of its spans (``covered_s``), never more than the step; the queues overlap
    each other, so the sum over queues may exceed the step."""
    by_queue: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        by_queue.setdefault(s.queue, []).append((s.start_s, s.end_s))
    return {queue: covered_s(intervals) for queue, intervals in by_queue.items()}


def moved_by_tier(moves: Iterable[tuple[str, int]]) -> dict[str, dict[str, int]]:
    """tier -> {"read", "write"} bytes of the executed moves among ``(span name, bytes)`` pairs.

    A move is a Load or Store span, whose name ends in ``src->dst``; other spans move nothing between tiers.
    """
    moved = {t: {"read": 0, "write": 0} for t in ("device", "host", "nvme")}
    for name, nbytes in moves:
        if name.startswith(("Load ", "Store ")) and "->" in name:
            src, dst = name.rsplit(" ", 1)[1].split("->")
            moved[src]["read"] += nbytes
            moved[dst]["write"] += nbytes
    return moved


def covered_s(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: time covered by at least one of them."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:  # the part of this interval past what the earlier ones covered
            total += end - max(start, reach)
            reach = end
    return total


def write_chrome_trace(spans: Iterable[Span], path: str | os.PathLike) -> None:
    """One complete event (``ph: X``) per span, one track per queue."""
    write_rank_traces([spans], path)


def write_rank_traces(ranks: Sequence[Iterable[Span]], path: str | os.PathLike, *,
                      extra: Sequence[tuple[str, Iterable[Span]]] = ()) -> None:
    """``ranks[r]``'s spans as process ``rank r``, one track per queue: one file for a run of several ranks.
    Each rank's times count from the start of its own step; the ranks start their steps together, held by
    the collectives of the step before. ``extra``: ``(name, spans)`` of other processes (the optimizer
    node's queues), each a process row of its own after the ranks."""
    events: list[dict] = []
    rows = [(f"rank {r}", spans) for r, spans in enumerate(ranks)] + list(extra)
    for rank, (name, spans) in enumerate(rows):
        if len(rows) > 1:
            events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": name}})
        events += [
            {
                "name": s.name, "cat": s.queue, "ph": "X", "pid": rank, "tid": s.queue,
                "ts": s.start_s * 1e6, "dur": max(s.end_s - s.start_s, 0.0) * 1e6,
                "args": {"bytes": s.nbytes, "tier": s.tier},
            }
            for s in spans
        ]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
