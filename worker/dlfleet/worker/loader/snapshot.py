"""The snapshot a sync-mode loader computes itself when the master does not
answer (it restarts: a second or two), so that `state_dict` and with it every
checkpoint go on without waiting for it.

In sync mode every rank of a round holds every lease of the round, in order,
and a lease's trained part is a prefix. The master's snapshot is the epoch's
DONE ranges, plus the trained prefix of every lease in flight, plus the
caller's own progress (`ShardService.snapshot`). So, from the last snapshot
the master gave (asked at some moment), what was trained since is exactly the
leases it confirmed DONE after that moment and the trained prefixes of the
leases held now (`LeaseLedger.trained_since`); nothing else moves the master
while it is away. The result is the master's form: an epoch whose positions
are all trained or failed is given as the start of the next one.

Pure; checked against the master's own snapshot, by properties, in
tests/unit/loader/test_local_snapshot.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from dlfleet.api.v1 import shards_pb2


def merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-adjacent ranges covering exactly the given ones
    (empty ranges dropped)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(s for s in spans if s[0] < s[1]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _covers(ranges: list[tuple[int, int]], length: int) -> bool:
    return length == 0 or (len(ranges) == 1 and ranges[0][0] <= 0 and ranges[0][1] >= length)


def local_snapshot(
    base: shards_pb2.DatasetSnapshot,
    trained: Iterable[tuple[int, int, int]],
    *,
    epoch_length: int,
    epochs: int,
) -> shards_pb2.DatasetSnapshot:
    """`base` with the (epoch, start, end) spans in `trained` added."""
    if base.finished:
        return base
    by_epoch: dict[int, list[tuple[int, int]]] = {}
    for epoch, start, end in trained:
        by_epoch.setdefault(epoch, []).append((start, end))
    failed: dict[int, list[tuple[int, int]]] = {}
    for shard in base.failed:
        failed.setdefault(shard.epoch, []).append((shard.range.start, shard.range.end))
    epoch = base.epoch
    done = merged([*((r.start, r.end) for r in base.done), *by_epoch.get(epoch, ())])
    while epoch < epochs and _covers(merged([*done, *failed.get(epoch, ())]), epoch_length):
        epoch += 1
        done = merged(by_epoch.get(epoch, ()))
    if epoch >= epochs:
        done = []
    return shards_pb2.DatasetSnapshot(
        dataset=base.dataset,
        spec_digest=base.spec_digest,
        epoch=epoch,
        done=[shards_pb2.Range(start=s, end=e) for s, e in done],
        failed=list(base.failed),
        finished=epoch >= epochs,
    )
