"""Heartbeats of the ranks of a run, and one line naming the rank that stopped when a collective fails.

[Note: failure detection]
A collective that fails tells a rank little: gloo says "connection closed by
peer" when a peer died and "timed out" when a peer hangs, without saying which
peer or why. So every rank of a multi-rank run keeps a daemon thread that sets
``luwu/heartbeat/<rank>`` = "<wall time> <last step>" in the run's rendezvous
store every ``PERIOD_S``. The thread holds its own connection to the store: a
``TCPStore`` client serialises its requests, and the process group's own
client may be parked in a blocking ``get`` for as long as the run's timeout.
When a step raises, ``explain`` reads the heartbeats. A dead rank (killed,
crashed) stops beating at once, but the error reaches the others within
milliseconds, so ``explain`` waits up to ``_WAIT_PERIODS`` periods for a
heartbeat to go stale (``_STALE_PERIODS`` periods old) before it gives up
telling a dead rank from a slow one. A hung rank (stopped, deadlocked with the
GIL held) also stops beating; the others find out when the process group's
timeout expires, and by then its heartbeat is that old. A rank that fails
itself writes ``luwu/failed/<rank>`` with its own line before it exits, so the
others say "rank R failed" rather than "stopped responding", and the launcher
knows the rank already explained itself.

The store lives in the launcher (``luwu train --nproc``, or torchrun's agent),
not in rank 0, so the survivors can still read it when rank 0 dies. With plain
``env://`` rendezvous rank 0 hosts it; then an unreachable store is the
explanation: rank 0 (or the launcher) is gone. Heartbeat times are wall-clock
times, compared across machines; they assume clocks agree to well under
``_STALE_PERIODS`` periods, as NTP keeps them.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Beat", "INTERRUPTED_KEY", "PERIOD_S", "explain", "failure", "failures", "is_communication_error",
           "progress", "read_beats", "report_failure", "start", "stop"]

PERIOD_S = 1.0
_STALE_PERIODS = 2.5  # a heartbeat this many periods old means the rank stopped
_WAIT_PERIODS = 3.5  # how long explain() waits for a heartbeat to go stale
_STORE_TIMEOUT_S = 5.0
# Words of the errors gloo and NCCL raise when a peer is gone or late (the store raises DistStoreError).
_COMM_WORDS = ("gloo", "nccl", "connection", "timed out", "peer", "socket", "broken pipe", "collective",
               "process group")


def heartbeat_key(rank: int) -> str:
    return f"luwu/heartbeat/{rank}"


def failed_key(rank: int) -> str:
    return f"luwu/failed/{rank}"


INTERRUPTED_KEY = "luwu/interrupted"
"""Set by the launcher before it forwards Ctrl-C: a rank that then loses a peer is not told it stopped."""


@dataclass(frozen=True, slots=True)
class Beat:
    """A rank's last heartbeat as read from the store."""

    time: float
    step: int | None

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.time


class _Heartbeat:
    def __init__(self, store: Any, address: tuple[str, int] | None, rank: int, world_size: int, period_s: float):
        self.store, self.address, self.rank, self.world_size, self.period_s = store, address, rank, world_size, period_s
        self.step: int | None = None
        self.store_gone = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"luwu-heartbeat-{rank}", daemon=True)

    def beat(self) -> None:
        self.store.set(heartbeat_key(self.rank), f"{time.time():.3f} {-1 if self.step is None else self.step}")

    def _loop(self) -> None:
        while not self.stopped.wait(self.period_s):
            try:
                self.beat()
            except Exception:
                # The store is gone for good (a TCPStore does not come back); explain() says so when a step
                # fails. Retrying would only log a C++ stack trace every period.
                self.store_gone = True
                return


_beat: _Heartbeat | None = None


def _client(timeout_s: float) -> tuple[Any, tuple[str, int] | None]:
    """A new connection to the run's store (and its address), or the default group's store when the
    environment does not name one (``tcp://`` or ``file://`` init)."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        return store, (host, int(port))
    return dist.distributed_c10d._get_default_store(), None


def start(rank: int, world_size: int, *, period_s: float = PERIOD_S) -> None:
    """Starts this rank's heartbeat thread (after the default process group is up). Idempotent."""
    global _beat
    if _beat is not None:
        return
    if not (isinstance(period_s, (int, float)) and period_s > 0):
        raise ValueError(f"heartbeat period must be a positive number of seconds, got {period_s!r}")
    store, address = _client(_STORE_TIMEOUT_S)
    _beat = _Heartbeat(store, address, rank, world_size, float(period_s))
    try:
        store.delete_key(failed_key(rank))  # left by an earlier attempt of a restarted run
    except Exception:
        pass
    _beat.beat()  # at once, so that a rank is never without a heartbeat once it started
    _beat.thread.start()


def stop() -> None:
    """Stops the heartbeat (at the end of a run, so that an idle rank is not taken for a hung one)."""
    global _beat
    if _beat is not None:
        _beat.stopped.set()
        _beat = None


def progress(step: int) -> None:
    """Records the step this rank reached; the next heartbeat carries it."""
    if _beat is not None:
        _beat.step = int(step)


def read_beats(store: Any, world_size: int) -> dict[int, Beat | None]:
    """Every rank's last heartbeat (None for a rank that never sent one). ``check`` first: a ``get`` of
    a missing key would block for the store's timeout."""
    out: dict[int, Beat | None] = {}
    for rank in range(world_size):
        key = heartbeat_key(rank)
        if not store.check([key]):
            out[rank] = None
            continue
        stamp, step = store.get(key).decode().split()
        out[rank] = Beat(float(stamp), None if int(step) < 0 else int(step))
    return out


def failure(store: Any, rank: int) -> tuple[bool, str] | None:
    """Whether ``rank`` failed and said why (``report_failure``): (whether it was a communication error,
    its line), else None."""
    if not store.check([failed_key(rank)]):
        return None
    kind, _, line = store.get(failed_key(rank)).decode().partition(" ")
    return kind == "comm", line


def failures(store: Any, world_size: int) -> dict[int, tuple[bool, str]]:
    """``failure`` of every rank that failed."""
    return {r: f for r in range(world_size) if (f := failure(store, r)) is not None}


def report_failure(exc: BaseException, line: str) -> None:
    """Tells the others and the launcher that this rank failed on ``exc`` and why (best effort)."""
    if _beat is None or _beat.store_gone:
        return
    try:
        store, _ = _client(2.0)
        store.set(failed_key(_beat.rank), f"{'comm' if is_communication_error(exc) else 'own'} {line}")
    except Exception:
        pass


def _first_line(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, without the C++ source location gloo and c10d put first."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0] if lines else "")
    if len(text) > limit and not isinstance(exc, (ValueError, OSError)):  # ours: one line whose end says the fix
        end = text.find(". ")
        text = text[:end + 1] if 0 < end < limit else text[:limit - 3] + "..."
    return f"{type(exc).__name__}: {text}".rstrip(": ")


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective or the store failing, as opposed to a
    problem of this rank's own (a bad setting, a full disk) that the heartbeats cannot explain."""
    import torch.distributed as dist

    for e in _chain(exc):
        if isinstance(e, dist.DistError):
            return True
        if isinstance(e, (RuntimeError, ConnectionError, TimeoutError)):
            text = str(e).lower()
            if any(word in text for word in _COMM_WORDS):
                return True
    return False


def _stopped(beats: dict[int, Beat | None], first: dict[int, Beat | None], me: int, now: float,
             waited: float, period_s: float) -> dict[int, str]:
    """The ranks (but ``me``) whose heartbeat is stale by its time, or did not change while this rank
    watched for ``waited`` seconds (which needs no clock agreement)."""
    stale = _STALE_PERIODS * period_s
    out = {}
    for rank, beat in beats.items():
        if rank == me:
            continue
        if beat is None:
            if waited >= stale:
                out[rank] = f"rank {rank} never sent a heartbeat"
        elif beat.age(now) >= stale or (beat == first[rank] and waited >= stale):
            at = "" if beat.step is None else f", last at step {beat.step}"
            out[rank] = f"rank {rank} stopped responding (no heartbeat for {beat.age(now):.1f} s{at})"
    return out


def explain(exc: BaseException) -> str:
    """One line on why ``exc`` happened: the rank(s) that failed or stopped, else the exception
    ([Note: failure detection])."""
    own = _first_line(exc)
    beat = _beat
    if beat is None or not is_communication_error(exc):
        return own
    where = f" at {beat.address[0]}:{beat.address[1]}" if beat.address else ""
    gone = (f"the rendezvous store{where} is unreachable, so the process hosting it is gone: the launcher "
            f"(luwu train --nproc, torchrun) or, with plain env:// rendezvous, rank 0 ({own})")
    if beat.store_gone:
        return gone
    try:
        # A connection of its own: the heartbeat thread keeps using its one, so that this rank does not
        # look stopped to the others while it explains. A short timeout: the store may be gone.
        store, _ = _client(2.0)
        t0 = time.monotonic()
        first = read_beats(store, beat.world_size)
        while True:
            if store.check([INTERRUPTED_KEY]):
                return f"the run was interrupted ({own})"
            failed = {r: f for r, f in failures(store, beat.world_size).items() if r != beat.rank}
            # A rank that failed on its own is the cause; one that failed on a collective is a witness
            # like this one, and its heartbeat stopped because it exited, so it is not named as stopped.
            cause = {r: line for r, (comm, line) in failed.items() if not comm}
            if cause:
                return "; ".join(f"rank {r} failed: {cause[r]}" for r in sorted(cause))
            waited = time.monotonic() - t0
            beats = {r: b for r, b in read_beats(store, beat.world_size).items() if r not in failed}
            stopped = _stopped(beats, first, beat.rank, time.time(), waited, beat.period_s)
            if stopped:
                return "; ".join(stopped[r] for r in sorted(stopped))
            if waited >= _WAIT_PERIODS * beat.period_s:
                if failed:
                    return "; ".join(f"rank {r} failed" for r in sorted(failed)) + f" ({own})"
                return f"every rank still sends heartbeats ({own})"
            time.sleep(min(0.25, beat.period_s / 4))
    except Exception:
        beat.store_gone = True
        return gone
