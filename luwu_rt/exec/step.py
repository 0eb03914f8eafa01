"""``OptimizerStep``: one optimizer step of a plan, the same wherever the optimizer runs.

It owns what turns a step's gradients into an update, once: the learning-rate
schedule (``lr_at``), the clip factor from the step's gradient norm, the skip
of a step whose norm is not finite, the AdamW handler, the gradient-norm
handlers, Adam's step count and the step's metrics. The engine's local
optimizer (``LocalOptimizer`` in place.py) and the optimizer node's runner
(node/runner.py) both serve its handlers to their executors; a worker whose
optimizer runs on the node keeps the schedule and Adam's count through it and
takes the step's outcome from the node (``finish(outcome=...)``).

[Note: clipping]
Global-norm clipping is exact: an update uses the clip factor of the step's
norm, ``min(1, grad_clip / (norm + 1e-6))`` as ``clip_grad_norm_`` computes it.
The gradient norm is only known after the whole backward, so with
``grad_clip > 0`` (and for fp16, whose overflow check needs the norm too) the
update either waits for it or speculates. Waiting: every optimizer step of the
plan reads the step's total norm, the output of its ``NormReduce``, which reads
every unit's ``GradNorm`` (``ModelSpec.optimizer_waits_for_backward``): the wait
follows from the data; loads of optimizer state still overlap backward, the
update itself does not. Speculating (optimizer state on NVMe, double-buffered:
[Note: speculative updates] in plan/sequence.py): each unit's update runs as its
gradients are final, with clip factor 1, into the other half of the state;
after the step ``verdict`` reads the norm: factor exactly 1 and a finite norm
commit the step (the halves swap), anything else redoes it from the untouched
half (``SpeculativeRuns``). With clipping off, each unit's update overlaps the
backward of the units below it, and the norm is only reported.

[Note: skipped steps]
A step whose norm is not finite (an fp16 overflow) updates nothing: every
``OptimStep`` of it still refreshes the compute copy of the parameters from the
master, because the plan stores that output whether or not the step applied
(an output buffer is not loaded first). Adam's ``t`` counts applied updates
only, so a skipped step leaves the bias corrections of the next one as they
were; the step number (and with it the learning rate) moves on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from luwu_rt.exec.executor import Handler, Views
from luwu_rt.exec.norm import NormHandlers
from luwu_rt.exec.optim import AdamWHandler, AdamWHyper
from luwu_rt.optim.config import OptimConfig
from luwu_rt.optim.schedule import lr_at, schedule_end
from luwu_rt.plan.ops import GLOBAL_UNIT, OptimStep, ShardId, ShardInfo

__all__ = ["OptimizerStep", "StepOutcome", "StepResult"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutcome:
    """What the update of a step found: its gradient norm and whether it was skipped."""

    grad_norm: float
    """Global L2 norm of the step's unscaled gradients."""
    skipped: bool
    """The norm was not finite: nothing was updated ([Note: skipped steps])."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """A finished step's metrics, as ``Engine.train_step`` reports them."""

    lr: float
    """The step's learning rate."""
    grad_norm: float
    """Global L2 norm of the step's unscaled gradients."""
    skipped: bool
    """The update was skipped for a non-finite norm ([Note: skipped steps])."""
    loss: float = math.nan
    """The global batch's mean loss, where the step computed one (a worker's step; not the node's)."""


class OptimizerStep:
    """The handlers of a plan's ``OptimStep``, ``GradNorm`` and ``NormReduce`` ops and the step around them.

    ``shards``: the plan's shard map. ``optim``: AdamW's settings, the schedule and clipping;
    ``total_steps``: the run's steps, where the cosine ends unless ``optim.schedule_steps`` says otherwise
    ([Note: the schedule of a resumed run] in optim/schedule.py); ``loss_scale``: what the gradients are
    scaled by (fp16);
    ``adam_step``: updates applied before the first step run here (a resumed run's)."""

    SPECULATION = "adaptive"
    """The default of ``speculation`` ([Note: when to speculate] in speculate.py)."""

    def __init__(self, shards: Mapping[ShardId, ShardInfo], *, optim: OptimConfig, total_steps: int,
                 loss_scale: float, param_dtype: torch.dtype, grad_dtype: torch.dtype, adam_step: int = 0) -> None:
        self.optim = optim
        self.total_steps = schedule_end(optim, steps=total_steps)
        """The step at which the learning rate's cosine ends."""
        self.loss_scale = loss_scale
        self.adamw = AdamWHandler(shards, param_dtype=param_dtype, grad_dtype=grad_dtype)
        self.norms = NormHandlers(shards, grad_dtype=grad_dtype)
        self.adam_step = adam_step
        """Updates applied (skipped steps do not count): Adam's ``t`` of the last step."""
        self.step = 0
        """The step being run, 1-based (the schedule's position)."""
        self._skip: bool | None = None
        """Whether this step skips its update; ``None`` until its first ``OptimStep`` read the norm."""
        self.speculation = self.SPECULATION
        """When a double-buffered run updates speculatively ([Note: when to speculate]): ``adaptive``, ``always``
        or ``never``."""
        self._clipped = False
        """Whether the last step's norm called for clipping (or was not finite)."""

    def handlers(self) -> dict[str, Handler]:
        """The executor's handlers of the update and of the norms (a ``NormReduce`` within this process;
        one across ranks or node shards replaces it and records the total in ``norms``)."""
        return {"OptimStep": self.optim_step, "GradNorm": self.norms.grad_norm, "NormReduce": self.norms.norm_reduce}

    def start_at(self, *, adam_step: int) -> None:
        """Where a resumed run's Adam count stands (a checkpoint's, or a restarted node's)."""
        self.adam_step = adam_step

    def clip_factor(self, norm: float | None) -> float:
        """What the gradients are multiplied by for a step of gradient norm ``norm`` ([Note: clipping]): 1 with
        clipping off, without a norm or for a norm that is not finite (a step that is skipped)."""
        o = self.optim
        clipping = norm is not None and o.grad_clip > 0 and math.isfinite(norm)
        return min(1.0, o.grad_clip / (norm + 1e-6)) if clipping else 1.0

    def hyper(self, step: int, norm: float | None) -> AdamWHyper:
        """The hyper-parameters of ``step``; ``norm``: the step's gradient norm when the plan made the update
        wait for it ([Note: clipping]), else ``None`` (no clipping, or a speculative update)."""
        o = self.optim
        clip = self.clip_factor(norm)
        lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=self.total_steps)
        return AdamWHyper(lr=lr, beta1=o.beta1, beta2=o.beta2, eps=o.eps, weight_decay=o.weight_decay,
                          grad_scale=clip / self.loss_scale)

    def begin(self, step: int) -> None:
        """Before running the plan of ``step`` (1-based)."""
        self.step = step
        self._skip = None
        self.adamw.step = self.adam_step + 1
        self.adamw.hyper = self.hyper(step, None)

    def speculates(self) -> bool:
        """Whether the next step should update speculatively, when it can ([Note: when to speculate])."""
        return self.speculation == "always" or (self.speculation == "adaptive" and not self._clipped)

    def verdict(self) -> str:
        """After a speculative run of the step ([Note: clipping]): ``commit`` when its updates used the exact clip
        factor (1, the norm finite), ``skip`` when the norm is not finite (nothing may be updated), else
        ``redo``."""
        norm = self.grad_norm
        if not math.isfinite(norm):
            self._skip = True
            return "skip"
        return "commit" if self.clip_factor(norm) == 1.0 else "redo"

    def restore(self, op: OptimStep, views: Views) -> None:
        """The ``OptimStep`` handler of a restore plan (``plan_restore``): the parameters from the master weights."""
        self.adamw(op, views, update=False)

    def optim_step(self, op: OptimStep, views: Views) -> None:
        """The ``OptimStep`` handler. They run one at a time on their queue; the first of a step reads the
        norm (complete here when the plan made the update wait for it: [Note: clipping]) and sets the
        step's hyper-parameters and whether it skips ([Note: skipped steps])."""
        if self._skip is None:
            total = views.get(ShardId(GLOBAL_UNIT, "norm", 0))
            norm = math.sqrt(float(total.view(torch.float64)[0])) / self.loss_scale if total is not None else None
            self._skip = norm is not None and not math.isfinite(norm)
            self.adamw.hyper = self.hyper(self.step, norm)
        self.adamw(op, views, update=not self._skip)

    @property
    def grad_norm(self) -> float:
        """Global L2 norm of the last step's unscaled gradients (as the norm handlers summed them)."""
        return math.sqrt(self.norms.total_sq) / self.loss_scale

    def finish(self, *, outcome: StepOutcome | None = None) -> StepResult:
        """After the plan of the step ran: counts the update unless it was skipped, and returns the step's
        metrics. ``outcome``: the norm and skip of an update that ran elsewhere (the optimizer node's),
        instead of this one's."""
        if outcome is None:
            outcome = StepOutcome(grad_norm=self.grad_norm, skipped=bool(self._skip))
        if not outcome.skipped:
            self.adam_step += 1
        self._clipped = outcome.skipped or self.clip_factor(outcome.grad_norm) < 1.0
        return StepResult(lr=self.adamw.hyper.lr, grad_norm=outcome.grad_norm, skipped=outcome.skipped)
