"""A model as a chain of units: the interface the engine trains through.

A unit is an ``nn.Module`` that maps one tensor to the next (token ids to
hidden states, hidden states to hidden states, hidden states to logits). It is
the granularity of streaming: the engine makes a unit's parameters resident for
its forward and its backward and releases them in between (DESIGN.md, "The
execution model").

[Note: ownership and reads]
Every parameter is *owned* by exactly one unit, the first one that holds it;
the owner stores it, receives its gradient and steps its optimizer. A unit that
uses another unit's parameter *reads* that unit: GPT's head reads the token
embedding of unit 0 when the embeddings are tied. Reads are found by parameter
identity (a module shared between units) or declared explicitly (a unit that
reaches another unit's weight in ``run`` without holding it). The engine must
make ``reads(i)`` resident together with unit ``i``, and a read unit's
gradient is final only once every unit that reads it has run its backward.

[Note: materialisation]
Chains are built on the ``meta`` device. ``materialize(i, seed=...)`` allocates
only unit ``i``'s parameters and initialises them from a seed derived from
``(seed, i)`` alone, on the CPU generator, so any unit can be materialised
alone, in any order, on any device, with the same values; the whole model never
has to exist at once. Parameters keep their identity (``torch.utils.swap_tensors``)
so that modules which share a parameter keep sharing it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from luwu_rt.plan.spec import forward_flops_per_token

__all__ = ["ParamSpec", "UnitChain", "chain_from_sequential", "lm_loss", "unit_seed"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
InitFn = Callable[[nn.Module], None]

_MASK64 = (1 << 64) - 1


def unit_seed(seed: int, index: int) -> int:
    """A 63-bit seed for unit ``index`` that depends only on ``(seed, index)``.

    SplitMix64 finalisation of the pair: neighbouring units and neighbouring
    seeds get unrelated streams, unlike ``seed + index``.
    """
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; logits ``(..., vocab)``, targets ``(...)``.

    The softmax runs in fp32 even under bf16 autocast: the loss of a large
    vocabulary loses digits in bf16.
    """
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamSpec:
    """One parameter of a unit, as a store needs it before the parameter exists."""

    name: str
    """Name inside the unit module, e.g. ``attn.qkv.weight``."""
    shape: tuple[int, ...]
    """Tensor shape."""
    dtype: str
    """Torch dtype name without the ``torch.`` prefix, e.g. ``float32``."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _swap_in(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace ``param``'s storage, device and dtype in place, keeping its identity."""
    replacement = nn.Parameter(value, requires_grad=param.requires_grad) if isinstance(param, nn.Parameter) else value
    torch.utils.swap_tensors(param, replacement)


class UnitChain:
    """An ordered chain of units plus what the engine needs to train it unit by unit.

    Subclasses (or the constructor arguments) say how to run a unit, what the
    loss is, which other units each one reads, and how to initialise a unit.
    """

    def __init__(
        self,
        units: Sequence[nn.Module],
        *,
        loss_fn: LossFn = lm_loss,
        init_fn: InitFn | None = None,
        reads: Mapping[int, Sequence[int]] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        if not units:
            raise ValueError("a unit chain needs at least one unit")
        self.units: tuple[nn.Module, ...] = tuple(units)
        self.names: tuple[str, ...] = (tuple(names) if names is not None
                                       else tuple(f"unit{i}" for i in range(len(units))))
        if len(self.names) != len(self.units):
            raise ValueError(f"{len(self.names)} names given for {len(self.units)} units")
        self._loss_fn = loss_fn
        self._init_fn = init_fn
        self._owner: dict[int, int] = {}
        self._own: list[list[nn.Parameter]] = []
        read_sets: list[set[int]] = [set() for _ in self.units]
        for index, unit in enumerate(self.units):
            own = []
            for param in unit.parameters():
                owner = self._owner.setdefault(id(param), index)
                if owner == index:
                    own.append(param)
                else:
                    read_sets[index].add(owner)
            self._own.append(own)
        held = [set(r) for r in read_sets]  # reads found by identity: the unit holds what it reads
        for index, extra in (reads or {}).items():
            for other in extra:
                if not (0 <= other < len(self.units)) or other == index:
                    raise ValueError(f"unit {index} cannot read unit {other} of a {len(self.units)}-unit chain")
                read_sets[index].add(other)
        self._reached = tuple(tuple(sorted(r - h)) for r, h in zip(read_sets, held))
        """Per unit, the units it reads without holding their parameters (declared reads only)."""
        self._reads = tuple(tuple(sorted(s)) for s in read_sets)
        self._readers = tuple(
            tuple(i for i in range(len(self.units)) if j in self._reads[i]) for j in range(len(self.units))
        )

    # -- structure ---------------------------------------------------------

    @property
    def num_units(self) -> int:
        return len(self.units)

    def own_params(self, index: int) -> list[nn.Parameter]:
        """The parameters unit ``index`` owns (stores, receives grads for, updates)."""
        return list(self._own[index])

    def named_own_params(self, index: int) -> Iterator[tuple[str, nn.Parameter]]:
        """``own_params`` with their names inside the unit module, for checkpoints."""
        own = {id(p) for p in self._own[index]}
        for name, param in self.units[index].named_parameters():
            if id(param) in own:
                yield name, param

    def layout(self, index: int) -> tuple[ParamSpec, ...]:
        """Names, shapes and dtypes of unit ``index``'s own parameters, in ``own_params`` order.

        Available on meta, so a store can lay out a unit's flat buffers and
        chunks before any parameter exists.
        """
        return tuple(ParamSpec(name=n, shape=tuple(p.shape), dtype=str(p.dtype).removeprefix("torch."))
                     for n, p in self.named_own_params(index))

    def signature(self) -> str:
        """A hash of every unit's name, layout and reads: equal for chains a checkpoint can be loaded into."""
        digest = hashlib.sha256()
        for index in range(self.num_units):
            digest.update(repr((self.names[index], self.layout(index), self.reads(index))).encode())
        return digest.hexdigest()

    def reads(self, index: int) -> tuple[int, ...]:
        """Other units whose parameters unit ``index`` uses ([Note: ownership and reads])."""
        return self._reads[index]

    def readers(self, index: int) -> tuple[int, ...]:
        """Units that read unit ``index``'s parameters."""
        return self._readers[index]

    def num_unit_params(self, index: int) -> int:
        return sum(p.numel() for p in self._own[index])

    def flops_per_token(self, index: int, *, seq_len: int) -> int:
        """Forward FLOPs per token of unit ``index`` over sequences of ``seq_len`` tokens, what the planner
        predicts compute time from ([Note: FLOPs of a unit] in plan/spec.py): 2 per parameter the unit
        multiplies by (its own and those it holds of other units, but not the rows of an ``nn.Embedding``
        it only looks up), every parameter of a unit it reads without holding them (``reads=``: which of them
        ``run`` touches is not known, so all count), and the attention ``attention_width`` says it computes.
        A chain that knows its units' shapes better overrides this (``GPTChain``: its preset's formula)."""
        unit = self.units[index]
        lookups = {id(m.weight) for m in unit.modules() if isinstance(m, nn.Embedding)}
        matmul = sum(p.numel() for p in unit.parameters() if id(p) not in lookups)
        matmul += sum(self.num_unit_params(j) for j in self._reached[index])
        return forward_flops_per_token(matmul_params=matmul, seq_len=seq_len,
                                       attention_width=self.attention_width(index))

    def attention_width(self, index: int) -> int:
        """Query/key features of the causal self-attention over the sequence that unit ``index`` computes, 0
        for none. Attention has no parameters of its own to be seen by, so a chain that has it says so; this
        generic chain cannot tell and counts none, which under-counts a transformer block by about seq_len /
        (12 x d_model) (11% at 1024 tokens of width 768)."""
        return 0

    @property
    def num_params(self) -> int:
        return sum(self.num_unit_params(i) for i in range(self.num_units))

    # -- computation -------------------------------------------------------

    def context(self, inputs: torch.Tensor) -> object:
        """Per-batch extra inputs shared by all units (positions, rotary tables); none by default."""
        return None

    def run(self, index: int, x: torch.Tensor, ctx: object) -> torch.Tensor:
        """Unit ``index`` applied to the previous unit's output ``x``."""
        return self.units[index](x)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The scalar loss from the last unit's output."""
        return self._loss_fn(output, targets)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The whole chain under ordinary autograd: the reference the unit-wise step must match."""
        ctx = self.context(inputs)
        x = inputs
        for index in range(self.num_units):
            x = self.run(index, x, ctx)
        return x if targets is None else self.loss(x, targets)

    # -- materialisation ([Note: materialisation]) ---------------------------

    def materialize(self, index: int, *, seed: int, device: torch.device | str = "cpu") -> None:
        """Allocate and initialise unit ``index``'s own parameters from ``(seed, index)``."""
        unit = self.units[index]
        for name, buf in unit.named_buffers():
            if buf.is_meta:
                raise ValueError(
                    f"unit {index} ({self.names[index]}): buffer {name!r} is on the meta device and has no "
                    "initialiser; build the model with real buffers (only parameters may be meta)"
                )
        for param in self._own[index]:
            _swap_in(param, torch.empty(param.shape, dtype=param.dtype, device="cpu"))
        with self._borrowed_hidden(index), torch.random.fork_rng(devices=[]):
            torch.manual_seed(unit_seed(seed, index))
            with torch.no_grad():
                self.init_unit(index)
        target = torch.device(device)
        for tensor in [*self._own[index], *unit.buffers()]:
            if tensor.device != target:
                _swap_in(tensor, tensor.detach().to(target))

    def release(self, index: int) -> None:
        """Return unit ``index``'s own parameters to the meta device, freeing their memory."""
        for param in self._own[index]:
            _swap_in(param, torch.empty(param.shape, dtype=param.dtype, device="meta"))

    def init_unit(self, index: int) -> None:
        """Initialise unit ``index`` in place from the (already seeded) CPU RNG.

        With ``init_fn`` it is applied to every submodule, children first
        (``nn.Module.apply``, as Hugging Face initialises); otherwise each
        submodule's ``reset_parameters()`` is called.
        """
        unit = self.units[index]
        if self._init_fn is not None:
            unit.apply(self._init_fn)
            return
        own = {id(p) for p in self._own[index]}
        for module in unit.modules():
            direct = [p for p in module.parameters(recurse=False) if id(p) in own]
            if not direct:
                continue
            reset = getattr(module, "reset_parameters", None)
            if reset is None:
                raise ValueError(
                    f"unit {index} ({self.names[index]}): {type(module).__name__} has parameters but no "
                    "reset_parameters(); pass init_fn= to say how to initialise it"
                )
            reset()

    @contextmanager
    def _borrowed_hidden(self, index: int) -> Iterator[None]:
        """Park the parameters unit ``index`` reads from other units on meta while it is initialised.

        Initialisers walk every submodule, including a tied head's weight that
        belongs to unit 0; writes to a meta tensor are no-ops, so the owner's
        values survive whatever order units are materialised in.
        """
        own = {id(p) for p in self._own[index]}
        parked: list[tuple[nn.Parameter, nn.Parameter]] = []
        for param in self.units[index].parameters():
            if id(param) not in own and not param.is_meta:
                holder = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                      requires_grad=param.requires_grad)
                # After the swap ``param`` is the meta tensor and ``holder`` keeps the real data.
                torch.utils.swap_tensors(param, holder)
                parked.append((param, holder))
        try:
            yield
        finally:
            for param, holder in parked:
                torch.utils.swap_tensors(param, holder)


def chain_from_sequential(
    modules: nn.Sequential | nn.ModuleList | Sequence[nn.Module],
    *,
    loss_fn: LossFn = lm_loss,
    init_fn: InitFn | None = None,
) -> UnitChain:
    """One unit per module of an ``nn.Sequential``-like list; parameters shared
    between modules become reads of the first module that holds them."""
    units = list(modules)
    names = [f"{i}:{type(m).__name__}" for i, m in enumerate(units)]
    return UnitChain(units, loss_fn=loss_fn, init_fn=init_fn, names=names)
