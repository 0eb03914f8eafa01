"""Best-fit byte-range allocator that remembers who freed each range.

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

    def _holes(self) -> list[tuple[int, int, int]]:
        """(length, first segment, last segment) of each run of touching free segments."""
        segs, holes, i = self._segments, [], 0
        while i < len(segs):
            j = i
            while j + 1 < len(segs) and segs[j + 1][0] == segs[j][1]:
                j += 1
            holes.append((segs[j][1] - segs[i][0], i, j))
            i = j + 1
        return holes

    def alloc(self, nbytes: int) -> tuple[int, tuple[int, ...]] | None:
        """(offset, frees to depend on) of the smallest hole that fits (best fit keeps large
        holes for large shards), or None."""
        fitting = [h for h in self._holes() if h[0] >= nbytes]
        if not fitting:
            return None
        _, i, j = min(fitting)
        segs = self._segments
        start, end = segs[i][0], segs[i][0] + nbytes
        k = i
        while segs[k][1] < end:
            k += 1
        deps = tuple(sorted({s[2] for s in segs[i:k + 1] if s[2] is not None}))
        segs[i:k + 1] = [(end, segs[k][1], segs[k][2])] if segs[k][1] > end else []
        self.used_bytes += nbytes
        return start, deps

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
