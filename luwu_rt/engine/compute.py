"""The one step engine: each unit's forward and backward, as the plan's ``Compute`` ops run them.

DESIGN.md, "The execution model"::

    F0 F1 ... F(L-2)         forward under no_grad, keeping each unit's input
    B(L-1) ... B1 B0         recompute each unit with grad from its saved input,
                             backward, hand the input-gradient to the previous unit

``UnitCompute`` holds a step's per-micro-batch state (saved inputs, RNG states,
kept graphs, the gradient flowing down) and computes one unit at a time:
``forward(mb, k)`` and ``backward(mb, k)``. As the executor's ``Compute``
handler (``__call__``) it points the unit's parameters at the plan's device
copies, runs the unit and writes (or, for a gradient an earlier op started,
adds) the parameter gradients into the plan's gradient copies. Training,
evaluation (a forward-only plan) and ``unitwise_step`` (in memory, with hooks)
all run through it.

[Note: the last unit runs once]
The last unit's forward output is needed only to compute the loss, so F(L-1)
is fused into B(L-1): the last unit is computed once, with grad, and the loss
comes out of that computation. A forward-only (evaluation) plan runs F(L-1)
itself, and the loss comes out of that.

[Note: keeping a unit's graph]
Recomputation costs one extra forward per unit (about 1.1-1.3x a plain
autograd step). A unit in ``UnitwiseConfig.keep_graph`` instead runs its
forward with grad, and its backward differentiates that saved graph: no
recomputation, at the price of holding the unit's activations from F to B.

[Note: kept graphs in the engine]
A kept graph's saved tensors include the unit's parameters (a fp32 ``linear``
saves its weight), and those are views of the device arena: between F(k) and
B(k) the plan may free unit k's parameter slot and load another unit into the
same bytes. Arena views have their own version counters (store/arena.py), so
autograd would not notice and B(k) would compute with another unit's weights.
So while a kept unit's forward runs, a ``saved_tensors_hooks`` pack hook looks
at every saved tensor that aliases the device arena, for the forwards whose
parameter copies are at risk (``plan.analysis.params_at_risk``; under bf16
autocast the weights autograd saves are already casts, so none does). A
parameter, or a view of one (a ``linear`` saves ``weight.t()``), is kept as
where it lies in that parameter (``_Rebound``) and read again in B(k), where
the plan has the unit's parameters resident once more, bound to their copies
of then: the same values, wherever the slot is (B(k) reads every unit F(k)
read, and no update of them falls between). A copy of the parameters in every
kept graph had cost zero3 of gpt-small 112 MiB per rank beside the arena that
gathers them again for B. Any other saved tensor aliasing the arena is copied,
once, at pack time: the graph then owns its bytes and the arena is free to
reuse the slot. The cost of kept graphs is memory outside the arenas;
``kept_bytes`` in the step metrics reports it.

[Note: dropout is drawn by step]
A training pass runs every unit in train mode and an evaluation pass in eval
mode (``begin``): dropout is on in the one and off in the other, whatever mode
the model was handed over in. With ``StepRng`` (the engine's), the random
numbers a training step draws come from a generator state of their own,
derived from ``(seed, rank, step)`` alone, as the step's batches are drawn by
step number: the step is reproducible in any process, a resumed run draws what
the uninterrupted one drew (nothing about the RNG needs saving: the seed and the
step are in the checkpoint), a step replayed after a node restart draws the
same masks, and neither the user's draws from the global RNG between steps nor
this step's draws touch each other ([Note: a node that restarts] in
node/worker.py). Forwards draw from it in order; the recomputation in backward
replays the state its forward started from (``_RngState.replay``), so B(k)
differentiates the masks F(k) used; the last unit runs once and draws from the
step's state directly ([Note: the last unit runs once]).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from luwu_rt.exec.executor import Views
from luwu_rt.kernels.dtypes import LOW_PRECISION_DTYPES
from luwu_rt.models.units import UnitChain, _swap_in
from luwu_rt.plan.ops import Compute, ShardId

__all__ = ["InputStore", "StepRng", "UnitCompute", "UnitwiseConfig", "bind_unit_params"]

Grads = dict[int, list[torch.Tensor | None]]
"""Parameter gradients by owning unit, aligned with ``chain.own_params(owner)``."""


@dataclass(kw_only=True, slots=True)
class UnitwiseConfig:
    """How units compute."""

    autocast_dtype: torch.dtype | None = None
    """Compute dtype under ``torch.autocast`` (``torch.bfloat16`` or ``torch.float16``); ``None`` runs in the
    parameters' dtype."""
    loss_scale: float = 1.0
    """The loss is multiplied by this before backward (fp16 loss scaling, 1/grad_accum); gradients come out
    scaled by it, the returned loss does not."""
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
        if self.autocast_dtype not in (None, *LOW_PRECISION_DTYPES):
            raise ValueError(f"autocast_dtype must be None, torch.bfloat16 or torch.float16, not {self.autocast_dtype}")
        if not (self.loss_scale > 0 and self.loss_scale < float("inf")):
            raise ValueError(f"loss_scale must be a positive finite number, not {self.loss_scale}")


class InputStore:
    """Where a unit's forward input waits for its backward. The default keeps it as is; an engine
    may move it elsewhere (``unitwise_step``'s ``UnitHooks`` are one)."""

    def save_input(self, index: int, x: torch.Tensor) -> object:
        return x

    def load_input(self, index: int, handle: object) -> torch.Tensor:
        assert isinstance(handle, torch.Tensor)
        return handle


class _RngState:
    """A CPU (and, on a CUDA device, that device's) RNG state: the global one now, or a seed's."""

    __slots__ = ("cpu", "cuda", "device")

    def __init__(self, device: torch.device, *, seed: int | None = None) -> None:
        self.device = device
        cuda = device.type == "cuda"
        if seed is None:
            self.cpu = torch.get_rng_state()
            self.cuda = torch.cuda.get_rng_state(device) if cuda else None
        else:  # fresh generators: the global RNG is not touched
            self.cpu = torch.Generator().manual_seed(seed).get_state()
            self.cuda = torch.Generator(device=device).manual_seed(seed).get_state() if cuda else None

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with the saved state, then put the current RNG state back."""
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield

    @contextmanager
    def drawing(self) -> Iterator[None]:
        """Run the block drawing from this state, which then stands past what the block drew; the global
        RNG state is put back."""
        with self.replay():
            try:
                yield
            finally:
                self.cpu = torch.get_rng_state()
                if self.cuda is not None:
                    self.cuda = torch.cuda.get_rng_state(self.device)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRng:
    """Where a training step's random numbers (dropout masks) come from ([Note: dropout is drawn by step])."""

    seed: int
    """The run's seed (``TrainConfig.seed``)."""
    rank: int = 0
    """This rank: each rank draws its own masks for its own rows."""

    def state(self, step: int, device: torch.device) -> _RngState:
        """The generator state step ``step`` starts drawing from."""
        digest = hashlib.blake2b(f"luwu-dropout/{self.seed}/{self.rank}/{step}".encode(), digest_size=8).digest()
        return _RngState(device, seed=int.from_bytes(digest, "little") >> 1)


def _autocast(device: torch.device, config: UnitwiseConfig):
    return torch.autocast(device_type=device.type, dtype=config.autocast_dtype or torch.bfloat16,
                          enabled=config.autocast_dtype is not None)


def bind_unit_params(chain: UnitChain, unit: int, flat: torch.Tensor) -> None:
    """Points unit ``unit``'s own parameters at consecutive slices of ``flat`` (a typed flat tensor)."""
    offset = 0
    for param in chain.own_params(unit):
        n = param.numel()
        view = flat[offset : offset + n].view(param.shape)
        if param.device == view.device and param.dtype == view.dtype:
            param.data = view
        else:  # first binding of a meta parameter: swap in place, keeping its identity
            _swap_in(param, view)
        offset += n


class UnitCompute:
    """Forward and backward of one unit at a time over a step's micro-batches; also the executor's
    ``Compute`` handler."""

    def __init__(self, chain: UnitChain, *, config: UnitwiseConfig, param_dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype | None = None, device_arena: torch.Tensor | None = None,
                 at_risk: frozenset[tuple[int, int]] | None = None, inputs: InputStore | None = None,
                 step_rng: StepRng | None = None) -> None:
        """``param_dtype``/``grad_dtype``: element types of the plan's parameter and gradient copies (the
        handler only). ``device_arena``: the buffer the parameter views come from. ``at_risk``: the
        ``(micro_batch, unit)`` forwards whose saved tensors aliasing the arena must be copied
        (``params_at_risk(plan)``); ``None``: all of them ([Note: kept graphs in the engine]).
        ``step_rng``: training steps draw from a state of their own ([Note: dropout is drawn by step]);
        ``None``: from the global RNG."""
        if config.keep_graph and max(config.keep_graph) >= chain.num_units:
            raise ValueError(f"keep_graph names unit {max(config.keep_graph)}, but the chain has "
                             f"{chain.num_units} units")
        self.chain = chain
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.config = config
        self.inputs = inputs or InputStore()
        self._arena_ptr = device_arena.untyped_storage().data_ptr() if device_arena is not None else None
        self._at_risk = at_risk
        self.step_rng = step_rng
        self.begin([])

    def begin(self, batches: list[tuple[torch.Tensor, torch.Tensor]], *, train: bool = True,
              step: int | None = None) -> None:
        """Resets per-step state for the micro-batches ``[(inputs, targets), ...]`` of the next step and
        puts every unit in train mode; ``train=False`` for a forward-only (evaluation) pass: units in eval
        mode (no dropout), no graphs kept, the last unit's forward computes the loss. ``step``: the step's
        number, which its random numbers derive from (needed with ``step_rng``)."""
        self.batches = batches
        self.train = train
        for unit in self.chain.units:  # dropout reads each module's .training
            unit.train(train)
        self._draws: _RngState | None = None
        if train and self.step_rng is not None and batches:
            assert step is not None, "a training step of a UnitCompute with step_rng needs its step number"
            self._draws = self.step_rng.state(step, batches[0][0].device)
        self.ctx = [self.chain.context(inputs) for inputs, _ in batches]
        self.saved: list[dict[int, object]] = [{} for _ in batches]
        self.graphs: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in batches]
        self.kept_bytes = 0
        """Bytes held by kept graphs (activations and snapshots), summed over this step's micro-batches."""
        self.snapshot_bytes = 0
        """Of those, bytes copied out of the device arena ([Note: kept graphs in the engine])."""
        # Storages already in kept_bytes, per micro-batch (a unit's output is the next one's input). Per
        # micro-batch: its saved tensors are all alive until its backward, so their addresses are unique.
        self._counted: list[set[int]] = [set() for _ in batches]
        self.rng: list[dict[int, _RngState]] = [{} for _ in batches]
        self.carry: list[torch.Tensor | None] = [inputs for inputs, _ in batches]
        self.losses: list[float] = [float("nan")] * len(batches)

    # -- the plan's Compute handler -------------------------------------------------------------

    def __call__(self, op: Compute, views: Views) -> None:
        # Called on the compute queue's thread (or its stream's worker), which lives across steps and
        # plans ([Note: persistent queue threads] in exec/streams.py).
        for unit in (op.unit, *self.chain.reads(op.unit)):
            bind_unit_params(self.chain, unit, _full(views, unit, "param").view(self.param_dtype))
        if op.name.startswith("F"):
            self.forward(op.micro_batch, op.unit)
            return
        grads = self.backward(op.micro_batch, op.unit)
        written = {a.shard for a in op.inputs}
        for unit in (op.unit, *self.chain.reads(op.unit)):
            buffer = _full(views, unit, "grad").view(self.grad_dtype)
            n = self.chain.num_unit_params(unit)
            accumulate = any(s.unit == unit and s.state.startswith("grad") for s in written)
            _write_grads(self.chain, unit, buffer[:n], grads.get(unit), accumulate=accumulate)
            if not accumulate:
                buffer[n:].zero_()  # a full buffer's padding is reduce-scattered too: it must add nothing

    # -- one unit -------------------------------------------------------------------------------

    def _drawing(self):
        """Where a training computation's fresh random numbers come from ([Note: dropout is drawn by step])."""
        return self._draws.drawing() if self._draws is not None else nullcontext()

    def forward(self, mb: int, k: int) -> None:
        """F(k) of micro-batch ``mb``, the unit's parameters resident."""
        x = self.carry[mb]
        if not self.train:
            with torch.no_grad(), _autocast(x.device, self.config):
                y = self.chain.run(k, x, self.ctx[mb])
                if k == self.chain.num_units - 1:
                    self.losses[mb] = float(self.chain.loss(y, self.batches[mb][1]))
            self.carry[mb] = y
            return
        if k in self.config.keep_graph:
            with self._drawing():
                self._forward_kept(mb, k, x)
            return
        self.saved[mb][k] = self.inputs.save_input(k, x)
        with self._drawing():
            if self.config.preserve_rng:
                self.rng[mb][k] = _RngState(x.device)
            with torch.no_grad(), _autocast(x.device, self.config):
                self.carry[mb] = self.chain.run(k, x, self.ctx[mb])

    def _forward_kept(self, mb: int, k: int, x: torch.Tensor) -> None:
        """F(k) with grad, keeping the graph; saved tensors aliasing the arena are read again in B(k) where they
        are parameters, else copied once ([Note: kept graphs in the engine])."""
        copies: dict[tuple, torch.Tensor] = {}
        counted = self._counted[mb]
        snapshot = self._at_risk is None or (mb, k) in self._at_risk
        params = [p for unit in (k, *self.chain.reads(k)) for p in self.chain.own_params(unit)]

        def pack(t: torch.Tensor) -> torch.Tensor | _Rebound:
            ptr = t.untyped_storage().data_ptr()
            if ptr == self._arena_ptr:
                if not snapshot:
                    return t  # the arena's bytes, not held by the graph
                if (rebound := _Rebound.of(t, params)) is not None:
                    return rebound  # read again in B(k), from the parameter's copy of then
                key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                if key not in copies:
                    copies[key] = t.detach().clone(memory_format=torch.preserve_format)
                    self.snapshot_bytes += copies[key].untyped_storage().nbytes()
                t = copies[key]
                ptr = t.untyped_storage().data_ptr()
            if ptr not in counted:  # a storage saved by several ops is held once
                counted.add(ptr)
                self.kept_bytes += t.untyped_storage().nbytes()
            return t

        x_in = _as_unit_input(x, k)
        with torch.autograd.graph.saved_tensors_hooks(pack, _Rebound.unpack), torch.enable_grad(), \
                _autocast(x.device, self.config):
            y = self.chain.run(k, x_in, self.ctx[mb])
        self.graphs[mb][k] = (x_in, y)
        self.carry[mb] = y.detach()

    def backward(self, mb: int, k: int) -> Grads:
        """B(k) of micro-batch ``mb`` (the last unit's forward included): returns the parameter gradients
        by owning unit and leaves the gradient of the unit's input for B(k-1)."""
        if k in self.graphs[mb]:
            x_in, y = self.graphs[mb].pop(k)
            grads, self.carry[mb] = _differentiate(self.chain, k, x_in, y, self.carry[mb])
            return grads
        last = self.chain.num_units - 1
        if k == last:  # [Note: the last unit runs once]: it draws afresh, nothing to replay
            self.saved[mb][k] = self.inputs.save_input(k, self.carry[mb])
        x_in = self.inputs.load_input(k, self.saved[mb].pop(k))
        with self._drawing() if k == last else nullcontext():
            grads, self.carry[mb], loss = _backward_unit(
                self.chain, k, x_in, self.ctx[mb], self.batches[mb][1], self.carry[mb] if k != last else None,
                is_last=k == last, rng=self.rng[mb].pop(k, None), config=self.config)
        if loss is not None:
            self.losses[mb] = loss
        return grads


class _Rebound:
    """A saved tensor that is a unit's parameter or a view of one, kept as where it lies in the parameter and read
    again when backward unpacks it, from whatever copy the parameter is bound to then ([Note: kept graphs in the
    engine])."""

    __slots__ = ("param", "offset", "size", "stride")

    def __init__(self, param: torch.Tensor, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.param, self.offset, self.size, self.stride = param, offset, size, stride

    @classmethod
    def of(cls, t: torch.Tensor, params: list[torch.Tensor]) -> "_Rebound | None":
        """``t`` as a place in one of ``params`` (of its dtype, every element it spans inside it), or ``None``."""
        span = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        for p in params:
            if p.dtype != t.dtype or p.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
                continue
            offset = t.storage_offset() - p.storage_offset()
            if 0 <= offset and offset + span < p.numel() and p.is_contiguous():
                return cls(p, offset, tuple(t.shape), t.stride())
        return None

    @staticmethod
    def unpack(t: "torch.Tensor | _Rebound") -> torch.Tensor:
        if not isinstance(t, _Rebound):
            return t
        base = t.param.detach()
        return base.as_strided(t.size, t.stride, base.storage_offset() + t.offset)


def _full(views: Views, unit: int, kind: str) -> torch.Tensor:
    """A unit's whole ``param`` or ``grad`` buffer among an op's views: the ``*_full`` workspace under the
    strategies that shard the state ([Note: planned workspaces] in plan/ops.py), else the state itself
    (one shard per unit and state in the engine's plans)."""
    full = views.get(ShardId(unit, f"{kind}_full", 0))
    return full if full is not None else views[ShardId(unit, kind, 0)]


def _as_unit_input(x: torch.Tensor, index: int) -> torch.Tensor:
    """A leaf copy of the previous unit's output that collects its gradient (none for unit 0's ids)."""
    x = x.detach()
    x.requires_grad_(index > 0 and x.is_floating_point())
    return x


def _backward_unit(chain: UnitChain, index: int, x_in: torch.Tensor, ctx: object, targets: torch.Tensor,
                   grad_out: torch.Tensor | None, *, is_last: bool, rng: _RngState | None,
                   config: UnitwiseConfig) -> tuple[Grads, torch.Tensor | None, float | None]:
    """Recompute unit ``index`` with grad from its saved input and differentiate it. Returns the
    parameter gradients by owning unit, the gradient for the previous unit's output, and (for the
    last unit) the unscaled loss."""
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


def _differentiate(chain: UnitChain, index: int, x: torch.Tensor, root: torch.Tensor,
                   root_grad: torch.Tensor | None) -> tuple[Grads, torch.Tensor | None]:
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
    by_owner: Grads = {o: [None] * len(chain.own_params(o)) for o in owners}
    for (owner, slot, _), grad in zip(params, grads[len(wrt) - len(params):], strict=True):
        by_owner[owner][slot] = grad
    return by_owner, input_grad


def _write_grads(chain: UnitChain, unit: int, flat: torch.Tensor, grads: list[torch.Tensor | None] | None,
                 *, accumulate: bool) -> None:
    offset = 0
    for slot, param in enumerate(chain.own_params(unit)):
        n = param.numel()
        dst = flat[offset : offset + n]
        grad = grads[slot] if grads is not None else None
        if grad is None:
            if not accumulate:
                dst.zero_()
        elif accumulate:
            dst.add_(grad.reshape(-1))
        else:
            dst.copy_(grad.reshape(-1))
        offset += n


def accumulate_grads(pending: Grads, owner: int, grads: list[Any]) -> None:
    """Adds ``grads`` (one unit's, aligned with its own params) into ``pending[owner]``."""
    current = pending.get(owner)
    if current is None:
        pending[owner] = list(grads)
        return
    for slot, grad in enumerate(grads):
        if grad is not None:
            current[slot] = grad if current[slot] is None else current[slot] + grad
