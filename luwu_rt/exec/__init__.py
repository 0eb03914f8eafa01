"""The executor: walks a ``SwapPlan``, moving bytes and calling handlers."""

from luwu_rt.exec.executor import DONE, Executor, Handle, Handler, Views
from luwu_rt.exec.norm import NormHandlers
from luwu_rt.exec.optim import AdamWHandler, AdamWHyper
from luwu_rt.exec.trace import Span, write_chrome_trace

__all__ = ["AdamWHandler", "AdamWHyper", "DONE", "Executor", "Handle", "Handler", "NormHandlers", "Span", "Views",
           "write_chrome_trace"]
