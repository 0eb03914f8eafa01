"""Streams, events and the queues that own them (luwu_rt/exec/streams.py)."""

import threading

import pytest
import torch

from luwu_rt.exec.streams import QUEUE_STREAMS, DeferredStream, HostEvent, HostStream, IOStream, JoinedEvent, Queues
from luwu_rt.plan.ops import QUEUES


def _luwu_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("luwu-")}


@pytest.fixture
def gate():
    """An event the test opens: work that waits on it cannot have run before."""
    opened = threading.Event()
    yield opened
    opened.set()  # never leave a worker blocked


def test_deferred_work_runs_after_launch_returned_and_its_event_says_when(gate) -> None:
    stream = DeferredStream("t")
    ran: list[str] = []
    try:
        stream.launch(gate.wait)
        stream.launch(lambda: ran.append("work"))
        event = stream.record()
        assert ran == [] and not event.query()  # enqueued is not done
        gate.set()
        event.synchronize()
        assert ran == ["work"] and event.query()
    finally:
        stream.close()


def test_a_wait_orders_two_deferred_streams_without_blocking_the_issuer(gate) -> None:
    a, b = DeferredStream("a"), DeferredStream("b")
    order: list[str] = []
    try:
        a.launch(gate.wait)
        a.launch(lambda: order.append("a"))
        b.wait(a.record())  # returns at once: the worker of b waits, not this thread
        b.launch(lambda: order.append("b"))
        done = b.record()
        assert not done.query()
        gate.set()
        done.synchronize()
        assert order == ["a", "b"]
    finally:
        a.close()
        b.close()


def test_host_stream_runs_at_launch_and_blocks_on_other_streams(gate) -> None:
    host, deferred = HostStream("h"), DeferredStream("d")
    order: list[str] = []
    try:
        host.launch(lambda: order.append("host"))
        assert order == ["host"] and host.record().query()  # complete when recorded
        deferred.launch(gate.wait)
        deferred.launch(lambda: order.append("deferred"))
        event = deferred.record()
        waiter = threading.Thread(target=host.wait, args=(event,))
        waiter.start()
        waiter.join(0.05)
        assert waiter.is_alive()  # the host thread blocks until the other stream's work is done
        gate.set()
        waiter.join()
        assert order == ["host", "deferred"]
    finally:
        deferred.close()


@pytest.mark.parametrize("kind", [HostStream, DeferredStream])
def test_a_failure_reaches_the_next_event_and_its_dependants_only(kind) -> None:
    stream, other = kind("s"), DeferredStream("o")
    ran: list[str] = []
    try:
        stream.launch(lambda: 1 / 0)
        stream.launch(lambda: ran.append("skipped"))  # after a failure, up to the record
        failed = stream.record()
        with pytest.raises(ZeroDivisionError):
            failed.synchronize()
        stream.launch(lambda: ran.append("next"))
        stream.record().synchronize()  # the stream is clean again after the record
        other.wait(failed)
        other.launch(lambda: ran.append("dependant"))
        with pytest.raises(ZeroDivisionError):
            other.record().synchronize()
        assert ran == ["next"]
    finally:
        stream.close()
        other.close()


def test_joined_event_completes_when_all_parts_do(gate) -> None:
    stream = DeferredStream("d")
    try:
        stream.launch(gate.wait)
        joined = JoinedEvent([HostEvent(done=True), JoinedEvent([stream.record()])])
        assert len(joined.events) == 2 and not joined.query()
        gate.set()
        joined.synchronize()
        assert joined.query()
    finally:
        stream.close()


def test_queues_threads_live_until_close_and_are_joined() -> None:
    before = _luwu_threads()
    queues = Queues(device_streams="deferred")
    assert _luwu_threads() == before  # threads start with the first op of their queue
    where: list[threading.Thread] = []
    for _ in range(3):
        queues.submit("compute", lambda: where.append(threading.current_thread())).wait()
    assert len(set(where)) == 1 and where[0].name == "luwu-compute" and where[0] is not threading.current_thread()
    assert queues.stream("compute") is queues.stream("compute")
    assert isinstance(queues.stream("compute"), DeferredStream) and isinstance(queues.stream("optim"), HostStream)
    started = _luwu_threads() - before
    assert {t.name for t in started} == {"luwu-compute", "luwu-compute-stream", "luwu-optim"}
    with pytest.raises(KeyError):
        queues.submit("optim", lambda: {}["missing"]).wait()  # a job's error reaches whoever waits for it
    queues.close()
    assert not any(t.is_alive() for t in started) and _luwu_threads() == before
    queues.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        queues.submit("compute", lambda: None)


def test_a_transfer_is_completed_as_it_ends_not_when_its_consumer_comes(gate) -> None:
    """[Note: completing a transfer where it ends]: the completion (a read's checksums) runs on the stream's
    completer thread with no consumer waiting; a failed one still reaches whoever synchronises its event."""
    before = _luwu_threads()
    with Queues() as queues:
        stream = queues.stream("nvme_read")
        assert isinstance(stream, IOStream)
        completed: list[str] = []
        done = threading.Event()

        def transfer():  # a transfer that ends when the gate opens
            def complete():
                gate.wait()
                completed.append(threading.current_thread().name)
                done.set()
            return complete

        events = []
        queues.submit("nvme_read", lambda: (stream.launch(transfer), events.append(stream.record()))).wait()
        gate.set()
        assert done.wait(10), "nobody synchronised the event, and the transfer was never completed"
        assert completed == ["luwu-nvme_read-completer"]

        def corrupt():
            def complete():
                raise OSError("checksum mismatch")
            return complete

        queues.submit("nvme_read", lambda: (stream.launch(corrupt), events.append(stream.record()))).wait()
        with pytest.raises(OSError, match="checksum mismatch"):
            events[1].synchronize()
        events[0].synchronize()
        started = _luwu_threads() - before
        assert {t.name for t in started} == {"luwu-nvme_read", "luwu-nvme_read-completer"}
    assert not any(t.is_alive() for t in started)


def test_every_plan_queue_has_a_stream_and_a_reason() -> None:
    assert set(QUEUE_STREAMS) == set(QUEUES)
    assert all(kind in ("host", "device", "io") and why for kind, why in QUEUE_STREAMS.values())
    with Queues() as queues, pytest.raises(KeyError, match="no queue 'disk'"):
        queues.stream("disk")


def test_queues_refuse_unknown_stream_kinds() -> None:
    with pytest.raises(ValueError, match="device_streams"):
        Queues(device_streams="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            Queues(device_streams="cuda")


def test_unclosed_queues_end_their_threads_when_collected() -> None:
    import gc

    before = _luwu_threads()
    queues = Queues(device_streams="deferred")
    queues.submit("h2d", lambda: None).wait()
    started = _luwu_threads() - before
    assert len(started) == 2
    del queues
    gc.collect()
    for t in started:
        t.join(10)
    assert not any(t.is_alive() for t in started)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_streams_order_copies_through_events() -> None:
    queues = Queues(device="cuda")
    try:
        h2d, compute = queues.stream("h2d"), queues.stream("compute")
        assert compute.stream == torch.cuda.current_stream()  # compute runs on the current stream
        host = torch.arange(1 << 22, dtype=torch.float32).pin_memory()
        device = torch.zeros_like(host, device="cuda")
        out = torch.empty_like(device)
        h2d.launch(lambda: device.copy_(host, non_blocking=True))
        compute.wait(h2d.record())
        compute.launch(lambda: torch.mul(device, 2, out=out))
        compute.record().synchronize()
        assert torch.equal(out.cpu(), host * 2)
    finally:
        queues.close()
