"""First-fit byte-range allocator that remembers who freed each range.

The planner assigns every copy on the device and host tiers a slot (a byte
offset) in that tier's arena. A new copy may only reuse bytes once the op that
freed them ran, so besides the offset ``alloc`` returns the ``Free`` ops that last
released any byte of the range: the new copy's producer depends on them.
"""

from __future__ import annotations

__all__ = ["Arena"]


class Arena:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        # Free segments (start, end, free_op) sorted by start; adjacent segments may differ in
        # free_op, so a hole is a run of touching segments. free_op is None for never-used bytes.
        self._segments: list[tuple[int, int, int | None]] = [(0, capacity_bytes, None)] if capacity_bytes else []

    def alloc(self, nbytes: int) -> tuple[int, tuple[int, ...]] | None:
        """(offset, frees to depend on) of the first hole that fits, or None."""
        segs = self._segments
        i = 0
        while i < len(segs):
            run_start, j = segs[i][0], i
            while segs[j][1] - run_start < nbytes and j + 1 < len(segs) and segs[j + 1][0] == segs[j][1]:
                j += 1
            if segs[j][1] - run_start >= nbytes:
                end = run_start + nbytes
                deps = tuple(sorted({s[2] for s in segs[i:j + 1] if s[2] is not None}))
                rest = [(end, segs[j][1], segs[j][2])] if segs[j][1] > end else []
                segs[i:j + 1] = rest
                self.used_bytes += nbytes
                return run_start, deps
            i = j + 1
        return None

    def free(self, offset: int, nbytes: int, *, free_op: int) -> None:
        """Return ``[offset, offset + nbytes)``, released by op ``free_op``."""
        segs = self._segments
        lo, hi = 0, len(segs)
        while lo < hi:
            mid = (lo + hi) // 2
            if segs[mid][0] < offset:
                lo = mid + 1
            else:
                hi = mid
        assert (lo == 0 or segs[lo - 1][1] <= offset) and (lo == len(segs) or segs[lo][0] >= offset + nbytes), \
            "double free in arena"
        segs.insert(lo, (offset, offset + nbytes, free_op))
        self.used_bytes -= nbytes
