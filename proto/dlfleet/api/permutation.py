"""The per-epoch permutation of a dataset: a pure function of (seed, epoch).

The master hands out *positions* [start, end) of an epoch; the loader maps each
position to a record index with this permutation. Nothing is materialised: a
keyed Feistel network over the smallest even power of two that covers the
dataset, with cycle-walking back into [0, size), gives a bijection computed in
O(1) memory per position, so a dataset of 10^9 records costs nothing to shuffle.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_ROUNDS = 6


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a fast, well-distributed 64-bit hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


class EpochPermutation:
    """Position -> record index for one epoch. Identity when `shuffle` is off."""

    __slots__ = ("_half_bits", "_half_mask", "_keys", "shuffle", "size")

    def __init__(self, size: int, seed: int, epoch: int, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError(f"permutation size must be >= 1, got {size}")
        self.size = size
        self.shuffle = shuffle
        bits = max(2, (size - 1).bit_length())
        bits += bits & 1
        self._half_bits = bits // 2
        self._half_mask = (1 << self._half_bits) - 1
        base = _mix64((seed & _MASK64) ^ _mix64(epoch + 0x9E3779B97F4A7C15 & _MASK64))
        self._keys = tuple(_mix64(base + r) for r in range(_ROUNDS))

    def _feistel(self, x: int) -> int:
        left, right = x >> self._half_bits, x & self._half_mask
        for key in self._keys:
            left, right = right, left ^ (_mix64(right ^ key) & self._half_mask)
        return (left << self._half_bits) | right

    def __getitem__(self, position: int) -> int:
        if not 0 <= position < self.size:
            raise IndexError(f"position {position} outside [0, {self.size})")
        if not self.shuffle:
            return position
        x = self._feistel(position)
        while x >= self.size:  # cycle-walk: stays a bijection on [0, size)
            x = self._feistel(x)
        return x

    def indices(self, start: int, end: int) -> list[int]:
        """Record indices of positions [start, end)."""
        return [self[p] for p in range(start, end)]
