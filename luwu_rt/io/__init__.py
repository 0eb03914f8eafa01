"""Asynchronous NVMe/file IO: :class:`IOEngine` over io_uring or a thread pool,
and page-aligned host buffers from :func:`aligned_empty`."""

from luwu_rt.io.buffers import PAGE_BYTES, aligned_empty
from luwu_rt.io.engine import BACKENDS, BLOCK_BYTES, QUEUE_DEPTH, IOEngine, IOTicket, rank_queue_depth

__all__ = ["BACKENDS", "BLOCK_BYTES", "PAGE_BYTES", "QUEUE_DEPTH", "IOEngine", "IOTicket", "aligned_empty",
           "rank_queue_depth"]
