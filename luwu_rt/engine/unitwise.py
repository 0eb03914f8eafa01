"""``unitwise_step``: one training step unit by unit, in memory, with hooks.

A thin driver of the one step engine (``engine/compute.py``'s ``UnitCompute``)
without a plan or a store: it walks ``step_schedule`` and calls ``UnitHooks``
around each unit. The default hooks keep everything in memory and accumulate
into ``param.grad``, which makes the step a drop-in replacement for
``loss.backward()`` (and is what the tests compare against). ``UnitHooks`` is
where a custom out-of-core scheme plugs in: it makes a unit's parameters
resident before the unit computes and releases them after, may move saved
inputs elsewhere, and receives each unit's gradients the moment they are final
([Note: final gradients] in plan/sequence.py), so that unit's optimizer step can
run while earlier units are still in backward.

A unit's parameters are resident for exactly one acquire/release pair per phase
it appears in: units ``0..L-2`` in both phases, unit ``L-1`` in backward only
([Note: the last unit runs once] in engine/compute.py). Partial gradients of a
read unit are held by the step, not in ``param.grad``, so the hooks may release
that unit's parameters in between.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from luwu_rt.engine.compute import InputStore, UnitCompute, UnitwiseConfig, accumulate_grads
from luwu_rt.models.units import UnitChain
from luwu_rt.plan.sequence import final_points as _final_points

__all__ = ["Phase", "StepResult", "UnitHooks", "UnitwiseConfig", "final_points", "step_schedule", "unitwise_loss",
           "unitwise_step"]


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    loss: float
    """The unscaled mean loss of the batch."""
    num_tokens: int
    """Target elements in the batch."""


class UnitHooks(InputStore):
    """Callbacks of a unit-wise step; override what you need.

    ``acquire(i, phase=...)`` precedes every computation of unit ``i`` and must
    make resident the parameters of ``i`` and of ``chain.reads(i)``;
    ``release(i, phase=...)`` follows it. ``save_input(i, x)`` keeps unit
    ``i``'s forward input until its backward and returns a handle that
    ``load_input`` turns back into the tensor. ``grads_final(i, grads)`` delivers
    unit ``i``'s gradients, aligned with ``chain.own_params(i)`` (``None`` for a
    parameter that got none), as soon as they are final.
    """

    def acquire(self, index: int, *, phase: Phase) -> None:
        pass

    def release(self, index: int, *, phase: Phase) -> None:
        pass

    def grads_final(self, index: int, grads: list[torch.Tensor | None], *, chain: UnitChain) -> None:
        """Default: accumulate into ``param.grad`` as ``loss.backward()`` would."""
        for param, grad in zip(chain.own_params(index), grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad


def final_points(chain: UnitChain) -> tuple[tuple[int, ...], ...]:
    """``final_points(chain)[k]``: the units whose gradients become final right after B(k), highest first
    (the planner's fact, ``luwu_rt.plan.sequence.final_points``, for this chain)."""
    return _final_points(tuple(chain.reads(i) for i in range(chain.num_units)))


def step_schedule(chain: UnitChain) -> tuple[tuple[str, int], ...]:
    """The hook calls ``unitwise_step`` makes, in order, for planners that lay out a step ahead of time.

    Events are ``("F", i)``/``("f", i)`` for acquire/release in forward,
    ``("B", i)``/``("b", i)`` in backward and ``("G", i)`` for ``grads_final``.
    """
    events: list[tuple[str, int]] = []
    for index in range(chain.num_units - 1):
        events += [("F", index), ("f", index)]
    finals = final_points(chain)
    for index in range(chain.num_units - 1, -1, -1):
        events += [("B", index), ("b", index), *(("G", owner) for owner in finals[index])]
    return tuple(events)


def unitwise_loss(chain: UnitChain, inputs: torch.Tensor, targets: torch.Tensor, *, hooks: UnitHooks | None = None,
                  config: UnitwiseConfig | None = None) -> float:
    """The loss of a batch computed unit by unit without gradients (evaluation)."""
    hooks = hooks or UnitHooks()
    compute = UnitCompute(chain, config=config or UnitwiseConfig())
    compute.begin([(inputs, targets)], train=False)
    for index in range(chain.num_units):
        hooks.acquire(index, phase=Phase.FORWARD)
        compute.forward(0, index)
        hooks.release(index, phase=Phase.FORWARD)
    return compute.losses[0]


def unitwise_step(chain: UnitChain, inputs: torch.Tensor, targets: torch.Tensor, *, hooks: UnitHooks | None = None,
                  config: UnitwiseConfig | None = None) -> StepResult:
    """Forward and backward of one (micro-)batch, unit by unit; gradients go to ``hooks.grads_final``."""
    hooks = hooks or UnitHooks()
    compute = UnitCompute(chain, config=config or UnitwiseConfig(), inputs=hooks)
    compute.begin([(inputs, targets)])
    last = chain.num_units - 1
    for index in range(last):
        hooks.acquire(index, phase=Phase.FORWARD)
        compute.forward(0, index)
        hooks.release(index, phase=Phase.FORWARD)
    pending: dict[int, list[torch.Tensor | None]] = {}
    finals = final_points(chain)
    for index in range(last, -1, -1):
        hooks.acquire(index, phase=Phase.BACKWARD)
        grads = compute.backward(0, index)
        hooks.release(index, phase=Phase.BACKWARD)
        for owner, owner_grads in grads.items():
            accumulate_grads(pending, owner, owner_grads)
        for owner in finals[index]:
            hooks.grads_final(owner, pending.pop(owner, [None] * len(chain.own_params(owner))), chain=chain)
    assert not pending, f"gradients of units {sorted(pending)} were never delivered"
    return StepResult(loss=compute.losses[0], num_tokens=targets.numel())
