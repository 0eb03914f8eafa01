"""The ranks of a run: who this process is, and the process groups its plan's queues own.

A multi-rank run is started by ``torchrun`` or ``luwu train --nproc N``; both
set the ``torch.distributed`` environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ...). ``init_from_env`` joins the default process group from
it (gloo on the CPU, NCCL with a GPU) with the run's timeout; one process
without that environment is a world of one and runs strategy ``local``.

[Note: one process group per queue]
Ranks must issue the collectives of one process group in the same order. The
plan puts each kind of collective on its own queue (gathers, reductions, the
cross-group all-reduce), every queue issues in plan order on one thread, and
each queue owns its own process group, created here identically on every
rank: so the order per group is the plan's, whatever the timing of the
queues. hsdp's ``shard`` and ``replica`` groups come in several instances
(one per sharding group, one per slice index); every rank creates all of
them in the same order, as ``new_group`` requires, and keeps its own.
Metrics, barriers and checkpoint bookkeeping use a separate gloo group
(``World.control``) so they never interleave with a queue's collectives.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from luwu_rt.plan.sequence import group_members
from luwu_rt.plan.spec import Strategy

__all__ = ["World", "init_from_env", "queue_groups"]


@dataclass(slots=True)
class World:
    """This process's place among the ranks of the run."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    backend: str = "gloo"
    """Backend of the queues' process groups: ``gloo`` on the CPU, ``nccl`` on GPUs."""
    timeout_s: float = 300.0
    control: Any = field(default=None, repr=False)
    """A gloo process group over all ranks for metrics, barriers and checkpoint bookkeeping."""

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Element-wise sum (or ``max``/``min``) of ``values`` over the ranks, in float64."""
        if not self.distributed:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op],
                        group=self.control)
        return t.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (small metadata: plan digests, checkpoint manifests, trace spans)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def together(self, fn: Callable[[], Any]) -> list[Any]:
        """Runs ``fn`` on every rank and returns every rank's result; when it raised on any rank, every
        rank raises (the failing rank its own exception, the others one naming it), so no rank waits
        for a peer that gave up."""
        try:
            mine: tuple[str | None, Any] = (None, fn())
        except Exception as exc:
            if not self.distributed:
                raise
            error, mine = exc, (f"{type(exc).__name__}: {exc}", None)
        else:
            error = None
        results = self.all_gather_object(mine)
        failed = [(r, e) for r, (e, _) in enumerate(results) if e is not None]
        if error is not None:
            raise error
        if failed:
            rank, text = failed[0]
            raise RuntimeError(f"rank {rank} failed: {text}")
        return [value for _, value in results]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.control)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (as torchrun sets it)") from None


_joined: World | None = None


def init_from_env(*, timeout_s: float = 300.0) -> World:
    """Joins the run's process group when the environment names more than one rank (``WORLD_SIZE`` as
    ``torchrun`` sets it), or uses the one a script already initialised; returns this process's
    ``World``. Idempotent: later calls return the same ``World``."""
    global _joined
    import torch.distributed as dist

    if _joined is not None and dist.is_initialized():
        return _joined
    size = _env_int("WORLD_SIZE", 1)
    if size <= 1 and not dist.is_initialized():
        return World(timeout_s=timeout_s)
    backend = dist.get_backend() if dist.is_initialized() else "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
        dist.init_process_group(backend=backend, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    _joined = World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=_env_int("LOCAL_RANK", dist.get_rank()),
                 local_size=_env_int("LOCAL_WORLD_SIZE", dist.get_world_size()), backend=backend,
                 timeout_s=timeout_s, control=control)
    return _joined


def _instances(strategy: Strategy, group: str) -> list[tuple[int, ...]]:
    """Every instance of ``group`` in the world, in a fixed order."""
    return sorted({group_members(strategy, group, r) for r in range(strategy.world_size)})


def queue_groups(strategy: Strategy, comm_groups: dict[str, str], world: World) -> dict[str, Any]:
    """One ``torch.distributed`` process group per communication queue of the plan, holding this rank
    ([Note: one process group per queue]). Every rank must call this with the same arguments."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=world.timeout_s)
    mine: dict[str, Any] = {}
    for queue in sorted(comm_groups):
        for members in _instances(strategy, comm_groups[queue]):
            pg = dist.new_group(ranks=list(members), timeout=timeout, backend=world.backend)
            if world.rank in members:
                mine[queue] = pg
    return mine
