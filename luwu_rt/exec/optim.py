"""The ``OptimStep`` handler: runs the fused AdamW kernel over one unit's shards.

A unit's buffers of different state kinds are cut into shards by bytes, and
the kinds differ in element size (bf16 params, fp32 master), so shard ``i`` of
``param`` and shard ``i`` of ``master`` cover different elements. The handler
therefore splits the unit's element range at every shard boundary of every
kind and calls the kernel once per piece, on views that line up element for
element.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from luwu_rt.exec.executor import Views
from luwu_rt.exec.views import state_dtypes, typed_views
from luwu_rt.plan.ops import OptimStep, ShardId, ShardInfo
from luwu_rt.plan.spec import SECOND_HALF

__all__ = ["AdamWHyper", "AdamWHandler"]

_ROLES = {"grad_slice": "grad", "param_slice": "param", **{b: a for a, b in SECOND_HALF.items()}}
"""zero1 updates from its reduce-scattered ``grad_slice``; zero1/2 write the updated ``param_slice``; a
double-buffered update writes the other half of the optimizer state ([Note: speculative updates] in
plan/sequence.py)."""
_UPDATED = ("param", "param_slice", "grad", "grad_slice", "master", "exp_avg", "exp_avg_sq", *SECOND_HALF.values())
"""The state kinds an update reads or writes (not the norms)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamWHyper:
    lr: float = 1e-3
    """Learning rate of this step."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.999
    """Second-moment decay."""
    eps: float = 1e-8
    """Denominator term."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_scale: float = 1.0
    """Multiplies gradients first: loss-scale removal and clipping in one factor."""


class AdamWHandler:
    """Callable ``(op, views)`` for the executor's ``OptimStep`` ops."""

    def __init__(
        self,
        shards: Mapping[ShardId, ShardInfo],
        *,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        backend: str = "auto",
    ) -> None:
        self.shards = shards
        self.dtypes = state_dtypes(param_dtype=param_dtype, grad_dtype=grad_dtype)
        self.backend = backend
        self.step = 0
        """The optimizer step number (1-based once set by the caller before each run)."""
        self.hyper = AdamWHyper()

    @staticmethod
    def _pieces(typed: dict[str, list[torch.Tensor]]):
        """Yields ``{state: flat typed view}`` for each run of elements covered by one shard of every
        state kind (``typed``: each kind's typed views in element order, ``typed_views``)."""
        starts: dict[str, list[int]] = {}
        cuts: set[int] = set()
        total = None
        for state, items in typed.items():
            pos, starts[state] = 0, []
            for view in items:
                starts[state].append(pos)
                pos += view.numel()
            cuts.update(starts[state])
            assert total is None or total == pos, "state kinds of one unit cover different element counts"
            total = pos
        bounds = sorted(cuts) + [total]
        for a, b in zip(bounds, bounds[1:]):
            out = {}
            for state, st in starts.items():
                i = bisect.bisect_right(st, a) - 1
                out[state] = typed[state][i][a - st[i] : b - st[i]]
            yield out

    def __call__(self, op: OptimStep, views: Views, *, update: bool = True) -> None:
        """Updates the unit's shards in ``views``. ``update=False`` (a skipped step) leaves the
        optimizer state alone but still writes the compute copy of the parameters from the
        master: the plan stores that output whether or not the step was applied, and an
        output buffer is not loaded first."""
        from luwu_rt.kernels import adamw_step

        assert self.step >= 1, "set handler.step before running the plan"
        # The step's norm is read by whoever set ``hyper`` ([Note: clipping] in step.py). A consumed copy's bytes
        # are its output's ([Note: taking over a copy] in plan/ops.py): the update runs in place on the output.
        gone = {a.shard for a in op.consumes}
        typed = {_ROLES.get(state, state): pieces
                 for state, pieces in typed_views({s: v for s, v in views.items() if s not in gone}, self.shards,
                                                  self.dtypes, states=_UPDATED).items()}
        h = self.hyper
        for piece in self._pieces(typed):
            param = piece.get("param")
            # The compute copy (fp32 too) is written in the update's pass: a copy after it would read the master
            # and write the copy once more (14 ms of a 450 ms gpt-small step on 2 ranks).
            fused_out = param if update else None
            if update:
                adamw_step(
                    piece["master"], piece["grad"], piece["exp_avg"], piece["exp_avg_sq"],
                    step=self.step, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                    weight_decay=h.weight_decay, grad_scale=h.grad_scale,
                    param_out=fused_out, backend=self.backend,
                )
            if param is not None and fused_out is None:
                param.copy_(piece["master"])
