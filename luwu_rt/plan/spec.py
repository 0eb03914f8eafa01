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

from .codec import COMPRESSING_STRATEGIES, NODE_CODECS, parse_codec

__all__ = [
    "TIERS", "STATE_KINDS", "PERSISTENT_KINDS", "DATA_PARALLEL", "STRATEGIES", "ALIGN_BYTES", "SECOND_HALF",
    "UnitSpec", "ModelSpec", "Placement", "Budgets", "HardwareProfile", "Strategy", "forward_flops_per_token",
    "base_kind", "half_kind",
]

TIERS = ("device", "host", "nvme")
"""Fastest first. Data moves only between neighbours: device <-> host <-> nvme."""
STATE_KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq")
OPTIMIZER_KINDS = ("master", "exp_avg", "exp_avg_sq")
SECOND_HALF = {"master": "master_b", "exp_avg": "exp_avg_b", "exp_avg_sq": "exp_avg_sq_b"}
"""The twin of each optimizer state kind in a double-buffered layout (``ModelSpec.double_buffer``): the two
halves take turns holding the current version ([Note: speculative updates] in sequence.py)."""
PERSISTENT_KINDS = frozenset({"param", "master", "exp_avg", "exp_avg_sq", "residual", *SECOND_HALF.values()})
"""Kinds that outlive a step; ``grad`` is dead once the optimizer consumed it. ``residual`` (a compressing
strategy's error feedback, [Note: codecs on the wire] in codec.py) exists only where a unit is compressed."""
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "hsdp")
"""The strategies of several ranks that each run the optimizer on their own copy or shard of the state:
``TrainConfig.strategy == "auto"`` picks among them (engine/strategy.py)."""
STRATEGIES = ("local", *DATA_PARALLEL, "node")
"""Every strategy, the one list the planner, ``TrainConfig.strategy`` (``--strategy``) and the CLI's help
take theirs from: one process (``local``), the data-parallel family, and workers with an optimizer node."""

_FIRST_HALF = {b: a for a, b in SECOND_HALF.items()}


def base_kind(state: str) -> str:
    """The optimizer kind a second-half kind twins (``master_b`` -> ``master``); any other kind itself."""
    return _FIRST_HALF.get(state, state)


def half_kind(state: str, half: int) -> str:
    """The kind that holds optimizer ``state`` (``master``, ``exp_avg`` or ``exp_avg_sq``) in ``half`` 0 or 1
    of a double-buffered layout; any other state is its own in both."""
    return SECOND_HALF.get(state, state) if half else state


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
    """Forward FLOPs per token (``forward_flops_per_token``); backward with recompute costs three times this."""

    def __post_init__(self) -> None:
        _check_positive(f"UnitSpec({self.name})", num_params=self.num_params)
        if self.flops_per_token < 0:
            raise ValueError(f"UnitSpec({self.name}).flops_per_token must not be negative")


def forward_flops_per_token(*, matmul_params: int, seq_len: int = 0, attention_width: int = 0) -> int:
    """Forward FLOPs per token of one unit ([Note: FLOPs of a unit]): ``matmul_params`` parameters that
    multiply the token's activations, and a causal self-attention of ``attention_width`` query/key features
    over sequences of ``seq_len`` tokens (0: none).

    [Note: FLOPs of a unit]
    Kaplan et al. (2020), table 1: a forward pass costs 2 FLOPs per token for every weight the token's
    activations are multiplied by (a multiply and an add), plus 2 x n_ctx x d_attn per attention layer for
    the attention scores, which no parameter stands for. Two consequences decide what a unit counts: a table
    the unit only looks rows up in (a token embedding) multiplies nothing and counts 0, and a matrix the unit
    reads from another one (a tied head's output matrix is the embedding's) counts where it multiplies. This
    is the one formula: the built-in GPT's closed form (plan/gpt.py) and every chain the engine trains
    (``UnitChain.flops_per_token``, models/units.py) fill ``UnitSpec.flops_per_token`` through it.
    """
    if min(matmul_params, seq_len, attention_width) < 0:
        raise ValueError(f"matmul_params={matmul_params}, seq_len={seq_len} and attention_width={attention_width} "
                         "must not be negative")
    return 2 * matmul_params + 2 * seq_len * attention_width


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
    double_buffer: bool = False
    """The optimizer state (on NVMe) has two halves, ``master`` and ``master_b`` and so on: an update reads the
    current half and writes the other one, leaving the current one untouched. Without
    ``optimizer_waits_for_backward`` the updates then run as gradients are final, before the step's norm is
    known, and the step is committed or redone once it is ([Note: speculative updates] in sequence.py)."""
    uncompressed: bool = False
    """The strategy's codec shards (residuals, payload workspaces) are laid out, but the gradients synchronise
    uncompressed: the step of a compression warm-up (``--compress-warmup``), which runs over the same store
    as the compressed step and leaves the residuals untouched."""
    state_half: int = 0
    """Which half of a double-buffered optimizer state the step reads (0: ``master``, 1: ``master_b``); it
    writes the other."""

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
        if self.state_half not in (0, 1) or (self.state_half and not self.double_buffer):
            raise ValueError(f"ModelSpec.state_half={self.state_half}: 0, or 1 with double_buffer")
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
                raise ValueError(f"placement {f.name}={getattr(self, f.name)!r}: "
                                 f"choose one of {', '.join(PLACEMENT_CHOICES)}")

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
    device_arena_bytes: int | None = None
    """The most bytes the device arena's slots may span, within ``device_bytes`` less the activation reserve;
    ``None``: all of that. Set by ``snug_arenas`` ([Note: arenas no larger than the step needs] in search.py)."""
    host_arena_bytes: int | None = None
    """The same for the host arena, within ``host_bytes``."""

    def __post_init__(self) -> None:
        sizes = (self.device_bytes, self.host_bytes, self.nvme_bytes, self.device_arena_bytes, self.host_arena_bytes)
        if any(n is not None and n < 0 for n in sizes):
            raise ValueError(f"budgets must not be negative: {self}")

    def of(self, tier: str) -> int | None:
        return {"device": self.device_bytes, "host": self.host_bytes}.get(tier, self.nvme_bytes)

    def arena_limit(self, tier: str) -> int | None:
        """``device_arena_bytes`` or ``host_arena_bytes``."""
        return self.device_arena_bytes if tier == "device" else self.host_arena_bytes


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
    # Gradient codecs ([Note: codecs on the wire] in codec.py): GB/s of fp32 gradient an encode reads (with
    # its residual, fused) or a decode writes, on one rank. Defaults: the Numba kernels (torch for powersgd)
    # on one core of the 2-core CPU machine of benchmarks/README.md, as ranks there get (bench_compress.py
    # part 1 measures all cores); a GPU is far faster.
    cast_encode_gbps: float = 2.0
    """bf16/fp16 encode: x = g + e, round, e = x - round(x)."""
    cast_decode_gbps: float = 5.0
    """bf16/fp16 decode (and its sum into the output)."""
    onebit_encode_gbps: float = 2.0
    """onebit encode: the signs and the sum of |x| in one pass, the residual in a second."""
    onebit_decode_gbps: float = 3.0
    """onebit decode."""
    topk_encode_gbps: float = 0.2
    """topk encode: a selection of the k largest |x| per chunk, then the residual."""
    topk_decode_gbps: float = 10.0
    """topk decode: a scatter of k values per chunk (the rest of the output zeroed or kept)."""
    powersgd_encode_gbps: float = 0.12
    """powersgd encode: two thin matrix products and a QR per chunk."""
    powersgd_decode_gbps: float = 1.5
    """powersgd decode: one matrix product per chunk."""
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
    nvme_overlap: float = 0.0
    """How much of the shorter direction's time hides behind the longer one when the disk reads and writes at
    once, 0 to 1: 0 (the default) none, the two take their sum ([Note: one disk] in cost.py); 1 fully, as if
    each had a disk of its own. ``luwu calibrate`` measures it: a read and a write at once against each
    alone."""
    nvme_core_s_per_gb: float = 0.0
    """Seconds of the host's cores that each GB moved to or from the disk takes: the store's CRC-32C of every
    chunk it writes or reads back. It counts among the queues that share the cores ([Note: shared cores] in
    cost.py); 0 (the default) for none. ``luwu calibrate`` measures it: the checksums of 128 MiB in the store's
    chunks (about 0.08 s per GB on this project's 2-core machine)."""

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        _check_positive("HardwareProfile", **{k: v for k, v in values.items()
                                              if not k.endswith(("_latency_s", "_overlap", "_per_gb"))})
        for name in (k for k in values if k.endswith(("_latency_s", "_per_gb"))):
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
    """One of ``STRATEGIES``: ``local``, ``ddp``, ``zero1``, ``zero2``, ``zero3``, ``hsdp``, ``node``."""
    world_size: int = 1
    """Data-parallel ranks (workers, for ``node``)."""
    group_size: int = 0
    """``hsdp`` only: ranks per sharding group; 0 means min(8, world_size)."""
    compress: tuple[str, ...] = ()
    """Gradient codec of each unit (``codec.parse_codec`` names), resolved from ``--compress`` by
    ``compression.resolve_compression``; empty: none anywhere. ``ddp``, ``zero1`` and ``zero2``, and ``node``
    with the codecs of ``codec.NODE_CODECS`` ([Note: compressed pushes] in codec.py)."""
    node_shards: int = 1
    """``node`` only: the optimizer node shards that split every unit ([Note: node shards] in node/shards.py); a
    compressed unit's gradient is encoded as one piece per shard."""

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}; choose one of {', '.join(STRATEGIES)}")
        _check_positive("Strategy", world_size=self.world_size)
        if self.name == "local" and self.world_size != 1:
            raise ValueError(f"strategy local runs one process; world_size={self.world_size} needs one of "
                             f"{', '.join(s for s in STRATEGIES if s != 'local')}")
        if self.group_size < 0 or self.world_size % self.shard_ways:
            raise ValueError(f"hsdp group size {self.shard_ways} must divide world_size={self.world_size}; "
                             f"set group_size to a divisor")
        codecs = tuple(parse_codec(c).name for c in self.compress)
        # Nothing compressed is the default strategy, whatever spelled it: its plans are the uncompressed ones.
        object.__setattr__(self, "compress", codecs if any(c != "none" for c in codecs) else ())
        _check_positive("Strategy", node_shards=self.node_shards)
        if self.node_shards != 1 and self.name != "node":
            raise ValueError(f"node_shards={self.node_shards} applies to strategy node, not {self.name}")
        if self.compresses and self.name == "node":
            other = sorted({c for c in self.compress if parse_codec(c).family not in NODE_CODECS + ("none",)})
            if other:
                raise ValueError(f"--compress {other[0]}: node pushes compress with bf16, fp16, onebit or "
                                 f"topk:RATIO, not {parse_codec(other[0]).family}, whose low-rank factors the node "
                                 f"does not run; choose one of those, or --compress none")
        elif self.compresses and (self.name not in COMPRESSING_STRATEGIES or self.world_size < 2):
            raise ValueError(f"--compress applies to {', '.join(COMPRESSING_STRATEGIES)} on 2 or more ranks and to "
                             f"node, not {self.name} on {self.world_size}: zero3 and hsdp gather parameters "
                             f"uncompressed; use --compress none")

    @property
    def compresses(self) -> bool:
        """Whether any unit's gradients are compressed."""
        return any(c != "none" for c in self.compress)

    def codec(self, unit: int) -> str:
        """The codec of ``unit``'s gradient synchronisation (``none`` when the strategy compresses nothing)."""
        return self.compress[unit] if self.compress else "none"

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
        state = base_kind(state)  # both halves of a double-buffered state alike
        kinds = {"zero1": OPTIMIZER_KINDS, "zero2": OPTIMIZER_KINDS + ("grad",)}.get(self.name)
        if kinds is not None:
            return state in kinds
        return self.name in ("zero3", "hsdp") and state in STATE_KINDS


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align_up(num_bytes: int) -> int:
    return math.ceil(num_bytes / ALIGN_BYTES) * ALIGN_BYTES
