"""Runs a ``SwapPlan`` against the store: it moves bytes and calls handlers,
and decides nothing (DESIGN.md, "Planner and executor").

[Note: issuing ops on streams]
Each plan queue has a thread and a stream (``Queues`` in streams.py). The
thread issues its queue's ops in plan order; for each op it waits, host-side,
until every dependency has been *issued* (its event exists), makes its stream
wait on the event of each dependency that ran on another queue, launches the
op's work on its stream and records the op's event. The event, not the issue,
says when the op is complete: on a host stream the two coincide, on a deferred
CPU stream or a CUDA stream the work runs later, and everything downstream
waits for it through the event. Dependencies point to earlier ops and each
queue issues in plan order, so no thread ever waits for an op that cannot be
issued: this never deadlocks. A ``Free`` has no work and no queue thread: its
event joins its dependencies' events, made when the first op that allocates
the freed bytes asks for it (a thread of its own would block in plan order
behind a write-back nothing else waits for).
Python threads are enough: every long op (file IO, copies, fused kernels,
collectives) releases the GIL.

[Note: failures in a run]
The work of an op that raises records ``(op index, error)`` in the run; the
error also fails the op's event, and through it every op waiting on it
([Note: stream failures] in streams.py). From then on queue threads stop at
their next op boundary and work not yet started is skipped; ``run`` waits for
everything already issued to finish, so nothing of this run is left running,
and re-raises the failure of the lowest op index: the first cause, not a
consequence. Threads and streams stay up for the next run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Literal, Protocol

import torch

from luwu_rt.exec.chaos import Chaos, QueueChaos
from luwu_rt.exec.streams import Event, JoinedEvent, Queues
from luwu_rt.exec.trace import Span
from luwu_rt.plan.ops import Collective, Free, Load, Op, ShardId, Store, SwapPlan, Wait
from luwu_rt.store import TieredStore

__all__ = ["DONE", "Executor", "Handle", "Handler", "Pending", "Views", "WaitAll"]

Views = Mapping[ShardId, torch.Tensor]
"""The op's shard copies as flat uint8 tensors, keyed by shard; outputs override inputs."""


class Handle(Protocol):
    """What a collective's handler returns: ``wait()`` completes the transfer (a ``torch.distributed``
    ``Work`` is one). The executor calls it when it runs the collective's ``Wait`` op, on the stream
    of their queue."""

    def wait(self) -> object: ...


class WaitAll:
    """The one handle type of the executor's handlers: ``wait()`` waits for each of ``handles`` in order
    (a ``torch.distributed`` ``Work``, a node transfer's handle, another ``WaitAll``: anything with
    ``wait()``), then runs ``then``, the work that needs their result (a sum of received pieces) or the
    blocking half of a transfer of its own (a node's receive). With neither it is the handle of a
    collective that completed inside its start (``DONE``)."""

    __slots__ = ("handles", "then")

    def __init__(self, handles: Sequence[Handle] = (), then: Callable[[], object] | None = None) -> None:
        self.handles = tuple(handles)
        self.then = then

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
        if self.then is not None:
            self.then()


DONE = WaitAll()
"""A collective that completed inside its start (a local reduction)."""
Handler = Callable[[Op, Views], "Handle | None"]
"""``(op, views)``: does the op's work; a collective's handler returns the ``Handle`` its ``Wait`` completes."""


class _Run:
    """The state of one ``Executor.run``: per op its event once issued, when its work ran once done."""

    def __init__(self, queued: Sequence[bool], previous: "Pending | None") -> None:
        num_ops = len(queued)
        self.origin = time.perf_counter()
        self.issued = [threading.Event() if q else None for q in queued]
        """Per op issued on a queue (not a ``Free``), set once it is; an event costs microseconds to make, and a
        plan of small ops is thousands of them."""
        self.events: list[Event | None] = [None] * num_ops
        self.times: list[tuple[float, float] | None] = [None] * num_ops
        """Per op, when its work started and ended (perf_counter); spans are made from them after the run."""
        self.handles: dict[int, Handle] = {}
        """Collective starts' handles until their ``Wait`` (written and read on their queue's stream)."""
        self.failures: list[tuple[int, BaseException]] = []
        self.failed = threading.Event()
        self.previous = previous
        """The previous period, whose tail may still run ([Note: steady state] in plan/steady.py)."""
        self._lock = threading.Lock()

    def fail(self, index: int, error: BaseException) -> None:
        """Records a failure and wakes every thread waiting for an issue ([Note: failures in a run])."""
        with self._lock:
            self.failures.append((index, error))
            self.failed.set()
        for issued in self.issued:
            if issued is not None:
                issued.set()


class Pending:
    """A run whose tail may still be running ([Note: steady state] in plan/steady.py): what the next period of its
    plan waits for op by op, and what anything else waits for as a whole (``wait``)."""

    def __init__(self, executor: "Executor", run: _Run, jobs: list) -> None:
        self.executor, self.run, self.jobs = executor, run, jobs

    def wait(self) -> None:
        """Blocks until the tail ran; re-raises its first failure."""
        self.executor._finish(self.run, self.jobs)
        if self.run.failures:
            raise min(self.run.failures, key=lambda f: f[0])[1]


class Executor:
    """Walks a plan. ``handlers`` maps op kinds (``Compute``, ``OptimStep``, ``GradNorm``, ``Reduce``,
    ``Gather``, ``NormReduce``, ...) to callables ``(op, views)``; ``Load``/``Store``/``Free``/``Wait``
    are the executor's own.

    ``queues``: the threads and streams to run on, shared by several executors (the engine's training
    and evaluation plans); by default the executor makes its own and ``close()`` joins them.
    ``chaos``: random delays around every op (chaos.py); ``"env"`` reads ``LUWU_CHAOS_SEED``.
    ``partner``: the executor of the plan whose period follows this one's in a pipeline ([Note: steady state] in
    plan/steady.py): ``None`` (the default) for this one; set it for the two halves of a double-buffered state.
    """

    def __init__(self, plan: SwapPlan, *, store: TieredStore, handlers: Mapping[str, Handler],
                 queues: Queues | None = None, chaos: Chaos | Literal["env"] | None = "env") -> None:
        missing = sorted({op.kind for op in plan.ops if not isinstance(op, (Load, Store, Free, Wait))} - set(handlers))
        if missing:
            raise ValueError(f"Executor: no handler for op kind(s) {missing}")
        store.check_plan(plan)
        self.plan = plan
        self.store = store
        self.handlers = handlers
        self._own_queues = queues is None
        self.queues = queues if queues is not None else Queues(device=_device_of(store))
        self.chaos = Chaos.from_env() if chaos == "env" else chaos
        self.partner: Executor | None = None
        self._by_queue: dict[str, list[int]] = {}
        self._queued = [not isinstance(op, Free) for op in plan.ops]
        for i, op in enumerate(plan.ops):
            if not isinstance(op, Free):  # a Free has no work and no thread: its event joins its dependencies'
                self._by_queue.setdefault(op.queue, []).append(i)
        self._essential = [i for i in range(len(plan.ops)) if i not in plan.tail]
        self._delays: dict[str, QueueChaos] = {q: self.chaos.queue(q) for q in self._by_queue} if self.chaos else {}

    def close(self) -> None:
        """Joins the executor's queue threads (not those of ``queues`` given to it)."""
        if self._own_queues:
            self.queues.close()

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- an op's work, on its stream -------------------------------------------------------------

    def _move(self, op: Load | Store) -> Callable[[], None] | None:
        """Starts the move; returns the completion of a file transfer (its stream waits for it: [Note: IO in
        flight] in streams.py)."""
        src, dst = op.inputs[0], op.outputs[0]
        info, nvme, view = self.plan.shards[src.shard], self.store.nvme, self.store.view
        if src.tier == "nvme":
            return partial(nvme.wait, nvme.submit_read(src.shard.unit, src.shard.state, first_chunk=info.first_chunk,
                                                       buffer=view(dst)))
        if dst.tier == "nvme":
            return partial(nvme.wait, nvme.submit_write(dst.shard.unit, dst.shard.state, first_chunk=info.first_chunk,
                                                        buffer=view(src)))
        view(dst).copy_(view(src), non_blocking=True)  # asynchronous on a CUDA stream: its event says when it is done
        return None

    def _run_op(self, run: _Run, i: int, op: Op) -> Callable[[], None] | None:
        if isinstance(op, (Load, Store)):
            return self._move(op)
        if isinstance(op, Wait):
            run.handles.pop(op.start).wait()
        else:
            views = {a.shard: self.store.view(a) for a in op.inputs if a.tier != "nvme"}
            views.update({a.shard: self.store.view(a) for a in op.outputs if a.tier != "nvme"})
            handle = self.handlers[op.kind](op, views)
            if isinstance(op, Collective):
                assert handle is not None, f"the {op.kind} handler returned no handle to wait for"
                run.handles[i] = handle
        return None

    def _work(self, run: _Run, i: int) -> Callable[[], None] | None:
        """Op ``i``'s work as its stream runs it, timed inside it; for a file transfer, the completion its stream
        waits for, which ends its time."""
        if run.failed.is_set():
            return None  # another op failed: skip the work not yet started ([Note: failures in a run])
        start = time.perf_counter()
        try:
            done = self._run_op(run, i, self.plan.ops[i])
        except BaseException as exc:
            run.fail(i, exc)
            raise  # fails the op's event, and with it the ops that wait on it
        if done is None:
            run.times[i] = (start, time.perf_counter())
            return None

        def complete() -> None:
            try:
                ended = done()
            except BaseException as exc:
                run.fail(i, exc)
                raise
            # When the transfer ended, not when its consumer came to wait ([Note: when a transfer ended] in
            # csrc/io/engine.cpp); a completion that cannot say ends now.
            run.times[i] = (start, ended if isinstance(ended, float) else time.perf_counter())

        return complete

    # -- issuing, on the queue threads -----------------------------------------------------------

    def _event(self, run: _Run, i: int) -> Event | None:
        """Op ``i``'s event once issued (blocking until then), ``None`` once the run failed. A ``Free`` is never
        issued on a queue: its event joins its dependencies' ([Note: issuing ops on streams])."""
        op = self.plan.ops[i]
        if not isinstance(op, Free):
            event = run.events[i]
            if event is None:  # not issued yet: its event is set before ``issued``
                run.issued[i].wait()
                event = run.events[i]
            return event
        event = run.events[i]
        if event is None:
            parts = [self._event(run, d) for d in op.deps]
            if any(p is None for p in parts):
                return None
            event = run.events[i] = JoinedEvent(parts)  # two threads may join it at once: the same join
            now = time.perf_counter()
            run.times[i] = (now, now)
        return event

    def _issue(self, run: _Run, i: int) -> bool:
        """Issues op ``i`` on its queue's stream ([Note: issuing ops on streams]); False once the run failed."""
        if run.failed.is_set():
            return False
        op = self.plan.ops[i]
        ops = self.plan.ops
        stream = self.queues.stream(op.queue)
        for d in op.deps:
            event = self._event(run, d)
            if event is None or run.failed.is_set():
                return False
            if ops[d].queue != op.queue or not stream.ordered:  # an ordered stream keeps its queue's order
                stream.wait(event)
        previous = run.previous
        if previous is not None:  # the previous period's ops it waits for ([Note: steady state])
            for d in self.plan.wrap_deps[i]:
                event = previous.executor._event(previous.run, d)
                if event is None:  # the previous period failed: so does this op, with its error
                    raise min(previous.run.failures, key=lambda f: f[0])[1]
                stream.wait(event)
        delays = self._delays.get(op.queue)
        if delays is not None:  # on the stream, after its waits and before the record: they delay the work
            stream.sleep(delays.next_delay_s())
        stream.launch(partial(self._work, run, i))
        if delays is not None:
            stream.sleep(delays.next_delay_s())
        run.events[i] = stream.record()
        run.issued[i].set()
        return True

    def _issue_queue(self, run: _Run, indices: list[int]) -> None:
        """A queue thread's part of an overlapped run: its ops in plan order."""
        for i in indices:
            try:
                if not self._issue(run, i):
                    return
            except BaseException as exc:  # the executor's own failure (a handler's fails its event instead)
                run.fail(i, exc)
                return

    def _issue_and_sync(self, run: _Run, i: int) -> None:
        """One op of a serialised run: issued like any other, then synchronised before the next."""
        try:
            if self._issue(run, i):
                run.events[i].synchronize()
        except BaseException as exc:
            if not run.failed.is_set():
                run.fail(i, exc)

    def _sync(self, run: _Run, indices) -> None:
        """Waits until each of ``indices`` is issued (or the run failed) and its event completed; a failure not
        raised by an op's work is recorded."""
        for i in indices:
            event = self._event(run, i)
            if event is not None:
                try:
                    event.synchronize()
                except BaseException as exc:
                    if not run.failed.is_set():
                        run.fail(i, exc)

    def _finish(self, run: _Run, jobs: list) -> None:
        """Waits for every queue job of ``run`` and every event it issued."""
        for job in jobs:
            job.wait()
        self._sync(run, range(len(self.plan.ops)))

    def run(self, *, overlap: bool = True, pipeline: bool = False) -> list[Span]:
        """Runs every op once; returns a span per op (measured inside its work). ``overlap=False`` runs
        the ops one after another in plan order (the serialised baseline), on the same threads and
        streams. ``pipeline=True``: return once every op outside the plan's tail is done, leaving the tail
        running ([Note: steady state] in plan/steady.py); a run of this plan or its ``partner`` then starts
        beside it, anything else (another plan's run, ``Queues.drain``) waits for it first. A run beside a
        previous period's tail also returns the spans of that tail (times before its own start are
        negative). Re-raises the first failure ([Note: failures in a run])."""
        lock = self.queues.exclusive()
        if not lock.acquire(blocking=False):
            raise RuntimeError("another run is using these queues; runs that share Queues go one at a time")
        try:
            previous = self.queues.take_pending()
            if previous is not None and (not overlap or (previous.executor.partner or previous.executor) is not self
                                         or not self.plan.wrap_deps):
                previous.wait()  # not this pipeline's period: it starts cold
                previous = None
            run = _Run(self._queued, previous)
            jobs = []
            try:
                if overlap:
                    jobs = [self.queues.submit(q, partial(self._issue_queue, run, ix))
                            for q, ix in self._by_queue.items()]
                else:
                    for i, op in enumerate(self.plan.ops):
                        if not isinstance(op, Free):
                            self.queues.submit(op.queue, partial(self._issue_and_sync, run, i)).wait()
                        if run.failed.is_set():
                            break
                leave = pipeline and overlap and bool(self.plan.wrap_deps) and not run.failed.is_set()
                if leave:
                    self._sync(run, self._essential)
                else:
                    self._finish(run, jobs)
            finally:
                if previous is not None:  # its tail had this whole run to finish
                    previous.executor._finish(previous.run, previous.jobs)
                    run.failures += [(-1, e) for _, e in previous.run.failures]
            if leave and not run.failures:
                self.queues.set_pending(Pending(self, run, jobs))
        finally:
            lock.release()
        if run.failures:
            raise min(run.failures, key=lambda f: f[0])[1]
        spans = self._spans(run, self._essential if leave else range(len(self.plan.ops)))
        if previous is not None:
            spans += previous.executor._spans(previous.run, previous.executor.plan.tail, origin=run.origin)
        return spans

    def _spans(self, run: _Run, indices, *, origin: float | None = None) -> list[Span]:
        origin = run.origin if origin is None else origin
        ops, out = self.plan.ops, []
        for i in indices:
            times = run.times[i]
            assert times is not None, f"op {i} ({ops[i].kind}) of a run without failures did not run"
            out.append(Span.of(ops[i], start=times[0] - origin, end=times[1] - origin))
        return out


def _device_of(store: TieredStore) -> torch.device:
    arena = store.arenas.get("device")
    return arena.buffer.device if arena is not None else torch.device("cpu")
