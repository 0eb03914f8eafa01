"""Ctrl-C and SIGTERM in ``luwu train``: stop at a step boundary, save, close, exit 128 + the signal.

[Note: interrupting a run]
Raising ``KeyboardInterrupt`` wherever the main thread happens to be is what
made Ctrl-C abort: the exception unwinds while queue threads and the IO
engine's native threads are inside torch or io_uring calls, and the
interpreter then exits under them ("terminate called without an active
exception", SIGABRT). So ``luwu train`` installs these handlers first thing and
a signal only *requests* a stop: the training loop looks at the request after
each step (on every rank, agreeing through one all-reduce so that all ranks
stop after the same step), writes a checkpoint of that step when
``--ckpt-dir`` is set and it is not already saved, joins the threads and exits
130 (SIGINT) or 143 (SIGTERM). A second signal exits at once with
``os._exit``: no interpreter shutdown runs under the native threads, and
checkpoints are safe because a checkpoint only becomes visible by a rename
(a partial directory left behind is removed by the next writer).

A wait on another process - the optimizer node's answers - may not end by
itself (a node that hangs, a handshake that never completes): such a wait
asks ``pending()`` as it waits and, once a stop is requested and the wait has
seen no progress for a moment, raises ``Interrupted``, a ``KeyboardInterrupt``
that ``luwu`` reports in one line and exits 128 + the signal with.

``LUWU_TEST_SIGNAL_AT=<phase>[@<step>]`` makes the process send itself SIGINT
when it reaches ``phase`` (``start``, ``forward``, ``backward``, ``optimizer``,
``checkpoint``) of step ``step`` (default 1; for ``checkpoint`` the step being
saved), once: tests interrupt a real run at a chosen instant with it. With several
ranks ``LUWU_TEST_SIGNAL_RANK=<r>`` limits it to rank ``r``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

__all__ = ["LAUNCHER_ENV", "Interrupted", "StopRequest", "die_with_launcher", "pending", "test_hook", "wrap_handlers"]

LAUNCHER_ENV = "LUWU_LAUNCHER_PID"
"""Set by a launcher in the environment of the processes it starts (ranks, a spawned optimizer node): its pid."""
_PR_SET_PDEATHSIG = 1
_fired = threading.Event()
_active: "StopRequest | None" = None
"""The installed handlers of this process, if any."""


class Interrupted(KeyboardInterrupt):
    """A wait that a stop request ended ([Note: interrupting a run]); ``luwu`` exits ``exit_code``."""

    def __init__(self, signum: int, text: str) -> None:
        super().__init__(text)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def pending() -> int | None:
    """The signal that asked this process to stop, while ``StopRequest`` handlers are installed; else None."""
    active = _active
    return active.signum if active is not None else None


class StopRequest:
    """The handlers of SIGINT and SIGTERM, and the signal that asked to stop (``None`` until one did)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def install(self) -> "StopRequest":
        global _active
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
            _active = self
        return self

    def restore(self) -> None:
        global _active
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        if _active is self:
            _active = None

    def finish(self, *, ignore_signals: bool) -> None:
        """The run is over (saved, threads joined). ``ignore_signals``: this process is the ``luwu`` command
        itself, which ignores signals from here on: interpreter shutdown resets Python's handlers to the
        default, and a Ctrl-C during it would kill the finished process by SIGINT instead of letting it
        exit with its status. Otherwise (a caller of the CLI in its own process) the old handlers return."""
        if not self._old:
            return
        global _active
        if ignore_signals:
            for sig in self._old:
                signal.signal(sig, signal.SIG_IGN)
            self._old.clear()
            if _active is self:
                _active = None
        else:
            self.restore()

    def _handle(self, signum: int, _frame) -> None:
        if self.signum is not None:
            os.write(2, b"luwu: interrupted again; exiting now (checkpoints already written are intact)\n")
            os._exit(128 + signum)  # [Note: interrupting a run]: no interpreter shutdown under native threads
        self.signum = signum
        if int(os.environ.get("RANK") or 0) == 0:
            os.write(2, f"luwu: {signal.Signals(signum).name}: stopping after the current step "
                        f"(again to exit at once)\n".encode())

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


def test_hook(phase: str, step: int) -> None:
    """Sends this process SIGINT once, when ``LUWU_TEST_SIGNAL_AT`` names ``phase`` of ``step``."""
    spec = os.environ.get("LUWU_TEST_SIGNAL_AT")
    if not spec or _fired.is_set():
        return
    name, _, at = spec.partition("@")
    rank = os.environ.get("LUWU_TEST_SIGNAL_RANK")
    if rank is not None and rank != (os.environ.get("RANK") or "0"):
        return
    if name == phase and step == int(at or 1):
        _fired.set()
        os.kill(os.getpid(), signal.SIGINT)


def wrap_handlers(engine) -> None:
    """Routes the engine's compute and optimizer handlers through ``test_hook`` (only when the test
    variable is set: a normal run's handlers stay as they are)."""
    if not os.environ.get("LUWU_TEST_SIGNAL_AT"):
        return
    handlers = dict(engine.executor.handlers)

    def hooked(kind: str, phase) -> None:
        inner = handlers.get(kind)
        if inner is None:  # e.g. no OptimStep on a worker whose optimizer runs on a node
            return

        def run(op, views):
            test_hook(phase(op), engine.step + 1)
            return inner(op, views)

        handlers[kind] = run

    hooked("Compute", lambda op: "forward" if op.name.startswith("F") else "backward")
    hooked("OptimStep", lambda op: "optimizer")
    engine.executor.handlers = handlers


def die_with_launcher() -> None:
    """Has the kernel SIGKILL this process when the launcher that started it (``LAUNCHER_ENV``) dies, however
    it dies: a launcher killed by SIGKILL leaves no rank or spawned node behind ([Note: no process left
    behind] in dist/launch.py). Nothing without ``LAUNCHER_ENV`` or off Linux."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # it died before the request took effect
        os._exit(1)
