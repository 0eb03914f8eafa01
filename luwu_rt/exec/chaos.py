"""The chaos mode: random delays before and after every op on every queue.

Set ``LUWU_CHAOS_SEED=<int>`` and every executor of the process - every rank,
the optimizer node, the engine's training and evaluation plans - sleeps a
random time, uniform in ``[0, max_delay_s]``, before and after the work of each
op it runs. The delays are enqueued on the op's stream between its waits and
its event (``Stream.sleep``), so on a ``DeferredStream`` or a GPU (which spins)
they delay when the work happens and completes, not only when it is issued.
Any order the plan's dependencies allow can come out; results must
stay bit for bit those of a run without chaos. A missing dependency, or an op
treated as complete when it was merely enqueued, then shows as a wrong result
or an error instead of waiting for an unlucky day (DESIGN.md, "Planner and
executor").

Each process draws its own delays from the seed and its rank, one generator
per queue, seeded from a string: the same seed and rank give the same delays
in every process, whatever ``PYTHONHASHSEED`` is.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

__all__ = ["CHAOS_ENV", "Chaos", "QueueChaos"]

CHAOS_ENV = "LUWU_CHAOS_SEED"
MAX_DELAY_S = 0.002
"""A few milliseconds: longer than most ops of a test-sized plan, so any order can come out, and short
enough that the test suite under chaos stays fast."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Chaos:
    seed: int
    """Seed of this process's delays (``LUWU_CHAOS_SEED``)."""
    rank: int = 0
    """The process's rank: ranks of one run draw different delays."""
    max_delay_s: float = MAX_DELAY_S
    """Longest delay before or after an op."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_delay_s < 1:
            raise ValueError(f"Chaos: max_delay_s must be in [0, 1) seconds, got {self.max_delay_s}")

    @classmethod
    def from_env(cls, rank: int | None = None) -> "Chaos | None":
        """The chaos mode ``LUWU_CHAOS_SEED`` asks for, or ``None`` when it is unset or empty. ``rank``:
        this process's rank; by default ``torch.distributed``'s when it is initialised, else the
        ``RANK`` environment variable (set by ``torchrun``), else 0."""
        text = os.environ.get(CHAOS_ENV, "").strip()
        if not text:
            return None
        try:
            seed = int(text)
        except ValueError:
            raise ValueError(f"{CHAOS_ENV} must be an integer (the seed of the chaos mode's delays), got {text!r}; "
                             f"unset it to run without chaos") from None
        return cls(seed=seed, rank=_rank() if rank is None else rank)

    def queue(self, name: str) -> "QueueChaos":
        """The delays of queue ``name``: a generator of its own, so that how the queues interleave does
        not change which delay each op gets."""
        return QueueChaos(random.Random(f"luwu-chaos/{self.seed}/{self.rank}/{name}"), self.max_delay_s)


class QueueChaos:
    """One queue's delays, drawn by the thread that issues its ops, in plan order."""

    __slots__ = ("_rng", "_max_s")

    def __init__(self, rng: random.Random, max_delay_s: float) -> None:
        self._rng, self._max_s = rng, max_delay_s

    def next_delay_s(self) -> float:
        return self._rng.uniform(0.0, self._max_s)


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    text = os.environ.get("RANK", "").strip()
    return int(text) if text.isdigit() else 0
