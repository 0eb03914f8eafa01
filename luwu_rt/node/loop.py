"""The optimizer node's socket loop: its ROUTER, and the one thread that receives and sends on it
([Note: the node's threads] in service.py)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from .auth import NodeGate
from .config import NodeConfig
from .events import Mailbox
from .machine import NodeProtocol
from .steps import NodeSteps

__all__ = ["RECEIVE_MESSAGES", "serve_loop"]

RECEIVE_MESSAGES = 2
"""Messages a connection may have waiting in the node's socket (ZeroMQ's receive high-water mark, per peer),
beside the one it is receiving: beyond them a peer waits in TCP, in no memory of the node's. (1 would do, but
with CURVE a connection then receives nothing at all: libzmq 4.3.) The loop takes them as they come (a
stranger's dropped by their header, [Note: strangers] in machine.py), so a worker's pushes flow as fast;
a connection costs the node at most three frames of ``max_message_bytes`` however it floods ([Note: the
connection cap] in auth.py)."""


def serve_loop(*, config: NodeConfig, protocol: NodeProtocol, steps: NodeSteps, mailbox: Mailbox,
               stopping: threading.Event, log: Callable[[str], None], bound: Callable[[str], None],
               ready: threading.Event | None = None) -> int:
    """Binds ``config.bind`` and runs until the run is over or ``stopping`` is set; returns the exit status
    (1 when a step failed). ``bound(address)``: the address it listens on (the system's port for a ``*``)."""
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 2000)
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting worker takes over its identity
    router.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)  # per frame: a header or one payload
    router.setsockopt(zmq.RCVHWM, RECEIVE_MESSAGES)
    inbox = ctx.socket(zmq.PULL)
    gate = None
    try:
        gate = NodeGate(ctx, router, config.auth_keys, max_connections=config.max_connections,
                        rejects=protocol.rejects, log=log)
        try:
            router.bind(config.bind)
        except zmq.ZMQError as exc:  # in use, or an address this machine has not: one line, not a traceback
            raise OSError(exc.errno, f"--bind {config.bind}: cannot listen there ({os.strerror(exc.errno)}); "
                                     f"choose a free port, or a port of * for one the system picks") from None
        address = router.getsockopt_string(zmq.LAST_ENDPOINT)
        bound(address)
        wake = f"inproc://luwu-node-wake-{id(mailbox)}"
        inbox.bind(wake)
        mailbox.attach(ctx, wake)
        log(f"listening on {address} for {config.num_workers} worker(s) "
            + (f"(CURVE: clients in {config.auth_keys}/clients only)" if config.auth_keys else
               "(open: loopback without --auth-keys, every local client is accepted)"))
        if ready is not None:
            ready.set()
        protocol.progress_at = time.monotonic()  # the join's --timeout counts from here
        return _run(router, inbox, config=config, protocol=protocol, steps=steps, mailbox=mailbox,
                    stopping=stopping, log=log)
    finally:
        protocol.flush_log()
        mailbox.detach()
        inbox.close(0)
        if gate is not None:
            gate.close()
        router.close()
        ctx.term()


def _run(router, inbox, *, config: NodeConfig, protocol: NodeProtocol, steps: NodeSteps, mailbox: Mailbox,
         stopping: threading.Event, log: Callable[[str], None]) -> int:
    import zmq

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(inbox, zmq.POLLIN)
    finished_at = None
    while True:
        events = dict(poller.poll(500))
        while router in events:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            protocol.handle(frames[0].bytes, frames[1:])
        if inbox in events:
            while inbox.poll(0):
                inbox.recv()
        for event in mailbox.take():
            protocol.apply(event)
        outbox, protocol.outbox = protocol.outbox, []
        for identity, frames in outbox:
            router.send_multipart([identity, *frames], copy=False)
        if stopping.is_set():
            return 0
        if not protocol.welcomed and time.monotonic() - protocol.progress_at > config.timeout:
            problem = protocol.join_problem()
            log(f"error: {problem}")
            for identity, frames in protocol.failure(f"optimizer node gave up: {problem}"):
                router.send_multipart([identity, *frames])
            return 1
        if steps.error is not None:
            log(f"error: {steps.error}")
            for identity, frames in protocol.failure(f"optimizer node failed: {steps.error}"):
                router.send_multipart([identity, *frames])
            return 1
        if steps.done.is_set():
            finished_at = finished_at or time.monotonic()
            if len(protocol.byes) >= config.num_workers or time.monotonic() - finished_at > config.timeout:
                log(f"done: {protocol.runner.step} steps; rejected {dict(protocol.rejects) or 'none'}, "
                    f"{protocol.duplicates} duplicate pushes")
                return 0
