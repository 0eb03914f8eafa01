"""The executor: walks a ``SwapPlan``, moving bytes and calling handlers."""

from luwu_rt.exec.executor import Executor, Handler, Views
from luwu_rt.exec.optim import AdamWHandler, AdamWHyper
from luwu_rt.exec.trace import Span, write_chrome_trace

__all__ = ["AdamWHandler", "AdamWHyper", "Executor", "Handler", "Span", "Views", "write_chrome_trace"]
