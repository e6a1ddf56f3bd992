"""A registered dataset's configuration: validated once, then immutable.

The master's memory must grow with the number of shards, never with the number
of records, so the limits here are on shards and epochs; a dataset of 10^9
records is ordinary.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from dlfleet.api.epochs import cut, epoch_length, require_records
from dlfleet.api.errors import InvalidArgument

MAX_RECORDS = 1 << 48
MAX_SHARDS_PER_EPOCH = 10_000_000
MAX_EPOCHS = 1_000_000
MAX_SHARD_FAILURES = 1_000
MAX_NAME_LENGTH = 200
# A lease per 16 global batches: each lease costs the training processes about
# a millisecond (bench/loader.py), too much every 4 batches of small steps; a
# failure replays at most the unacked part of one shard without a checkpoint.
DEFAULT_BATCHES_PER_SHARD = 16
DEFAULT_MAX_SHARD_FAILURES = 3


@dataclass(frozen=True)
class DatasetConfig:
    name: str
    size: int
    batch_size: int
    shard_size: int
    epochs: int
    shuffle: bool
    seed: int
    drop_last: bool
    max_shard_failures: int

    @classmethod
    def create(
        cls,
        *,
        name: str,
        size: int,
        batch_size: int,
        shard_size: int = 0,
        epochs: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        max_shard_failures: int = 0,
    ) -> DatasetConfig:
        """Validate and fill defaults (0 means default); raise InvalidArgument
        naming the first bad field."""
        if not name or len(name) > MAX_NAME_LENGTH or not name.isprintable():
            raise InvalidArgument(
                f"dataset name must be 1..{MAX_NAME_LENGTH} printable characters, got {name!r}"
            )
        where = f"dataset {name!r}"
        require_records(name, size)
        if size > MAX_RECORDS:
            raise InvalidArgument(f"{where}: size {size} exceeds the limit of {MAX_RECORDS}")
        if batch_size < 1:
            raise InvalidArgument(f"{where}: batch_size must be at least 1, got {batch_size}")
        epoch_length(name, size, batch_size, drop_last)  # the loader's rule without a master
        if shard_size < 0:
            raise InvalidArgument(f"{where}: shard_size must not be negative, got {shard_size}")
        shard_size = shard_size or min(size, batch_size * DEFAULT_BATCHES_PER_SHARD)
        if -(-size // shard_size) > MAX_SHARDS_PER_EPOCH:
            raise InvalidArgument(
                f"{where}: shard_size {shard_size} gives more than {MAX_SHARDS_PER_EPOCH} "
                "shards per epoch; use larger shards"
            )
        if not 1 <= epochs <= MAX_EPOCHS:
            raise InvalidArgument(f"{where}: epochs must be in 1..{MAX_EPOCHS}, got {epochs}")
        if not 0 <= seed < 1 << 64:
            raise InvalidArgument(f"{where}: seed must fit in 64 unsigned bits, got {seed}")
        if max_shard_failures < 0 or max_shard_failures > MAX_SHARD_FAILURES:
            raise InvalidArgument(
                f"{where}: max_shard_failures must be in 0..{MAX_SHARD_FAILURES} "
                f"(0 = default {DEFAULT_MAX_SHARD_FAILURES}), got {max_shard_failures}"
            )
        return cls(
            name=name,
            size=size,
            batch_size=batch_size,
            shard_size=shard_size,
            epochs=epochs,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            max_shard_failures=max_shard_failures or DEFAULT_MAX_SHARD_FAILURES,
        )

    @property
    def epoch_length(self) -> int:
        """Positions per epoch: with drop_last the last partial batch is cut."""
        return cut(self.size, self.batch_size, self.drop_last)

    @property
    def shards_per_epoch(self) -> int:
        return -(-self.epoch_length // self.shard_size)

    def shard_of(self, position: int) -> int:
        return position // self.shard_size

    def shard_end(self, shard: int) -> int:
        return min((shard + 1) * self.shard_size, self.epoch_length)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetConfig:
        return cls(**data)

    def digest(self) -> str:
        """Identifies the spec inside snapshots, so a checkpoint of one dataset
        cannot be restored into another."""
        text = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(text).hexdigest()[:16]
