"""Cutting a stream of leased position ranges into global batches, and a global
batch into one batch per rank. Pure: no I/O, no torch, no clock.

The master hands a round (or a rank) position ranges [start, end) of an epoch,
shard after shard. `BatchCutter` concatenates them in the order received and
cuts global batches of `global_batch` positions, carrying a partial global
batch over shard boundaries so that batches stay full. Each rank takes the
slice `[r * n // W, (r + 1) * n // W)` of a global batch of `n` positions, so a
full global batch gives every rank exactly `global_batch / W` records.

Split by block: a dataset read sequentially in blocks (a file catalog,
`indexing.ReadOrder`) would make every rank read every block of the batch's
shuffle window, W times what it trains, if ranks took slices of positions.
For one, the batch's records are first sorted by where they are read (block,
then offset in the block), rank r takes the same slice `[r * n // W,
(r + 1) * n // W)` of that order, a contiguous run of blocks, and
`shuffle_share` permutes it (seeded by `share_key`: seed, epoch, round and
the batch) so that the rank's batch is not block-sorted. The global batch's
records, and each rank's count, are the same either way.

Invariants (checked by tests/unit/loader/test_loader_slicing.py):
- Every position pushed into an epoch is in exactly one global batch, and in
  exactly one rank's slice of it (of positions, or of the read order):
  nothing is lost, nothing is repeated.
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

import numpy as np
import numpy.typing as npt

from dlfleet.api.permutation import _mix64

_MASK64 = (1 << 64) - 1
_SALT_SHARE = 0x5AA2E


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
        segments = self.segments
        if len(segments) == 1:  # most batches: one run of one lease (this runs every step)
            only = segments[0]
            lo, hi = rank_bounds(only.end - only.start, rank, world_size)
            return [(only.start + lo, only.start + hi)] if lo < hi else []
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

    @property
    def first(self) -> int:
        """The batch's first position: with the epoch and round, its name."""
        return self.segments[0].start

    def runs(self) -> list[tuple[int, int]]:
        """All of the batch's positions as runs [start, end), in order."""
        return [(s.start, s.end) for s in self.segments]

    def lease_counts(self) -> list[tuple[int, int]]:
        """(lease id, positions of that lease in this batch), in order."""
        return [(s.lease_id, s.end - s.start) for s in self.segments]


def rank_bounds(size: int, rank: int, world_size: int) -> tuple[int, int]:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    return rank * size // world_size, (rank + 1) * size // world_size


def share_key(seed: int, epoch: int, round_: int, first: int) -> int:
    """The seed of one rank's shuffle of its share of one global batch."""
    key = _SALT_SHARE
    for part in (seed, epoch, round_, first):
        key = _mix64(key ^ (part & _MASK64))
    return key


def shuffle_share(records: npt.NDArray[np.int64], key: int) -> list[int]:
    """`records` in an order that is a pure function of `key` and their
    count: sorted by a splitmix64 hash of (key + index)."""
    if len(records) < 2:
        out: list[int] = records.tolist()
        return out
    # splitmix64 of (key + index), in place: uint64 arithmetic wraps.
    h = np.arange(len(records), dtype=np.uint64)
    h += np.uint64(key)
    h ^= h >> np.uint64(30)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    shuffled: list[int] = records[np.argsort(h)].tolist()
    return shuffled


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
