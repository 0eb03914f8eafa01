"""The workload of training a ``UnitChain`` as the engine runs it: units, FLOPs and activation bytes.

The planner (``luwu_rt/plan``) plans a chain of ``UnitSpec``s and keeps
``ModelSpec.activation_bytes`` of the device budget outside its arena for the
compute's own tensors. ``train_model_spec`` makes that ``ModelSpec`` for any
chain, so that the engine and ``luwu plan`` put the same question to the
planner. Unit sizes come from the chain; activation bytes are measured, not
guessed: one micro-batch runs on the ``meta`` device (no memory behind any
tensor) exactly as ``UnitCompute`` (engine/compute.py) runs it, while the bytes
of every tensor it holds are tracked over time ([Note: activation estimate]).

[Note: activation estimate]
What is counted: the bytes of the tensors the step's compute holds outside the
arenas on the compute device, at the moment that holds the most, over the
whole step:

* the inputs and targets of *all* the step's micro-batches and their contexts
  (``Engine.train_step`` moves them to the device together, before F0), as
  tensors of their own, as ``.to(device)`` makes them on a GPU (on the CPU
  the sampler's inputs and targets are two views of one tensor, a little
  less);
* each recomputed unit's saved input, from F(k) to B(k);
* each kept unit's graph ([Note: keeping a unit's graph]), from F(k) to B(k):
  the storages its ops save, counted once each as ``UnitCompute.kept_bytes``
  counts them, and its output;
* whatever the running op holds for itself: a forward's intermediates (under
  ``no_grad`` each dies once the next op has read it), a backward's
  recomputed graph, the gradient flowing in and the one flowing out, and the
  parameter gradients autograd returns, which live until the handler has
  written them into the arena; at the last unit the logits, their fp32 copy,
  the log-softmax the loss saves and the gradients of both.

Parameters and buffers are the model's own bytes (the arena's, for
parameters) and are not counted, except where a kept graph copies the
parameters it saves. ``UnitCompute`` copies none now: where the plan may reuse
their slots before the backward (``params_at_risk(plan)``) it reads them again
in B from the slots the plan loads them into then ([Note: kept graphs in the
engine]). By default (``snapshot_units=None``) the estimate still counts one
copy for every kept forward, as when the engine copied them: the reserve errs
on the large side by at most the weights the kept units save (nothing when no
graph is kept; 3 MiB of gpt-tiny's 67 MiB of kept graphs), a budget and not
memory the run holds; ``snapshot_units=()`` counts what the engine holds.

Why the peak and not a sum of parts: the planner keeps one fixed reserve for
the whole step, so what must fit is the most that is ever live at once. A sum
of parts (``plan/gpt.py``'s analytic ``gpt_activation_bytes``: every saved
input + one block's workspace + the logits) adds tensors that never coexist
(the logits die before any block's backward starts) and misses some that do
(the parameter gradients, the kept graphs). Micro-batches do not add up: the
plan runs F..B of one micro-batch before the next one's F0, so only their
inputs coexist, and those are counted.

How it is measured: a ``TorchDispatchMode`` sees every op's outputs, looks at
their storages (a view shares its base's storage) and follows each storage
with a ``weakref.finalize``: it is live from the op that made it until Python
lets go of its last view, as on a real device, because the walk keeps
exactly the references ``UnitCompute`` keeps. ``timeline`` is the most live
at once during each op. The meta kernels give every output the shape, dtype
and layout a real kernel gives it, so the bytes are the real ones (in fp32
the CPU allocator's peak over a step equals the estimate to the byte, tests
in tests/engine/test_workload.py). Invisible here is what a kernel allocates
and frees inside itself: oneDNN's bf16 GEMMs on the CPU reorder operands into
scratch (the estimate is 6% under the CPU's peak for gpt-tiny in bf16), a
GPU's flash attention backward accumulates dq in fp32; and so are the CUDA
caching allocator's rounding and fragmentation, cuBLAS's workspace and the
CUDA context, which a GPU budget must leave room for besides. Two kernels
differ from the real ones in what they keep: the CPU's bf16/fp16 LayerNorm
keeps its mean and rstd in bf16/fp16 where meta (and CUDA) keep fp32, 4 bytes
per token per LayerNorm more in the estimate; and attention ([Note: attention
on meta]).

[Note: attention on meta]
On ``meta``, ``scaled_dot_product_attention`` falls back to the math kernel,
which saves the batch x heads x T x T attention probabilities for backward. On
the CPU (and on a GPU) the engine gets a fused kernel that saves only q, k, v,
the output and a logsumexp per row. So while the walk runs, SDPA calls are
answered with the CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``,
which has a meta kernel) whenever the CPU's own kernel choice,
``_fused_sdp_choice`` asked about data-free stand-ins of the same shapes,
dtypes and flags, would pick it; otherwise the math kernel's bytes stand. A
GPU picks flash or memory-efficient attention in more cases (dropout), which
save about the same ([Note: the estimate on a GPU]).

[Note: the estimate on a GPU]
Measured on an H200 (torch 2.11, CUDA 13), against the engine's own
``kept_bytes`` (tests/engine/test_workload.py runs there): CUDA's fused
attention keeps a Philox seed and offset (16 bytes per attention call) beside
its logsumexp, and the memory-efficient kernel (fp32) pads that logsumexp to a
multiple of 32 rows, so the estimate is short by up to
batch x heads x 31 x 4 + 16 bytes per kept attention (2112 bytes for
gpt-tiny's four blocks at 2 x 16 tokens; 64 in bf16, where flash attention
pads nothing); a Dropout's mask is bool on CUDA where meta keeps it in the
input's dtype, so there the estimate is long by itemsize - 1 bytes per
element. Both are small beside what a GPU budget must leave room for anyway
(the CUDA context, cuBLAS's workspace, the caching allocator's rounding).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from luwu_rt.engine.compute import _as_unit_input, _differentiate
from luwu_rt.kernels.dtypes import COMPUTE_DTYPES, torch_dtype
from luwu_rt.models.units import UnitChain
from luwu_rt.plan.spec import ModelSpec, UnitSpec

if TYPE_CHECKING:
    from luwu_rt.engine.config import TrainConfig

__all__ = ["ActivationEstimate", "config_model_spec", "device_budget", "kept_units", "measure_activations",
           "train_model_spec", "unit_specs"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationEstimate:
    """Device bytes of a training step's activations ([Note: activation estimate])."""

    peak_bytes: int
    """The most bytes live at once at any point of the step: what the plan must reserve."""
    peak_at: str
    """The op of one micro-batch during which the peak happens (``F3``, ``B5``, ...)."""
    timeline: tuple[tuple[str, int], ...]
    """Each op of one micro-batch in step order (F0..F(L-2), B(L-1)..B0), with the most bytes live while it runs."""
    batch_bytes: int
    """Inputs, targets and contexts of all the step's micro-batches, live the whole step."""
    saved_input_bytes: int
    """Inputs that recomputed units keep for their backward, one micro-batch, each storage once: what
    ``UnitCompute`` hands ``InputStore.save_input`` (the last unit's input included, the batch's own inputs
    when unit 0 is recomputed)."""
    kept_bytes: int
    """Bytes held by kept graphs of one micro-batch, counted as ``UnitCompute.kept_bytes`` counts them."""
    snapshot_bytes: int
    """Of ``kept_bytes``, the copies of parameters that kept graphs save."""


def unit_specs(chain: UnitChain, *, seq_len: int) -> tuple[UnitSpec, ...]:
    """The planner's view of ``chain``'s units: sizes, reads, and the forward FLOPs per token of sequences of
    ``seq_len`` tokens that the chain counts ([Note: FLOPs of a unit] in plan/spec.py)."""
    units = tuple(UnitSpec(name=chain.names[i], num_params=chain.num_unit_params(i), reads=chain.reads(i),
                           flops_per_token=chain.flops_per_token(i, seq_len=seq_len))
                  for i in range(chain.num_units) if chain.num_unit_params(i) > 0)
    if len(units) != chain.num_units:
        empty = [chain.names[i] for i in range(chain.num_units) if chain.num_unit_params(i) == 0]
        raise ValueError(f"units {empty} own no parameters; merge them into a neighbouring unit")
    return units


def kept_units(keep_graphs: int | str, *, num_units: int) -> frozenset[int]:
    """``TrainConfig.keep_graphs`` as unit indices, the most a run may keep: N keeps the N units before the
    last, ``all`` every unit before the last, and so does ``auto``, of which a run keeps as many as its
    budgets allow ([Note: kept graphs chosen by the budget] in engine/kept.py). The last unit runs once
    anyway ([Note: the last unit runs once] in compute.py), so at most the units before it keep a graph."""
    last = num_units - 1
    count = {"all": last, "auto": last, "none": 0}.get(keep_graphs, keep_graphs)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"keep_graphs={keep_graphs!r}: choose auto, all, none or a number of units >= 0")
    return frozenset(range(max(last - count, 0), last))


def train_model_spec(chain: UnitChain, *, batch_size: int, seq_len: int, chunk_bytes: int, grad_accum: int = 1,
                     dtype: torch.dtype | str = torch.float32, keep_graph: Iterable[int] = (),
                     optimizer_waits_for_backward: bool = False, snapshot_units: Iterable[int] | None = None,
                     example: tuple[torch.Tensor, torch.Tensor] | None = None, world_size: int = 1) -> ModelSpec:
    """The ``ModelSpec`` of training ``chain`` as the engine does: one shard per (unit, state), since a unit's
    parameters must be one contiguous run of device bytes that its modules can point at (chunks still cut
    its IO); ``grad_accum`` micro-batches of ``batch_size`` x ``seq_len`` tokens computed in ``dtype``; and
    the measured activation peak of ``measure_activations`` as the device reserve. With ``world_size`` > 1
    the gradients are fp32, as ranks reduce them ([Note: data parallelism in the engine])."""
    compute_dtype = _compute_dtype(dtype)
    units = unit_specs(chain, seq_len=seq_len)
    activations = measure_activations(chain, batch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum,
                                      dtype=compute_dtype, keep_graph=keep_graph, snapshot_units=snapshot_units,
                                      example=example)
    return ModelSpec(units=units, param_bytes=compute_dtype.itemsize,
                     grad_bytes=4 if world_size > 1 else compute_dtype.itemsize,
                     chunk_bytes=chunk_bytes, max_shards_per_state=1,
                     tokens_per_step=batch_size * seq_len * grad_accum, num_micro_batches=grad_accum,
                     optimizer_waits_for_backward=optimizer_waits_for_backward,
                     activation_bytes=activations.peak_bytes)


def config_model_spec(chain: UnitChain, config: "TrainConfig", *, world_size: int = 1,
                      keep_graph: Iterable[int] | None = None) -> ModelSpec:
    """``train_model_spec`` for a run of ``config``: what ``Engine`` plans, and the device budget it needs is
    ``activation_bytes`` plus the arena it leaves for shards. ``keep_graph``: the units that keep their
    forward graph; ``None``: ``kept_units(config.keep_graphs)``, under ``auto`` every unit that may keep one
    (how many a run keeps: ``plan_kept`` in engine/kept.py)."""
    if keep_graph is None:
        keep_graph = kept_units(config.keep_graphs, num_units=chain.num_units)
    return train_model_spec(chain, batch_size=config.batch_size, seq_len=config.seq_len,
                            grad_accum=config.grad_accum, chunk_bytes=config.offload.chunk_bytes, dtype=config.dtype,
                            keep_graph=keep_graph,
                            optimizer_waits_for_backward=config.optim.grad_clip > 0 or config.dtype == "fp16",
                            # A node worker's gradients leave the process too (pushed, summed on the node): fp32.
                            world_size=max(world_size, 2) if config.strategy == "node" else world_size)


def device_budget(config: "TrainConfig", *, arena_bytes: int, chain: UnitChain | None = None) -> int:
    """The ``offload.device_mem_bytes`` that leaves ``arena_bytes`` for shards beside the activations a run of
    ``config`` reserves with the graphs it asks to keep (under ``auto`` all: the budget with which ``auto``
    keeps every one); ``chain`` defaults to ``config.model``, built on meta."""
    if chain is None:
        from luwu_rt.models.adapt import as_unit_chain

        chain = as_unit_chain(config.model)
    return config_model_spec(chain, config).activation_bytes + arena_bytes


def measure_activations(chain: UnitChain, *, batch_size: int, seq_len: int, dtype: torch.dtype | str = torch.float32,
                        keep_graph: Iterable[int] = (), grad_accum: int = 1,
                        snapshot_units: Iterable[int] | None = None,
                        example: tuple[torch.Tensor, torch.Tensor] | None = None) -> ActivationEstimate:
    """Activation bytes of one training step of ``chain``, measured on ``meta`` ([Note: activation estimate]).

    Micro-batches are ``(inputs, targets)`` of ``batch_size`` x ``seq_len`` token ids (int64), as the engine's
    sampler makes them, or shaped like ``example`` (only its shapes and dtypes are read). ``dtype``: the
    compute dtype (``torch.float32`` or ``"fp32"``, ``"bf16"``, ``"fp16"``). ``keep_graph``: the units whose
    forward keeps its graph (``kept_units``). ``snapshot_units``: the kept units whose graphs copy the
    parameters they save (``UnitCompute``'s forwards at risk); ``None``: all of them ([Note: activation
    estimate]). ``chain`` may be on any device; it runs as a meta copy and is left as it is."""
    compute_dtype = _compute_dtype(dtype)
    if min(batch_size, seq_len, grad_accum) <= 0:
        raise ValueError(f"batch_size={batch_size}, seq_len={seq_len} and grad_accum={grad_accum} must be positive")
    keep = frozenset(keep_graph)
    snapshot = keep if snapshot_units is None else frozenset(snapshot_units)
    if any(not isinstance(k, int) or not 0 <= k < chain.num_units for k in keep):
        raise ValueError(f"keep_graph {sorted(keep)} must name units of the {chain.num_units}-unit chain")
    meta_chain, model_storages = _meta_copy(chain, compute_dtype)
    with _LiveBytes(exclude=model_storages) as live, _FusedAttention():
        batches = [_meta_batch(example, batch_size=batch_size, seq_len=seq_len) for _ in range(grad_accum)]
        contexts = [meta_chain.context(inputs) for inputs, _ in batches]
        batch_bytes = live.now
        walk = _Walk(meta_chain, live=live, keep=keep, snapshot=snapshot, model_storages=model_storages)
        walk.run(batches[0], contexts[0])
        del batches, contexts
    peak_at, peak = max(live.timeline, key=lambda op: op[1])
    return ActivationEstimate(peak_bytes=peak, peak_at=peak_at, timeline=tuple(live.timeline),
                              batch_bytes=batch_bytes, saved_input_bytes=walk.saved_input_bytes,
                              kept_bytes=walk.kept_bytes, snapshot_bytes=walk.snapshot_bytes)


def _compute_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        return torch_dtype(dtype)
    if dtype not in COMPUTE_DTYPES.values():
        raise ValueError(f"dtype={dtype}: the engine computes in {', '.join(map(str, COMPUTE_DTYPES.values()))}")
    return dtype


def _meta_batch(example: tuple[torch.Tensor, torch.Tensor] | None, *, batch_size: int,
                seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    if example is None:
        return (torch.empty(batch_size, seq_len, dtype=torch.long, device="meta"),
                torch.empty(batch_size, seq_len, dtype=torch.long, device="meta"))
    inputs, targets = example
    return torch.empty_like(inputs, device="meta"), torch.empty_like(targets, device="meta")


def _storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage object: equal for all views of one storage while it lives (meta
    tensors have no data pointer to tell them apart)."""
    return t.untyped_storage()._cdata


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops make, each from the op that makes it until it dies ([Note: activation
    estimate]); ``op(name)`` records the most live at once while ``name`` runs."""

    def __init__(self, *, exclude: frozenset[int]) -> None:
        super().__init__()
        self.exclude = exclude
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0
        self.timeline: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key in self.live or key in self.exclude:
            return  # a view, an in-place result, or the model's own bytes
        storage = t.untyped_storage()
        self.live[key] = storage.nbytes()
        self.now += self.live[key]
        self.peak = max(self.peak, self.now)
        # The storage's Python object lives as long as the storage itself, so this fires when the last
        # view dies (and before its address can be reused by a new storage).
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    @contextmanager
    def op(self, name: str) -> Iterator[None]:
        self.peak = self.now
        yield
        self.timeline.append((name, self.peak))


class _Walk:
    """One micro-batch of ``UnitCompute``'s training step, holding the references it holds: saved inputs and
    kept graphs from F to B, the tensor flowing between units in ``carry``, each backward's parameter
    gradients until the op ends (the handler writes them into the arena and lets go)."""

    def __init__(self, chain: UnitChain, *, live: _LiveBytes, keep: frozenset[int], snapshot: frozenset[int],
                 model_storages: frozenset[int]) -> None:
        self.chain, self.live, self.keep = chain, live, keep
        self.snapshot = snapshot
        self.model_storages = model_storages
        self.saved: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.carry: torch.Tensor | None = None
        self.counted: set[int] = set()
        self.saved_keys: set[int] = set()
        self.kept_bytes = self.snapshot_bytes = self.saved_input_bytes = 0

    def run(self, batch: tuple[torch.Tensor, torch.Tensor], ctx: object) -> None:
        self.carry, targets = batch
        last = self.chain.num_units - 1
        for k in range(last):  # [Note: the last unit runs once]: its forward is part of B(L-1)
            with self.live.op(f"F{k}"):
                self._forward(k, ctx)
        for k in range(last, -1, -1):
            with self.live.op(f"B{k}"):
                grads = self._backward(k, targets, ctx)
                del grads  # written into the arena's gradient shards, then dropped
        self.carry = None

    def _forward(self, k: int, ctx: object) -> None:
        x = self.carry
        if k in self.keep:
            self._forward_kept(k, x, ctx)
            return
        self.saved[k] = self._save_input(x)
        with torch.no_grad():
            self.carry = self.chain.run(k, x, ctx)

    def _save_input(self, x: torch.Tensor) -> torch.Tensor:
        """Where ``UnitCompute`` calls ``InputStore.save_input``: counts each storage once."""
        if _storage_key(x) not in self.saved_keys:
            self.saved_keys.add(_storage_key(x))
            self.saved_input_bytes += x.untyped_storage().nbytes()
        return x

    def _forward_kept(self, k: int, x: torch.Tensor, ctx: object) -> None:
        """``UnitCompute._forward_kept`` with "aliases the device arena" read as "is a parameter's storage"."""
        copies: dict[tuple, torch.Tensor] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage_key(t)
            if key in self.model_storages:
                if k not in self.snapshot:
                    return t
                view = (key, t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
                if view not in copies:
                    copies[view] = t.detach().clone(memory_format=torch.preserve_format)
                    self.snapshot_bytes += copies[view].untyped_storage().nbytes()
                t = copies[view]
                key = _storage_key(t)
            if key not in self.counted:  # a storage saved by several ops is held once
                self.counted.add(key)
                self.kept_bytes += t.untyped_storage().nbytes()
            return t

        x_in = _as_unit_input(x, k)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.enable_grad():
            y = self.chain.run(k, x_in, ctx)
        self.graphs[k] = (x_in, y)
        self.carry = y.detach()

    def _backward(self, k: int, targets: torch.Tensor, ctx: object) -> dict:
        if k in self.graphs:
            x_in, y = self.graphs.pop(k)
            grads, self.carry = _differentiate(self.chain, k, x_in, y, self.carry)
            return grads
        is_last = k == self.chain.num_units - 1
        x_in = self._save_input(self.carry) if is_last else self.saved.pop(k)
        if not is_last and self.carry is None:
            return {}  # nothing downstream depends on this unit's output
        # compute._backward_unit without its autocast context (torch.autocast refuses the meta device; the
        # engine runs without autocast) and without reading the loss's value (a meta loss has none).
        x = _as_unit_input(x_in, k)
        with torch.enable_grad():
            y = self.chain.run(k, x, ctx)
            loss = self.chain.loss(y, targets) if is_last else None
        if loss is None:
            grads, self.carry = _differentiate(self.chain, k, x, y, self.carry)
        else:
            # Times the loss scale, as there: any scale makes the same tensors.
            grads, self.carry = _differentiate(self.chain, k, x, loss * 1.0, None)
        return grads


def _meta_copy(chain: UnitChain, dtype: torch.dtype) -> tuple[UnitChain, frozenset[int]]:
    """A copy of ``chain`` whose parameters are meta tensors in the compute dtype (floating ones: the engine
    binds parameters to typed views of the arena) and whose buffers are meta tensors, and the storages of
    both: the model's own bytes, not activations. ``deepcopy`` with the stand-ins in its memo copies no
    data and keeps shared parameters shared (a tied head still reads the embedding); ``chain`` itself is
    left alone, also when the walk fails halfway (a model that reads a value on meta) or ``context``
    moves a module (a rotary table) to the inputs' device."""
    memo: dict[int, object] = {}
    own: list[torch.Tensor] = []
    for module in {id(m): m for root in _roots(chain) for m in root.modules()}.values():
        for p in module.parameters(recurse=False):
            if id(p) not in memo:
                want = dtype if p.is_floating_point() else p.dtype
                memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=want, device="meta"),
                                           requires_grad=p.requires_grad)
                own.append(memo[id(p)])
        for b in module.buffers(recurse=False):
            if id(b) not in memo:
                memo[id(b)] = torch.empty_like(b, device="meta")
                own.append(memo[id(b)])
    return copy.deepcopy(chain, memo), frozenset(_storage_key(t) for t in own)


def _roots(chain: UnitChain) -> list[nn.Module]:
    """The units, and the whole model when the chain has one: modules outside the units (a rotary table)
    may hold buffers that ``chain.context`` uses."""
    whole = getattr(chain, "model", None)
    return [*chain.units, *([whole] if isinstance(whole, nn.Module) else [])]


class _FusedAttention(TorchFunctionMode):
    """Answers SDPA on meta with the fused kernel the CPU would run ([Note: attention on meta])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _flash_on_meta(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _flash_on_meta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, **newer: object) -> torch.Tensor | None:
    """The CPU flash kernel's output when the CPU would choose that kernel for these arguments, else ``None``
    (also for arguments that a later PyTorch may add: the math kernel's bytes err on the large side)."""
    if enable_gqa or newer or not query.is_meta:
        return None
    stand_ins = [_stand_in(t) for t in (query, key, value)]
    mask = _stand_in(attn_mask) if attn_mask is not None else None
    choice = torch.ops.aten._fused_sdp_choice(*stand_ins, mask, dropout_p, is_causal, scale=scale)
    if choice != int(SDPBackend.FLASH_ATTENTION):
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA converts it before the kernel
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(), float("-inf"))
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                       attn_mask=attn_mask, scale=scale)
    return out


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``t``'s shape, dtype and grad flag that owns one row of memory (stride 0 elsewhere):
    enough for a kernel choice, which reads metadata only."""
    strides = (0,) * (t.dim() - 1) + (1,) if t.dim() else ()
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, requires_grad=t.requires_grad and t.is_floating_point())
