"""What the optimizer node's threads hand each other ([Note: the node's threads] in service.py).

Each hand-off is a type of its own, and its receiver dispatches on the type: the socket loop applies
the events to the protocol state machine (which alone sends), the steps thread takes the requests that
arrive between two steps. ``Mailbox`` carries events to the loop from any thread and wakes it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from .protocol import Message

__all__ = ["Begin", "Mailbox", "NormsKnown", "ReadState", "Refusal", "StateRead", "StepDone", "UnitServed"]


# -- events, for the socket loop ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class UnitServed:
    """An executor thread's ``Serve``: the pulls waiting for ``unit`` after ``step`` can be answered."""

    unit: int
    step: int


@dataclass(frozen=True, slots=True)
class NormsKnown:
    """Shard 0's hub has every shard's partial norm of ``step``: the shards' NORMs can be answered."""

    step: int


@dataclass(frozen=True, slots=True)
class StepDone:
    """The steps thread finished ``step``: its STATS (JSON) go to every worker."""

    step: int
    stats: bytes


@dataclass(frozen=True, slots=True)
class StateRead:
    """The steps thread read the optimizer state a GET_STATE (``request``) asked for: sent as STATE."""

    identity: bytes
    request: Message
    values: torch.Tensor


@dataclass(frozen=True, slots=True)
class Refusal:
    """An ERROR line for the peer ``identity``."""

    identity: bytes
    text: str


Event = UnitServed | NormsKnown | StepDone | StateRead | Refusal


# -- requests, for the steps thread between two steps ([Note: between two steps] in steps.py) ---------

@dataclass(frozen=True, slots=True)
class Begin:
    """A worker began ``step``: the steps thread runs its plan."""

    step: int


@dataclass(frozen=True, slots=True)
class ReadState:
    """A GET_STATE from ``identity``, answered from the quiet store."""

    identity: bytes
    request: Message


class Mailbox:
    """Events for the socket loop from any thread: a queue, and a wake-up message on an inproc socket
    that the loop polls beside its ROUTER (ZeroMQ sockets are not thread-safe: only the loop sends)."""

    def __init__(self) -> None:
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = None
        self._lock = threading.Lock()

    def post(self, event: Event | None = None) -> None:
        """Files ``event`` (None: only wakes the loop) and wakes the loop, if one listens."""
        if event is not None:
            self._events.put(event)
        with self._lock:
            if self._wake is not None:
                self._wake.send(b"")

    def take(self) -> list[Event]:
        out = []
        while not self._events.empty():
            out.append(self._events.get())
        return out

    def attach(self, ctx, address: str) -> None:
        """The loop's side: wake-ups go to ``address`` (an inproc PULL the loop bound) from now on."""
        import zmq

        with self._lock:
            self._wake = ctx.socket(zmq.PUSH)
            self._wake.connect(address)

    def detach(self) -> None:
        with self._lock:
            if self._wake is not None:
                self._wake.close(0)
                self._wake = None
