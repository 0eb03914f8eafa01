"""Saving an engine's state as a checkpoint, on one rank or on several.

Each rank writes what it alone holds of the first replica: the slices of the
states its strategy shards, and (rank 0) the replicated ones; rank 0 commits
([Note: checkpoints of several ranks] in checkpoint.py). Every phase runs
through ``World.together``: a rank that fails (a full disk) makes every rank
raise, and rank 0 removes the partial directory, so nothing half-written is
ever visible and no rank waits for a peer that gave up.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from luwu_rt.engine.checkpoint import CheckpointWriter, slice_name
from luwu_rt.plan.spec import ceil_div

if TYPE_CHECKING:
    from luwu_rt.engine.engine import Engine

__all__ = ["PERSISTENT", "save_checkpoint"]

PERSISTENT = ("param", "master", "exp_avg", "exp_avg_sq")


def _my_tensors(engine: "Engine") -> list[tuple[str, int, str, int]]:
    """``(name, unit, state, numel)`` of the tensors this rank writes."""
    strategy, rank = engine.strategy, engine.world.rank
    ways = strategy.shard_ways
    out = []
    for u in range(engine.chain.num_units):
        n = engine.chain.num_unit_params(u)
        for state in PERSISTENT:
            if strategy.sharded(state):
                if rank < ways:  # the first replica's slices (hsdp: the first sharding group)
                    out.append((slice_name(f"u{u}.{state}", rank, ways), u, state, ceil_div(n, ways)))
            elif rank == 0:
                out.append((f"u{u}.{state}", u, state, n))
    return out


def save_checkpoint(engine: "Engine", directory: str | os.PathLike) -> Path:
    """Writes ``<directory>/step_<N>`` of ``engine``'s current step; every rank calls it."""
    world = engine.world
    writers: list[CheckpointWriter] = []

    def create() -> str | None:
        if world.rank == 0:
            writers.append(CheckpointWriter(directory, step=engine.step))
            return str(writers[0].partial)
        return None

    partial = world.together(create)[0]
    try:
        def write() -> dict:
            if world.rank != 0:
                writers.append(CheckpointWriter(directory, step=engine.step, partial=partial))
            for name, unit, state, numel in _my_tensors(engine):
                writers[0].add(name, engine.store.read_state(unit, state, torch.empty(numel, dtype=engine._dtype_of(state))))
            return writers[0].entries

        entries = world.together(write)

        def commit() -> Path:
            writer = writers[0]
            if world.rank == 0:
                for other in entries[1:]:
                    writer.merge(other)
                writer.commit({"config": asdict(engine.config), "step": engine.step, "adam_step": engine.adam_step,
                               "model": engine._signature(), "world_size": world.size,
                               "strategy": engine.strategy.name})
            return writer.final

        return world.together(commit)[0]
    except BaseException:
        if world.rank == 0 and writers:
            writers[0].abort()
        raise
