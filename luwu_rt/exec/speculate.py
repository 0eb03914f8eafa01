"""``SpeculativeRuns``: the plans of a step whose optimizer state is double-buffered, and when each runs.

[Note: when to speculate]
A double-buffered step ([Note: speculative updates] in plan/sequence.py) has
three plans per half of the state: ``speculate`` (each update as its
gradients are final, clip factor 1), ``wait`` (each update after the step's
norm, with its true factor: [Note: clipping] in step.py) and ``restore`` (the
parameters from the current half of the master weights). A speculative run is
committed when its norm needs no clipping; otherwise its updates were wrong,
and the step is redone: the parameters the updates overwrote are put back,
then the step runs again with the ``wait`` plan, from the same batches and
dropout masks ([Note: dropout is drawn by step] in engine/compute.py), so its
gradients and norm are the same bits and its updates those of
``clip_grad_norm_`` and AdamW. Redoing the whole step, not only the updates,
keeps nothing alive in the common case: retaining every gradient until the
norm is known would cost a step's worth of gradient memory, or its write to
NVMe, on every step, where a redo costs one step when it happens.

How often it happens is up to the norms. On the default corpus (gpt-tiny,
clipping 1.0, 300 steps) the norm exceeds 1 in 50 steps, mostly in the first 40
and then in short runs (benchmarks/bench_speculate.py). So ``OptimizerStep.speculation`` defaults to
``adaptive``: a step speculates unless the step before it needed clipping (or
was skipped), in which case it waits, as clipping persists from step to step;
that turned the 50 redos into 24 there (and 50 steps that waited instead).
``always`` and ``never`` are for tests and measurements.

A skipped step (fp16, a norm that is not finite) needs no second run: the
parameters are put back and nothing else changes. Where nothing reads the
parameters between steps (the optimizer node, which serves them), there is
no restore plan: a skipped step runs again too, waiting, and skips there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from luwu_rt.exec.executor import Executor
from luwu_rt.exec.step import OptimizerStep
from luwu_rt.exec.trace import Span
from luwu_rt.store import TieredStore

__all__ = ["SpeculativeRuns"]


class SpeculativeRuns:
    """Runs one step of a double-buffered plan ([Note: when to speculate]). Each of ``speculate``, ``wait`` and
    ``restore`` holds the executors of the two halves' plans, by half; ``store.half`` says which runs. Without
    ``restore`` (nothing reads the parameters between steps) a skipped step runs again, waiting."""

    def __init__(self, step: OptimizerStep, store: TieredStore, *, speculate: Sequence[Executor],
                 wait: Sequence[Executor], restore: Sequence[Executor] = ()) -> None:
        assert store.double_buffered and len(speculate) == len(wait) == 2 and len(restore) in (0, 2)
        self.step, self.store = step, store
        self.speculate, self.wait, self.restore = tuple(speculate), tuple(wait), tuple(restore)
        for a, b in (self.speculate, self.wait):  # each half's period is followed by the other's ([Note: steady state])
            a.partner, b.partner = b, a
        self.counts = dict.fromkeys(("commit", "redo", "skip", "wait"), 0)
        """Steps run so far by how they ended: committed, redone, skipped after a speculative run, or waited."""
        self.last = ""
        """How the last step ended (a key of ``counts``)."""

    def run(self, again: Callable[[], None]) -> list[Span]:
        """Runs the step; ``again()`` sets the step up anew (its batches, the optimizer's ``begin``) before a
        redo. Returns the spans of every run, in order; ``last`` says how it ended."""
        half = self.store.half
        if not self.step.speculates():
            self.last = "wait"
            spans = self.wait[half].run(pipeline=True)
        else:
            spans = self.speculate[half].run(pipeline=True)
            self.last = self.step.verdict()
            if self.last != "commit" and self.restore:
                spans += self.restore[half].run()
            if self.last == "redo" or (self.last == "skip" and not self.restore):
                again()
                spans += self.wait[half].run(pipeline=True)
        self.counts[self.last] += 1
        return spans

    def close(self) -> None:
        for executor in (*self.speculate, *self.wait, *self.restore):
            executor.close()
