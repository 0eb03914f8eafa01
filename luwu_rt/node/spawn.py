"""``luwu train --spawn-node``: local optimizer node processes for the run, stopped when the run ends or fails."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from collections.abc import Iterator

from luwu_rt.interrupt import LAUNCHER_ENV

from .client import NodeError

__all__ = ["spawned_node"]


@contextmanager
def spawned_node(*, num_workers: int, host_mem: str = "1GiB", timeout_s: float = 300.0, num_shards: int = 1,
                 start_timeout_s: float = 120.0, log_file: str | None = None) -> Iterator[str]:
    """Starts ``num_shards`` ``luwu node serve`` processes (node shards, [Note: node shards] in shards.py) on
    free loopback ports and yields their addresses as ``--node`` takes them (comma-separated, in shard
    order); on leaving, the nodes get ``timeout_s`` to finish (each exits by itself once every worker said
    BYE), then are terminated. The nodes share the workers' terminal: their per-step lines would break the
    progress bar there, so they go to ``log_file`` (every shard's, each line naming its shard), or nowhere."""
    with tempfile.TemporaryDirectory(prefix="luwu-node-") as tmp:
        ready = [os.path.join(tmp, f"address-{i}") for i in range(num_shards)]
        logging = ["--log-file", log_file] if log_file else []
        # A node dies with this process, however it ends (SIGKILL too): die_with_launcher in interrupt.py.
        env = {**os.environ, LAUNCHER_ENV: str(os.getpid())}
        procs = [subprocess.Popen([sys.executable, "-m", "luwu_rt", "node", "serve", "--bind", "tcp://127.0.0.1:*",
                                   "--num-workers", str(num_workers), "--host-mem", host_mem,
                                   "--timeout", str(timeout_s), "--shard", f"{i}/{num_shards}",
                                   "--ready-file", ready[i], "--quiet", *logging], env=env) for i in range(num_shards)]
        try:
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
            yield ",".join(addresses)
            end = time.monotonic() + min(timeout_s, 30.0)
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
