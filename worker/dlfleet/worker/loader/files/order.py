"""The order in which a file catalog's records are trained in one epoch: a pure
function of (catalog blocks, seed, epoch), so every rank of every round maps a
leased position to the same record.

Why blocks: the master leases positions [start, end) of an epoch. A
record-level permutation (what `EpochPermutation` gives an indexed dataset)
would send a rank to a random file for every record; streamed data must be
read sequentially. So each file is cut into blocks of `block` records (the
last block of a file may be shorter) and the epoch visits a seeded permutation
of all blocks, of all files, reading each block front to back. A bounded
*shuffle window* then permutes positions within consecutive windows of
`window` positions (seeded by seed, epoch and window number): the
deterministic counterpart of a streaming shuffle buffer of `window` records,
which touches at most window/block + 2 blocks at a time.

Invariants (tests/unit/loader/test_stream_order.py):
- Each epoch's mapping is a bijection of [0, size): composed of a block
  permutation and per-window permutations, each a bijection.
- Without shuffling a position is its record (files in catalog order).
- Memory is O(blocks), never O(records).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

KEEP_WINDOWS = 8
_SALT_BLOCKS = 0xB10C
_SALT_WINDOW = 0x5B0F


class BlockOrder:
    """Position -> record index for one epoch of a file catalog."""

    def __init__(
        self,
        block_starts: npt.NDArray[np.int64],
        block_lengths: npt.NDArray[np.int64],
        seed: int,
        epoch: int,
        shuffle: bool,
        window: int,
    ) -> None:
        self.size = int(block_lengths.sum())
        self.shuffle = shuffle
        self.window = window if shuffle else 0
        self._seed = seed & ((1 << 63) - 1)
        self._epoch = epoch
        if shuffle:
            rng = np.random.default_rng([self._seed, epoch, _SALT_BLOCKS])
            order = rng.permutation(len(block_starts)).astype(np.int64)
        else:
            order = np.arange(len(block_starts), dtype=np.int64)
        self._catalog_starts = block_starts  # in catalog order
        self._visit = np.empty_like(order)  # catalog block -> its turn in this epoch
        self._visit[order] = np.arange(len(order), dtype=np.int64)
        self._starts = block_starts[order]
        lengths = block_lengths[order]
        # Position of each visited block's first record.
        self._positions = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        self._windows: OrderedDict[int, npt.NDArray[np.int64]] = OrderedDict()

    def ranges(self, runs: Sequence[tuple[int, int]]) -> list[int]:
        """Record indices of the positions of each run [start, end), in order
        (the interface of indexing.PositionIndexer)."""
        parts = [np.arange(a, b, dtype=np.int64) for a, b in runs if a < b]
        if not parts:
            return []
        positions = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if positions[0] < 0 or positions.max() >= self.size:
            raise IndexError(f"positions outside [0, {self.size})")
        if self.window > 1:
            positions = self._shuffle_windows(positions)
        visited = np.searchsorted(self._positions, positions, side="right") - 1
        records = self._starts[visited] + (positions - self._positions[visited])
        out: list[int] = records.tolist()
        return out

    def following(self, record: int, count: int) -> list[int]:
        """First records of the `count` blocks visited after the block of
        `record` this epoch (what to prefetch next)."""
        block = int(np.searchsorted(self._catalog_starts, record, side="right")) - 1
        turn = int(self._visit[block])
        out: list[int] = self._starts[turn + 1 : turn + 1 + count].tolist()
        return out

    def _shuffle_windows(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        numbers = positions // self.window
        first, last = int(numbers.min()), int(numbers.max())
        if first == last:  # the common case: a rank's batch within one window
            return first * self.window + self._window(first)[positions - first * self.window]
        out = positions.copy()
        for number in np.unique(numbers).tolist():
            mask = numbers == number
            out[mask] = number * self.window + self._window(number)[positions[mask] % self.window]
        return out

    def _window(self, number: int) -> npt.NDArray[np.int64]:
        perm = self._windows.get(number)
        if perm is None:
            length = min(self.window, self.size - number * self.window)
            rng = np.random.default_rng([self._seed, self._epoch, number, _SALT_WINDOW])
            perm = rng.permutation(length).astype(np.int64)
            self._windows[number] = perm
            while len(self._windows) > KEEP_WINDOWS:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(number)
        return perm
