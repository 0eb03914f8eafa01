"""Handlers of the gradient-norm ops: ``GradNorm`` (one unit) and a local ``NormReduce`` (the step's sum).

[Note: one order for the norm]
The total is summed in the order the ``NormReduce`` lists its inputs (units
0..L-1), whatever order the units' norms were computed in, and in float64: the
same bits on every run and under any timing, which is what makes clipped runs
reproducible under the chaos mode.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from luwu_rt.exec.executor import DONE, Handle, Views
from luwu_rt.plan.ops import GLOBAL_UNIT, GradNorm, NormReduce, ShardId, ShardInfo

__all__ = ["NormHandlers"]


class NormHandlers:
    """``grad_norm`` and ``norm_reduce`` for the executor; ``total_sq`` is the last step's squared norm."""

    def __init__(self, shards: Mapping[ShardId, ShardInfo], *, grad_dtype: torch.dtype) -> None:
        self.shards = shards
        self.grad_dtype = grad_dtype
        self.total_sq = 0.0

    def grad_norm(self, op: GradNorm, views: Views) -> None:
        """Squared norm of the unit's final gradients (``grad`` or ``grad_slice``) into its ``norm``."""
        total = torch.zeros((), dtype=torch.float64, device=_device(views))
        for sid in sorted((s for s in views if s.state != "norm"), key=lambda s: s.chunk):
            part = views[sid].view(self.grad_dtype)[: self.shards[sid].numel]
            total += torch.linalg.vector_norm(part, dtype=torch.float32).double() ** 2
        views[ShardId(op.unit, "norm", 0)].view(torch.float64)[0] = total

    def local_sum(self, op: NormReduce, views: Views) -> torch.Tensor:
        """Sums the units' norms into the step's total ([Note: one order for the norm]); returns the
        total's one-element float64 view."""
        out = views[ShardId(GLOBAL_UNIT, "norm", 0)].view(torch.float64)[:1]
        parts = [views[a.shard].view(torch.float64)[0] for a in op.inputs]
        out.copy_(torch.stack(parts).sum() if parts else torch.zeros(()))
        return out

    def norm_reduce(self, op: NormReduce, views: Views) -> Handle:
        """A ``local`` NormReduce: the sum is the total (gradients are not split across ranks)."""
        assert op.collective == "local", "a NormReduce across ranks needs a process group (luwu_rt.dist)"
        self.total_sq = float(self.local_sum(op, views))
        return DONE


def _device(views: Views) -> torch.device:
    return next(iter(views.values())).device
