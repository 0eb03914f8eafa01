"""``luwu train --spawn-node``: a local optimizer node for the run, stopped when the run ends or fails."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from collections.abc import Iterator

__all__ = ["spawned_node"]


@contextmanager
def spawned_node(*, num_workers: int, host_mem: str = "1GiB", timeout_s: float = 300.0,
                 start_timeout_s: float = 120.0) -> Iterator[str]:
    """Starts ``luwu node serve`` on a free loopback port and yields its address; on leaving, the node
    gets ``timeout_s`` to finish (it exits by itself once every worker said BYE), then is terminated."""
    with tempfile.TemporaryDirectory(prefix="luwu-node-") as tmp:
        ready = os.path.join(tmp, "address")
        proc = subprocess.Popen([sys.executable, "-m", "luwu_rt", "node", "serve", "--bind", "tcp://127.0.0.1:*",
                                 "--num-workers", str(num_workers), "--host-mem", host_mem,
                                 "--timeout", str(timeout_s), "--ready-file", ready])
        try:
            deadline = time.monotonic() + start_timeout_s
            while not os.path.exists(ready):
                if proc.poll() is not None:
                    raise RuntimeError(f"the optimizer node exited with status {proc.returncode} before it listened "
                                       f"(see its output above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the optimizer node did not listen within {start_timeout_s:g}s")
                time.sleep(0.05)
            with open(ready) as f:
                address = f.read().strip()
            yield address
            try:
                proc.wait(timeout=min(timeout_s, 30.0))
            except subprocess.TimeoutExpired:
                pass
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
