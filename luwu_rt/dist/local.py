"""Process groups whose ranks are threads of one process: simulate a multi-rank plan without processes.

``LocalWorld(size)`` hands each rank thread its ``LocalGroup``s; their
collectives are asynchronous like ``torch.distributed``'s (a call returns a
handle at once; the transfer completes when the last rank of the group has
called), and they check what real backends do not: that every rank's n-th call
on a group is the same collective with the same shapes and dtypes
([Note: collectives as start and wait] in plan/ops.py promises it), and that a
handle is completed within a timeout, so a mismatched order or a deadlock is an
error that names the group, the call and the ranks that never came, instead of
a hang. Sums run in rank order, so results do not depend on arrival order.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from luwu_rt.exec.executor import WaitAll

__all__ = ["LocalGroup", "LocalWorld"]


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives as the same call of one group."""


class _Call:
    def __init__(self, kind: str, signature: tuple, size: int) -> None:
        self.kind, self.signature, self.size = kind, signature, size
        self.args: dict[int, tuple] = {}
        self.done = threading.Event()
        self.error: BaseException | None = None


def _completion(call: _Call, describe: str, timeout_s: float) -> WaitAll:
    """The handle of one rank's part of ``call``: its wait ends once the last rank of the group called."""

    def wait() -> None:
        if not call.done.wait(timeout_s):
            missing = sorted(set(range(call.size)) - set(call.args))
            raise TimeoutError(f"{describe} did not complete in {timeout_s:g} s: group rank(s) {missing} "
                               f"never issued it (a deadlock, or ranks issuing collectives in different orders)")
        if call.error is not None:
            raise call.error

    return WaitAll(then=wait)


class LocalWorld:
    """The shared state of ``size`` rank threads' groups."""

    def __init__(self, size: int, *, timeout_s: float = 60.0) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._groups: dict[tuple, dict] = {}

    def group(self, name: str, *, rank: int, members: Sequence[int]) -> "LocalGroup":
        """Rank ``rank``'s handle on the group ``name`` over world ranks ``members`` (every member
        must ask for it with the same name and members)."""
        key = (name, tuple(members))
        if rank not in key[1]:
            raise ValueError(f"rank {rank} is not a member of group {name} {list(members)}")
        with self._lock:
            state = self._groups.setdefault(key, {"calls": {}, "issued": dict.fromkeys(key[1], 0)})
        return LocalGroup(self, key, state, rank=key[1].index(rank))


class LocalGroup:
    """One rank's view of an in-process group; implements ``luwu_rt.dist.Group``."""

    def __init__(self, world: LocalWorld, key: tuple, state: dict, *, rank: int) -> None:
        self.world, self.key, self.state = world, key, state
        self.rank = rank
        self.size = len(key[1])

    def _issue(self, kind: str, args: tuple, signature: tuple) -> WaitAll:
        with self.world._lock:
            seq = self.state["issued"][self.key[1][self.rank]]
            self.state["issued"][self.key[1][self.rank]] += 1
            call = self.state["calls"].setdefault(seq, _Call(kind, signature, self.size))
            if (call.kind, call.signature) != (kind, signature):
                call.error = CollectiveMismatch(
                    f"group {self.key[0]} call #{seq}: rank {self.rank} issued {kind}{signature}, another rank "
                    f"{call.kind}{call.signature}")
                call.done.set()
                raise call.error
            call.args[self.rank] = args
            complete = len(call.args) == self.size
            if complete:
                del self.state["calls"][seq]
        if complete:
            try:
                _COMPLETE[kind](call)
            except BaseException as exc:  # handed to every rank's wait
                call.error = exc
            call.done.set()
        return _completion(call, f"group {self.key[0]} call #{seq} ({kind}) of rank {self.rank}", self.world.timeout_s)

    def all_reduce(self, tensor: torch.Tensor) -> WaitAll:
        return self._issue("all_reduce", (tensor,), _sig(tensor))

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor]) -> WaitAll:
        if len(inputs) != self.size:
            raise ValueError(f"reduce_scatter needs {self.size} inputs, got {len(inputs)}")
        return self._issue("reduce_scatter", (output, tuple(inputs)), _sig(output, *inputs))

    def all_gather(self, outputs: Sequence[torch.Tensor], input: torch.Tensor) -> WaitAll:
        if len(outputs) != self.size:
            raise ValueError(f"all_gather needs {self.size} outputs, got {len(outputs)}")
        return self._issue("all_gather", (tuple(outputs), input), _sig(input, *outputs))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> WaitAll:
        if input.numel() % self.size or output.shape != input.shape:
            raise ValueError(f"all_to_all needs equal input and output of {self.size} equal pieces, got "
                             f"{tuple(input.shape)} and {tuple(output.shape)}")
        return self._issue("all_to_all", (output, input), _sig(input, output))


def _sig(*tensors: torch.Tensor) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for part in parts[1:]:  # rank order: the same bits whatever order the ranks arrived in
        total += part
    return total


def _all_reduce(call: _Call) -> None:
    total = _sum([call.args[r][0] for r in range(call.size)])
    for r in range(call.size):
        call.args[r][0].copy_(total)


def _reduce_scatter(call: _Call) -> None:
    for dest in range(call.size):
        call.args[dest][0].copy_(_sum([call.args[r][1][dest] for r in range(call.size)]))


def _all_gather(call: _Call) -> None:
    for r in range(call.size):
        for source in range(call.size):
            call.args[r][0][source].copy_(call.args[source][1])


def _all_to_all(call: _Call) -> None:
    pieces = [call.args[r][1].reshape(call.size, -1) for r in range(call.size)]
    for dest in range(call.size):
        out = call.args[dest][0].reshape(call.size, -1)
        for source in range(call.size):
            out[source].copy_(pieces[source][dest])


_COMPLETE = {"all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter, "all_gather": _all_gather,
             "all_to_all": _all_to_all}
