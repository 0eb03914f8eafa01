"""The planner's inputs: model, placement, budgets, hardware and strategy.

All frozen dataclasses of plain numbers, so a plan is a pure function of them
and a test can build any of them by hand.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = [
    "TIERS", "STATE_KINDS", "PERSISTENT_KINDS", "STRATEGIES", "RUNNABLE_STRATEGIES", "ALIGN_BYTES",
    "UnitSpec", "ModelSpec", "Placement", "Budgets", "HardwareProfile", "Strategy",
]

TIERS = ("device", "host", "nvme")
"""Fastest first. Data moves only between neighbours: device <-> host <-> nvme."""
STATE_KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq")
PERSISTENT_KINDS = frozenset({"param", "master", "exp_avg", "exp_avg_sq"})
"""Kinds that outlive a step; ``grad`` is dead once the optimizer consumed it."""
OPTIMIZER_KINDS = ("master", "exp_avg", "exp_avg_sq")
STRATEGIES = ("local", "ddp", "zero1", "zero2", "zero3", "hsdp", "node")
RUNNABLE_STRATEGIES = ("local", "ddp", "zero1", "zero2", "zero3", "hsdp", "node")
"""Strategies ``luwu train`` can run today (``node`` with a ``luwu node serve``); ``luwu plan`` says so
for any other, whose plans are predictions only."""
PLACEMENT_CHOICES = ("device", "host", "nvme", "auto")
ALIGN_BYTES = 4096
"""O_DIRECT alignment: every state buffer and chunk is a multiple of this."""


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{owner}.{name} must be positive, got {value}")


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitSpec:
    """One unit of streaming: the embedding, a transformer block or the head."""

    name: str
    """For messages and op names, e.g. ``block3``."""
    num_params: int
    """Parameters the unit owns (its flat buffers hold this many elements)."""
    reads: tuple[int, ...] = ()
    """Other units whose parameters this unit's compute reads: a tied head reads the embedding."""
    flops_per_token: int = 0
    """Forward FLOPs per token; backward with recompute costs three times this."""

    def __post_init__(self) -> None:
        _check_positive(f"UnitSpec({self.name})", num_params=self.num_params)
        if self.flops_per_token < 0:
            raise ValueError(f"UnitSpec({self.name}).flops_per_token must not be negative")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A chain of units and the per-step workload that runs through it."""

    units: tuple[UnitSpec, ...]
    """In forward order."""
    param_bytes: int = 2
    """Bytes per element of the compute copy of the parameters (bf16: 2)."""
    grad_bytes: int = 2
    """Bytes per element of gradients as backward produces them."""
    chunk_bytes: int = 64 * 2**20
    """Size of one storage chunk (the unit of IO and of collectives); a multiple of 4 KiB."""
    max_shards_per_state: int = 4
    """Planning granularity: each unit's buffer of one state kind is planned as at most this
    many shards of whole chunks. See [Note: plan granularity] in planner.py."""
    tokens_per_step: int = 0
    """Tokens in one optimizer step, all micro-batches together; 0 plans IO only."""
    num_micro_batches: int = 1
    """Forward/backward passes per optimizer step (gradient accumulation); must divide tokens_per_step."""
    optimizer_waits_for_backward: bool = False
    """Hold every optimizer step until the whole backward is done. Exact global-norm clipping
    and fp16 overflow checks need the norm of *all* gradients before any update; without them
    a unit's update starts as soon as its gradients are final, overlapping earlier units'
    backward."""
    activation_bytes: int = 0
    """Device memory kept for activations of one micro-batch (saved unit inputs, recompute
    workspace, logits)."""
    optimizer_only: bool = False
    """Plan only the optimizer steps, the gradients already at their home as after a backward
    pass: the out-of-core optimizer step on its own (``luwu bench offload-step``)."""
    forward_only: bool = False
    """Plan only the forward of every unit, the last one included, for one micro-batch (evaluation): no
    gradients, no optimizer. With the same units, placement and budgets it lays out the store exactly as the
    training plan does, so both run over one store."""

    def __post_init__(self) -> None:
        if not self.units:
            raise ValueError("ModelSpec.units is empty: a model needs at least one unit")
        _check_positive("ModelSpec", param_bytes=self.param_bytes, grad_bytes=self.grad_bytes,
                        chunk_bytes=self.chunk_bytes, max_shards_per_state=self.max_shards_per_state)
        if self.chunk_bytes % ALIGN_BYTES:
            raise ValueError(f"ModelSpec.chunk_bytes={self.chunk_bytes} is not a multiple of {ALIGN_BYTES} (O_DIRECT)")
        if min(self.tokens_per_step, self.activation_bytes) < 0:
            raise ValueError("ModelSpec.tokens_per_step and activation_bytes must not be negative")
        if self.num_micro_batches <= 0 or self.tokens_per_step % self.num_micro_batches:
            raise ValueError(f"ModelSpec.num_micro_batches={self.num_micro_batches} must be positive and divide "
                             f"tokens_per_step={self.tokens_per_step}")
        if self.optimizer_only and self.forward_only:
            raise ValueError("ModelSpec: optimizer_only and forward_only exclude each other")
        for i, unit in enumerate(self.units):
            bad = [r for r in unit.reads if not 0 <= r < len(self.units) or r == i or unit.reads.count(r) > 1]
            if bad:
                raise ValueError(f"unit {unit.name} reads unit(s) {bad}: list each other unit of the model once")

    @property
    def num_params(self) -> int:
        return sum(u.num_params for u in self.units)

    @property
    def initial_kinds(self) -> frozenset[str]:
        """State kinds whose shards exist at their home before a step starts."""
        return PERSISTENT_KINDS | {"grad"} if self.optimizer_only else PERSISTENT_KINDS



@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Home tier of each state kind: where it lives between uses."""

    params: str = "auto"
    """Compute copy of the parameters: ``device``, ``host``, ``nvme`` or ``auto``."""
    optimizer: str = "auto"
    """fp32 master weights and both Adam moments; the optimizer runs on the device only when
    these live there, else on the host CPU."""
    grads: str = "auto"
    """Gradients between backward and the optimizer step."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) not in PLACEMENT_CHOICES:
                raise ValueError(f"placement {f.name}={getattr(self, f.name)!r}: choose one of {', '.join(PLACEMENT_CHOICES)}")

    @property
    def is_resolved(self) -> bool:
        return "auto" not in (self.params, self.optimizer, self.grads)

    def home(self, state: str) -> str:
        return {"param": self.params, "grad": self.grads}.get(state, self.optimizer)

    @property
    def optim_tier(self) -> str:
        return "device" if self.optimizer == "device" else "host"


@dataclass(frozen=True, kw_only=True, slots=True)
class Budgets:
    """Bytes the plan may use on each tier."""

    device_bytes: int
    """Device (GPU, or the budgeted CPU arena without one), activations included."""
    host_bytes: int
    """The pinned host arena."""
    nvme_bytes: int | None = None
    """NVMe capacity; ``None`` when unlimited or unknown."""

    def __post_init__(self) -> None:
        if self.device_bytes < 0 or self.host_bytes < 0 or (self.nvme_bytes is not None and self.nvme_bytes < 0):
            raise ValueError(f"budgets must not be negative: {self}")

    def of(self, tier: str) -> int | None:
        return {"device": self.device_bytes, "host": self.host_bytes}.get(tier, self.nvme_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """Throughputs and latencies the cost model uses. The defaults describe a single-GPU server with
    one PCIe 4 NVMe drive, servers of 8 GPUs on a 100 Gb/s-per-GPU network, and a CPU optimizer node
    on 100 Gb/s Ethernet; ``luwu bench`` measures the real ones (``from_json``)."""

    nvme_read_gbps: float = 3.0
    """NVMe -> host, GB/s (1e9 bytes/s), O_DIRECT with a deep queue."""
    nvme_write_gbps: float = 2.0
    """Host -> NVMe, GB/s."""
    h2d_gbps: float = 12.0
    """Pinned host -> device copies, GB/s (PCIe 4 x16 in practice)."""
    d2h_gbps: float = 12.0
    """Device -> pinned host copies, GB/s."""
    host_optim_params_per_s: float = 1.5e9
    """Fused CPU AdamW, fp32 master + moments (benchmarks/README.md measures ~1.9e9 on 2 AVX-512 cores)."""
    device_optim_params_per_s: float = 50e9
    """AdamW on the device: HBM bandwidth / 28 bytes per parameter."""
    compute_flops: float = 100e12
    """Sustained device FLOP/s of bf16 training (about a third of an A100's peak)."""
    net_gbps: float = 10.0
    """Per-rank bandwidth of the network between ranks (groups ``world`` and ``replica``), GB/s: the beta
    term of [Note: collective cost] in cost.py (100 Gb/s InfiniBand or RoCE per GPU)."""
    net_latency_s: float = 10e-6
    """Latency of one message step on that network, seconds: the alpha term that each ring or tree
    step pays, which dominates small collectives such as the norm's all-reduce."""
    group_gbps: float = 100.0
    """Per-rank bandwidth inside a hsdp sharding group (group ``shard``: the ranks of one server, over
    NVLink or PCIe peer-to-peer), GB/s; hsdp pays ``net_gbps`` only for the replica all-reduce."""
    group_latency_s: float = 3e-6
    """Latency of one message step inside a sharding group, seconds."""
    host_mem_gbps: float = 50.0
    """Host memory bandwidth of one streaming pass (the gradient norm read on the host CPU), GB/s;
    benchmarks/README.md measures ~54 on 2 AVX-512 cores."""
    device_mem_gbps: float = 1500.0
    """Device memory bandwidth of one streaming pass (the gradient norm on the device), GB/s."""
    node_gbps: float = 12.5
    """NIC of one optimizer node process (strategy ``node``), GB/s: the pushes and pulls of all N workers
    share it, so each worker gets ``min(net_gbps, node_gbps * node shards / N)`` (100 Gb/s Ethernet)."""
    node_latency_s: float = 50e-6
    """Latency of one message between a worker and an optimizer node, or between node shards (ZeroMQ
    over TCP), seconds."""
    node_optim_params_per_s: float = 3e9
    """Fused CPU AdamW on an optimizer node, parameters/s: a CPU server with more memory channels than a
    GPU host spends on its optimizer (memory bound at 28 bytes per parameter)."""
    node_mem_gbps: float = 50.0
    """Memory bandwidth of the node's passes over gradients, GB/s: summing the N pushes of a unit into its
    fp32 gradient (each push read, the sum read and written) and the gradient norm."""
    node_nvme_read_gbps: float = 3.0
    """The optimizer node's NVMe -> host reads, GB/s."""
    node_nvme_write_gbps: float = 2.0
    """The optimizer node's host -> NVMe writes, GB/s."""
    shard_collective_factor: float = 1.0
    """Time of a reduce-scatter or an all-gather over what the ring model of [Note: collective cost] in cost.py
    gives at ``net_gbps``/``group_gbps`` (fitted to the all-reduce): 1 for a ring, as NCCL runs them; ``luwu
    calibrate`` measured about 2 for gloo between two CPU processes, whose reduce-scatter and all-gather of a
    buffer take as long as its all-reduce."""
    cpu_overlap: float = 1.0
    """How much of the work of the queues that share the host's cores (``SHARED_CORE_QUEUES`` in cost.py:
    compute, the host optimizer, the copies) hides behind the busiest of them when they run at once, 0 to 1:
    1 (the default) fully, as if each had cores of its own; 0 not at all, and a step then takes at least their
    sum ([Note: shared cores] in cost.py). ``luwu calibrate`` measures it: a matmul, the fused optimizer and a
    copy run together against the three alone."""

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        _check_positive("HardwareProfile", **{k: v for k, v in values.items()
                                              if not k.endswith(("_latency_s", "_overlap"))})
        for name in (k for k in values if k.endswith("_latency_s")):
            if not values[name] >= 0:  # zero latency is a valid what-if; NaN is not
                raise ValueError(f"HardwareProfile.{name} must not be negative, got {values[name]}")
        for name in (k for k in values if k.endswith("_overlap")):
            if not 0.0 <= values[name] <= 1.0:
                raise ValueError(f"HardwareProfile.{name} must be between 0 and 1, got {values[name]}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "HardwareProfile":
        """The profile of ``values``' keys; keys that start with ``_`` are notes (a figure's source, the machine
        a calibration measured) and are not read."""
        values = {k: v for k, v in values.items() if not k.startswith("_")}
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"unknown hardware profile key(s) {unknown}; valid keys: {', '.join(valid)}")
        return cls(**{k: float(v) for k, v in values.items()})

    @classmethod
    def from_json(cls, path: str | Path) -> "HardwareProfile":
        """Read a JSON object of the fields above (e.g. written by ``luwu calibrate``); missing keys keep
        their defaults, keys that start with ``_`` are notes."""
        try:
            values = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"hardware profile {path}: not valid JSON ({exc})") from None
        if not isinstance(values, dict):
            raise ValueError(f"hardware profile {path}: expected a JSON object of throughputs")
        return cls.from_dict(values)


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """Data-parallel strategy and the world this rank belongs to."""

    name: str = "local"
    """One of ``local``, ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``hsdp``, ``node``."""
    world_size: int = 1
    """Data-parallel ranks (workers, for ``node``)."""
    group_size: int = 0
    """``hsdp`` only: ranks per sharding group; 0 means min(8, world_size)."""

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}; choose one of {', '.join(STRATEGIES)}")
        _check_positive("Strategy", world_size=self.world_size)
        if self.name == "local" and self.world_size != 1:
            raise ValueError(f"strategy local runs one process; world_size={self.world_size} needs ddp, zero1/2/3, hsdp or node")
        if self.group_size < 0 or self.world_size % self.shard_ways:
            raise ValueError(f"hsdp group size {self.shard_ways} must divide world_size={self.world_size}; "
                             f"set group_size to a divisor")

    @property
    def shard_ways(self) -> int:
        """Ranks that each own a slice of the sharded states."""
        if self.name == "hsdp":
            return self.group_size or min(8, self.world_size)
        return self.world_size if self.name in ("zero1", "zero2", "zero3") else 1

    @property
    def replicas(self) -> int:
        """``hsdp``: sharding groups that each hold a replica of the sharded states (1 otherwise)."""
        return self.world_size // self.shard_ways if self.name == "hsdp" else 1

    def sharded(self, state: str) -> bool:
        """Whether this rank holds only 1/shard_ways of ``state`` (ZeRO's table: zero1 shards the
        optimizer state, zero2 also the gradients, zero3 and hsdp also the parameters)."""
        kinds = {"zero1": OPTIMIZER_KINDS, "zero2": OPTIMIZER_KINDS + ("grad",)}.get(self.name)
        if kinds is not None:
            return state in kinds
        return self.name in ("zero3", "hsdp") and state in STATE_KINDS


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align_up(num_bytes: int) -> int:
    return math.ceil(num_bytes / ALIGN_BYTES) * ALIGN_BYTES
