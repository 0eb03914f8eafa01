"""Memory arenas of the device and host tiers.

Each tier is one allocation made once at start-up; the plan assigns every copy
of a shard a byte offset (slot) in it, so the hot path never allocates and a
budget is a hard bound rather than an allocator's hope.
"""

from __future__ import annotations

import os

import torch

from luwu_rt.io import aligned_empty

__all__ = ["Arena", "host_memory_available_bytes"]


def host_memory_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class Arena:
    """One contiguous, page-aligned byte buffer handed out as typed views.

    ``tier="host"``: pinned (mlocked / CUDA-registered) host memory for IO and
    host<->device copies. ``tier="device"``: CUDA memory when ``device`` is a
    CUDA device, else a CPU buffer standing in for it with the same budget, so
    every plan runs on a machine without a GPU.
    """

    def __init__(self, nbytes: int, *, tier: str, device: torch.device | str | None = None) -> None:
        if tier not in ("host", "device"):
            raise ValueError(f"Arena: tier must be 'host' or 'device', got {tier!r}")
        if nbytes < 0:
            raise ValueError(f"Arena: nbytes must be >= 0, got {nbytes}")
        self.tier = tier
        self.nbytes = nbytes
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            free, _total = torch.cuda.mem_get_info(dev)
            if nbytes > free:
                raise ValueError(
                    f"device budget of {nbytes} bytes exceeds the {free} bytes free on {dev}; "
                    "lower --device-mem or free GPU memory"
                )
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        else:
            available = host_memory_available_bytes()
            if nbytes > available:
                raise ValueError(
                    f"{tier} budget of {nbytes} bytes exceeds the {available} bytes of host memory available; "
                    f"lower --{tier}-mem (or move state to NVMe)"
                )
            self.buffer = aligned_empty(nbytes, lock=(tier == "host"))
        self._storage, self._base, self._device = (self.buffer.untyped_storage(), self.buffer.storage_offset(),
                                                   self.buffer.device)  # buffer is uint8: its offset is in bytes

    def view(self, offset: int, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The ``nbytes`` at ``offset`` as a flat tensor of ``dtype`` (no copy)."""
        itemsize = dtype.itemsize
        # Slots come from the planner; out-of-range or misaligned ones are planner bugs.
        assert 0 <= offset and offset + nbytes <= self.nbytes, (offset, nbytes, self.nbytes)
        assert offset % itemsize == 0 and nbytes % itemsize == 0, (offset, nbytes, dtype)
        # Not a slice of ``buffer``: slices share one autograd version counter, so a copy
        # into one slot would look like an in-place change of every tensor saved for
        # backward from another slot. A tensor set on the storage has its own counter.
        # Every op takes a few views, so the storage and its offset are looked up once (__init__).
        out = torch.empty(0, dtype=dtype, device=self._device)
        return out.set_(self._storage, (self._base + offset) // itemsize, (nbytes // itemsize,))
