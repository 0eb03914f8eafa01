"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr``, then ``min_lr``.

[Note: the schedule of a resumed run]
The learning rate of a step depends on where the cosine ends, so a run that is
stopped and resumed must keep that step, or the rate jumps at the first resumed
step (a 200-step run resumed with ``--steps 300`` went from 3e-4 at step 200 to
1.05e-3 at step 201, and its loss with it). Where the cosine ends is
``optim.schedule_steps``, by default the run's ``steps``; a checkpoint records
the run's config, and a resumed run takes the saved end (the saved ``steps``
for a checkpoint older than the key), whatever ``steps`` it is given
(``resumed_settings`` in engine/config.py). So:

- ``luwu train --resume`` alone continues the saved run to its own ``--steps``
  on its own schedule, and ends where the uninterrupted run ends;
- ``--steps N`` beyond the schedule's end trains the steps past it at
  ``min_lr``, where the cosine left the rate (no jump);
- ``--schedule-steps N`` is the one way to change the schedule of a run that
  has started: the cosine is recomputed to end at step N.

A resumed ``luwu train`` says which of these happens in one line (``resume_line``).
"""

from __future__ import annotations

import math

from luwu_rt.optim.config import OptimConfig

__all__ = ["lr_at", "resume_line", "schedule_end"]


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based); ``total_steps``: the step the cosine ends at."""
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def schedule_end(optim: OptimConfig, *, steps: int) -> int:
    """The step at which ``optim``'s cosine ends, in a run of ``steps`` steps."""
    return optim.schedule_steps if optim.schedule_steps is not None else steps


def _lr(optim: OptimConfig, step: int, end: int) -> float:
    return lr_at(step, lr=optim.lr, min_lr=optim.min_lr, warmup_steps=optim.warmup_steps, total_steps=end)


def resume_line(optim: OptimConfig, *, step: int, steps: int, saved_end: int) -> str:
    """What the learning rate does in a run resumed after ``step`` to ``steps`` under ``optim``, whose
    schedule the checkpoint had end at ``saved_end`` ([Note: the schedule of a resumed run])."""
    end, first = schedule_end(optim, steps=steps), step + 1
    if end != saved_end:
        return (f"learning rate: --schedule-steps {end} replaces the checkpoint's schedule (cosine to step "
                f"{saved_end}): "
                f"step {first} runs at {_lr(optim, first, end):.3g} instead of {_lr(optim, first, saved_end):.3g}")
    if steps <= end:
        return (f"learning rate: the checkpoint's schedule goes on (cosine to {optim.min_lr:.3g} at step {end}): "
                f"{_lr(optim, first, end):.3g} at step {first}")
    last = max(first, end + 1)
    past, run = (f"steps {last}-{steps}", "run") if steps > last else (f"step {steps}", "runs")
    w = optim.warmup_steps
    if first > w:
        what = f"{run} at min_lr {optim.min_lr:.3g}"
    elif steps <= w:
        what = f"{run} in its warmup (to step {w}): {_lr(optim, first, end):.3g} at step {first}"
    else:
        what = f"{run} to the end of its warmup (step {w}), then at min_lr {optim.min_lr:.3g}"
    return (f"learning rate: the checkpoint's schedule ends at step {end}; {past} {what} (--schedule-steps {steps} "
            f"stretches the cosine to step {steps} instead: {_lr(optim, first, steps):.3g} at step {first})")
