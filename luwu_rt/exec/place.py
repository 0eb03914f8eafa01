"""Where a run's optimizer runs: ``OptimizerPlace``, and ``LocalOptimizer``, the place that is this process.

[Note: where the optimizer runs]
A strategy is composed from parts (DESIGN.md, style 12): its plan, its
collectives, and where its optimizer runs. The engine holds one
``OptimizerPlace`` and talks to it alone about the optimizer: the plan handlers
it serves, the optimizer state a unit starts with (materialised or loaded), the
state a checkpoint reads back, what happens around each step (and whether the
step must run again), the step's results, what the run's first line and its
trace say about it, and closing. ``LocalOptimizer`` keeps the optimizer state
in this rank's store and runs ``OptimizerStep``'s handlers on the plan's
optimizer queue; ``NodeWorker`` (node/worker.py) pushes gradients to optimizer
node shards that hold the state and run the same ``OptimizerStep`` there.
Which one a run uses is chosen once, where the engine is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import torch

from luwu_rt.exec.executor import Handler
from luwu_rt.exec.step import OptimizerStep, StepResult
from luwu_rt.exec.trace import Span
from luwu_rt.store import TieredStore

__all__ = ["LocalOptimizer", "OptimizerPlace", "StepFn"]

R = TypeVar("R")
StepFn = Callable[[int, Any], R]
"""``step_fn(step, batch)``: runs step ``step`` (1-based) of the engine on ``batch``; returns its metrics."""


class OptimizerPlace(Protocol):
    """Where the optimizer runs ([Note: where the optimizer runs])."""

    @property
    def adam_step(self) -> int:
        """Updates applied so far (skipped steps do not count): Adam's ``t`` of the last step."""
        ...

    @property
    def grad_norm(self) -> float:
        """Global L2 norm of the last step's unscaled gradients."""
        ...

    def handlers(self) -> dict[str, Handler]:
        """The plan's op kinds this place serves (``OptimStep``/``GradNorm``/``NormReduce`` here, ``Push``/
        ``Pull`` for a node) and their handlers."""
        ...

    def start_at(self, *, step: int, adam_step: int) -> None:
        """Where the run stands before its first step here: ``step`` steps done, ``adam_step`` updates applied."""
        ...

    def keep_initial(self, unit: int, states: Mapping[str, torch.Tensor]) -> None:
        """A unit's first optimizer state (``master``, ``exp_avg``, ``exp_avg_sq``: this rank's part of them),
        materialised or loaded from a checkpoint. The caller flushes the store."""
        ...

    def read_state(self, unit: int, state: str, out: torch.Tensor) -> torch.Tensor:
        """``unit``'s optimizer ``state`` after the last step (this rank's part) into ``out``; between steps."""
        ...

    def run_step(self, step_fn: StepFn[R], batch: Any, *, step: int) -> R:
        """``step_fn(step, batch)``, and whatever running step ``step`` takes beyond it (a node restarted
        under the run: the steps it lost run again first)."""
        ...

    def begin_step(self, step: int) -> None:
        """Before the plan of ``step`` runs."""
        ...

    def finish_step(self, loss_part: float) -> StepResult:
        """After the plan of the step ran: ``loss_part`` is this rank's share of the global mean loss; returns
        the step's results with the global loss. Every rank calls it (the loss is summed over the ranks)."""
        ...

    def describe(self) -> tuple[str, ...]:
        """What the run's first line says about where the optimizer state lives, beyond the plan's homes."""
        ...

    def trace_rows(self) -> list[tuple[str, list[Span]]]:
        """``(process name, spans)`` of the optimizer's own processes in the last step, for ``--trace``."""
        ...

    def close(self) -> None:
        """Releases what the place holds (connections); idempotent."""
        ...


class LocalOptimizer:
    """The optimizer in this process, on the optimizer state in this rank's ``store``.

    ``all_reduce``: sums floats over the ranks (the step's loss); ``collectives``: handlers of the plan's
    collectives across ranks (their ``NormReduce`` replaces the step's local one and records the total in
    ``step.norms``)."""

    def __init__(self, step: OptimizerStep, *, store: TieredStore, all_reduce: Callable[[list[float]], list[float]],
                 collectives: Mapping[str, Handler] | None = None) -> None:
        self.step = step
        self.store = store
        self.all_reduce = all_reduce
        self.collectives = dict(collectives or {})

    @property
    def adam_step(self) -> int:
        return self.step.adam_step

    @property
    def grad_norm(self) -> float:
        return self.step.grad_norm

    def handlers(self) -> dict[str, Handler]:
        return {**self.step.handlers(), **self.collectives}

    def start_at(self, *, step: int, adam_step: int) -> None:
        self.step.start_at(adam_step=adam_step)

    def keep_initial(self, unit: int, states: Mapping[str, torch.Tensor]) -> None:
        for state, values in states.items():
            self.store.write_state(unit, state, values)

    def read_state(self, unit: int, state: str, out: torch.Tensor) -> torch.Tensor:
        return self.store.read_state(unit, state, out)

    def run_step(self, step_fn: StepFn[R], batch: Any, *, step: int) -> R:
        return step_fn(step, batch)

    def begin_step(self, step: int) -> None:
        self.step.begin(step)

    def finish_step(self, loss_part: float) -> StepResult:
        (loss,) = self.all_reduce([loss_part])
        result = self.step.finish()
        if self.store.double_buffered and not result.skipped:
            self.store.swap_halves()  # the half the step wrote is current ([Note: speculative updates])
        return dataclasses.replace(result, loss=loss)

    def describe(self) -> tuple[str, ...]:
        return ()  # the plan's homes say it all

    def trace_rows(self) -> list[tuple[str, list[Span]]]:
        return []

    def close(self) -> None:
        pass
