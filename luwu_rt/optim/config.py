"""The optimizer's settings: AdamW hyper-parameters, the learning-rate schedule and clipping."""

from __future__ import annotations

from dataclasses import dataclass, field

from luwu_rt.config import flag

__all__ = ["OptimConfig"]


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay, and global-norm clipping."""

    lr: float = field(default=3e-3, metadata=flag("peak learning rate of warmup + cosine decay"))
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to ``lr``."""
    schedule_steps: int | None = field(default=None, metadata=flag(
        "the step at which the cosine decay reaches min_lr, where the learning rate then stays (default: --steps; "
        "a resumed run keeps its checkpoint's)", metavar="N"))
    """The step at which warmup + cosine decay end at ``min_lr``; later steps run at ``min_lr``. ``None``: the
    run's ``steps``. A checkpoint keeps the schedule of the run that wrote it: resuming with another number
    of ``steps`` keeps it too, and only this key changes it ([Note: the schedule of a resumed run] in
    optim/schedule.py)."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.95
    """Second-moment decay."""
    eps: float = 1e-8
    """Denominator term."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW)."""
    grad_clip: float = field(default=1.0, metadata=flag(
        "global-norm clip, 0 off; exact: where the optimizer state is double-buffered on NVMe updates "
        "speculate and a step that needed clipping is redone, elsewhere (and with fp16) each update waits for the "
        "step's norm", plans=True))
    """Clip the global gradient norm to this; 0 disables clipping."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(f"optim: need lr > 0 and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0 or self.eps <= 0:
            raise ValueError("optim: warmup_steps, grad_clip and weight_decay must be >= 0 and eps > 0")
        if self.schedule_steps is not None and (isinstance(self.schedule_steps, bool) or self.schedule_steps < 1):
            raise ValueError(f"optim.schedule_steps (--schedule-steps) must be a positive number of steps, got "
                             f"{self.schedule_steps!r}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim: betas must be in [0, 1), got {self.beta1}, {self.beta2}")
