"""Cost model: a plan and a hardware profile in, a predicted step time out.

Each op takes its bytes over the bandwidth of its link, its FLOPs over the
device's FLOP/s or its parameters over the optimizer's rate. Ops start when
their dependencies ended and their queue is free (one op at a time per queue,
in plan order: an executor issues them in that order), so the predicted step
time is the critical path through dependencies and queue serialisation. The
bottleneck is the queue busy for longest.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from .ops import Collective, Compute, Free, GradNorm, Load, Op, OptimStep, Store, SwapPlan, Wait
from .spec import TIERS, HardwareProfile

__all__ = ["StepCost", "estimate", "op_seconds"]

_GB = 1e9
_LINK = {"nvme_read": "nvme_read_gbps", "nvme_write": "nvme_write_gbps", "h2d": "h2d_gbps", "d2h": "d2h_gbps"}


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    predicted_step_s: float
    """Critical path of one step."""
    bottleneck: str
    """Queue with the most busy time (``compute`` means the step is compute bound), or ``nvme``
    when reads and writes together keep the disk busier than any queue ([Note: one disk])."""
    busy_s: Mapping[str, float]
    """Seconds each queue is busy per step."""
    io_bytes: Mapping[str, Mapping[str, int]]
    """tier -> {"read": bytes moved out of it, "write": bytes moved into it} per step."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "busy_s", MappingProxyType(dict(self.busy_s)))
        object.__setattr__(self, "io_bytes", MappingProxyType({t: MappingProxyType(dict(v)) for t, v in self.io_bytes.items()}))


def op_seconds(op: Op, profile: HardwareProfile) -> float:
    """Time ``op`` keeps its queue busy."""
    if isinstance(op, (Load, Store)):
        return op.nbytes / (getattr(profile, _LINK[op.queue]) * _GB)
    if isinstance(op, Compute):
        return op.flops / profile.compute_flops
    if isinstance(op, OptimStep):
        rate = profile.device_optim_params_per_s if op.tier == "device" else profile.host_optim_params_per_s
        return op.num_params / rate
    if isinstance(op, Collective):
        return op.comm_bytes / (profile.net_gbps * _GB)
    if isinstance(op, GradNorm):
        return op.num_params / (profile.host_optim_params_per_s * 4)
    assert isinstance(op, (Free, Wait)), op
    return 0.0


def estimate(plan: SwapPlan, profile: HardwareProfile) -> StepCost:
    """Predicted step time, per-queue busy time and bytes moved per tier for ``plan``."""
    end: list[float] = []
    queue_free: dict[str, float] = {}
    busy: dict[str, float] = {}
    io = {t: {"read": 0, "write": 0} for t in TIERS}
    for op in plan.ops:
        ready = max((end[d] for d in op.deps), default=0.0)
        seconds = op_seconds(op, profile)
        if op.queue == "mem":
            end.append(ready)  # bookkeeping only: never waits for a queue
            continue
        start = max(ready, queue_free.get(op.queue, 0.0))
        end.append(start + seconds)
        queue_free[op.queue] = end[-1]
        busy[op.queue] = busy.get(op.queue, 0.0) + seconds
        if isinstance(op, (Load, Store)):
            io[op.src]["read"] += op.nbytes
            io[op.dst]["write"] += op.nbytes
    bottleneck = max(busy, key=busy.__getitem__) if busy else "none"
    # [Note: one disk] Reads and writes have their own queues so that neither waits behind the
    # other, but one NVMe device serves both from one budget of time: measured here (luwu bench
    # offload-step), reading and writing at once took about the sum of the two alone. So a step
    # takes at least the two queues' busy time together, however well they overlap.
    disk_s = busy.get("nvme_read", 0.0) + busy.get("nvme_write", 0.0)
    if disk_s > busy.get(bottleneck, 0.0):
        bottleneck = "nvme"
    predicted = max(max(end, default=0.0), disk_s)
    return StepCost(predicted_step_s=predicted, bottleneck=bottleneck, busy_s=busy, io_bytes=io)
