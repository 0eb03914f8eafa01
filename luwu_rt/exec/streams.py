"""Streams and events: where each plan queue's work runs, and how one queue waits for another.

A stream runs work in the order it was launched. ``launch(fn)`` enqueues work,
``record()`` returns an ``Event`` that completes when everything launched
before it has completed, and ``wait(event)`` makes work launched later wait for
that event. Three kinds share this interface, so the executor has one code path:

* ``HostStream``: the work runs at ``launch``, on the calling (queue) thread;
  its events are complete when recorded, and waiting on another stream's event
  blocks that thread.
* ``DeferredStream``: a CPU worker thread with a FIFO. ``launch`` returns at
  once and the work runs later, as on a GPU; ``wait`` enqueues the wait, so the
  issuer does not block. It stands in for a CUDA stream in tests: an op treated
  as done when it was merely enqueued reads bytes that are not there yet.
* ``CudaStream``: a ``torch.cuda.Stream`` and ``torch.cuda.Event``s. Waiting on
  a host event from it host-synchronises that event first (a CUDA stream cannot
  wait for the host).
* ``IOStream``: file IO. The work runs at ``launch`` on the queue thread and
  starts a transfer; the event completes when the transfer has (``record``'s
  event waits for it, and checks its checksums, in whichever thread needs it
  first). So the queue thread goes on submitting the next transfer while the
  previous ones are in flight: the disk sees a deep queue of the step's IO,
  not one shard at a time ([Note: IO in flight]).

Work may return a completion (a callable; any other value is ignored): the IO
it started, which an ``IOStream`` waits for in its event and every other
stream at once.

``Queues`` is the one place that owns every queue's thread and stream.

[Note: stream failures]
Work that raises does not raise out of ``launch`` (on a device stream it could
not): the failure is kept by the stream, work launched after it is skipped, and
the next ``record()`` hands it to its event, whose ``synchronize()`` re-raises
it. A stream that waits on a failed event fails the same way, so a failure
reaches every op that depends on it, and only those; after the record the
stream is clean again, so a failed run leaves its streams usable for the next.

[Note: IO in flight]
Measured (``luwu bench offload-step``, 256M params, 16 MiB shards): with each
NVMe op waiting for its own transfer the read and write queues were each busy
almost all of the step, yet moved the step's bytes 25% slower than the same
IO engine moving them in one request each way: a queue thread that waits for
every transfer leaves at most one shard in flight per direction, and the disk
idles between them. Completing each transfer in its event instead keeps as
many in flight as the plan's dependencies and the budget allow. Since such a
stream's ops complete out of order, an op on it waits for the events of its
dependencies on the same queue too (``ordered`` is False).

[Note: idle threads hold nothing]
A queue thread or stream worker drops its last job before it waits for the
next. Otherwise the job would keep its executor (and the store's tensors) alive
between runs, so that queues nobody closed were never finalised; and a daemon
thread that frees the last reference to a tensor when the interpreter exits
re-takes the GIL inside torch's C++ and aborts the process ("terminate called
without an active exception"). For the same reason the finaliser of unclosed
queues does not run at exit: their daemon threads stay asleep and end with the
process.

[Note: persistent queue threads]
Queue threads (and a deferred stream's worker) are created once, the first
time their queue runs an op, and live until ``close()``, across steps and
across the plans that share the ``Queues`` (the engine's training and
evaluation plans). Besides saving a thread start per queue per step, this is
measured: units computed on a thread that was just born run about 10% slower
on the CPU (gpt-small: a plain fwd+bwd on a new thread 1.32 s vs 1.25 s on a
long-lived one), because the math libraries' per-thread state (OpenMP team,
scratch buffers, malloc arena) is rebuilt each time.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import torch

__all__ = ["CudaStream", "DeferredStream", "DoneEvent", "Event", "HostEvent", "HostStream", "IOEvent", "IOStream",
           "JoinedEvent", "QUEUE_STREAMS", "Queues", "STREAM_KINDS", "Stream"]

Work = Callable[[], None]


class Event(Protocol):
    """Completes when the work recorded before it has completed."""

    def query(self) -> bool:
        """Whether it has completed (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Blocks the calling thread until it completes; re-raises the failure of the work before it."""
        ...


class HostEvent:
    """An event completed by a host thread (``set``), carrying the failure of the work before it."""

    __slots__ = ("_done", "error")

    def __init__(self, *, done: bool = False, error: BaseException | None = None) -> None:
        self._done = threading.Event()
        self.error = error
        if done:
            self._done.set()

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


class DoneEvent:
    """An event complete when made: a host stream's (its work ran at ``launch``). Cheaper than a ``HostEvent``,
    which makes a ``threading.Event``: a host queue records one per op."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.error is not None:
            raise self.error


class JoinedEvent:
    """Completes when all of ``events`` have: a ``Free`` completes when its dependencies completed,
    without a thread blocking for it."""

    __slots__ = ("events",)

    def __init__(self, events: Sequence[Event]) -> None:
        self.events = tuple(part for e in events for part in _parts(e))

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


def _parts(event: Event) -> tuple[Event, ...]:
    return event.events if isinstance(event, JoinedEvent) else (event,)


class Stream(Protocol):
    name: str
    ordered: bool
    """Whether work completes in launch order (so a later op of the queue need not wait for an earlier one)."""

    def launch(self, fn: Work) -> None:
        """Enqueues ``fn``; it runs after everything launched and waited for before it."""
        ...

    def record(self) -> Event:
        """An event that completes when the work launched so far has completed."""
        ...

    def wait(self, event: Event) -> None:
        """Work launched from now on starts only after ``event`` completed."""
        ...

    def sleep(self, seconds: float) -> None:
        """Enqueues a delay: work launched from now on starts ``seconds`` later (the chaos mode)."""
        ...

    def close(self) -> None:
        """Finishes what was launched and joins the stream's worker thread, if it has one."""
        ...

    def let_go(self) -> None:
        """Lets the stream's worker thread end after its work, without joining it: the finaliser of unreachable
        ``Queues``, which may run on one of those threads."""
        ...


class _Pending:
    """The failure a stream keeps until its next record ([Note: stream failures])."""

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def call(self, fn: Work) -> object:
        """Runs ``fn`` unless an earlier one failed; returns what it returned (a completion, or ``None``)."""
        if self.error is not None:
            return None  # after a failure, work up to the next record is skipped
        try:
            return fn()
        except BaseException as exc:  # handed to the next recorded event
            self.error = exc
            return None

    def complete(self, fn: Work) -> None:
        """Runs ``fn`` and, at once, the completion it returns (a stream that waits for all its work)."""
        done = self.call(fn)
        if callable(done):
            self.call(done)

    def take(self) -> BaseException | None:
        error, self.error = self.error, None
        return error


class HostStream:
    """Runs work at ``launch`` on the calling thread: the stream of a queue whose work is host code."""

    ordered = True
    """Its work completes in launch order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pending = _Pending()

    def launch(self, fn: Work) -> None:
        self._pending.complete(fn)

    def record(self) -> DoneEvent:
        return DoneEvent(self._pending.take())

    def wait(self, event: Event) -> None:
        self._pending.call(event.synchronize)  # blocks the queue thread: its next work is host code

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self) -> None:
        pass

    def let_go(self) -> None:
        pass


class IOEvent:
    """Completes when the transfers started before it have: its first ``synchronize`` waits for them."""

    __slots__ = ("_waits", "_lock", "_done", "error")

    def __init__(self, waits: list[Work], error: BaseException | None) -> None:
        self._waits, self.error = waits, error
        self._lock = threading.Lock()
        self._done = not waits

    def query(self) -> bool:
        return self._done

    def settle(self) -> None:
        """Completes the transfers (once, whichever thread comes first), keeping a failure for ``synchronize``."""
        with self._lock:  # one thread completes the transfers; any other waits for it here
            if not self._done:
                try:
                    for wait in self._waits:
                        wait()
                except BaseException as exc:
                    self.error = self.error or exc
                finally:
                    self._done, self._waits = True, []

    def synchronize(self) -> None:
        self.settle()
        if self.error is not None:
            raise self.error


class IOStream:
    """File IO ([Note: IO in flight]): ``launch`` runs the work on the calling thread, which starts a transfer and
    returns its completion; the next ``record``'s event completes it, on the stream's completer thread as soon
    as the transfer ends ([Note: completing a transfer where it ends]).

    [Note: completing a transfer where it ends]
    A read's completion checks the CRC-32C of every chunk it read (store/nvme.py). Completed by whichever thread
    first synchronised its event, that was the optimizer's, at the update, though the read had ended during
    backward: gpt-small zero3 x2 with its state on NVMe at batch 1 x 64 spaced the updates after the norm 3-9 ms
    apart for 3 ms of work each. A completer thread per IO stream settles each event in record order as its
    transfers end, so the check runs while the consumer is busy elsewhere; a consumer that comes first completes
    the event itself, as before, and the completer finds it done. Measured in traces of that run, two
    interleaved pairs: the gaps between updates 0.1 ms, from the norm to the last update 42-54 ms against 54-78
    (benchmarks/results/2026-12-07-completer.md)."""

    ordered = False
    """Its ops complete out of launch order: a same-queue dependency is waited for like any other."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._pending = _Pending()
        self._open: list[Work] = []
        self._settle: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    def launch(self, fn: Work) -> None:
        done = self._pending.call(fn)
        if callable(done):
            self._open.append(done)

    def record(self) -> IOEvent:
        event, self._open = IOEvent(self._open, self._pending.take()), []
        if not event.query():
            self._completer().put(event)
        return event

    def _completer(self) -> queue.SimpleQueue:
        if self._settle is None:  # started on the first transfer and kept ([Note: persistent queue threads])
            self._settle = queue.SimpleQueue()
            # The thread holds only the FIFO, never the stream: an unreachable stream can be finalised.
            self._thread = threading.Thread(target=_settle, args=(self._settle,), name=f"luwu-{self.name}-completer",
                                            daemon=True)
            self._thread.start()
        return self._settle

    def wait(self, event: Event) -> None:
        self._pending.call(event.synchronize)  # blocks the queue thread: the next transfer needs it

    def sleep(self, seconds: float) -> None:
        if self._open:  # after a launch: its completion comes later
            self._open.append(partial(time.sleep, seconds))
        else:
            time.sleep(seconds)

    def close(self) -> None:
        """Completes what was recorded, then joins the completer."""
        if self._thread is not None and self._thread.is_alive():
            self._settle.put(None)
            self._thread.join()

    def let_go(self) -> None:
        if self._settle is not None:
            self._settle.put(None)


def _settle(events: queue.SimpleQueue) -> None:
    while (event := events.get()) is not None:
        event.settle()
        del event  # [Note: idle threads hold nothing]


class DeferredStream:
    """A worker thread that runs launched work and waits in FIFO order, some time after ``launch``
    returned: the CPU stand-in for a GPU stream."""

    ordered = True

    def __init__(self, name: str) -> None:
        self.name = name
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        # The worker holds only the FIFO, never the stream: an unreachable stream can be finalised.
        self._thread = threading.Thread(target=_drain, args=(self._items,), name=f"luwu-{name}-stream", daemon=True)
        self._thread.start()

    def launch(self, fn: Work) -> None:
        self._items.put(("run", fn))  # _drain completes what it returns

    def record(self) -> HostEvent:
        event = HostEvent()
        self._items.put(("record", event))
        return event

    def wait(self, event: Event) -> None:
        self._items.put(("run", event.synchronize))  # blocks the worker, not the issuer

    def sleep(self, seconds: float) -> None:
        self._items.put(("run", partial(time.sleep, seconds)))

    def close(self) -> None:
        """Runs what was launched, then joins the worker."""
        if self._thread.is_alive():
            self._items.put(None)
            self._thread.join()

    def let_go(self) -> None:
        self._items.put(None)


def _drain(items: queue.SimpleQueue) -> None:
    pending = _Pending()
    while (item := items.get()) is not None:
        kind, arg = item
        if kind == "record":
            arg.set(pending.take())
        else:
            pending.complete(arg)
        del item, arg  # [Note: idle threads hold nothing]


_GPU_CYCLES_PER_S = 1.5e9
"""About a GPU's clock: ``torch.cuda._sleep`` spins for cycles, and a chaos delay need not be exact."""


class CudaEvent:
    """A ``torch.cuda.Event`` recorded on a ``CudaStream``, with the host-side failure of the work
    launched before it."""

    __slots__ = ("event", "error")

    def __init__(self, event: torch.cuda.Event, error: BaseException | None) -> None:
        self.event, self.error = event, error

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()
        if self.error is not None:
            raise self.error


class CudaStream:
    """Work launched from the queue thread onto a CUDA stream: the host returns once the kernels,
    copies or collectives are enqueued; events say when they ran."""

    ordered = True

    def __init__(self, name: str, *, stream: torch.cuda.Stream) -> None:
        self.name = name
        self.stream = stream
        self._pending = _Pending()

    def launch(self, fn: Work) -> None:
        def on_stream() -> object:
            with torch.cuda.stream(self.stream):
                return fn()

        self._pending.complete(on_stream)

    def record(self) -> CudaEvent:
        event = torch.cuda.Event()
        event.record(self.stream)
        return CudaEvent(event, self._pending.take())

    def wait(self, event: Event) -> None:
        for part in _parts(event):
            if isinstance(part, CudaEvent):
                if part.error is not None and self._pending.error is None:
                    self._pending.error = part.error
                self.stream.wait_event(part.event)
            else:  # a host event: the GPU cannot wait for the host, so the issuing thread does
                self._pending.call(part.synchronize)

    def sleep(self, seconds: float) -> None:
        with torch.cuda.stream(self.stream):  # the GPU spins; the host goes on issuing
            torch.cuda._sleep(int(seconds * _GPU_CYCLES_PER_S))

    def close(self) -> None:
        pass

    def let_go(self) -> None:
        pass


STREAM_KINDS = ("host", "deferred", "cuda")
"""What runs the device queues' work: ``host`` (on the queue thread), ``deferred`` (a CPU worker that
runs it later, for tests) or ``cuda`` (CUDA streams)."""

QUEUE_STREAMS = {
    # queue: (what runs its work on a GPU, why the queue has a thread and a stream of its own)
    "nvme_read": ("io", "file reads, submitted by the queue thread, several in flight; never behind a write-back"),
    "nvme_write": ("io", "file write-back, beside the reads"),
    "h2d": ("device", "copies to the device on a stream of their own: a copy engine overlaps compute"),
    "d2h": ("device", "copies off the device on the other copy engine, beside loads and compute"),
    "compute": ("device", "the current stream: kernels launched without naming a stream stay in order with it"),
    "optim": ("host", "the CPU optimizer and gradient norms, overlapping backward on the device"),
    "gather": ("device", "NCCL all-gathers on their own stream, never behind compute, copies or a reduction"),
    "reduce": ("device", "NCCL reductions on their own stream, never behind a gather"),
    "reduce_cross": ("device", "hsdp's all-reduce across groups on its own stream, beside the next reduce-scatter"),
    "encode": ("device", "gradient encoding (Numba kernels on the CPU) beside backward, never behind a decode"),
    "decode": ("device", "decoding received payloads, beside the next unit's encode and transfer"),
    "push": ("host", "node: gradient sends over sockets by the queue thread"),
    "pull": ("host", "node: parameter receives, never behind a push"),
    "mem": ("host", "frees: no work; their events join their dependencies' ([Note: issuing ops on streams])"),
}
"""Every queue of ``plan.ops.QUEUES`` (which says what runs on it) and the stream it gets: ``device``
queues get the ``device_streams`` kind of their ``Queues``, ``host`` queues always a ``HostStream``, ``io``
queues an ``IOStream``."""


class _Job:
    __slots__ = ("fn", "done", "error")

    def __init__(self, fn: Work) -> None:
        self.fn, self.done, self.error = fn, threading.Event(), None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        fn, job.fn = job.fn, None
        try:
            fn()
        except BaseException as exc:  # handed to whoever waits for the job
            job.error = exc
        finally:
            del fn  # [Note: idle threads hold nothing]
            job.done.set()
        del job


def _shut(jobs: list[queue.SimpleQueue], streams: list[Stream]) -> None:
    """Finaliser of unreachable ``Queues``: lets the threads end (no join: it may run on one of them)."""
    for q in jobs:
        q.put(None)
    for s in streams:
        s.let_go()


class Queues:
    """Every plan queue's thread and stream: the one place that owns them (DESIGN.md, Style 5).

    A queue's thread issues its ops in plan order (``Executor``); its stream runs their work
    (``QUEUE_STREAMS`` says which, and why each queue exists). ``device_streams`` picks the device
    queues' streams: ``cuda`` by default on a CUDA device, else ``host``; ``deferred`` makes them
    ``DeferredStream``s, for tests. Threads start on first use and live until ``close()``
    ([Note: persistent queue threads]); several executors may share one ``Queues``, one run at a time.
    """

    def __init__(self, *, device: torch.device | str = "cpu", device_streams: str | None = None) -> None:
        self.device = torch.device(device)
        kind = device_streams or ("cuda" if self.device.type == "cuda" else "host")
        if kind not in STREAM_KINDS:
            raise ValueError(f"device_streams must be one of {list(STREAM_KINDS)}, not {device_streams!r}")
        if kind == "cuda" and self.device.type != "cuda":
            raise ValueError(f"device_streams='cuda' needs a CUDA device, not {self.device}")
        self.device_streams = kind
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._run_lock = threading.Lock()
        self._jobs: dict[str, queue.SimpleQueue] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._streams: dict[str, Stream] = {}
        self._closed = False
        self._pending: Any = None
        """A run whose tail may still be running (``executor.Pending``): [Note: steady state] in plan/steady.py."""
        # The finaliser gets the FIFOs, not ``self``: queues nobody closed still end their threads.
        self._all_jobs: list[queue.SimpleQueue] = []
        self._all_streams: list[Stream] = []
        self._finalizer = weakref.finalize(self, _shut, self._all_jobs, self._all_streams)
        self._finalizer.atexit = False  # [Note: idle threads hold nothing]

    def _stream_for(self, name: str) -> Stream:
        if name not in QUEUE_STREAMS:
            raise KeyError(f"no queue {name!r}: plan queues are {sorted(QUEUE_STREAMS)}")
        if QUEUE_STREAMS[name][0] == "io":
            return IOStream(name)
        if QUEUE_STREAMS[name][0] == "host" or self.device_streams == "host":
            return HostStream(name)
        if self.device_streams == "deferred":
            return DeferredStream(name)
        current = torch.cuda.current_stream(self.device)
        return CudaStream(name, stream=current if name == "compute" else torch.cuda.Stream(device=self.device))

    def _open(self, name: str) -> None:
        """Creates queue ``name``'s stream and thread, once."""
        with self._lock:
            if self._closed:
                raise RuntimeError("these Queues are closed; create new ones (or a new Executor/Engine)")
            if os.getpid() != self._pid:
                raise RuntimeError("Queues cannot be used in a forked child: their threads stayed in the parent")
            if name in self._threads:
                return
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            stream = self._stream_for(name)
            thread = threading.Thread(target=_serve, args=(jobs,), name=f"luwu-{name}", daemon=True)
            thread.start()
            self._jobs[name], self._streams[name], self._threads[name] = jobs, stream, thread
            self._all_jobs.append(jobs)
            self._all_streams.append(stream)

    def stream(self, name: str) -> Stream:
        """Queue ``name``'s stream (created with its thread on first use)."""
        if self._closed or name not in self._streams:
            self._open(name)
        return self._streams[name]

    def submit(self, name: str, fn: Work) -> _Job:
        """Runs ``fn`` on queue ``name``'s thread, after what was submitted there before; ``wait()``
        on the result blocks until it returned and re-raises its exception."""
        if self._closed or name not in self._threads:
            self._open(name)  # raises once closed: a job on a joined thread would never run
        job = _Job(fn)
        self._jobs[name].put(job)
        return job

    def exclusive(self) -> threading.Lock:
        """Held by a run: the queues serve one plan run at a time."""
        return self._run_lock

    @property
    def pending(self) -> Any:
        """The run whose tail may still be running, or ``None``."""
        return self._pending

    def set_pending(self, pending: Any) -> None:
        """A run that returned with its tail still running ([Note: steady state] in plan/steady.py)."""
        assert self._pending is None
        self._pending = pending

    def take_pending(self) -> Any:
        """The run whose tail may still be running (``None``: none); the caller waits for it or runs beside it."""
        pending, self._pending = self._pending, None
        return pending

    def drain(self) -> None:
        """Waits until no run's tail is running any more; re-raises the tail's failure. What reads or writes the
        store outside a run calls it first."""
        pending = self.take_pending()
        if pending is not None:
            pending.wait()

    def threads(self) -> dict[str, threading.Thread]:
        """The live queue threads by queue (deferred streams' workers not included)."""
        return dict(self._threads)

    def close(self) -> None:
        """Lets every queue finish what it was given, then joins its thread and its stream's worker.
        Idempotent; the queues refuse work afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        assert threading.current_thread() not in self._threads.values(), "a queue thread cannot close its queues"
        pending = self.take_pending()
        if pending is not None:  # its tail finishes on these threads first; a failure of it is not this call's
            try:
                pending.wait()
            except Exception:  # noqa: BLE001 - raised by the next run or drain had there been one; closing goes on
                pass
        for jobs in self._jobs.values():
            jobs.put(None)
        for thread in self._threads.values():
            thread.join()
        for stream in self._streams.values():
            stream.close()
        self._finalizer.detach()

    def __enter__(self) -> "Queues":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
