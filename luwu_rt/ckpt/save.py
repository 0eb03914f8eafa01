"""Saving an engine's state as a checkpoint, on one rank or on several.

Each rank writes what it alone holds of the first replica: the slices of the
states its strategy shards, and (rank 0) the replicated ones; rank 0 commits
([Note: checkpoints of several ranks] in ckpt/format.py). Every phase runs
through ``World.together``: a rank that fails (a full disk) makes every rank
raise, and rank 0 removes the partial directory, so nothing half-written is
ever visible and no rank waits for a peer that gave up.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from luwu_rt import interrupt
from luwu_rt.ckpt.format import CheckpointReader, CheckpointWriter, new_run_id, slice_name
from luwu_rt.plan.spec import ceil_div

__all__ = ["PERSISTENT", "save_checkpoint", "verify_checkpoint"]

PERSISTENT = ("param", "master", "exp_avg", "exp_avg_sq")
_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _my_tensors(engine: Any) -> list[tuple[str, int, str, int]]:
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


def _lock(engine: Any, directory: str | os.PathLike) -> None:
    """Rank 0 holds the checkpoint directory's lock from its first save until ``Engine.close``
    ([Note: directory locks] in fs.py): the writer removes leftover partial directories."""
    from luwu_rt.fs import lock_dir

    locks = engine.__dict__.setdefault("_dir_locks", {})
    key = str(Path(directory).resolve())
    if key not in locks:
        locks[key] = lock_dir(directory, flag="--ckpt-dir")


def save_checkpoint(engine: Any, directory: str | os.PathLike) -> Path:
    """Writes ``<directory>/step_<N>`` of ``engine``'s current step; every rank calls it."""
    world = engine.world
    writers: list[CheckpointWriter] = []
    if getattr(engine, "run_id", None) is None:  # a fresh run: its checkpoints are its own from now on
        engine.run_id = new_run_id()

    def create() -> str | None:
        if world.rank == 0:
            _lock(engine, directory)
            writers.append(CheckpointWriter(directory, step=engine.step))
            return str(writers[0].partial)
        return None

    partial = world.together(create)[0]
    try:
        def write() -> dict:
            if world.rank != 0:
                writers.append(CheckpointWriter(directory, step=engine.step, partial=partial))
            for name, unit, state, numel in _my_tensors(engine):
                # Strategy node: the optimizer state is the node's ([Note: between two steps], node/steps.py).
                node = engine.node is not None and state != "param"
                read = engine.node.read_state if node else engine.store.read_state
                writers[0].add(name, read(unit, state, torch.empty(numel, dtype=engine._dtype_of(state))))
            interrupt.test_hook("checkpoint", engine.step)
            return writers[0].entries

        entries = world.together(write)

        def commit() -> Path:
            writer = writers[0]
            if world.rank == 0:
                for other in entries[1:]:
                    writer.merge(other)
                writer.commit({"run_id": engine.run_id, "config": asdict(engine.config), "step": engine.step,
                               "adam_step": engine.adam_step,
                               "model": engine._signature(), "world_size": world.size,
                               "strategy": engine.strategy.name})
            return writer.final

        return world.together(commit)[0]
    except BaseException:
        if world.rank == 0 and writers:
            writers[0].abort()
        raise


def verify_checkpoint(reader: CheckpointReader, *, read_data: bool) -> int:
    """Checks that ``reader``'s checkpoint is complete and consistent with the model it names: every
    unit's persistent states present (whole or a full set of slices), in their dtypes, holding the
    unit's number of values, and no stray entries; with ``read_data`` every file's checksum too.
    Returns the number of files; raises ``ValueError`` (``OSError`` for data) naming the checkpoint."""
    where = reader.directory
    try:
        units = reader.meta["model"]["units"]
        sizes = [sum(_numel(shape) for _name, shape in unit["params"]) for unit in units]
        param_dtype = _PARAM_DTYPES[reader.meta["config"]["dtype"]]
        steps = (reader.meta["step"], reader.meta["adam_step"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: checkpoint metadata lacks or garbles {exc}; resume from an older checkpoint") from None
    if steps[0] != reader.step or not (isinstance(steps[1], int) and 0 <= steps[1] <= steps[0]):
        raise ValueError(f"{where}: checkpoint steps disagree (step {reader.step}, meta {steps}); it is corrupt")
    seen: set[str] = set()
    for u, n in enumerate(sizes):
        for state in PERSISTENT:
            parts = reader.parts(f"u{u}.{state}")
            want = param_dtype if state == "param" else torch.float32
            held = 0
            for key in parts:
                entry = reader.tensors[key]
                if entry["dtype"] != str(want).removeprefix("torch."):
                    raise ValueError(f"{where}: tensor {key} is {entry['dtype']}, the model's {state} is "
                                     f"{str(want).removeprefix('torch.')}; the checkpoint is corrupt")
                held += _numel(entry["shape"])
            if held < n:
                raise ValueError(f"{where}: u{u}.{state} holds {held} values, the model needs {n}; the checkpoint is corrupt")
            if read_data:
                reader.read_joined(f"u{u}.{state}", n)
            seen.update(parts)
    stray = sorted(set(reader.tensors) - seen)
    if stray:
        raise ValueError(f"{where}: checkpoint has entries no unit of its model owns ({', '.join(stray[:3])})")
    return len(seen)


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
