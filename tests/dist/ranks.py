"""Run a function in N real processes that form a torch.distributed world (gloo on loopback), as
``torchrun`` would start them, and collect what each returns."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, size: int, port: int, env: dict[str, str], args: tuple,
           out: "mp.Queue") -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size),
                       "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        import torch

        torch.set_num_threads(1)  # ranks share the machine's cores
        out.put((rank, "ok", fn(rank, *args)))
    except BaseException as exc:  # reported to the parent with its traceback
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, env: dict[str, str] | None = None,
              timeout_s: float = 240.0) -> list[Any]:
    """``[fn(0, *args), ..., fn(size - 1, *args)]``, each in its own process; ``fn`` must be importable
    (a module-level function). The first rank's failure is raised with its traceback."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, size, port, env or {}, args, out), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(size):
            rank, status, value = out.get(timeout=timeout_s)
            (results if status == "ok" else errors)[rank] = value
            if errors:
                break
    finally:
        for p in procs:
            p.join(5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed: {errors[rank]}")
    return [results[r] for r in range(size)]
