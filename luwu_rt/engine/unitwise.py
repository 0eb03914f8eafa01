"""One training step of the execution model, unit by unit, in memory.

DESIGN.md, "The execution model"::

    F0 F1 ... F(L-2)         forward under no_grad, keeping each unit's input
    B(L-1) ... B1 B0         recompute each unit with grad from its saved input,
                             backward, hand the input-gradient to the previous unit

The step owns no memory policy. ``UnitHooks`` is where the out-of-core engine
plugs in: it makes a unit's parameters resident before the unit computes and
releases them after, may move saved inputs elsewhere, and receives each unit's
gradients the moment they are final, so that unit's optimizer step can run
while earlier units are still in backward. The default hooks keep everything in
memory and accumulate into ``param.grad``, which makes the step a drop-in
replacement for ``loss.backward()`` (and is what the tests compare against).

[Note: the last unit runs once]
The last unit's forward output is needed only to compute the loss, so F(L-1)
is fused into B(L-1): the last unit is computed once, with grad, and the loss
comes out of that computation. A unit's parameters are therefore resident for
exactly one acquire/release pair per phase it appears in: units ``0..L-2`` in
both phases, unit ``L-1`` in backward only.

[Note: keeping a unit's graph]
Recomputation costs one extra forward per unit (about 1.1-1.3x a plain
autograd step). A unit in ``UnitwiseConfig.keep_graph`` instead runs its
forward with grad, and its backward differentiates that saved graph: no
recomputation, at the price of holding the unit's activations from F to B. The
graph references the parameters the unit computed with, so an engine must not
swap or update those parameters' storage between the unit's F and B (it may
still release and re-acquire them if that leaves their storage in place). The
hook calls are the same either way.

[Note: final gradients]
A unit's gradients are final when its own backward and the backward of every
unit that reads it ([Note: ownership and reads] in models/units.py) are done.
Reads go to earlier units in practice (a tied head reads the embedding), so the
order is B(L-1)...B0 with the tied embedding final only after B0. Partial
gradients of a read unit are held by the step, not in ``param.grad``, so the
engine may release that unit's parameters in between.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from luwu_rt.models.units import UnitChain

__all__ = ["Phase", "StepResult", "UnitHooks", "UnitwiseConfig", "final_points", "step_schedule", "unitwise_loss",
           "unitwise_step"]


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(kw_only=True, slots=True)
class UnitwiseConfig:
    """How a unit-wise step computes."""

    autocast_dtype: torch.dtype | None = None
    """Compute dtype under ``torch.autocast`` (``torch.bfloat16`` or ``torch.float16``); ``None`` runs in the
    parameters' dtype (fp32)."""
    loss_scale: float = 1.0
    """The loss is multiplied by this before backward (fp16 loss scaling); gradients come out scaled by it,
    the returned loss does not."""
    preserve_rng: bool = True
    """Replay each unit's RNG state in its recomputation, so dropout masks match the forward pass."""
    keep_graph: frozenset[int] = frozenset()
    """Units whose forward runs with grad and keeps its autograd graph (activations) until its backward,
    instead of being recomputed ([Note: keeping a unit's graph]). Empty: recompute every unit, the least
    memory."""

    def __post_init__(self) -> None:
        self.keep_graph = frozenset(self.keep_graph)
        if any(not isinstance(i, int) or i < 0 for i in self.keep_graph):
            raise ValueError(f"keep_graph must hold unit indices (non-negative ints), got {sorted(self.keep_graph)}")
        if self.autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast_dtype must be None, torch.bfloat16 or torch.float16, not {self.autocast_dtype}")
        if not (self.loss_scale > 0 and self.loss_scale < float("inf")):
            raise ValueError(f"loss_scale must be a positive finite number, not {self.loss_scale}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    loss: float
    """The unscaled mean loss of the batch."""
    num_tokens: int
    """Target elements in the batch."""


class UnitHooks:
    """Callbacks of a unit-wise step; override what you need.

    ``acquire(i, phase=...)`` precedes every computation of unit ``i`` and must
    make resident the parameters of ``i`` and of ``chain.reads(i)``;
    ``release(i, phase=...)`` follows it. ``grads_final(i, grads)`` delivers
    unit ``i``'s gradients, aligned with ``chain.own_params(i)`` (``None`` for a
    parameter that got none), as soon as they are final ([Note: final gradients]).
    """

    def acquire(self, index: int, *, phase: Phase) -> None:
        pass

    def release(self, index: int, *, phase: Phase) -> None:
        pass

    def save_input(self, index: int, x: torch.Tensor) -> object:
        """Keep unit ``index``'s forward input until its backward; returns a handle."""
        return x

    def load_input(self, index: int, handle: object) -> torch.Tensor:
        """The input saved by ``save_input``, on the compute device."""
        assert isinstance(handle, torch.Tensor)
        return handle

    def grads_final(self, index: int, grads: list[torch.Tensor | None], *, chain: UnitChain) -> None:
        """Default: accumulate into ``param.grad`` as ``loss.backward()`` would."""
        for param, grad in zip(chain.own_params(index), grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad


class _RngState:
    """The CPU (and, for a CUDA input, that device's) RNG state at a unit's forward."""

    __slots__ = ("cpu", "cuda", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with the saved state, then put the current RNG state back."""
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def _autocast(device: torch.device, config: UnitwiseConfig):
    return torch.autocast(device_type=device.type, dtype=config.autocast_dtype or torch.bfloat16,
                          enabled=config.autocast_dtype is not None)


def final_points(chain: UnitChain) -> tuple[tuple[int, ...], ...]:
    """``final_points(chain)[k]``: the units whose gradients become final right after B(k), highest first.

    Backward runs from the last unit down, so unit ``j`` is final after the
    lowest-numbered unit among ``j`` and its readers ([Note: final gradients]).
    """
    points: list[list[int]] = [[] for _ in range(chain.num_units)]
    for unit in range(chain.num_units - 1, -1, -1):
        points[min((unit, *chain.readers(unit)))].append(unit)
    return tuple(tuple(p) for p in points)


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


def unitwise_loss(
    chain: UnitChain,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    hooks: UnitHooks | None = None,
    config: UnitwiseConfig | None = None,
) -> float:
    """The loss of a batch computed unit by unit without gradients (evaluation)."""
    hooks = hooks or UnitHooks()
    config = config or UnitwiseConfig()
    ctx = chain.context(inputs)
    x = inputs
    with torch.no_grad(), _autocast(inputs.device, config):
        for index in range(chain.num_units):
            hooks.acquire(index, phase=Phase.FORWARD)
            x = chain.run(index, x, ctx)
            hooks.release(index, phase=Phase.FORWARD)
        return float(chain.loss(x, targets))


def unitwise_step(
    chain: UnitChain,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    hooks: UnitHooks | None = None,
    config: UnitwiseConfig | None = None,
) -> StepResult:
    """Forward and backward of one (micro-)batch, unit by unit; gradients go to ``hooks.grads_final``."""
    hooks = hooks or UnitHooks()
    config = config or UnitwiseConfig()
    if config.keep_graph and max(config.keep_graph) >= chain.num_units:
        raise ValueError(f"keep_graph names unit {max(config.keep_graph)}, but the chain has {chain.num_units} units")
    ctx = chain.context(inputs)
    last = chain.num_units - 1
    saved: list[object] = []
    rng: list[_RngState | None] = []
    graphs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    x = inputs
    # Forward of every unit but the last ([Note: the last unit runs once]).
    with _autocast(inputs.device, config):
        for index in range(last):
            keep = index in config.keep_graph
            saved.append(None if keep else hooks.save_input(index, x))
            rng.append(_RngState(inputs.device) if config.preserve_rng and not keep else None)
            hooks.acquire(index, phase=Phase.FORWARD)
            if keep:
                x_in = _as_unit_input(x, index)
                with torch.enable_grad():
                    y = chain.run(index, x_in, ctx)
                graphs[index] = (x_in, y)
                x = y.detach()
            else:
                with torch.no_grad():
                    x = chain.run(index, x, ctx)
            hooks.release(index, phase=Phase.FORWARD)
    saved.append(hooks.save_input(last, x))
    rng.append(_RngState(inputs.device) if config.preserve_rng else None)
    del x

    pending: dict[int, list[torch.Tensor | None]] = {}
    finals = final_points(chain)
    grad_out: torch.Tensor | None = None
    loss_value = float("nan")
    for index in range(last, -1, -1):
        hooks.acquire(index, phase=Phase.BACKWARD)
        if index in graphs:
            x_in, y = graphs.pop(index)
            grads, grad_out = _differentiate(chain, index, x_in, y, grad_out)
        else:
            x_in = hooks.load_input(index, saved[index])
            saved[index] = None  # the saved input dies with this unit's backward
            grads, grad_out, loss = _backward_unit(chain, index, x_in, ctx, targets, grad_out,
                                                   is_last=index == last, rng=rng[index], config=config)
            if loss is not None:
                loss_value = loss
        hooks.release(index, phase=Phase.BACKWARD)
        for owner, owner_grads in grads.items():
            _accumulate(pending, owner, owner_grads)
        for owner in finals[index]:
            hooks.grads_final(owner, pending.pop(owner, [None] * len(chain.own_params(owner))), chain=chain)
    assert not pending, f"gradients of units {sorted(pending)} were never delivered"
    return StepResult(loss=loss_value, num_tokens=targets.numel())


def _as_unit_input(x: torch.Tensor, index: int) -> torch.Tensor:
    """A leaf copy of the previous unit's output that collects its gradient (none for unit 0's ids)."""
    x = x.detach()
    x.requires_grad_(index > 0 and x.is_floating_point())
    return x


def _backward_unit(
    chain: UnitChain,
    index: int,
    x_in: torch.Tensor,
    ctx: object,
    targets: torch.Tensor,
    grad_out: torch.Tensor | None,
    *,
    is_last: bool,
    rng: _RngState | None,
    config: UnitwiseConfig,
) -> tuple[dict[int, list[torch.Tensor | None]], torch.Tensor | None, float | None]:
    """Recompute unit ``index`` with grad from its saved input and differentiate it.

    Returns the parameter gradients by owning unit, the gradient for the
    previous unit's output, and (for the last unit) the unscaled loss.
    """
    if not is_last and grad_out is None:
        return {}, None, None  # nothing downstream depends on this unit's output
    x = _as_unit_input(x_in, index)
    with rng.replay() if rng is not None else nullcontext(), torch.enable_grad(), _autocast(x.device, config):
        y = chain.run(index, x, ctx)
        loss = chain.loss(y, targets) if is_last else None
    if loss is None:
        return (*_differentiate(chain, index, x, y, grad_out), None)
    grads, input_grad = _differentiate(chain, index, x, loss * config.loss_scale, None)
    return grads, input_grad, float(loss.detach())


def _differentiate(
    chain: UnitChain, index: int, x: torch.Tensor, root: torch.Tensor, root_grad: torch.Tensor | None,
) -> tuple[dict[int, list[torch.Tensor | None]], torch.Tensor | None]:
    """Gradients of ``root`` (a unit's output, or the loss) by owning unit, and for the unit's input ``x``."""
    if root_grad is None and root.dim() > 0:
        return {}, None  # an intermediate unit whose output nothing downstream depends on
    owners = (index, *chain.reads(index))
    params = [(owner, slot, p) for owner in owners for slot, p in enumerate(chain.own_params(owner)) if p.requires_grad]
    wrt = ([x] if x.requires_grad else []) + [p for _, _, p in params]
    if not wrt or not root.requires_grad:
        return {}, None
    grads = torch.autograd.grad(root, wrt, grad_outputs=root_grad, allow_unused=True)
    input_grad = grads[0] if x.requires_grad else None
    by_owner: dict[int, list[torch.Tensor | None]] = {o: [None] * len(chain.own_params(o)) for o in owners}
    for (owner, slot, _), grad in zip(params, grads[len(wrt) - len(params):], strict=True):
        by_owner[owner][slot] = grad
    return by_owner, input_grad


def _accumulate(pending: dict[int, list[torch.Tensor | None]], owner: int, grads: list[torch.Tensor | None]) -> None:
    current = pending.get(owner)
    if current is None:
        pending[owner] = list(grads)
        return
    for slot, grad in enumerate(grads):
        if grad is None:
            continue
        current[slot] = grad if current[slot] is None else current[slot] + grad
