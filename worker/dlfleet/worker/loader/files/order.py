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

Why read positions: a position's *read position* is where its record is read
in the epoch: the visited block's turn, then the record's offset in that
block (the position before the shuffle window moved it). A global batch's
contiguous positions are spread over all of a window's blocks, so a rank
given a slice of positions would read every block of every window: W times
the records it trains. `in_read_order` gives a batch's records sorted by read
position instead (every other window backwards, so that the block a window
boundary cuts falls to the same rank on both sides), so that the loader can
give each rank a contiguous run of them, a contiguous run of blocks (see
slicing.py).

A rank asks for a few dozen positions a step, in increasing order, so the
mapping is composed a window at a time (`SPAN` positions without a window)
and the last `KEEP_SPANS` are kept: a step's positions are then one slice,
not a dozen numpy calls on 32 values (2 us instead of 20 us a batch).

Invariants (tests/unit/loader/test_stream_order.py):
- Each epoch's mapping is a bijection of [0, size): composed of a block
  permutation and per-window permutations, each a bijection.
- Without shuffling a position is its record (files in catalog order).
- `in_read_order(runs)` holds the records of `ranges(runs)`, each once,
  sorted by read position.
- Memory is O(blocks + KEEP_SPANS * window), never O(records).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

KEEP_SPANS = 8
SPAN = 1024
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
        # Positions are mapped a span at a time (a shuffle window, or
        # SPAN positions without one), and the last spans kept: a rank asks
        # for its runs in increasing order, a few dozen positions at a time.
        self._span = self.window if self.window > 1 else SPAN
        # Per span: the records of its positions, and their read keys (see
        # _span_of).
        self._spans: OrderedDict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = (
            OrderedDict()
        )

    def ranges(self, runs: Sequence[tuple[int, int]]) -> list[int]:
        """Record indices of the positions of each run [start, end), in order
        (the interface of indexing.PositionIndexer)."""
        out: list[int] = []
        for number, offset, take in self._pieces(runs):
            out.extend(self._span_of(number)[0][offset : offset + take].tolist())
        return out

    def _pieces(self, runs: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
        """(span number, offset in it, positions) of each run [start, end),
        cut at span boundaries, in order."""
        span = self._span
        for start, end in runs:
            if start >= end:
                continue
            if start < 0 or end > self.size:
                raise IndexError(f"positions [{start}, {end}) outside [0, {self.size})")
            at = start
            while at < end:
                number, offset = divmod(at, span)
                take = min(end - at, span - offset)
                yield number, offset, take
                at += take

    def in_read_order(self, runs: Sequence[tuple[int, int]]) -> npt.NDArray[np.int64]:
        """The records of the positions of each run [start, end), sorted by
        where they are read this epoch: block by block, front to back within
        even shuffle windows and back to front within odd ones."""
        keys: list[npt.NDArray[np.int64]] = []
        records: list[npt.NDArray[np.int64]] = []
        for number, offset, take in self._pieces(runs):
            span_records, span_keys = self._span_of(number)
            keys.append(span_keys[offset : offset + take])
            records.append(span_records[offset : offset + take])
        if not keys:
            return np.empty(0, dtype=np.int64)
        if len(keys) == 1:
            return records[0][np.argsort(keys[0])]
        return np.concatenate(records)[np.argsort(np.concatenate(keys))]

    def following(self, record: int, count: int) -> list[int]:
        """First records of the `count` blocks visited after the block of
        `record` this epoch (what to prefetch next)."""
        block = int(np.searchsorted(self._catalog_starts, record, side="right")) - 1
        turn = int(self._visit[block])
        out: list[int] = self._starts[turn + 1 : turn + 1 + count].tolist()
        return out

    def _span_of(self, number: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Records, and their read keys, of positions [number * span,
        (number + 1) * span): the window's permutation and the block order,
        composed once per window. A read key is the record's read position,
        taken backwards within odd windows: the block a window boundary cuts
        then goes to the same end of the read order, so to the same rank,
        in both windows."""
        cached = self._spans.get(number)
        if cached is not None:
            self._spans.move_to_end(number)
            return cached
        first = number * self._span
        length = min(self._span, self.size - first)
        if self.window > 1:
            rng = np.random.default_rng([self._seed, self._epoch, number, _SALT_WINDOW])
            positions = first + rng.permutation(length).astype(np.int64)
        else:
            positions = np.arange(first, first + length, dtype=np.int64)
        visited = np.searchsorted(self._positions, positions, side="right") - 1
        records = self._starts[visited] + (positions - self._positions[visited])
        backwards = self.window > 1 and number % 2 == 1
        keys = 2 * first + self._span - 1 - positions if backwards else positions
        self._spans[number] = (records, keys)
        while len(self._spans) > KEEP_SPANS:
            self._spans.popitem(last=False)
        return records, keys
