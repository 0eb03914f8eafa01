"""Saving an engine's state as a checkpoint, on one rank or on several.

Each rank writes what it alone holds of the first replica: the slices of the
states its strategy shards, and (rank 0) the replicated ones; rank 0 commits
([Note: checkpoints of several ranks] in ckpt/format.py). Every phase runs
through ``World.together``: a rank that fails (a full disk) makes every rank
raise, and rank 0 removes the partial directory, so nothing half-written is
ever visible and no rank waits for a peer that gave up.

[Note: residuals in checkpoints]
A compressed unit's residual (error feedback, [Note: codecs on the wire] in
plan/codec.py) is every rank's own: it is what that rank's codec still owes of
its gradients, not a slice of anything. Each rank writes its residual whole as
``u<unit>.residual.rank<r>of<W>``. A run on W' ranks gives rank r' the sum of
the saved residuals of ranks r with r mod W' = r': on W' = W each rank gets its
own back (an exact resume), on any other count the ranks together still owe
exactly what the saved ones did (the sum of the residuals is what error
feedback adds to the coming updates). A unit saved without a residual starts
from zeros; a run that does not compress a unit ignores its residuals.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from luwu_rt import interrupt
from luwu_rt.ckpt.format import CheckpointReader, CheckpointWriter, slice_name
from luwu_rt.kernels.dtypes import torch_dtype
from luwu_rt.plan.spec import Strategy, ceil_div

__all__ = ["PERSISTENT", "RankTensor", "rank_tensors", "read_residual", "residual_name", "save_checkpoint",
           "verify_checkpoint"]

PERSISTENT = ("param", "master", "exp_avg", "exp_avg_sq")

ReadState = Callable[[int, str, torch.Tensor], torch.Tensor]
"""``read(unit, state, out)``: this rank's part of a unit's ``state`` after the last step, into ``out``."""


class RankTensor(NamedTuple):
    """One tensor a rank writes into a checkpoint."""

    name: str
    """Its entry: ``u<unit>.<state>``, or a slice of it (``slice_name``)."""
    unit: int
    state: str
    numel: int
    dtype: torch.dtype


def residual_name(unit: int, rank: int, count: int) -> str:
    """The entry of rank ``rank``'s (of ``count``) residual of ``unit`` ([Note: residuals in checkpoints])."""
    return f"u{unit}.residual.rank{rank}of{count}"


def _residuals(reader: CheckpointReader, unit: int) -> dict[int, tuple[int, str]]:
    """Saved rank -> (rank count, entry) of ``unit``'s residuals."""
    pattern = re.compile(rf"u{unit}\.residual\.rank(\d+)of(\d+)")
    return {int(m.group(1)): (int(m.group(2)), key) for key in reader.tensors if (m := pattern.fullmatch(key))}


def read_residual(reader: CheckpointReader, unit: int, numel: int, *, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s (of ``world_size``) residual of ``unit`` from the checkpoint ([Note: residuals in
    checkpoints]): its own when the rank counts match, else the sum of the saved ranks it stands for; zeros
    when none was saved."""
    out = torch.zeros(numel)
    for saved, (_count, key) in sorted(_residuals(reader, unit).items()):
        if saved % world_size == rank:
            out += reader.read(key).reshape(-1)
    return out


def rank_tensors(*, strategy: Strategy, rank: int, numels: Sequence[int], param_dtype: torch.dtype) -> list[RankTensor]:
    """The tensors rank ``rank`` writes: the first replica's slices of what ``strategy`` shards, (rank 0) the
    whole of what it replicates, and its own residual of each compressed unit ([Note: residuals in
    checkpoints]); ``numels``: each unit's parameter count."""
    ways = strategy.shard_ways
    out = []
    for u, n in enumerate(numels):
        for state in PERSISTENT:
            dtype = param_dtype if state == "param" else torch.float32
            if strategy.sharded(state):
                if rank < ways:  # the first replica's slices (hsdp: the first sharding group)
                    out.append(RankTensor(slice_name(f"u{u}.{state}", rank, ways), u, state, ceil_div(n, ways), dtype))
            elif rank == 0:
                out.append(RankTensor(f"u{u}.{state}", u, state, n, dtype))
        if strategy.codec(u) != "none":
            out.append(RankTensor(residual_name(u, rank, strategy.world_size), u, "residual", n, torch.float32))
    return out


def save_checkpoint(directory: str | os.PathLike, *, world: Any, step: int, adam_step: int, run_id: str,
                    config: dict[str, Any], model: dict[str, Any], strategy: str, tensors: Sequence[RankTensor],
                    read: ReadState, locks: MutableMapping[str, Any]) -> Path:
    """Writes ``<directory>/step_<N>`` of step ``step``; every rank of ``world`` (a ``dist.World``) calls it.

    ``tensors``: what this rank writes (``rank_tensors``), each read by ``read``; ``run_id``, ``config``
    (the run's settings as a dict), ``model`` (the model's signature), ``strategy``, ``adam_step``: the
    checkpoint's metadata. ``locks``: the caller's directory locks, held from its first save until it
    closes ([Note: directory locks] in fs.py): rank 0 adds this directory's."""
    writers: list[CheckpointWriter] = []

    def create() -> str | None:
        if world.rank == 0:
            _lock(locks, directory)
            writers.append(CheckpointWriter(directory, step=step))
            return str(writers[0].partial)
        return None

    partial = world.together(create)[0]
    try:
        def write() -> dict:
            if world.rank != 0:
                writers.append(CheckpointWriter(directory, step=step, partial=partial))
            for t in tensors:
                writers[0].add(t.name, read(t.unit, t.state, torch.empty(t.numel, dtype=t.dtype)))
            interrupt.test_hook("checkpoint", step)
            return writers[0].entries

        entries = world.together(write)

        def commit() -> Path:
            writer = writers[0]
            if world.rank == 0:
                for other in entries[1:]:
                    writer.merge(other)
                writer.commit({"run_id": run_id, "config": config, "step": step, "adam_step": adam_step,
                               "model": model, "world_size": world.size, "strategy": strategy})
            return writer.final

        return world.together(commit)[0]
    except BaseException:
        if world.rank == 0 and writers:
            writers[0].abort()
        raise


def _lock(locks: MutableMapping[str, Any], directory: str | os.PathLike) -> None:
    """Locks ``directory`` once per owner of ``locks``: the writer removes leftover partial directories."""
    from luwu_rt.fs import lock_dir

    key = str(Path(directory).resolve())
    if key not in locks:
        locks[key] = lock_dir(directory, flag="--ckpt-dir")


def verify_checkpoint(reader: CheckpointReader, *, read_data: bool) -> int:
    """Checks that ``reader``'s checkpoint is complete and consistent with the model it names: every
    unit's persistent states present (whole or a full set of slices), in their dtypes, holding the
    unit's number of values, and no stray entries; with ``read_data`` every file's checksum too.
    Returns the number of files; raises ``ValueError`` (``OSError`` for data) naming the checkpoint."""
    where = reader.directory
    try:
        units = reader.meta["model"]["units"]
        sizes = [sum(_numel(shape) for _name, shape in unit["params"]) for unit in units]
        param_dtype = torch_dtype(reader.meta["config"]["dtype"])
        steps = (reader.meta["step"], reader.meta["adam_step"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: checkpoint metadata lacks or garbles {exc}; "
                         "resume from an older checkpoint") from None
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
                raise ValueError(f"{where}: u{u}.{state} holds {held} values, the model needs {n}; "
                                 "the checkpoint is corrupt")
            if read_data:
                reader.read_joined(f"u{u}.{state}", n)
            seen.update(parts)
        seen.update(_verify_residuals(reader, u, n, read_data=read_data))
    stray = sorted(set(reader.tensors) - seen)
    if stray:
        raise ValueError(f"{where}: checkpoint has entries no unit of its model owns ({', '.join(stray[:3])})")
    return len(seen)


def _verify_residuals(reader: CheckpointReader, unit: int, numel: int, *, read_data: bool) -> list[str]:
    """The entries of ``unit``'s residuals, checked: none, or one per saved rank, fp32, of ``numel`` values."""
    found = _residuals(reader, unit)
    counts = {count for count, _ in found.values()}
    if found and (len(counts) != 1 or sorted(found) != list(range(counts.pop()))):
        raise ValueError(f"{reader.directory}: the residuals of unit {unit} are not one per rank "
                         f"({sorted(key for _, key in found.values())}); the checkpoint is corrupt")
    for _, key in found.values():
        entry = reader.tensors[key]
        if entry["dtype"] != "float32" or _numel(entry["shape"]) != numel:
            raise ValueError(f"{reader.directory}: {key} is {entry['dtype']} of {_numel(entry['shape'])} values, a "
                             f"residual is float32 of the unit's {numel}; the checkpoint is corrupt")
        if read_data:
            reader.read(key)
    return [key for _, key in found.values()]


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
