"""Sets of integer positions as sorted, disjoint, merged half-open ranges.

A shard's progress is a few ranges, never a list of records: memory grows with
the number of fragments, which merging keeps near the number of shards in
flight.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

Range = tuple[int, int]


class IntervalSet:
    __slots__ = ("_ends", "_starts")
    __hash__ = None  # type: ignore[assignment]  # mutable

    def __init__(self, ranges: Iterable[Range] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in ranges:
            self.add(start, end)

    def add(self, start: int, end: int) -> None:
        """Add [start, end), merging with touching or overlapping ranges."""
        if start >= end:
            return
        i = bisect.bisect_left(self._ends, start)
        j = bisect.bisect_right(self._starts, end)
        if i < j:
            start = min(start, self._starts[i])
            end = max(end, self._ends[j - 1])
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]

    def remove(self, start: int, end: int) -> None:
        """Remove [start, end), splitting ranges as needed."""
        if start >= end:
            return
        i = bisect.bisect_right(self._ends, start)
        j = bisect.bisect_left(self._starts, end)
        if i >= j:
            return
        keep: list[Range] = []
        if self._starts[i] < start:
            keep.append((self._starts[i], start))
        if self._ends[j - 1] > end:
            keep.append((end, self._ends[j - 1]))
        self._starts[i:j] = [s for s, _ in keep]
        self._ends[i:j] = [e for _, e in keep]

    def first(self) -> Range | None:
        return (self._starts[0], self._ends[0]) if self._starts else None

    def covers(self, start: int, end: int) -> bool:
        """True when every position of [start, end) is in the set."""
        if start >= end:
            return True
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def __contains__(self, position: object) -> bool:
        if not isinstance(position, int):
            return False
        i = bisect.bisect_right(self._starts, position) - 1
        return i >= 0 and position < self._ends[i]

    def overlaps(self, start: int, end: int) -> bool:
        if start >= end:
            return False
        i = bisect.bisect_right(self._ends, start)
        return i < len(self._starts) and self._starts[i] < end

    def total(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def complement(self, start: int, end: int) -> IntervalSet:
        """Positions of [start, end) not in the set."""
        gaps = IntervalSet()
        cursor = start
        for s, e in self:
            if e <= cursor:
                continue
            if s >= end:
                break
            gaps.add(cursor, min(s, end))
            cursor = max(cursor, e)
        gaps.add(cursor, end)
        return gaps

    def __iter__(self) -> Iterator[Range]:
        return iter(list(zip(self._starts, self._ends, strict=True)))

    def __len__(self) -> int:
        return len(self._starts)

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IntervalSet) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"IntervalSet({list(self)!r})"
