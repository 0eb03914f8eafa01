"""The training engine: the execution model of DESIGN.md over the planner, store and executor."""

from luwu_rt.engine.config import CheckpointConfig, OffloadConfig, OptimConfig, TrainConfig
from luwu_rt.engine.engine import Engine

__all__ = ["CheckpointConfig", "Engine", "OffloadConfig", "OptimConfig", "TrainConfig"]
