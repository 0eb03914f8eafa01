"""The executor: walks a ``SwapPlan`` on per-queue threads and streams, moving bytes and calling handlers."""

from luwu_rt.exec.chaos import Chaos
from luwu_rt.exec.executor import DONE, Executor, Handle, Handler, Views
from luwu_rt.exec.norm import NormHandlers
from luwu_rt.exec.optim import AdamWHandler, AdamWHyper
from luwu_rt.exec.streams import DeferredStream, HostStream, Queues
from luwu_rt.exec.trace import Span, write_chrome_trace, write_rank_traces

__all__ = ["AdamWHandler", "AdamWHyper", "Chaos", "DONE", "DeferredStream", "Executor", "Handle", "Handler",
           "HostStream", "NormHandlers", "Queues", "Span", "Views", "write_chrome_trace", "write_rank_traces"]
