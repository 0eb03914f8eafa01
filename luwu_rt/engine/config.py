"""Configuration of a training run: ``luwu train`` flags, TOML files and the ``Engine`` API."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from luwu_rt.data import DataConfig
from luwu_rt.optim.config import OptimConfig
from luwu_rt.plan.sizes import parse_size
from luwu_rt.plan.spec import STRATEGIES

__all__ = ["CheckpointConfig", "OffloadConfig", "OptimConfig", "TrainConfig"]

_TIERS = ("device", "host", "nvme", "auto")
_DTYPES = ("fp32", "bf16", "fp16")
_RUNNABLE = STRATEGIES


def _size(value: int | str, name: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    """Where each state kind lives between uses, and the budgets of the tiers."""

    params: str = "auto"
    """Home of the compute copy of the parameters: ``device``, ``host``, ``nvme`` or ``auto``."""
    optimizer: str = "auto"
    """Home of the fp32 master weights and the Adam moments."""
    grads: str = "auto"
    """Home of the gradients between backward and the optimizer step."""
    device_mem: int | str = "auto"
    """Device budget in bytes (``"4GiB"`` accepted), activations included: the planner reserves what one
    micro-batch's activations and kept graphs take (measured, ``engine/workload.py``) and places shards
    in the rest. Without a GPU the device tier is a CPU arena and the activations live beside it.
    ``"auto"``: a share of this machine's memory, or 88 MiB for the demo model gpt-tiny ([Note: automatic
    budgets] in engine/budgets.py), sized for its default run on the CPU: 77 MiB of activations (every
    graph kept) leave a 10.7 MiB arena, which holds the parameters and gradients (6.6 MiB) but not the
    optimizer state as well (9.9 MiB more), so the run uses the device tier for real."""
    host_mem: int | str = "auto"
    """Pinned host arena budget in bytes. ``"auto"``: a share of this machine's RAM, or 6 MiB for the demo
    model gpt-tiny, below its optimizer state (9.9 MiB) but holding one unit's share of it while that unit
    is updated, so the planner itself must put the optimizer state on NVMe: ``luwu train`` alone uses all
    three tiers."""
    nvme_dir: str | None = None
    """Directory of the NVMe tier; needed when any state lives on ``nvme`` (or ``auto`` may choose it).
    Created when missing, as ``luwu plan --nvme-dir`` assumes. The tier's files (``luwu_state/`` under it)
    are scratch: the checkpoint, not they, survives a run, so they are removed when the engine closes.
    ``None``: the engine has no NVMe tier; ``luwu train`` then gives it a scratch directory
    ``./luwu-scratch-*`` of its own, removed at exit, and ``luwu plan`` plans with that directory's disk
    ([Note: missing directories] in cli/dirs.py)."""
    keep_nvme_state: bool = False
    """Keep ``luwu_state/`` under ``nvme_dir`` (and ``luwu train``'s scratch directory) after the run, to look
    at it; the next run rebuilds it anyway."""
    chunk_size: int | str = "4MiB"
    """Storage chunk: the unit of file IO and checksums; a multiple of 4 KiB."""

    def __post_init__(self) -> None:
        for name in ("params", "optimizer", "grads"):
            if getattr(self, name) not in _TIERS:
                raise ValueError(f"offload.{name}={getattr(self, name)!r}: choose one of {', '.join(_TIERS)}")
        # "auto" stays: the engine resolves it on the machine it runs on (a resumed run on another one too).
        self.device_mem = self.device_mem if self.device_mem == "auto" else _size(self.device_mem, "offload.device_mem")
        self.host_mem = self.host_mem if self.host_mem == "auto" else _size(self.host_mem, "offload.host_mem")
        self.chunk_size = _size(self.chunk_size, "offload.chunk_size")
        if self.chunk_size <= 0 or self.chunk_size % 4096:
            raise ValueError(f"offload.chunk_size={self.chunk_size} must be a positive multiple of 4096 bytes")
        if self.nvme_dir is not None and not str(self.nvme_dir).strip():  # "" must not quietly mean "no tier"
            raise ValueError("offload.nvme_dir (--nvme-dir) is empty; give a directory, or leave it out (luwu train "
                             "then makes a scratch directory ./luwu-scratch-*)")
        uses_nvme = "nvme" in (self.params, self.optimizer, self.grads)
        if uses_nvme and not self.nvme_dir:
            raise ValueError("state is placed on nvme but no --nvme-dir (offload.nvme_dir) was given")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpointing and resuming."""

    dir: str | None = None
    """Where checkpoints go (``<dir>/step_<N>/``); ``None`` saves none."""
    every: int = 0
    """Save every this many steps (and at the end); 0 saves only at the end."""
    resume: bool = False
    """Continue from the latest complete checkpoint in ``dir``."""
    keep: int = 2
    """Complete checkpoints kept; older ones are deleted after a new one is committed."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ValueError(f"checkpoint: every must be >= 0 and keep >= 1, got {self.every}, {self.keep}")
        if self.dir is not None and not self.dir.strip():  # "" must not quietly mean "no checkpoints"
            raise ValueError("checkpoint.dir (--ckpt-dir) is empty; give a directory, or leave it out to save none")
        if self.resume and not self.dir:
            raise ValueError("--resume needs --ckpt-dir: the directory to resume from")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """A training run. Keys mirror ``luwu train`` flags; TOML files use the same keys and tables."""

    model: str = "gpt-tiny"
    """Built-in preset (see ``luwu plan --help``) when the engine builds the model, or ``hf:PATH``: a local
    Hugging Face model folder (config.json + safetensors), built from its config and started from its weights."""
    init_from: str | None = None
    """Safetensors file or folder (a Hugging Face model folder or this project's export) whose tensors, matched
    by name, are the first weights, streamed in unit by unit; ``None``: the model's own weights (``hf:PATH``:
    its folder's), or the seed for a model on meta."""
    steps: int = 300
    """Optimizer steps to run in total (a resumed run stops at the same step)."""
    batch_size: int = 16
    """Sequences per micro-batch."""
    seq_len: int = 128
    """Tokens per sequence."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    dtype: str = "fp32"
    """Compute dtype of the parameters and activations: ``fp32``, ``bf16`` or ``fp16``; master weights stay fp32."""
    loss_scale: float = 1024.0
    """Static loss scale for ``fp16`` (steps whose gradients overflow are skipped)."""
    seed: int = 0
    """Seeds the initial weights, the batch order and the dropout masks ([Note: dropout is drawn by step])."""
    eval_every: int = 100
    """Evaluate on validation batches every this many steps (0: never)."""
    eval_batches: int = 4
    """Validation batches per evaluation."""
    trace: str | None = None
    """Write the last step's per-op spans here as Chrome trace JSON."""
    json_log: str | None = None
    """Append one JSON line per step here."""
    keep_graphs: int | str = "auto"
    """Units whose forward keeps its autograd graph until backward instead of being recomputed: ``"all"``,
    ``"none"``, or a number N (the N units just before the last). Kept graphs save a forward per unit
    (~15-20% of a CPU step in benchmarks/bench_train.py) and cost the units' activations in memory,
    outside the budgets. ``"auto"``: ``"all"`` when computing on the CPU (activations live in host RAM,
    and the step is measured faster), ``"none"`` on a GPU, whose memory the plan's device budget already
    claims ([Note: kept graphs in the engine])."""
    io_backend: str = "auto"
    """IO engine backend: ``auto``, ``io_uring`` or ``threads``."""
    strategy: str = "auto"
    """Data-parallel strategy when several ranks run (``torchrun`` or ``luwu train --nproc N``): ``ddp``,
    ``zero1``, ``zero2``, ``zero3`` or ``hsdp``; ``auto`` lets the planner pick the fastest that fits.
    One rank always runs ``local``."""
    node: str | None = None
    """Strategy ``node``: the optimizer node's ZeroMQ address (``tcp://127.0.0.1:5555``), a ``luwu node serve``
    started with ``--num-workers`` equal to the number of ranks."""
    node_key: str | None = None
    """Strategy ``node`` with a node started with ``--auth-keys``: this worker's ``.key_secret`` file from
    ``luwu node keygen`` (the node's ``node.key`` beside it)."""
    shard_group_size: int = 0
    """``hsdp``: ranks per sharding group (G), replicated across groups; 0 means min(8, world size)."""
    timeout: float = 300.0
    """Seconds a rank waits for the others (a collective, a barrier) before it gives up and names the rank
    that did not come."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Placement and budgets."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(_DTYPES)}")
        if not self.loss_scale > 0:
            raise ValueError(f"loss_scale must be positive, got {self.loss_scale}")
        if not (self.keep_graphs in ("auto", "all", "none")
                or (isinstance(self.keep_graphs, int) and not isinstance(self.keep_graphs, bool) and self.keep_graphs >= 0)):
            raise ValueError(f"keep_graphs={self.keep_graphs!r}: choose auto, all, none or a number of units >= 0")
        if self.strategy not in ("auto",) + _RUNNABLE:
            raise ValueError(f"strategy={self.strategy!r}: choose one of auto, {', '.join(_RUNNABLE)}")
        if self.strategy == "node" and not self.node:
            raise ValueError("strategy node needs --node tcp://HOST:PORT (a running `luwu node serve`), or "
                             "--spawn-node to start one (a node run's checkpoint resumes with either, or without a "
                             "node with --strategy auto)")
        if self.node_key and not os.path.isfile(self.node_key):
            raise ValueError(f"--node-key {self.node_key}: no such file; make keys with `luwu node keygen DIR`")
        if self.node and self.strategy != "node":
            raise ValueError(f"--node {self.node} applies to --strategy node, not {self.strategy}")
        if not isinstance(self.shard_group_size, int) or self.shard_group_size < 0:
            raise ValueError(f"shard_group_size must be an integer >= 0, got {self.shard_group_size!r}")
        if self.shard_group_size and self.strategy not in ("hsdp", "auto"):
            raise ValueError(f"--shard-group-size applies to strategy hsdp, not {self.strategy}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.eval_every < 0 or self.eval_batches <= 0:
            raise ValueError("eval_every must be >= 0 and eval_batches > 0")
        folder = self.model[3:] if isinstance(self.model, str) and self.model.startswith("hf:") else None
        if folder is not None and not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(f"--model {self.model}: {self.model[3:]!r} holds no config.json; hf:PATH takes a local "
                             "model folder as save_pretrained writes it (nothing is downloaded)")
        if self.json_log:
            parent = os.path.dirname(os.path.abspath(self.json_log))
            if not os.path.isdir(parent):
                raise ValueError(f"--json-log {self.json_log}: directory {parent} does not exist")
