"""The executor: walks a ``SwapPlan`` on per-queue threads and streams, moving bytes and calling handlers."""

from luwu_rt.exec.chaos import Chaos
from luwu_rt.exec.executor import DONE, Executor, Handle, Handler, Views, WaitAll
from luwu_rt.exec.norm import NormHandlers
from luwu_rt.exec.optim import AdamWHandler, AdamWHyper
from luwu_rt.exec.place import LocalOptimizer, OptimizerPlace, StepFn
from luwu_rt.exec.step import OptimizerStep, StepOutcome, StepResult
from luwu_rt.exec.streams import DeferredStream, HostStream, Queues
from luwu_rt.exec.trace import Span, busy_by_queue, write_chrome_trace, write_rank_traces
from luwu_rt.exec.views import state_dtypes, typed_views

__all__ = ["AdamWHandler", "AdamWHyper", "Chaos", "DONE", "DeferredStream", "Executor", "Handle", "Handler",
           "HostStream", "LocalOptimizer", "NormHandlers", "OptimizerPlace", "OptimizerStep", "Queues", "Span",
           "StepFn", "StepOutcome", "StepResult", "Views", "WaitAll", "busy_by_queue", "state_dtypes", "typed_views",
           "write_chrome_trace", "write_rank_traces"]
