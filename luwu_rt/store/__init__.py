"""The tiered store: memory arenas for the device and host tiers, checksummed
files for the NVMe tier. Placement is the plan's; the store only holds bytes."""

from luwu_rt.store.arena import Arena, host_memory_available_bytes
from luwu_rt.store.nvme import NvmeRequest, NvmeTier, atomic_write_text
from luwu_rt.store.tiered import TieredStore, element_offsets, nvme_regions

__all__ = ["Arena", "NvmeRequest", "NvmeTier", "TieredStore", "atomic_write_text", "element_offsets",
           "host_memory_available_bytes", "nvme_regions"]
