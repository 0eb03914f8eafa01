"""Data-parallel communication: the plan's collectives over process groups (``torch.distributed`` or
in-process ranks for simulation)."""

from luwu_rt.dist.collectives import CollectiveHandlers, Group, TorchGroup
from luwu_rt.dist.local import LocalGroup, LocalWorld

__all__ = ["CollectiveHandlers", "Group", "LocalGroup", "LocalWorld", "TorchGroup"]
