"""The ``Compute`` handler: one unit's forward or backward on its planned copies.

The plan hands each ``Compute`` op the device copies of the parameters it
reads and of the gradients it writes, as flat byte views into the device
arena. This handler points the unit's parameters at those bytes (no copy),
runs the unit, and writes (or, for a gradient a previous op already started,
adds) the parameter gradients into the gradient views. Everything about where
those bytes live and when they move is the plan's.

[Note: gradient norm]
When the last writer of a unit's gradients finishes (in the last micro-batch),
the handler adds that unit's squared gradient norm to the step's total. The
optimizer steps read the total only after the whole backward (the plan makes
them wait when clipping or fp16 overflow checks are on), so it is complete.

[Note: kept graphs in the engine]
A unit in ``config.keep_graph`` runs its forward with grad and keeps the
autograd graph until its backward instead of recomputing it ([Note: keeping a
unit's graph] in unitwise.py). The graph's saved tensors include the unit's
parameters (a fp32 ``linear`` saves its weight), and those are views of the
device arena: between F(k) and B(k) the plan may free unit k's parameter slot
and load another unit into the same bytes. Arena views have their own version
counters (store/arena.py), so autograd would not notice and B(k) would compute
with another unit's weights.

So while a kept unit's forward runs, a ``saved_tensors_hooks`` pack hook
copies every saved tensor that aliases the device arena, once, at pack time:
the graph then owns its bytes and the arena is free to reuse the slot. Only
what autograd actually saves is copied (under bf16 autocast the weights it
saves are already casts, so nothing is), and only for the forwards whose
parameter copies are at risk (``params_at_risk``): those whose backward reads
another copy, or whose copy the plan frees, reloads or rewrites in between. A
copy the plan keeps from F to B (a device home, or a budget roomy enough to
keep the unit resident) is only released after B, so its bytes are intact.
Binding kept units to handler-owned parameter copies would also be sound, but
would copy every parameter, also those autograd never saves.

The cost of kept graphs is memory: the units' activations (and any snapshots)
live from F to B outside the arenas, which the plan does not see; hence
``TrainConfig.keep_graphs="auto"`` keeps them on the CPU only, and
``kept_bytes`` in the step metrics reports them.

[Note: one long-lived compute thread]
The executor starts fresh threads for every step's queues. Units computed on a
thread that was just born run about 10% slower on the CPU (measured on
gpt-small: a plain fwd+bwd on a new thread 1.32 s vs 1.25 s on a long-lived
one): the math libraries' per-thread state (OpenMP team, scratch buffers,
malloc arena) is rebuilt each time. So the handler hands every unit to one
daemon thread that lives as long as the process. Compute ops run one at a time
on the plan's compute queue anyway, so nothing is serialised that was not.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from luwu_rt.engine.unitwise import UnitwiseConfig, _as_unit_input, _autocast, _backward_unit, _differentiate, _RngState
from luwu_rt.exec.executor import Views
from luwu_rt.models.units import UnitChain, _swap_in
from luwu_rt.plan.ops import Access, Compute, Free, Op, ShardId, SwapPlan

__all__ = ["UnitCompute", "bind_unit_params", "params_at_risk"]


def params_at_risk(plan: SwapPlan) -> frozenset[tuple[int, int]]:
    """``(micro_batch, unit)`` of the forwards whose device parameter copies may be overwritten before
    the unit's backward: a graph they keep must copy what it saves ([Note: kept graphs in the engine])."""
    ops = plan.ops
    position = {(op.name[0], op.micro_batch, op.unit): i for i, op in enumerate(ops) if isinstance(op, Compute)}
    risky = set()
    for (phase, mb, unit), f in position.items():
        if phase != "F":
            continue
        b = position.get(("B", mb, unit))
        copies = {a for a in ops[f].inputs if a.shard.state == "param" and a.tier == "device"}
        if b is None or not copies <= set(ops[b].inputs) or any(_touches(op, copies) for op in ops[f + 1 : b]):
            risky.add((mb, unit))
    return frozenset(risky)


def _touches(op: Op, copies: set[Access]) -> bool:
    """Whether ``op`` frees or writes one of ``copies`` (another shard can only take their bytes after a Free)."""
    if isinstance(op, Free):
        return Access(op.shard, op.tier, op.slot) in copies
    return any(a in copies for a in op.outputs)


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


class _LongLivedThread:
    """Runs calls on one daemon thread that lives as long as the process ([Note: one long-lived compute
    thread]); callers block until their call returns and get its exception, if any."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def call(self, fn: Callable[..., None], *args: object) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():  # first call, or in a forked child
                self._calls = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, name="luwu-unit-compute", daemon=True)
                self._thread.start()
        if threading.current_thread() is self._thread:
            fn(*args)
            return
        done, failure = threading.Event(), []
        self._calls.put((fn, args, done, failure))
        done.wait()
        if failure:
            raise failure[0]

    def _serve(self) -> None:
        while True:
            fn, args, done, failure = self._calls.get()
            try:
                fn(*args)
            except BaseException as exc:  # handed to the caller, who re-raises it on its own thread
                failure.append(exc)
            finally:
                done.set()


_COMPUTE_THREAD = _LongLivedThread()


class UnitCompute:
    """Callable ``(op, views)`` for the executor's ``Compute`` ops of one training step."""

    def __init__(self, chain: UnitChain, *, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                 config: UnitwiseConfig, device_arena: torch.Tensor | None = None,
                 at_risk: frozenset[tuple[int, int]] | None = None) -> None:
        """``device_arena``: the buffer the parameter views come from. ``at_risk``: the ``(micro_batch, unit)``
        forwards whose saved tensors aliasing the arena must be copied (``params_at_risk(plan)``); ``None``:
        all of them ([Note: kept graphs in the engine])."""
        if config.keep_graph and max(config.keep_graph) >= chain.num_units:
            raise ValueError(f"keep_graph names unit {max(config.keep_graph)}, but the chain has "
                             f"{chain.num_units} units")
        self.chain = chain
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.config = config
        self._arena_ptr = device_arena.untyped_storage().data_ptr() if device_arena is not None else None
        self._at_risk = at_risk
        self.last_writer = {u: min((u, *chain.readers(u))) for u in range(chain.num_units)}
        self._lock = threading.Lock()
        self.begin([])

    def begin(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Resets per-step state for the micro-batches ``[(inputs, targets), ...]`` of the next step."""
        self.batches = batches
        self.ctx = [self.chain.context(inputs) for inputs, _ in batches]
        self.saved: list[dict[int, torch.Tensor]] = [{} for _ in batches]
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
        self.losses: list[float] = []
        self.grad_norm_sq = 0.0

    def _bind(self, op: Compute, views: Views) -> None:
        for unit in (op.unit, *self.chain.reads(op.unit)):
            bind_unit_params(self.chain, unit, views[ShardId(unit, "param", 0)].view(self.param_dtype))

    def __call__(self, op: Compute, views: Views) -> None:
        _COMPUTE_THREAD.call(self._run, op, views)  # [Note: one long-lived compute thread]

    def _run(self, op: Compute, views: Views) -> None:
        self._bind(op, views)
        if op.name.startswith("F"):
            self._forward(op)
        else:
            self._backward(op, views)

    def _forward(self, op: Compute) -> None:
        mb, k = op.micro_batch, op.unit
        x = self.carry[mb]
        if k in self.config.keep_graph:
            self._forward_kept(mb, k, x)
            return
        self.saved[mb][k] = x
        if self.config.preserve_rng:
            self.rng[mb][k] = _RngState(x.device)
        with torch.no_grad(), _autocast(x.device, self.config):
            self.carry[mb] = self.chain.run(k, x, self.ctx[mb])

    def _forward_kept(self, mb: int, k: int, x: torch.Tensor) -> None:
        """F(k) with grad, keeping the graph; saved tensors aliasing the arena are copied once."""
        copies: dict[tuple, torch.Tensor] = {}
        counted = self._counted[mb]
        snapshot = self._at_risk is None or (mb, k) in self._at_risk

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr == self._arena_ptr:
                if not snapshot:
                    return t  # the arena's bytes, not held by the graph
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
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad(), \
                _autocast(x.device, self.config):
            y = self.chain.run(k, x_in, self.ctx[mb])
        self.graphs[mb][k] = (x_in, y)
        self.carry[mb] = y.detach()

    def _backward(self, op: Compute, views: Views) -> None:
        mb, k = op.micro_batch, op.unit
        if k in self.graphs[mb]:
            x_in, y = self.graphs[mb].pop(k)
            grads, self.carry[mb] = _differentiate(self.chain, k, x_in, y, self.carry[mb])
            self._store_grads(op, views, mb, k, grads)
            return
        last = self.chain.num_units - 1
        if k == last:  # [Note: the last unit runs once] in unitwise.py
            self.saved[mb][k] = self.carry[mb]
            if self.config.preserve_rng:
                self.rng[mb][k] = _RngState(self.carry[mb].device)
        x_in = self.saved[mb].pop(k)
        grads, self.carry[mb], loss = _backward_unit(
            self.chain, k, x_in, self.ctx[mb], self.batches[mb][1], self.carry[mb] if k != last else None,
            is_last=k == last, rng=self.rng[mb].pop(k, None), config=self.config)
        if loss is not None:
            self.losses.append(loss)
        self._store_grads(op, views, mb, k, grads)

    def _store_grads(self, op: Compute, views: Views, mb: int, k: int,
                     grads: dict[int, list[torch.Tensor | None]]) -> None:
        written = {a.shard for a in op.inputs if a.shard.state == "grad"}
        for unit in (k, *self.chain.reads(k)):
            sid = ShardId(unit, "grad", 0)
            flat = views[sid].view(self.grad_dtype)[: self.chain.num_unit_params(unit)]
            self._write_grads(unit, flat, grads.get(unit), accumulate=sid in written)
            if self.last_writer[unit] == k and mb == len(self.batches) - 1:
                norm_sq = float(torch.linalg.vector_norm(flat, dtype=torch.float32)) ** 2  # [Note: gradient norm]
                with self._lock:
                    self.grad_norm_sq += norm_sq

    def _write_grads(self, unit: int, flat: torch.Tensor, grads: list[torch.Tensor | None] | None,
                     *, accumulate: bool) -> None:
        offset = 0
        for slot, param in enumerate(self.chain.own_params(unit)):
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
