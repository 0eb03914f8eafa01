"""Starting the ranks of a multi-rank run on one machine, and what a rank does around its training.

``luwu train --nproc N`` does not train: ``launch`` spawns N ranks running the
same command with the ``torch.distributed`` environment of one machine on
loopback, and waits for them. Each rank calls ``pin_cores`` (its share of this
machine's cores) and ``run_rank`` (join the process group, heartbeat, and on a
failure one line naming the cause). ``torchrun --nproc-per-node N -m luwu_rt
train ...`` gives the ranks the same environment and works the same way.

[Note: the launcher hosts the store]
With plain ``env://`` rendezvous rank 0 hosts the ``TCPStore`` that the ranks
meet in; when rank 0 dies the store dies with it, and the survivors can no
longer read the heartbeats that would name it. So the launcher hosts the store
itself and the ranks connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE``,
as torchrun's agent does). The launcher reads it too: a rank that failed wrote
why (``health.report_failure``), so the launcher only speaks for ranks that
could not (killed by a signal), and while it waits for the survivors to exit it
kills at once a rank whose heartbeat stopped (SIGSTOPped, or deadlocked with
the GIL held): that one would never exit by itself.

[Note: no process left behind]
Every rank runs in a session of its own (so the terminal's Ctrl-C reaches only
the launcher, which forwards it) and is ended by its process group, with
whatever it started. A rank also asks the kernel to SIGKILL it when the
launcher dies (``die_with_launcher`` in interrupt.py), which covers a launcher killed by SIGKILL; so does
the optimizer node that ``--spawn-node`` starts.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from luwu_rt.dist import health
from luwu_rt.interrupt import LAUNCHER_ENV, die_with_launcher

__all__ = ["core_slice", "launch", "pin_cores", "rank_env", "run_rank"]

_INTERRUPT_GRACE_S = 10.0  # after forwarding Ctrl-C, how long the ranks get to exit by themselves
_TERM_GRACE_S = 3.0  # between SIGTERM and SIGKILL
_HUNG_PERIODS = 5  # heartbeat periods after which the launcher takes a surviving rank for hung
_POLL_S = 0.1


def core_slice(cores: Sequence[int], local_rank: int, local_size: int) -> list[int]:
    """This rank's share of ``cores``: a contiguous slice, sizes differing by at most one; with fewer
    cores than ranks, one core each, round-robin."""
    if not (isinstance(local_size, int) and local_size >= 1):
        raise ValueError(f"local world size must be an integer >= 1, got {local_size!r} (LOCAL_WORLD_SIZE)")
    if not (isinstance(local_rank, int) and 0 <= local_rank < local_size):
        raise ValueError(f"local rank must be in [0, {local_size}), got {local_rank!r} (LOCAL_RANK)")
    cores = sorted(cores)
    if not cores:
        raise ValueError("no cores to split: this process's CPU affinity mask is empty")
    n = len(cores)
    if n < local_size:
        return [cores[local_rank % n]]
    return cores[local_rank * n // local_size:(local_rank + 1) * n // local_size]


def pin_cores(local_rank: int, local_size: int) -> list[int]:
    """Pins this process to its share of the machine's cores (``core_slice`` of the cores it may use)
    and sizes torch's and the optimizer kernels' thread pools to it, so that the ranks of one machine
    do not oversubscribe it. Call it before anything starts threads. Returns the cores."""
    import torch

    mine = core_slice(os.sched_getaffinity(0), local_rank, local_size)
    # Affinity is per thread on Linux: set it on the threads that exist (the interpreter may have started
    # some); the ones started later inherit it. The C++ optimizer pool pins its workers to the CPUs of this
    # mask and, like torch, runs torch.get_num_threads() of them (luwu_rt/kernels/_cpp.py), so it follows.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile; or a container forbids it, and the rank is correct anyway
    torch.set_num_threads(len(mine))
    if "numba" not in sys.modules:  # numba sizes its pool from this when it is imported
        os.environ["NUMBA_NUM_THREADS"] = str(len(mine))
    return mine


def rank_env(rank: int, world_size: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of rank ``rank`` of a one-machine run whose store (hosted by this launcher)
    listens on ``port`` of loopback ([Note: the launcher hosts the store])."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
               **{LAUNCHER_ENV: str(os.getpid())})
    return env


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _signal_groups(procs: Sequence[subprocess.Popen], sig: int) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_all(procs: Sequence[subprocess.Popen], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _end(procs: Sequence[subprocess.Popen]) -> None:
    """Ends every rank and what it started: SIGTERM (with SIGCONT, for a stopped one), then SIGKILL."""
    live = [p for p in procs if p.poll() is None]
    if live:
        _signal_groups(live, signal.SIGTERM)
        _signal_groups(live, signal.SIGCONT)
        if not _wait_all(live, _TERM_GRACE_S):
            _signal_groups(live, signal.SIGKILL)
    for p in procs:
        p.wait()
    _signal_groups(procs, signal.SIGKILL)  # descendants left in a finished rank's group


class _Interrupted(Exception):
    pass


def _raise_interrupted(signum, _frame):
    raise _Interrupted(signal.Signals(signum).name)


def _hung(store, ranks: Sequence[int], world_size: int) -> dict[int, float]:
    """The ``ranks`` whose heartbeat stopped, with its age ([Note: failure detection] in health.py)."""
    try:
        beats = health.read_beats(store, world_size)
    except Exception:
        return {}
    now = time.time()
    ages = {r: beats[r].age(now) for r in ranks if beats[r] is not None}
    return {r: age for r, age in ages.items() if age >= _HUNG_PERIODS * health.PERIOD_S}


def launch(command: Sequence[str], nproc: int, *, timeout_s: float, env: dict[str, str] | None = None) -> int:
    """Runs ``command`` as ranks 0..nproc-1 of a run on this machine and waits for them. When a rank
    fails, the others get ``timeout_s`` to exit by themselves (they name the failed rank), then what is
    left is killed. Returns 0 when every rank exited 0, else the first failure's exit code (128 + the
    signal for a rank killed by one; 130 when the launcher was interrupted). ``env`` is the ranks' base
    environment (default: this process's)."""
    import torch.distributed as dist

    if not (isinstance(nproc, int) and nproc >= 1):
        raise ValueError(f"nproc (--nproc) must be an integer >= 1, got {nproc!r}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout_s!r}")
    # Port 0: the kernel picks a free port, with no window for another process to take it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    procs: list[subprocess.Popen] = []
    main_thread = threading.current_thread() is threading.main_thread()
    # Both installed here, not left to Python: a launcher started from a script in the background inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt for it (kill -INT would do nothing).
    old = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    interrupted = False
    first: tuple[int, int] | None = None  # (rank, exit code) of the first rank that failed
    try:
        for rank in range(nproc):
            procs.append(subprocess.Popen(list(command), env=rank_env(rank, nproc, store.port, env),
                                          start_new_session=True))
        deadline = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if first is None:
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    first = _cause(store, failed)
                    _announce(store, *first)
                    deadline = time.monotonic() + timeout_s
            if deadline is not None:
                running = [r for r, c in enumerate(codes) if c is None]
                hung = _hung(store, running, nproc)
                if hung:
                    for r, age in hung.items():
                        print(f"luwu: rank {r} has sent no heartbeat for {age:.1f} s and will not exit by itself; "
                              f"killing it", file=sys.stderr)
                    _end([procs[r] for r in hung])
                elif time.monotonic() >= deadline:
                    print(f"luwu: rank(s) {', '.join(map(str, running))} still running {timeout_s:g} s after "
                          f"rank {first[0]} failed; killing them", file=sys.stderr)
                    break
            time.sleep(_POLL_S)
    except (KeyboardInterrupt, _Interrupted):
        interrupted = True
        print("luwu: interrupted; stopping the ranks", file=sys.stderr)
        store.set(health.INTERRUPTED_KEY, "1")
        _signal_groups([p for p in procs if p.poll() is None], signal.SIGINT)
        try:
            # The ranks finish their step and save it ([Note: interrupting a run] in interrupt.py): they
            # get the run's timeout for that; a second Ctrl-C kills them at once.
            _wait_all(procs, max(_INTERRUPT_GRACE_S, timeout_s))
        except (KeyboardInterrupt, _Interrupted):
            pass  # a second Ctrl-C: kill them now
    finally:
        _end(procs)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if interrupted:
        return 130
    if first is None:
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if not failed:
            return 0
        first = _cause(store, failed)
        _announce(store, *first)
    rank, code = first
    return code if code > 0 else 128 - code


def _cause(store, failed: list[tuple[int, int]]) -> tuple[int, int]:
    """Of ranks found ended with failure codes in the same poll, ``(rank, code)`` of the cause: one that failed on its
    own (``health.report_failure``), not a witness that failed on a collective naming it and exited first; else the
    lowest rank. A witness exits 1 within a poll of the cause, so which one was seen first was a race."""
    for rank, code in failed:
        try:
            said = health.failure(store, rank)
        except Exception:  # the store cannot say
            break
        if said is not None and not said[0]:
            return rank, code
    return failed[0]


def _announce(store, rank: int, code: int) -> None:
    """Says why ``rank`` ended, unless it said so itself."""
    try:
        if health.failure(store, rank) is not None:
            return
    except Exception:
        pass  # the store cannot say; better to say it twice than not at all
    how = f"was killed by signal {_signal_name(code)}" if code < 0 else f"exited with code {code}"
    _say(f"luwu: rank {rank} {how}")


def _say(line: str) -> None:
    """Writes one line to stderr in one write: ranks share the terminal, and print's separate writes of the
    text and its newline let two ranks' lines run into one."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stderr without a descriptor (captured in-process)
        print(line, file=sys.stderr, flush=True)
        return
    os.write(fd, (line + "\n").encode(errors="replace"))


def run_rank(train: Callable[[], int], *, timeout_s: float, cleanup: Callable[[], None] = lambda: None) -> int:
    """Runs ``train`` as one rank of a multi-rank run: joins the process group (``timeout_s`` for every
    collective), starts the heartbeat, and ends the process with what ``train`` returns. When it raises (anything but
    KeyboardInterrupt), prints ``luwu: rank R: <why>`` naming the rank that failed or stopped, runs ``cleanup``
    and ends the process at once, with code 2 for an error the user can fix (``ValueError``/``OSError``, as
    ``luwu`` exits), else 1: queue threads may be stuck in collectives, and a normal interpreter exit would
    wait for them. ``cleanup`` removes what the rank made (its NVMe tier's files) without waiting for
    anything: the process ends at once after it."""
    from luwu_rt.dist.world import init_from_env

    die_with_launcher()
    rank = os.environ.get("RANK", "?")
    try:
        world = init_from_env(timeout_s=timeout_s)
        rank = str(world.rank)
        health.start(world.rank, world.size)
        code = train()
    except KeyboardInterrupt:
        cleanup()
        raise
    except Exception as exc:
        communication = health.is_communication_error(exc)
        user = isinstance(exc, (ValueError, OSError)) and not communication
        if not (user or communication):
            traceback.print_exc()  # a bug: keep its traceback, as luwu's main() would
        line = health.explain(exc)
        health.report_failure(exc, line)
        sys.stdout.flush()
        sys.stderr.flush()
        _say(f"luwu: rank {rank}: {line}")
        cleanup()
        os._exit(2 if user else 1)  # as luwu's main() exits: 2 for what the user can fix
    health.stop()
    # The rank's work is done and saved (the engine closed, its outputs written): end the process here.
    # In the interpreter's exit, native threads (gloo's) were now and then destroyed still joinable, and
    # a rank that had finished cleanly died of SIGABRT ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
