"""The tiered store: memory arenas for the device and host tiers, checksummed
files for the NVMe tier. Placement is the plan's; the store only holds bytes."""

from luwu_rt.store.arena import Arena, host_memory_available_bytes
from luwu_rt.store.nvme import NvmeRequest, NvmeTier, atomic_write_text

__all__ = ["Arena", "NvmeRequest", "NvmeTier", "atomic_write_text", "host_memory_available_bytes"]
