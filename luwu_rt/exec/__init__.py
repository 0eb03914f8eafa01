"""The executor: walks a ``SwapPlan`` on per-queue threads and streams, moving bytes and calling handlers.

Names are imported on first use: ``luwu_rt.exec.trace`` and ``luwu_rt.exec.chaos`` are standard library only,
and what reads a plan's timeline without running it (``luwu_rt.testing``, ``luwu plan --simulate``) uses them
without paying for torch, which the executor itself needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from luwu_rt.exec.chaos import Chaos
    from luwu_rt.exec.executor import DONE, Executor, Handle, Handler, Views, WaitAll
    from luwu_rt.exec.norm import NormHandlers
    from luwu_rt.exec.optim import AdamWHandler, AdamWHyper
    from luwu_rt.exec.place import LocalOptimizer, OptimizerPlace, StepFn
    from luwu_rt.exec.speculate import SpeculativeRuns
    from luwu_rt.exec.step import OptimizerStep, StepOutcome, StepResult
    from luwu_rt.exec.streams import DeferredStream, HostStream, Queues
    from luwu_rt.exec.trace import Span, busy_by_queue, covered_s, write_chrome_trace, write_rank_traces
    from luwu_rt.exec.views import state_dtypes, typed_views

_WHERE = {
    "Chaos": "chaos", "DONE": "executor", "Executor": "executor", "Handle": "executor", "Handler": "executor",
    "Views": "executor", "WaitAll": "executor", "NormHandlers": "norm", "AdamWHandler": "optim",
    "AdamWHyper": "optim", "LocalOptimizer": "place", "OptimizerPlace": "place", "StepFn": "place",
    "SpeculativeRuns": "speculate", "OptimizerStep": "step", "StepOutcome": "step", "StepResult": "step",
    "DeferredStream": "streams",
    "HostStream": "streams", "Queues": "streams", "Span": "trace", "busy_by_queue": "trace", "covered_s": "trace",
    "write_chrome_trace": "trace", "write_rank_traces": "trace", "state_dtypes": "views", "typed_views": "views",
}
"""Public name -> the module of this package that defines it."""

__all__ = ["AdamWHandler", "AdamWHyper", "Chaos", "DONE", "DeferredStream", "Executor", "Handle", "Handler",
           "HostStream", "LocalOptimizer", "NormHandlers", "OptimizerPlace", "OptimizerStep", "Queues", "Span",
           "SpeculativeRuns",
           "StepFn", "StepOutcome", "StepResult", "Views", "WaitAll", "busy_by_queue", "covered_s", "state_dtypes",
           "typed_views",
           "write_chrome_trace", "write_rank_traces"]
assert sorted(__all__) == sorted(_WHERE)


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once imported, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
