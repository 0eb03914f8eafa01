"""Which hardware profile a run plans with, and what one rank of it gets.

[Note: which profile]
``luwu train``, ``luwu plan`` and ``--strategy auto`` predict step times with a ``HardwareProfile``
(plan/spec.py). ``TrainConfig.profile`` (``--profile``) chooses it: a JSON file; ``builtin``, the defaults
of a GPU server; or ``auto`` (the default): the profile ``luwu calibrate`` measured on this machine and
cached under the user's cache directory, keyed by the machine's identity (CPU model, cores, GPUs, RAM),
else the built-in one. Every command names the one it used in its first line, since a prediction made with
another machine's figures can be off by orders of magnitude (the built-in profile predicted a CPU box's
step 98% short).

[Note: a rank's share of the machine]
A calibration measures this machine with all its cores (``_machine`` in its notes says so). Ranks on one
machine pin themselves to a share of its cores (``pin_cores``), so each rank's host optimizer and, where the
device is the CPU itself, its compute and copies get ``1 / local ranks`` of the rates: ``per_rank`` scales
them. For the compute, how much a rank loses depends on the model: on 2 cores, ranks of two computed gpt-small
in 1.91x the time of one process on both cores but gpt-tiny in 1.46x (its kernels use two cores poorly). So
where the compute rate of a model is measured for ranks (``luwu bench e2e``), the ranks measure it side by
side and the profile's rate is theirs times the ranks ([Note: the compute rate of ranks side by side] in
cli/probes.py), which this division gives back. The disk is shared too, on any device: the ranks' NVMe
tiers are directories of one ``--nvme-dir``, so on one filesystem, and each rank gets ``1 / local ranks`` of the
read and write bandwidth ``luwu calibrate`` measured with the disk to itself. Without that division the model
priced two ranks' optimizer-state loads at twice the speed they had: gpt-small zero3 x2 with its state on NVMe
at batch 1 x 64 read its 0.3 GB a step at 0.93 GB/s per rank (busy time) where a rank's plan assumed the
calibrated 3.19 GB/s, and its step was predicted 20-34% short. A profile without ``_machine`` (written by
hand, e.g. a paper's testbed) gives per-rank figures already and is used as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from luwu_rt.plan.spec import HardwareProfile

__all__ = ["PROFILE_WORDS", "ProfileChoice", "cache_dir", "cached_profile_path", "choose_profile",
           "machine_identity", "per_rank", "read_profile"]

PROFILE_WORDS = ("auto", "builtin")
"""Values of ``--profile`` besides a file ([Note: which profile])."""
CACHE_ENV = "LUWU_CACHE_DIR"
"""Overrides the cache directory (tests point it at a temporary one)."""
_WRITERS = "`luwu calibrate --out FILE` writes one, `luwu bench io --dir DIR --profile-out FILE` its NVMe keys"
_HOST_KEYS = ("host_optim_params_per_s", "host_mem_gbps")
"""Rates of the host's cores that ranks on one machine share ([Note: a rank's share of the machine])."""
_CPU_DEVICE_KEYS = ("compute_flops", "device_optim_params_per_s", "device_mem_gbps", "h2d_gbps", "d2h_gbps")
"""Rates of the "device" that ranks share too when the device is the CPU."""
_DISK_KEYS = ("nvme_read_gbps", "nvme_write_gbps")
"""The disk of the NVMe tier, which ranks on one machine share on any device (the optimizer node's is its own)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileChoice:
    """The profile a run plans with and where it came from."""

    profile: HardwareProfile
    """The whole machine's figures (``per_rank`` gives one rank's)."""
    source: str
    """``file``, ``calibrated`` (this machine's cached calibration) or ``builtin``."""
    path: str | None = None
    """The file read (``None`` for the built-in profile)."""
    notes: dict[str, Any] = field(default_factory=dict)
    """The file's ``_`` keys: ``_machine`` for a calibration ([Note: a rank's share of the machine])."""

    def describe(self) -> str:
        """For a command's first line."""
        if self.source == "file":
            return f"profile {self.path}"
        if self.source == "calibrated":
            return f"profile calibrated for this machine ({self.path})"
        return "built-in profile (a GPU server; `luwu calibrate` measures this machine)"


def machine_identity() -> dict[str, Any]:
    """What a calibration is valid for: CPU model, cores, GPUs and RAM (GiB, rounded)."""
    import torch

    cpu = "unknown CPU"
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    available = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available else []
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count() or 1, "gpus": gpus, "ram_gib": round(ram / 2**30),
            "device": "cuda" if gpus else "cpu"}


def cache_dir() -> Path:
    """``$LUWU_CACHE_DIR``, else ``$XDG_CACHE_HOME/luwu_rt``, else ``~/.cache/luwu_rt``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "luwu_rt"


def cached_profile_path(identity: dict[str, Any] | None = None) -> Path:
    """Where ``luwu calibrate`` caches this machine's profile (``identity``: ``machine_identity()``)."""
    identity = machine_identity() if identity is None else identity
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "profiles" / f"{key}.json"


def read_profile(path: str | os.PathLike, *, flag: str = "--profile") -> tuple[HardwareProfile, dict[str, Any]]:
    """The profile in the JSON file ``path`` and its notes (the keys that start with ``_``)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise OSError(exc.errno, f"{flag}: cannot read the hardware profile ({exc.strerror})", str(path)) from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} {path}: not valid JSON ({exc}); {_WRITERS}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{flag} {path}: expected a JSON object of throughputs; {_WRITERS}")
    try:
        profile = HardwareProfile.from_dict(values)
    except ValueError as exc:
        # The likeliest wrong file is a bench's --json measurement, which is not a profile.
        raise ValueError(f"{flag} {path}: {exc} ({_WRITERS})") from None
    return profile, {k: v for k, v in values.items() if k.startswith("_")}


def choose_profile(given: str | None) -> ProfileChoice:
    """The profile of ``--profile given`` ([Note: which profile]): a file, ``builtin``, or ``auto``/``None``
    (this machine's calibration when cached, else the built-in one)."""
    if given == "builtin":
        return ProfileChoice(profile=HardwareProfile(), source="builtin")
    if given not in (None, "auto"):
        profile, notes = read_profile(given)
        return ProfileChoice(profile=profile, source="file", path=str(given), notes=notes)
    path = cached_profile_path()
    if path.is_file():
        profile, notes = read_profile(path, flag="the cached calibration (remove it or rerun `luwu calibrate`)")
        return ProfileChoice(profile=profile, source="calibrated", path=str(path), notes=notes)
    return ProfileChoice(profile=HardwareProfile(), source="builtin")


def per_rank(choice: ProfileChoice, *, local_ranks: int) -> HardwareProfile:
    """One rank's profile when ``local_ranks`` ranks share this machine ([Note: a rank's share of the machine])."""
    machine = choice.notes.get("_machine")
    if local_ranks <= 1 or not isinstance(machine, dict):
        return choice.profile
    p = choice.profile
    keys = _HOST_KEYS + _DISK_KEYS + (_CPU_DEVICE_KEYS if machine.get("device") == "cpu" else ())
    return dataclasses.replace(p, **{k: getattr(p, k) / local_ranks for k in keys})
