"""Positions -> record indices in bulk: the loader's fast path over
`EpochPermutation`.

`EpochPermutation[p]` maps one position at a time in pure Python (a 6-round
Feistel network, cycle-walking back into the dataset): 3-10 us a record, which
at small steps is a visible share of a step (a rank's batch of 32 costs some
250 us at 20,000 records, when the step itself takes 3 ms). The loader maps
aligned blocks of `BLOCK` positions at once instead, with torch: each round's
function, `mix64(right ^ key) & half_mask`, is tabulated once per epoch
(2^half_bits entries a round), and the network runs over the whole block as
tensor gathers, then again over the positions still outside the dataset until
none is left. 0.2-0.5 us a record.

Invariants:
- The result is `EpochPermutation`'s, bit for bit: this module reads its key
  schedule and half width (private attributes, so the check matters), and
  checks the first and last position of every block against
  `EpochPermutation[p]`. A mismatch raises: the loader must never train other
  records than the positions the master handed out.
- Without shuffling a position is its record. With half widths above
  MAX_TABLE_HALF_BITS (datasets of more than 2^32 records: tables too large)
  every position goes through `EpochPermutation[p]`, as before.
- A block is computed once and the last KEEP_BLOCKS are kept: a rank reads its
  positions in increasing order within an epoch, so a block is computed about
  once per epoch per process.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from dlfleet.api.permutation import EpochPermutation, _mix64

BLOCK = 8192
KEEP_BLOCKS = 4
# 6 tables of 2^16 int64 entries: 3 MiB, built in ~0.2 s once per epoch, for
# datasets of up to 2^32 records.
MAX_TABLE_HALF_BITS = 16


class PositionOrder(Protocol):
    """Positions of one epoch -> record indices (what the loader needs)."""

    def ranges(self, runs: Sequence[tuple[int, int]]) -> list[int]: ...


@runtime_checkable
class ReadOrder(PositionOrder, Protocol):
    """An order whose records are read sequentially, block by block (a file
    catalog's): the loader splits a global batch between ranks by where its
    records are read, so that each rank reads about 1/W of the blocks (see
    slicing.py)."""

    def in_read_order(self, runs: Sequence[tuple[int, int]]) -> npt.NDArray[np.int64]: ...


@runtime_checkable
class OrderedDataset(Protocol):
    """A dataset that decides its own epoch order (a file catalog: blocks of
    files instead of single records); any other dataset gets
    `EpochPermutation`. The order must be a bijection of [0, len(dataset)),
    a pure function of (seed, epoch, shuffle)."""

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> PositionOrder: ...


class PositionIndexer:
    """Record indices of positions of one epoch's permutation."""

    def __init__(self, permutation: EpochPermutation) -> None:
        self.permutation = permutation
        self._blocks: OrderedDict[int, list[int]] = OrderedDict()
        self._tables: list[torch.Tensor] | None = None
        # The permutation's internals: its round keys and half width.
        self._half_bits: int = permutation._half_bits
        self._half_mask: int = permutation._half_mask
        self._keys: tuple[int, ...] = permutation._keys
        # Two rounds at a time, below: an even number of rounds.
        self.bulk = (
            permutation.shuffle
            and self._half_bits <= MAX_TABLE_HALF_BITS
            and len(self._keys) % 2 == 0
        )

    def indices(self, positions: Sequence[int]) -> list[int]:
        """Record indices of `positions`, in order."""
        runs: list[tuple[int, int]] = []
        start = end = 0
        for p in positions:
            if p != end or start == end:
                if start < end:
                    runs.append((start, end))
                start = p
            end = p + 1
        if start < end:
            runs.append((start, end))
        return self.ranges(runs)

    def ranges(self, runs: Sequence[tuple[int, int]]) -> list[int]:
        """Record indices of the positions of each run [start, end), in order."""
        perm = self.permutation
        size = perm.size
        if len(runs) == 1 and self.bulk:  # one run within one block: most batches
            start, end = runs[0]
            number, offset = divmod(start, BLOCK)
            if 0 <= start < end <= size and end - start <= BLOCK - offset:
                return self._block(number)[offset : offset + end - start]
        out: list[int] = []
        for start, end in runs:
            if start >= end:
                continue
            if start < 0 or end > size:
                raise IndexError(f"positions [{start}, {end}) outside [0, {size})")
            if not perm.shuffle:
                out.extend(range(start, end))
                continue
            if not self.bulk:
                out.extend(perm[p] for p in range(start, end))
                continue
            at = start
            while at < end:
                number, offset = divmod(at, BLOCK)
                take = min(end - at, BLOCK - offset)
                out.extend(self._block(number)[offset : offset + take])
                at += take
        return out

    def _block(self, number: int) -> list[int]:
        cached = self._blocks.get(number)
        if cached is not None:
            self._blocks.move_to_end(number)
            return cached
        start = number * BLOCK
        end = min(start + BLOCK, self.permutation.size)
        values = self._compute(start, end)
        perm = self.permutation
        if values[0] != perm[start] or values[-1] != perm[end - 1]:
            raise RuntimeError(
                f"bulk indices of positions [{start}, {end}) disagree with EpochPermutation "
                f"(size {perm.size}); the permutation changed under the loader"
            )
        self._blocks[number] = values
        while len(self._blocks) > KEEP_BLOCKS:
            self._blocks.popitem(last=False)
        return values

    def _compute(self, start: int, end: int) -> list[int]:
        # index_select / index_copy_ / masked_select only: advanced indexing
        # (`t[idx]`, `t[mask]`) takes milliseconds per call when torch runs
        # several OpenMP threads on busy cores.
        size = self.permutation.size
        x = self._feistel(torch.arange(start, end, dtype=torch.int64))
        outside = (x >= size).nonzero().squeeze(1)
        while outside.numel():  # cycle-walk, as EpochPermutation does
            walked = self._feistel(x.index_select(0, outside))
            x.index_copy_(0, outside, walked)
            outside = outside.masked_select(walked >= size)
        values: list[int] = x.tolist()
        return values

    def _feistel(self, x: torch.Tensor) -> torch.Tensor:
        tables = self._round_tables()
        left, right = x >> self._half_bits, x & self._half_mask
        # Round i: (left, right) -> (right, left ^ F_i(right)); two rounds at a
        # time keep the halves in their variables.
        for i in range(0, len(tables), 2):
            left = left ^ tables[i].index_select(0, right)
            right = right ^ tables[i + 1].index_select(0, left)
        return (left << self._half_bits) | right

    def _round_tables(self) -> list[torch.Tensor]:
        if self._tables is None:
            mask = self._half_mask
            values = range(1 << self._half_bits)
            self._tables = [
                torch.tensor([_mix64(v ^ key) & mask for v in values], dtype=torch.int64)
                for key in self._keys
            ]
        return self._tables
