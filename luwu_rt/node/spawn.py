"""``luwu train --spawn-node``: local optimizer node processes for the run, stopped when the run ends or fails.

[Note: spawned nodes that die]
With ``--node-snapshot-every K`` each spawned shard snapshots its state every K
steps into a directory of its own, and a shard that dies while the run goes on
(killed, out of memory) is started again by this process, at the address the
workers know, on those snapshots: the workers rejoin it and replay from its
snapshot's step ([Note: a node that restarts] and [Note: node shards that
restart] in worker.py), so the run goes on with the losses it would have had.
A shard is restarted at most ``MAX_RESTARTS`` times in a run: one that keeps
dying has a cause that another start will not cure, and the workers then stop
with the reason. Without snapshots a node that dies ends the run, which
resumes from its last checkpoint (``luwu train --resume``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from luwu_rt.interrupt import LAUNCHER_ENV

from .client import NodeError

__all__ = ["MAX_RESTARTS", "spawned_node"]

MAX_RESTARTS = 3
"""Restarts of one spawned node shard per run ([Note: spawned nodes that die])."""


@contextmanager
def spawned_node(*, num_workers: int, host_mem: str = "1GiB", timeout_s: float = 300.0, num_shards: int = 1,
                 start_timeout_s: float = 120.0, log_file: str | None = None, snapshot_every: int = 0,
                 snapshot_dir: str | None = None) -> Iterator[str]:
    """Starts ``num_shards`` ``luwu node serve`` processes (node shards, [Note: node shards] in shards.py) on
    free loopback ports and yields their addresses as ``--node`` takes them (comma-separated, in shard
    order); on leaving, the nodes get ``timeout_s`` to finish (each exits by itself once every worker said
    BYE), then are terminated. The nodes share the workers' terminal: their per-step lines would break the
    progress bar there, so they go to ``log_file`` (every shard's, each line naming its shard), or nowhere.
    ``snapshot_every`` > 0: each shard snapshots every that many steps (into ``snapshot_dir``/shard-i, by
    default a temporary directory) and is restarted when it dies ([Note: spawned nodes that die])."""
    if snapshot_every < 0:
        raise ValueError(f"--node-snapshot-every {snapshot_every}: give a number of steps >= 1, or 0 for none")
    with tempfile.TemporaryDirectory(prefix="luwu-node-") as tmp:
        ready = [os.path.join(tmp, f"address-{i}") for i in range(num_shards)]
        common = ["--num-workers", str(num_workers), "--host-mem", host_mem, "--timeout", str(timeout_s), "--quiet"]
        if log_file:
            common += ["--log-file", log_file]
        commands = []
        for i in range(num_shards):
            snapshots = []
            if snapshot_every:
                directory = os.path.join(snapshot_dir or tmp, f"shard-{i}")
                os.makedirs(directory, exist_ok=True)
                snapshots = ["--snapshot-dir", directory, "--snapshot-every", str(snapshot_every)]
            commands.append([sys.executable, "-m", "luwu_rt", "node", "serve", *common, "--shard", f"{i}/{num_shards}",
                             "--ready-file", ready[i], *snapshots])
        # A node dies with this process, however it ends (SIGKILL too): die_with_launcher in interrupt.py.
        env = {**os.environ, LAUNCHER_ENV: str(os.getpid())}
        procs = [subprocess.Popen([*c, "--bind", "tcp://127.0.0.1:*"], env=env) for c in commands]
        keeper = None
        try:
            addresses = _addresses(procs, ready, start_timeout_s)
            if snapshot_every:
                keeper = _Keeper(procs, commands, addresses, env)
            yield ",".join(addresses)
            if keeper is not None:
                keeper.stop()
            end = time.monotonic() + min(timeout_s, 30.0)
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if keeper is not None:
                keeper.stop()
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _addresses(procs: list[subprocess.Popen], ready: list[str], start_timeout_s: float) -> list[str]:
    """The address each node process listens at, once each wrote its ``--ready-file``."""
    deadline = time.monotonic() + start_timeout_s
    while not all(os.path.exists(r) for r in ready):
        for proc in procs:
            if proc.poll() is not None:
                raise NodeError(f"an optimizer node exited with status {proc.returncode} before it "
                                f"listened (see its output above)")
        if time.monotonic() > deadline:
            raise NodeError(f"the optimizer node did not listen within {start_timeout_s:g}s")
        time.sleep(0.05)
    addresses = []
    for r in ready:
        with open(r) as f:
            addresses.append(f.read().strip())
    return addresses


class _Keeper:
    """Starts a spawned node shard again, at its address, when it exits with a failure while the run goes on
    ([Note: spawned nodes that die]); ``procs`` is updated in place, so the caller ends the live processes."""

    def __init__(self, procs: list[subprocess.Popen], commands: list[list[str]], addresses: list[str],
                 env: dict[str, str]) -> None:
        self.procs, self.commands, self.addresses, self.env = procs, commands, addresses, env
        self.restarts = [0] * len(procs)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="luwu-node-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No restart from now on: the run ended, and its nodes exit or are ended."""
        with self._lock:
            self._stopping.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stopping.wait(0.1):
            for i, proc in enumerate(self.procs):
                code = proc.poll()
                if code in (None, 0) or self.restarts[i] >= MAX_RESTARTS:
                    continue  # running, done (every worker said BYE), or given up on
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self.restarts[i] += 1
                    print(f"luwu: optimizer node shard {i} exited with status {code}; starting it again on its "
                          f"snapshots at {self.addresses[i]} (restart {self.restarts[i]} of {MAX_RESTARTS})",
                          file=sys.stderr, flush=True)
                    self.procs[i] = subprocess.Popen([*self.commands[i], "--bind", self.addresses[i]], env=self.env)
