"""A worker's link to the node closes however its IO thread ended: no send to the thread's pipe may wait
forever once the thread has returned."""

import threading
import time

from luwu_rt.node.client import NodeClient


def _returns(fn, timeout_s: float = 5.0) -> bool:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()  # a hung call leaks a daemon thread, not the test run
    return done.wait(timeout_s)


def test_close_returns_when_the_io_thread_returned_between_its_check_and_its_wake() -> None:
    """close() checks that the IO thread is alive, queues its BYE, sets the stop flag and wakes the thread. The
    thread may see the flag from the BYE's wake, return and close its end of the pipe before close()'s own wake:
    that wake blocked forever (a worker hung after its last step). Replayed here deterministically: the thread
    has returned, yet close() is told it is alive."""
    client = NodeClient("tcp://127.0.0.1:1", rank=0, timeout_s=1.0, chunk_bytes=4096)
    thread = client._thread
    client._stop.set()
    client._nudge()
    thread.join(5)
    assert not thread.is_alive()
    time.sleep(0.2)  # the closed end's pipe is torn down by ZeroMQ's own threads, a moment later
    client._stop.clear()
    client.welcome = {}  # as after a handshake: close() says BYE
    thread.is_alive = lambda: True
    assert _returns(lambda: client.close()), "close() hung on the pipe of a returned IO thread"


def test_a_send_after_the_io_thread_returned_does_not_block() -> None:
    client = NodeClient("tcp://127.0.0.1:1", rank=0, timeout_s=1.0, chunk_bytes=4096)
    client._stop.set()
    client._nudge()
    client._thread.join(5)
    returned = _returns(lambda: [client._nudge() for _ in range(3000)])  # more than the pipe's 1000 messages
    if returned:  # a hung send holds the client's lock, which close() takes
        client.close(bye=False)
    assert returned, "a wake blocked on the pipe of a returned IO thread"
