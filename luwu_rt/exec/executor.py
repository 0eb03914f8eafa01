"""Runs a ``SwapPlan`` against the store: it moves bytes and calls handlers,
and decides nothing (DESIGN.md, "Planner and executor").

[Note: executor threads]
One thread per plan queue (``nvme_read``, ``nvme_write``, ``h2d``, ``d2h``,
``compute``, ``optim``, ``comm``, ``mem``). Each thread runs its queue's ops in
plan order, waiting for each op's dependencies first. Because the plan's order
is a topological order of its dependencies, this never deadlocks, and ops on
different queues overlap exactly as far as the plan allows. Python threads are
enough: every long op (file IO, copies, fused kernels, collectives) releases
the GIL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from luwu_rt.exec.trace import Span
from luwu_rt.io import aligned_empty
from luwu_rt.plan.ops import Access, Free, Load, Op, ShardId, ShardInfo, Store, SwapPlan
from luwu_rt.store import Arena, NvmeTier

__all__ = ["Executor", "Handler", "Views", "element_offsets", "nvme_regions"]

Views = Mapping[ShardId, torch.Tensor]
"""The op's shard copies as flat uint8 tensors, keyed by shard; outputs override inputs."""
Handler = Callable[[Op, Views], None]


def element_offsets(shards: Mapping[ShardId, ShardInfo]) -> dict[ShardId, int]:
    """First element of each shard within its unit's flat buffer of its state kind."""
    out: dict[ShardId, int] = {}
    pos: dict[tuple[int, str], int] = {}
    for sid in sorted(shards, key=lambda s: (s.unit, s.state, s.chunk)):
        key = (sid.unit, sid.state)
        out[sid] = pos.get(key, 0)
        pos[key] = out[sid] + shards[sid].numel
    return out


def nvme_regions(plan: SwapPlan) -> dict[tuple[int, str], int]:
    """Bytes of every (unit, state) buffer that has a copy on NVMe at some point of the plan:
    the regions an ``NvmeTier`` for this plan must hold."""
    on_nvme = {s.state for s in plan.shards if plan.homes.get(s.state) == "nvme"}
    on_nvme |= {a.shard.state for op in plan.ops for a in op.inputs + op.outputs if a.tier == "nvme"}
    regions: dict[tuple[int, str], int] = {}
    for sid, info in plan.shards.items():
        if sid.state in on_nvme:
            regions[(sid.unit, sid.state)] = regions.get((sid.unit, sid.state), 0) + info.nbytes
    return regions


@dataclass(frozen=True, slots=True)
class _Failure:
    op_index: int
    error: BaseException


class Executor:
    """Walks a plan. ``handlers`` maps op kinds (``Compute``, ``OptimStep``,
    ``Reduce``, ``Gather``, ``Push``, ``Pull``) to callables ``(op, views)``;
    ``Load``/``Store``/``Free`` are the executor's own."""

    def __init__(
        self,
        plan: SwapPlan,
        *,
        arenas: Mapping[str, Arena],
        nvme: NvmeTier | None,
        handlers: Mapping[str, Handler],
    ) -> None:
        missing = sorted({op.kind for op in plan.ops if not isinstance(op, (Load, Store, Free))} - set(handlers))
        if missing:
            raise ValueError(f"Executor: no handler for op kind(s) {missing}")
        for tier, nbytes in plan.arena_bytes.items():
            if tier not in arenas or arenas[tier].nbytes < nbytes:
                raise ValueError(f"Executor: the plan needs a {tier} arena of {nbytes} bytes")
        if nvme is None and "nvme" in plan.homes.values():
            raise ValueError("Executor: the plan keeps state on NVMe but no NVMe tier was given")
        self.plan = plan
        self.arenas = arenas
        self.nvme = nvme
        self.handlers = handlers
        self.offsets = element_offsets(plan.shards)

    # -- addressing ----------------------------------------------------------------------------

    def view(self, access: Access) -> torch.Tensor:
        """The bytes of one shard copy in an arena."""
        nbytes = self.plan.shards[access.shard].nbytes
        return self.arenas[access.tier].view(access.slot, nbytes)

    def home_view(self, shard: ShardId) -> torch.Tensor:
        """The home copy of a persistent shard kept in an arena (state before and after a step)."""
        tier = self.plan.homes[shard.state]
        return self.view(Access(shard, tier, self.plan.home_slots[shard]))

    def _unit_shards(self, unit: int, state: str) -> list[ShardId]:
        shards = [s for s in self.plan.shards if s.unit == unit and s.state == state]
        if not shards:
            raise KeyError(f"the plan has no {state!r} shards for unit {unit}")
        return shards

    def write_state(self, unit: int, state: str, values: torch.Tensor) -> None:
        """Sets the home copy of a unit's whole flat buffer of a persistent state kind
        (materialising a model, loading a checkpoint). Call ``nvme.flush()`` after the last."""
        for sid in self._unit_shards(unit, state):
            info, start = self.plan.shards[sid], self.offsets[sid]
            if self.plan.homes[state] == "nvme":
                staging = aligned_empty(info.nbytes)
                staging.view(values.dtype)[: info.numel].copy_(values[start : start + info.numel])
                self.nvme.wait(self.nvme.submit_write(unit, state, first_chunk=info.first_chunk, buffer=staging))
            else:
                self.home_view(sid).view(values.dtype)[: info.numel].copy_(values[start : start + info.numel])

    def read_state(self, unit: int, state: str, out: torch.Tensor) -> torch.Tensor:
        """Copies the home copy of a unit's flat buffer of ``state`` into ``out``; returns it."""
        for sid in self._unit_shards(unit, state):
            info, start = self.plan.shards[sid], self.offsets[sid]
            if self.plan.homes[state] == "nvme":
                staging = aligned_empty(info.nbytes)
                self.nvme.wait(self.nvme.submit_read(unit, state, first_chunk=info.first_chunk, buffer=staging))
            else:
                staging = self.home_view(sid)
            out[start : start + info.numel].copy_(staging.view(out.dtype)[: info.numel])
        return out

    # -- ops -----------------------------------------------------------------------------------

    def _move(self, op: Load | Store) -> None:
        src, dst = op.inputs[0], op.outputs[0]
        info = self.plan.shards[src.shard]
        if src.tier == "nvme":
            request = self.nvme.submit_read(src.shard.unit, src.shard.state, first_chunk=info.first_chunk, buffer=self.view(dst))
            self.nvme.wait(request)
        elif dst.tier == "nvme":
            request = self.nvme.submit_write(dst.shard.unit, dst.shard.state, first_chunk=info.first_chunk, buffer=self.view(src))
            self.nvme.wait(request)
        else:
            self.view(dst).copy_(self.view(src))

    def _run_op(self, op: Op) -> None:
        if isinstance(op, (Load, Store)):
            self._move(op)
        elif not isinstance(op, Free):
            views = {a.shard: self.view(a) for a in op.inputs if a.tier != "nvme"}
            views.update({a.shard: self.view(a) for a in op.outputs if a.tier != "nvme"})
            self.handlers[op.kind](op, views)

    # -- scheduling ----------------------------------------------------------------------------

    def run(self, *, overlap: bool = True) -> list[Span]:
        """Runs every op once; returns a span per op. ``overlap=False`` runs the
        ops one after another in plan order (the serialised baseline)."""
        spans: list[Span | None] = [None] * len(self.plan.ops)
        origin = time.perf_counter()

        def timed(i: int) -> None:
            op = self.plan.ops[i]
            start = time.perf_counter()
            self._run_op(op)
            spans[i] = Span.of(op, start=start - origin, end=time.perf_counter() - origin)

        if not overlap:
            for i in range(len(self.plan.ops)):
                timed(i)
            return list(spans)  # type: ignore[arg-type]

        done = [threading.Event() for _ in self.plan.ops]
        failures: list[_Failure] = []
        by_queue: dict[str, list[int]] = {}
        for i, op in enumerate(self.plan.ops):
            by_queue.setdefault(op.queue, []).append(i)

        def worker(indices: list[int]) -> None:
            for i in indices:
                for d in self.plan.ops[i].deps:
                    done[d].wait()
                if failures:
                    break  # another queue failed: stop at the next op boundary
                try:
                    timed(i)
                except BaseException as exc:  # re-raised by run() on the caller's thread
                    failures.append(_Failure(i, exc))
                    for event in done:
                        event.set()
                    break
                done[i].set()

        threads = [threading.Thread(target=worker, args=(ix,), name=f"luwu-{q}", daemon=True) for q, ix in by_queue.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            first = min(failures, key=lambda f: f.op_index)
            raise first.error
        return list(spans)  # type: ignore[arg-type]
