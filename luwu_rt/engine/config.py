"""Configuration of a training run: ``luwu train`` flags, TOML files and the ``Engine`` API.

The fields that are flags say so in their metadata (``flag(...)``: spelling, help, choices), and
``luwu_rt/cli/flags.py`` makes ``luwu train``'s and ``luwu plan``'s arguments from them ([Note: one flag
table] there): the defaults ``--help`` shows are the ones below.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from luwu_rt.config import flag, merge, upgrade_keys
from luwu_rt.data import DataConfig
from luwu_rt.plan.dtypes import DTYPE_NAMES
from luwu_rt.engine.budgets import auto_help
from luwu_rt.engine.hwprofile import PROFILE_WORDS
from luwu_rt.io.engine import BACKENDS
from luwu_rt.models.presets import PRESETS
from luwu_rt.optim.config import OptimConfig
from luwu_rt.plan.codec import COMPRESSING_STRATEGIES, parse_request
from luwu_rt.plan.sizes import parse_size
from luwu_rt.plan.spec import STRATEGIES, Strategy

__all__ = ["CheckpointConfig", "OffloadConfig", "OptimConfig", "TrainConfig", "resumed_settings"]

_TIERS = ("device", "host", "nvme", "auto")
"""Values of the ``offload`` placements (``--offload-*``)."""
_DTYPES = tuple(DTYPE_NAMES)
"""Values of ``TrainConfig.dtype`` (``--dtype``): the compute dtypes ([Note: dtype names] in plan/dtypes.py)."""
_STRATEGY_CHOICES = ("auto",) + STRATEGIES
"""Values of ``TrainConfig.strategy`` (``--strategy``)."""
_KEEP_GRAPHS_WORDS = ("auto", "all", "none")
"""The words ``TrainConfig.keep_graphs`` takes besides a number of units."""


def _size(value: int | str, name: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _count_or_word(text: str) -> int | str:
    """``--keep-graphs``: a number of units, or one of the words (which ``__post_init__`` checks)."""
    return int(text) if text.isdigit() else text


def _placement(key: str, what: str) -> dict:
    return flag(f"home of {what}: device, host, nvme or auto, the fastest placement that fits", choices=_TIERS,
                name=f"--offload-{key}", plans=True)


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    """Where each state kind lives between uses, and the budgets of the tiers."""

    params: str = field(default="auto", metadata=_placement("params", "the parameters"))
    """Home of the compute copy of the parameters: ``device``, ``host``, ``nvme`` or ``auto``."""
    optimizer: str = field(default="auto", metadata=_placement("optimizer", "the master weights and the moments"))
    """Home of the fp32 master weights and the Adam moments."""
    grads: str = field(default="auto", metadata=_placement("grads", "the gradients"))
    """Home of the gradients between backward and the optimizer step."""
    device_mem_bytes: int | str = field(default="auto", metadata=flag(
        f"device budget including the activations, e.g. 40GiB (default {auto_help('device')})",
        name="--device-mem", metavar="SIZE", plans=True))
    """Device budget in bytes (``"4GiB"`` accepted), activations included: the planner reserves what one
    micro-batch's activations and kept graphs take (measured, ``engine/workload.py``) and places shards
    in the rest. Without a GPU the device tier is a CPU arena and the activations live beside it.
    ``"auto"``: a share of this machine's memory, or 88 MiB for the demo model gpt-tiny ([Note: automatic
    budgets] in engine/budgets.py), sized for its default run on the CPU: 77 MiB of activations (every
    graph kept) leave a 10.7 MiB arena, which holds the parameters and gradients (6.6 MiB) but not the
    optimizer state as well (9.9 MiB more), so the run uses the device tier for real."""
    host_mem_bytes: int | str = field(default="auto", metadata=flag(
        f"pinned host budget, e.g. 200GiB (default {auto_help('host')})", name="--host-mem", metavar="SIZE",
        plans=True))
    """Pinned host arena budget in bytes. ``"auto"``: a share of this machine's RAM, or 6 MiB for the demo
    model gpt-tiny, below its optimizer state (9.9 MiB) but holding one unit's share of it while that unit
    is updated, so the planner itself must put the optimizer state on NVMe: ``luwu train`` alone uses all
    three tiers."""
    nvme_dir: str | None = field(default=None, metadata=flag(
        "directory of the NVMe tier, created if missing and then removed at exit (default: a scratch directory "
        "./luwu-scratch-* made for the run and removed at exit; a resumed run makes a new one too)", metavar="DIR",
        plans=True))
    """Directory of the NVMe tier; needed when any state lives on ``nvme`` (or ``auto`` may choose it).
    Created when missing, as ``luwu plan --nvme-dir`` assumes. The tier's files (``luwu_state/`` under it)
    are scratch: the checkpoint, not they, survives a run, so they are removed when the engine closes, and
    with them the directory when the engine created it. A resumed run does not reuse the saved run's.
    ``None``: the engine has no NVMe tier; ``luwu train`` then gives it a scratch directory
    ``./luwu-scratch-*`` of its own, removed at exit, and ``luwu plan`` plans with that directory's disk
    ([Note: missing directories] in cli/dirs.py)."""
    keep_nvme_state: bool = field(default=False, metadata=flag(
        "keep the NVMe tier's files (luwu_state/ under --nvme-dir, or the scratch directory) after the run; by "
        "default they are scratch and removed at exit (the checkpoint is what survives)"))
    """Keep ``luwu_state/`` under ``nvme_dir`` (and ``luwu train``'s scratch directory) after the run, to look
    at it; the next run rebuilds it anyway."""
    chunk_bytes: int | str = field(default="4MiB", metadata=flag("storage chunk size, a multiple of 4KiB",
                                                                 name="--chunk-size", metavar="SIZE", plans=True))
    """Storage chunk: the unit of file IO and checksums; a multiple of 4 KiB."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {"device_mem": "device_mem_bytes", "host_mem": "host_mem_bytes",
                                              "chunk_size": "chunk_bytes"}
    """Keys this table had before the units rule, read as the new ones ([Note: renamed config keys] in config.py)."""

    def __post_init__(self) -> None:
        for name in ("params", "optimizer", "grads"):
            if getattr(self, name) not in _TIERS:
                raise ValueError(f"offload.{name}={getattr(self, name)!r}: choose one of {', '.join(_TIERS)}")
        # "auto" stays: the engine resolves it on the machine it runs on (a resumed run on another one too).
        for name, flag_name in (("device_mem_bytes", "--device-mem"), ("host_mem_bytes", "--host-mem")):
            if getattr(self, name) != "auto":
                setattr(self, name, _size(getattr(self, name), f"offload.{name} ({flag_name})"))
        self.chunk_bytes = _size(self.chunk_bytes, "offload.chunk_bytes (--chunk-size)")
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096:
            raise ValueError(f"offload.chunk_bytes={self.chunk_bytes} (--chunk-size) must be a positive multiple of "
                             f"4096 bytes")
        if self.nvme_dir is not None and not str(self.nvme_dir).strip():  # "" must not quietly mean "no tier"
            raise ValueError("offload.nvme_dir (--nvme-dir) is empty; give a directory, or leave it out (luwu train "
                             "then makes a scratch directory ./luwu-scratch-*)")
        uses_nvme = "nvme" in (self.params, self.optimizer, self.grads)
        if uses_nvme and not self.nvme_dir:
            raise ValueError("state is placed on nvme but no --nvme-dir (offload.nvme_dir) was given")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpointing and resuming."""

    dir: str | None = field(default=None, metadata=flag("checkpoint directory", name="--ckpt-dir", metavar="DIR"))
    """Where checkpoints go (``<dir>/step_<N>/``); ``None`` saves none."""
    every: int = field(default=0, metadata=flag("checkpoint every N steps (default {default}: only at the end)",
                                                name="--ckpt-every", metavar="N"))
    """Save every this many steps (and at the end); 0 saves only at the end."""
    resume: bool = field(default=False, metadata=flag(
        "continue from the latest checkpoint in --ckpt-dir (an error when there is none)", name="--resume"))
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

    model: str = field(default="gpt-tiny", metadata=flag(
        f"built-in preset ({', '.join(PRESETS)}; default {{default}}) or hf:PATH, a local Hugging Face model folder "
        "(config.json + safetensors) to fine-tune", metavar="PRESET|hf:PATH", plans=True))
    """Built-in preset (see ``luwu plan --help``) when the engine builds the model, or ``hf:PATH``: a local
    Hugging Face model folder (config.json + safetensors), built from its config and started from its weights."""
    init_from: str | None = field(default=None, metadata=flag(
        "safetensors file or folder (a model folder or a luwu export) whose tensors, matched by name, are the first "
        "weights, streamed in unit by unit", metavar="PATH"))
    """Safetensors file or folder (a Hugging Face model folder or this project's export) whose tensors, matched
    by name, are the first weights, streamed in unit by unit; ``None``: the model's own weights (``hf:PATH``:
    its folder's), or the seed for a model on meta."""
    steps: int = field(default=300, metadata=flag(
        "optimizer steps in all (default {default}; --resume: the saved run's)"))
    """Optimizer steps to run in total; a resumed run keeps the saved run's unless given, and its learning-rate
    schedule whatever it is given ([Note: the schedule of a resumed run] in optim/schedule.py)."""
    batch_size: int = field(default=16, metadata=flag("sequences per micro-batch (per rank)", plans=True))
    """Sequences per micro-batch."""
    seq_len: int = field(default=128, metadata=flag("tokens per sequence", plans=True))
    """Tokens per sequence."""
    grad_accum: int = field(default=1, metadata=flag("micro-batches of --batch-size sequences per optimizer step",
                                                     plans=True))
    """Micro-batches per optimizer step."""
    dtype: str = field(default="fp32", metadata=flag(
        "compute dtype of the parameters and activations; master weights stay fp32", choices=_DTYPES, plans=True))
    """Compute dtype of the parameters and activations: ``fp32``, ``bf16`` or ``fp16``; master weights stay fp32."""
    loss_scale: float = 1024.0
    """Static loss scale for ``fp16`` (steps whose gradients overflow are skipped)."""
    seed: int = field(default=0, metadata=flag("seed of the initial weights, the batch order and the dropout masks"))
    """Seeds the initial weights, the batch order and the dropout masks ([Note: dropout is drawn by step]
    in engine/compute.py)."""
    eval_every: int = field(default=100, metadata=flag("validation loss every N steps, 0 never", metavar="N"))
    """Evaluate on validation batches every this many steps (0: never)."""
    eval_batches: int = 4
    """Validation batches per evaluation."""
    trace: str | None = field(default=None, metadata=flag(
        "write the last step's op spans as Chrome trace JSON (open in Perfetto)", metavar="FILE"))
    """Write the last step's per-op spans here as Chrome trace JSON."""
    json_log: str | None = field(default=None, metadata=flag(
        "append one JSON line per step (step, loss, tokens_per_s, step_s, ...)", metavar="FILE"))
    """Append one JSON line per step here."""
    keep_graphs: int | str = field(default="auto", metadata=flag(
        "units that keep their forward graph until backward instead of recomputing it: auto, all, none or N "
        "(default {default}: as many as fit, on the CPU and on a GPU alike); kept graphs' activations count against "
        "the device budget", metavar="auto|all|none|N", parse=_count_or_word, plans=True))
    """Units whose forward keeps its autograd graph until backward instead of being recomputed: ``"all"``,
    ``"none"``, or a number N (the N units just before the last). Kept graphs save a forward per unit
    (~15-20% of a CPU step in benchmarks/bench_train.py) and cost the units' activations, reserved in the
    device budget ([Note: kept graphs in the engine]). ``"auto"``: the most units (the last ones) with which
    the step still plans within the budgets, down to none, on the CPU and on a GPU alike ([Note: kept graphs
    chosen by the budget] in engine/kept.py)."""
    io_backend: str = field(default="auto", metadata=flag("IO engine backend", choices=BACKENDS))
    """IO engine backend: ``auto``, ``io_uring`` or ``threads``."""
    strategy: str = field(default="auto", metadata=flag(
        "data-parallel strategy with several ranks (default {default}: the fastest predicted that fits; one rank "
        "runs local; node: workers and an optimizer node)", choices=_STRATEGY_CHOICES, plans=True))
    """Strategy when several ranks run (``torchrun`` or ``luwu train --nproc N``), one of ``STRATEGIES``
    (plan/spec.py): a data-parallel one, or ``node`` (workers and an optimizer node, ``node``); ``auto`` lets
    the planner pick the fastest data-parallel one that fits. One rank always runs ``local``."""
    node: str | None = field(default=None, metadata=flag(
        "strategy node: the optimizer node's address, tcp://HOST:PORT of a luwu node serve", metavar="ADDR"))
    """Strategy ``node``: the optimizer node's ZeroMQ address (``tcp://127.0.0.1:5555``), a ``luwu node serve``
    started with ``--num-workers`` equal to the number of ranks."""
    node_key: str | None = field(default=None, metadata=flag(
        "strategy node: this worker's .key_secret from luwu node keygen, for a node run with --auth-keys",
        metavar="FILE"))
    """Strategy ``node`` with a node started with ``--auth-keys``: this worker's ``.key_secret`` file from
    ``luwu node keygen`` (the node's ``node.key`` beside it)."""
    compress: str = field(default="none", metadata=flag(
        "gradient compression of ddp, zero1, zero2 and node pushes with error feedback: none, bf16, fp16, onebit, "
        "topk:RATIO, powersgd:RANK (not node), or auto (not node: the cost model picks per unit among bf16 and "
        "onebit, or auto:C1,C2,... among those named; luwu plan shows its choice)", metavar="CODEC", plans=True))
    """Gradient codec of the data-parallel synchronisation ([Note: codecs on the wire] in plan/codec.py): ``none``,
    ``bf16``, ``fp16``, ``onebit``, ``topk:RATIO``, ``powersgd:RANK`` for every unit, or ``auto`` /
    ``auto:C1,C2,...``: per unit the fastest of none and the codecs named, by the cost model ([Note: selective
    compression] in plan/compression.py). ``ddp``, ``zero1`` and ``zero2`` (one rank compresses nothing), and
    ``node``'s pushes with one elementwise codec ([Note: compressed pushes] in plan/codec.py)."""
    compress_warmup: int = field(default=0, metadata=flag(
        "optimizer steps that synchronise uncompressed before --compress starts (DeepSpeed 1-bit Adam's freeze_step, "
        "DGC's warm-up): a sparse codec such as topk:0.01 under Adam trains far slower while the loss falls "
        "fastest; not node", metavar="N", plans=True))
    """Steps 1..N of the run synchronise their gradients uncompressed, the later ones through ``compress`` ([Note:
    compression warm-up] in engine/engine.py); 0: compressed from the first step."""
    shard_group_size: int = field(default=0, metadata=flag(
        "hsdp: ranks per sharding group, e.g. the GPUs of one server (default {default}: min(8, world size))",
        aliases=("--group-size",), metavar="G", plans=True))
    """``hsdp``: ranks per sharding group (G), replicated across groups; 0 means min(8, world size)."""
    profile: str | None = field(default=None, metadata=flag(
        "hardware profile the planner predicts step times with (placement and strategy auto choose by them): a JSON "
        "file (`luwu calibrate --out FILE` writes one), builtin (a GPU server), or auto (default: this machine's "
        "calibration cached by `luwu calibrate`, else builtin)", metavar="FILE|auto|builtin", plans=True))
    """Hardware profile of the cost model ([Note: which profile] in engine/hwprofile.py): a JSON file of
    ``HardwareProfile`` keys, ``"builtin"``, or ``"auto"``/``None``: this machine's cached calibration, else
    the built-in profile."""
    timeout_s: float = field(default=300.0, metadata=flag(
        "seconds a rank waits for the others before it exits naming the missing rank", name="--timeout",
        metavar="S"))
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

    RENAMED_KEYS: ClassVar[dict[str, str]] = {"timeout": "timeout_s"}
    """Keys this config had before the units rule, read as the new ones ([Note: renamed config keys] in config.py)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum"):
            if not isinstance(getattr(self, name), int) or not 0 < getattr(self, name) < 2**31:  # tensor sizes
                raise ValueError(f"{name} must be a positive integer below 2**31, got {getattr(self, name)!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(_DTYPES)}")
        if not self.loss_scale > 0:
            raise ValueError(f"loss_scale must be positive, got {self.loss_scale}")
        count = isinstance(self.keep_graphs, int) and not isinstance(self.keep_graphs, bool) and self.keep_graphs >= 0
        if not (self.keep_graphs in _KEEP_GRAPHS_WORDS or count):
            raise ValueError(f"keep_graphs={self.keep_graphs!r}: choose auto, all, none or a number of units >= 0")
        if self.strategy not in _STRATEGY_CHOICES:
            raise ValueError(f"strategy={self.strategy!r}: choose one of {', '.join(_STRATEGY_CHOICES)}")
        if self.io_backend not in BACKENDS:
            raise ValueError(f"io_backend={self.io_backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.strategy == "node" and not self.node:
            raise ValueError("strategy node needs --node tcp://HOST:PORT (a running `luwu node serve`), or "
                             "--spawn-node to start one (a node run's checkpoint resumes with either, or without a "
                             "node with --strategy auto)")
        if self.node_key and not os.path.isfile(self.node_key.replace("{rank}", "0")):  # {rank}: one key a worker
            raise ValueError(f"--node-key {self.node_key}: no such file; make keys with `luwu node keygen DIR`")
        if self.node and self.strategy != "node":
            raise ValueError(f"--node {self.node} applies to --strategy node, not {self.strategy}")
        auto, codecs = parse_request(self.compress)  # a ValueError naming --compress and the choices
        if self.strategy == "node" and auto:
            raise ValueError(f"--compress {self.compress} is not offered for --strategy node (the cost model prices "
                             f"collectives, not pushes): name one codec of bf16, fp16, onebit, topk:RATIO, or none")
        if self.strategy == "node" and codecs != ("none",):
            Strategy(name="node", compress=codecs)  # powersgd: a ValueError naming the codecs node pushes take
        elif not auto and codecs != ("none",) and self.strategy not in ("auto",) + COMPRESSING_STRATEGIES:
            raise ValueError(f"--compress {self.compress} applies to --strategy {', '.join(COMPRESSING_STRATEGIES)} "
                             f"(or auto) and node, not {self.strategy}: zero3 and hsdp gather parameters "
                             f"uncompressed; use --compress none or auto")
        if not isinstance(self.compress_warmup, int) or isinstance(self.compress_warmup, bool) \
                or self.compress_warmup < 0:
            raise ValueError(f"compress_warmup (--compress-warmup) must be an integer >= 0, "
                             f"got {self.compress_warmup!r}")
        if self.compress_warmup and codecs == ("none",) and not auto:
            raise ValueError(f"--compress-warmup {self.compress_warmup} delays a codec that --compress does not name; "
                             f"give --compress CODEC, or leave --compress-warmup out")
        if self.compress_warmup and self.strategy == "node":
            raise ValueError(f"--compress-warmup {self.compress_warmup} applies to ddp, zero1 and zero2: a node's "
                             f"workers push with one codec from the first step; leave it out, or use --compress none "
                             f"for uncompressed pushes")
        if not isinstance(self.shard_group_size, int) or self.shard_group_size < 0:
            raise ValueError(f"shard_group_size must be an integer >= 0, got {self.shard_group_size!r}")
        if self.shard_group_size and self.strategy not in ("hsdp", "auto"):
            raise ValueError(f"--shard-group-size applies to --strategy hsdp only, not {self.strategy}")
        if self.profile is not None and self.profile not in PROFILE_WORDS and not os.path.isfile(self.profile):
            raise ValueError(f"--profile {self.profile}: no such file; give a JSON profile (`luwu calibrate --out "
                             f"{self.profile}` writes one), auto or builtin")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"timeout_s (--timeout) must be a positive number of seconds, got {self.timeout_s!r}")
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


def resumed_settings(saved: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The config keys of a run resumed from a checkpoint whose config is ``saved`` (``CheckpointReader.settings``),
    ``overrides`` (flags, ``Engine.load``'s) on top; ``from_mapping(TrainConfig, ...)`` reads them. Each side is
    read under the keys' current names before they merge ([Note: renamed config keys] in config.py); the saved
    learning-rate schedule is kept whatever ``steps`` the overrides give, unless they give ``optim.schedule_steps``
    ([Note: the schedule of a resumed run] in optim/schedule.py); the saved NVMe directory is not: it was that
    run's (a scratch directory removed when it ended), and the resumed run names its own ([Note: missing
    directories] in cli/dirs.py)."""
    saved = upgrade_keys(TrainConfig, saved)
    optim = dict(saved.get("optim") or {})
    if optim.get("schedule_steps") is None:  # it ended at the run's steps (or the key is newer than the checkpoint)
        optim["schedule_steps"] = saved.get("steps", TrainConfig.__dataclass_fields__["steps"].default)
    offload = {key: value for key, value in (saved.get("offload") or {}).items() if key != "nvme_dir"}
    out = merge({**saved, "optim": optim, "offload": offload}, upgrade_keys(TrainConfig, overrides))
    out["offload"] = dict(out["offload"])  # the caller's to change (Engine.load names a scratch directory)
    return out
