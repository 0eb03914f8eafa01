"""Asynchronous NVMe/file IO: :class:`IOEngine` over io_uring or a thread pool,
and page-aligned host buffers from :func:`aligned_empty`."""

from luwu_rt.io.buffers import PAGE_BYTES, aligned_empty
from luwu_rt.io.engine import BACKENDS, IOEngine, IOTicket

__all__ = ["BACKENDS", "PAGE_BYTES", "IOEngine", "IOTicket", "aligned_empty"]
