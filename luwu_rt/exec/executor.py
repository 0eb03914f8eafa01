"""Runs a ``SwapPlan`` against the store: it moves bytes and calls handlers,
and decides nothing (DESIGN.md, "Planner and executor").

[Note: executor threads]
One thread per plan queue (``nvme_read``, ``nvme_write``, ``h2d``, ``d2h``,
``compute``, ``optim``, ``comm``, ``mem``). Each thread runs its queue's ops in
plan order, waiting for each op's dependencies first. Because the plan's order
is a topological order of its dependencies, this never deadlocks, and ops on
different queues overlap exactly as far as the plan allows. Python threads are
enough: every long op (file IO, copies, fused kernels, collectives) releases
the GIL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from luwu_rt.exec.trace import Span
from luwu_rt.plan.ops import Collective, Free, Load, Op, ShardId, Store, SwapPlan, Wait
from luwu_rt.store import TieredStore

__all__ = ["DONE", "Executor", "Handle", "Handler", "Views"]

Views = Mapping[ShardId, torch.Tensor]
"""The op's shard copies as flat uint8 tensors, keyed by shard; outputs override inputs."""


class Handle(Protocol):
    """What a collective's handler returns: ``wait()`` completes the transfer (a ``torch.distributed``
    ``Work`` is one). The executor calls it when it runs the collective's ``Wait`` op."""

    def wait(self) -> object: ...


class _Done:
    """The handle of a collective that completed inside its start (a local reduction)."""

    def wait(self) -> None:
        return None


DONE = _Done()
Handler = Callable[[Op, Views], "Handle | None"]
"""``(op, views)``: does the op's work; a collective's handler returns the ``Handle`` its ``Wait`` completes."""


@dataclass(frozen=True, slots=True)
class _Failure:
    op_index: int
    error: BaseException


class Executor:
    """Walks a plan. ``handlers`` maps op kinds (``Compute``, ``OptimStep``,
    ``Reduce``, ``Gather``, ``Push``, ``Pull``) to callables ``(op, views)``;
    ``Load``/``Store``/``Free`` are the executor's own."""

    def __init__(self, plan: SwapPlan, *, store: TieredStore, handlers: Mapping[str, Handler]) -> None:
        missing = sorted({op.kind for op in plan.ops if not isinstance(op, (Load, Store, Free, Wait))} - set(handlers))
        if missing:
            raise ValueError(f"Executor: no handler for op kind(s) {missing}")
        store.check_plan(plan)
        self.plan = plan
        self.store = store
        self.handlers = handlers
        self._handles: dict[int, Handle] = {}

    # -- ops -----------------------------------------------------------------------------------

    def _move(self, op: Load | Store) -> None:
        src, dst = op.inputs[0], op.outputs[0]
        info, nvme, view = self.plan.shards[src.shard], self.store.nvme, self.store.view
        if src.tier == "nvme":
            nvme.wait(nvme.submit_read(src.shard.unit, src.shard.state, first_chunk=info.first_chunk, buffer=view(dst)))
        elif dst.tier == "nvme":
            nvme.wait(nvme.submit_write(dst.shard.unit, dst.shard.state, first_chunk=info.first_chunk, buffer=view(src)))
        else:
            view(dst).copy_(view(src))

    def _run_op(self, i: int, op: Op) -> None:
        if isinstance(op, (Load, Store)):
            self._move(op)
        elif isinstance(op, Wait):
            self._handles.pop(op.start).wait()
        elif not isinstance(op, Free):
            views = {a.shard: self.store.view(a) for a in op.inputs if a.tier != "nvme"}
            views.update({a.shard: self.store.view(a) for a in op.outputs if a.tier != "nvme"})
            handle = self.handlers[op.kind](op, views)
            if isinstance(op, Collective):
                assert handle is not None, f"the {op.kind} handler returned no handle to wait for"
                self._handles[i] = handle

    # -- scheduling ----------------------------------------------------------------------------

    def run(self, *, overlap: bool = True) -> list[Span]:
        """Runs every op once; returns a span per op. ``overlap=False`` runs the
        ops one after another in plan order (the serialised baseline)."""
        spans: list[Span | None] = [None] * len(self.plan.ops)
        origin = time.perf_counter()

        def timed(i: int) -> None:
            op = self.plan.ops[i]
            start = time.perf_counter()
            self._run_op(i, op)
            spans[i] = Span.of(op, start=start - origin, end=time.perf_counter() - origin)

        if not overlap:
            for i in range(len(self.plan.ops)):
                timed(i)
            return list(spans)  # type: ignore[arg-type]

        done = [threading.Event() for _ in self.plan.ops]
        failures: list[_Failure] = []
        by_queue: dict[str, list[int]] = {}
        for i, op in enumerate(self.plan.ops):
            by_queue.setdefault(op.queue, []).append(i)

        def worker(indices: list[int]) -> None:
            for i in indices:
                for d in self.plan.ops[i].deps:
                    done[d].wait()
                if failures:
                    break  # another queue failed: stop at the next op boundary
                try:
                    timed(i)
                except BaseException as exc:  # re-raised by run() on the caller's thread
                    failures.append(_Failure(i, exc))
                    for event in done:
                        event.set()
                    break
                done[i].set()

        threads = [threading.Thread(target=worker, args=(ix,), name=f"luwu-{q}", daemon=True) for q, ix in by_queue.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            first = min(failures, key=lambda f: f.op_index)
            raise first.error
        return list(spans)  # type: ignore[arg-type]
