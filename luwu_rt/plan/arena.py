"""Byte-range allocator that remembers who freed each range.

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
        self.high_water_bytes = 0
        """End of the highest range ever allocated: the bytes an arena for this plan needs (the budget is
        only the limit; allocating all of it would pin memory no op uses)."""
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
        """(offset, frees to depend on) of the place that fits and was freed longest ago, in the
        smallest such hole on a tie (best fit keeps large holes for large shards), or None.

        [Note: reuse the oldest free bytes]
        A copy placed in bytes freed by op ``f`` cannot be produced before ``f`` runs. Taking
        the bytes freed earliest (never-used bytes first) keeps that false dependency as far
        back as the budget allows, so a prefetch can start early instead of waiting for the
        op that happens to free a hole of exactly the right size (best fit alone would chain
        each unit's loads to the previous unit's optimizer step). A hole is a run of touching
        segments freed at different times, so the copy may go anywhere in it: its candidate
        places start or end at a segment boundary (the just-freed bytes at a hole's start
        would otherwise chain zero3's every forward gather to the previous unit's compute)."""
        segs = self._segments
        best: tuple[int, int, int] | None = None  # (newest free covered, hole length, start)
        for length, i, j in self._holes():
            if length < nbytes:
                continue
            lo, hi = segs[i][0], segs[j][1]
            places = {segs[k][0] for k in range(i, j + 1)} | {segs[k][1] - nbytes for k in range(i, j + 1)}
            for start in places:
                if lo <= start and start + nbytes <= hi:
                    newest = max(-1 if f is None else f
                                 for a, b, f in segs[i : j + 1] if a < start + nbytes and start < b)
                    if best is None or (newest, length, start) < best:
                        best = (newest, length, start)
        if best is None:
            return None
        start, end = best[2], best[2] + nbytes
        covered = [s for s in segs if s[0] < end and start < s[1]]
        deps = tuple(sorted({f for _, _, f in covered if f is not None}))
        kept = [s for s in segs if not (s[0] < end and start < s[1])]
        kept += [(a, min(b, start), f) for a, b, f in covered if a < start]
        kept += [(max(a, end), b, f) for a, b, f in covered if b > end]
        self._segments = sorted(kept)
        self.used_bytes += nbytes
        self.high_water_bytes = max(self.high_water_bytes, end)
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
