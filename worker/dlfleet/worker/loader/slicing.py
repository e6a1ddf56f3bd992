"""Cutting a stream of leased position ranges into global batches, and a global
batch into one batch per rank. Pure: no I/O, no torch, no clock.

The master hands a round (or a rank) position ranges [start, end) of an epoch,
shard after shard. `BatchCutter` concatenates them in the order received and
cuts global batches of `global_batch` positions, carrying a partial global
batch over shard boundaries so that batches stay full. Each rank takes the
slice `[r * n // W, (r + 1) * n // W)` of a global batch of `n` positions, so a
full global batch gives every rank exactly `global_batch / W` records.

Invariants (checked by tests/unit/loader/test_loader_slicing.py):
- Every position pushed into an epoch is in exactly one global batch, and in
  exactly one rank's slice of it: nothing is lost, nothing is repeated.
- Every global batch gives every rank one batch, so all ranks yield the same
  number of batches per epoch (a collective can never hang on the data).
- Every global batch is full except the last of the epoch. The tail of an epoch
  is split evenly (sizes differ by at most one); a tail smaller than the world
  size is merged into the preceding full global batch, so that no rank gets an
  empty batch. A rank gets an empty batch only when its round received fewer
  positions of the epoch than there are ranks (possible only after a restore or
  a round change near the end of an epoch).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """A run of consecutive positions of one lease (lease 0: no master)."""

    lease_id: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class GlobalBatch:
    """One training step of the whole round: the positions of `segments`, in
    order, of epoch `epoch`."""

    epoch: int
    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        return sum(s.length for s in self.segments)

    def positions(self) -> Iterator[int]:
        for segment in self.segments:
            yield from range(segment.start, segment.end)

    def rank_positions(self, rank: int, world_size: int) -> list[int]:
        """This rank's slice: [rank * n // W, (rank + 1) * n // W)."""
        out: list[int] = []
        for start, end in self.rank_ranges(rank, world_size):
            out.extend(range(start, end))
        return out

    def rank_ranges(self, rank: int, world_size: int) -> list[tuple[int, int]]:
        """This rank's slice as runs [start, end) of positions, in order."""
        lo, hi = rank_bounds(self.size, rank, world_size)
        out: list[tuple[int, int]] = []
        offset = 0
        for segment in self.segments:
            a, b = max(lo - offset, 0), min(hi - offset, segment.length)
            if a < b:
                out.append((segment.start + a, segment.start + b))
            offset += segment.length
            if offset >= hi:
                break
        return out

    def lease_counts(self) -> list[tuple[int, int]]:
        """(lease id, positions of that lease in this batch), in order."""
        return [(s.lease_id, s.length) for s in self.segments]


def rank_bounds(size: int, rank: int, world_size: int) -> tuple[int, int]:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    return rank * size // world_size, (rank + 1) * size // world_size


def batches_per_epoch(epoch_length: int, global_batch: int, world_size: int) -> int:
    """Batches each rank yields in an epoch of `epoch_length` positions."""
    full, tail = divmod(epoch_length, global_batch)
    if tail == 0 or (0 < tail < world_size and full > 0):
        return full
    return full + 1


class BatchCutter:
    """Cuts one epoch's stream of segments into global batches. A full global
    batch is released only once at least `world_size` more positions are known
    to follow it, or at `finish`, so that a tail smaller than the world can
    still be merged into it."""

    def __init__(self, global_batch: int, world_size: int, epoch: int = 0) -> None:
        if world_size < 1 or global_batch < world_size:
            raise ValueError(
                f"a global batch of {global_batch} cannot be split over {world_size} ranks"
            )
        self.global_batch = global_batch
        self.world_size = world_size
        self.epoch = epoch
        self._pending: list[Segment] = []
        self._buffered = 0

    @property
    def buffered(self) -> int:
        return self._buffered

    def push(self, segment: Segment) -> list[GlobalBatch]:
        if segment.length <= 0:
            return []
        self._pending.append(segment)
        self._buffered += segment.length
        out: list[GlobalBatch] = []
        while self._buffered >= self.global_batch + self.world_size:
            out.append(self._take(self.global_batch))
        return out

    def finish(self) -> list[GlobalBatch]:
        """The end of the epoch: release the tail (at most one batch)."""
        if self._buffered == 0:
            return []
        return [self._take(self._buffered)]

    def _take(self, count: int) -> GlobalBatch:
        taken: list[Segment] = []
        while count > 0:
            head = self._pending[0]
            if head.length <= count:
                taken.append(self._pending.pop(0))
                count -= head.length
                self._buffered -= head.length
            else:
                taken.append(Segment(head.lease_id, head.start, head.start + count))
                self._pending[0] = Segment(head.lease_id, head.start + count, head.end)
                self._buffered -= count
                count = 0
        return GlobalBatch(self.epoch, tuple(taken))
