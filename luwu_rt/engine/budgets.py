"""The budgets of a run that names none: sized from this machine, or the demo's.

[Note: automatic budgets]
``offload.device_mem`` and ``offload.host_mem`` default to ``"auto"``, which
``resolve_budgets`` turns into bytes, the same way for ``luwu train`` (through
the engine) and ``luwu plan``, so both answer alike:

- the demo model (``gpt-tiny`` built by name, what ``luwu train`` alone trains)
  gets its showcase budgets, 88 MiB of device and 6 MiB of host memory, chosen
  so that its default run uses all three tiers (``OffloadConfig.device_mem``);
- any other model gets a share of this machine: on a GPU, 90% of the device's
  free memory (the rest is the CUDA context, the allocator's slack and the
  temporaries the activation estimate leaves out) and half of the available
  RAM for the pinned host arena; on the CPU, where the device tier is itself
  an arena in RAM beside the activations, half of the available RAM for the
  device and a quarter for the host, which leaves a quarter to the process
  (the model's code, data, page cache);
- ranks on one machine (``LOCAL_WORLD_SIZE``) divide its RAM, and the ranks
  sharing a GPU its memory; every rank then plans with the smallest of the
  ranks' values, as all must make the same plan (the engine agrees on them).

Available RAM is the kernel's ``MemAvailable``, capped by the cgroup's limit
(a container's ``MemAvailable`` is the host's). The shares are budgets, not
allocations: the arenas are as large as the plan needs, never more.
"""

from __future__ import annotations

import os

__all__ = ["AUTO", "DEMO_BUDGETS", "DEMO_MODEL", "auto_help", "available_memory_bytes", "machine_budgets",
           "resolve_budgets"]

AUTO = "auto"
"""A budget sized by ``resolve_budgets`` ([Note: automatic budgets])."""
DEMO_MODEL = "gpt-tiny"
"""The model ``luwu train`` trains with no arguments."""
DEMO_BUDGETS = (88 << 20, 6 << 20)
"""(device, host) bytes of the demo's three-tier run ([Note: automatic budgets])."""

_GPU_SHARE, _GPU_HOST_SHARE = 0.9, 0.5
_CPU_DEVICE_SHARE, _CPU_HOST_SHARE = 0.5, 0.25


def auto_help(tier: str) -> str:
    """What ``auto`` means for ``tier`` (``device`` or ``host``), for ``--help`` (from the figures above)."""
    pct = lambda share: f"{share:.0%}"  # noqa: E731
    if tier == "device":
        return (f"auto: {DEMO_BUDGETS[0] >> 20}MiB for the demo {DEMO_MODEL}, else {pct(_GPU_SHARE)} of the GPU's "
                f"free memory, or {pct(_CPU_DEVICE_SHARE)} of the available RAM for the CPU arena without a GPU")
    return (f"auto: {DEMO_BUDGETS[1] >> 20}MiB for the demo {DEMO_MODEL}, else {pct(_GPU_HOST_SHARE)} of the "
            f"available RAM ({pct(_CPU_HOST_SHARE)} without a GPU)")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def available_memory_bytes() -> int:
    """RAM this process may still use: ``MemAvailable``, capped by the cgroup's limit (v2 or v1)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 says "no limit" with a huge number
            available = min(available, max(limit - usage, 0))
    return available


def machine_budgets(*, device_type: str, local_ranks: int = 1) -> tuple[int, int]:
    """(device, host) budgets of one of ``local_ranks`` ranks on this machine ([Note: automatic budgets])."""
    ram = available_memory_bytes() // max(local_ranks, 1)
    if device_type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        per_gpu = -(-max(local_ranks, 1) // max(torch.cuda.device_count(), 1))  # ranks sharing this GPU
        return int(free * _GPU_SHARE) // per_gpu, int(ram * _GPU_HOST_SHARE)
    return int(ram * _CPU_DEVICE_SHARE), int(ram * _CPU_HOST_SHARE)


def resolve_budgets(device_mem: int | str, host_mem: int | str, *, demo: bool, device_type: str,
                    local_ranks: int = 1) -> tuple[int, int]:
    """(device, host) bytes of a run whose budgets are ``device_mem``/``host_mem`` (bytes, or ``"auto"``);
    ``demo``: the run trains the demo model ([Note: automatic budgets])."""
    if device_mem != AUTO and host_mem != AUTO:
        return int(device_mem), int(host_mem)
    auto = DEMO_BUDGETS if demo else machine_budgets(device_type=device_type, local_ranks=local_ranks)
    return (auto[0] if device_mem == AUTO else int(device_mem)), (auto[1] if host_mem == AUTO else int(host_mem))
