"""The C heap under torch's CPU tensors: what a run gives back, and one heap for its threads.

[Note: the C heap under CPU tensors]
torch allocates every CPU tensor with ``malloc`` (glibc's on Linux). Two of glibc's habits made a run hold
memory that no tensor used, measured on gpt-small (benchmarks/results/2026-12-05-rss.md):

- A freed block above the mmap threshold (128 KiB at first) raises the threshold to its size, up to 32 MiB,
  so later blocks of that size come from the heap, and freed heap memory stays resident. Materialising the
  model frees each unit's temporaries (its module's parameters, the flat copy, the zeroed moments) one unit at
  a time: 190 MiB stayed resident beside the arenas for the whole run, where the compute thread, which
  allocates from a heap of its own (below), could not reuse them. ``trim`` after materialising (or loading a
  checkpoint) gives them back.
- Each thread that allocates gets an arena of its own (up to eight per core), and memory freed in an arena
  serves only the threads of that arena. A step allocates on several queue threads (compute, the optimizer,
  gather, reduce), so each arena grew to its own peak and the process held their sum: zero3 on 2 ranks held
  1.34 GiB in malloc at a step's peak with 0.75 GiB in use. ``share_one_arena`` (``M_ARENA_MAX`` 1) makes every
  thread allocate from one arena, the main one, whose free memory any of them reuses: 0.88-0.91 GiB held.

The step's own large temporaries fragment the one heap as well: blocks of a unit's size, freed on other
threads than the ones that took them, left a zero3 rank of gpt-small holding 300-570 MiB in malloc for 170-200 in
use, growing from step to step. Most were gloo's: its all-gather staged the whole unit and the reduce-scatter took
two more copies; point to point they are gone ([Note: collectives on gloo] in dist/collectives.py), and the heap
held steady at 170-290 MiB (benchmarks/results/2026-12-07-rss.md).

A fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``) would return every freed block at once, but then every
step maps its activations anew: at 4 MiB, 350 thousand page faults and 0.6 s of system time per step of
gpt-small, a quarter of the step; at 16 MiB, 3% of zero3's step for 2% of its peak. Both calls are glibc's;
elsewhere (musl, macOS) they do nothing.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["share_one_arena", "trim"]

_M_ARENA_MAX = -8
"""``mallopt``'s parameter for the most arenas (glibc's malloc.h)."""


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)  # the symbols already in this process: its C library's
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def trim() -> bool:
    """Returns the heap's free memory to the system (``malloc_trim``): after a phase that freed many large
    temporaries. Whether any was returned (``False`` also without glibc)."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


def share_one_arena() -> bool:
    """Makes threads that have not allocated yet allocate from the arenas that exist, not from new ones of their
    own ([Note: the C heap under CPU tensors]): ``luwu`` calls it first thing (its ranks too), an ``Engine`` when
    it is made (in a process of the user's, before the run's threads start). A user's ``MALLOC_ARENA_MAX`` is
    left as it is. Whether the limit was set."""
    libc = _libc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, 1))
