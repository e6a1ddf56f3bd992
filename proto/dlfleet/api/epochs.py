"""How many positions an epoch of a dataset has, and when that is too few.

One rule for every launcher: the master applies it when a dataset is
registered, and `ShardedDataLoader` applies it itself where it has no master
(plain torchrun), so a script that runs one way runs the other, and fails
with the same message where it fails:

- A dataset of no records is refused: an epoch would train nothing.
- A global batch (batch_size x world size) larger than the dataset is one
  short batch per epoch, as torch's DataLoader gives; with drop_last that
  batch is cut, no record would train, and it is refused too.

The global batch is what the master is told (`DatasetSpec.batch_size`).
"""

from __future__ import annotations

from dlfleet.api.errors import InvalidArgument


def require_records(name: str, size: int) -> None:
    if size < 1:
        raise InvalidArgument(
            f"dataset {name!r} has no records (size {size}): an epoch would train nothing"
        )


def cut(size: int, global_batch: int, drop_last: bool) -> int:
    """Positions per epoch: with drop_last, whole global batches only."""
    return size - size % global_batch if drop_last else size


def epoch_length(name: str, size: int, global_batch: int, drop_last: bool) -> int:
    """`cut`, refusing an epoch that would train no record."""
    require_records(name, size)
    length = cut(size, global_batch, drop_last)
    if length < 1:
        raise InvalidArgument(
            f"dataset {name!r} has {size} records, fewer than one global batch of "
            f"{global_batch} (batch_size x world size): with drop_last no record would "
            "train; pass drop_last=False for one short batch per epoch, or a smaller batch_size"
        )
    return length
