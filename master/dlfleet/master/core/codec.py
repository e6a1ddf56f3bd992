"""The whole state of a dataset as a JSON-able dict, and back.

Used for journal compaction (a stream's checkpoint is its state at a sequence
number) and by tests to compare two books exactly. `load_dataset(dump_dataset(s))`
equals `s` field by field.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict
from typing import Any

from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.intervals import IntervalSet
from dlfleet.master.core.shards import ConsumerState, DatasetState, FailedRange, Lease


def dump_dataset(ds: DatasetState) -> dict[str, Any]:
    return {
        "config": ds.config.to_dict(),
        "epoch": ds.epoch,
        "round": ds.round,
        "requeued": [list(item) for item in ds.requeued],
        "fresh": [list(r) for r in ds.fresh],
        "done": [list(r) for r in ds.done],
        "doing": [asdict(lease) for lease in sorted(ds.doing.values(), key=_lease_key)],
        "failure_counts": sorted([k, v] for k, v in ds.failure_counts.items()),
        "failed": [asdict(f) for f in ds.failed],
        "done_leases": [list(r) for r in ds.done_leases],
        "prev_done_leases": [list(r) for r in ds.prev_done_leases],
        "positions": sorted([k, kind, value] for k, (kind, value) in ds.positions.items()),
        "next_position": ds.next_position,
        "consumers": {k: asdict(v) for k, v in sorted(ds.consumers.items())},
        "restore_key": ds.restore_key,
        "max_lease_id": ds.max_lease_id,
    }


def load_dataset(data: dict[str, Any]) -> DatasetState:
    return DatasetState(
        config=DatasetConfig.from_dict(data["config"]),
        epoch=data["epoch"],
        round=data["round"],
        requeued=deque((a, b, c) for a, b, c in data["requeued"]),
        fresh=IntervalSet((s, e) for s, e in data["fresh"]),
        done=IntervalSet((s, e) for s, e in data["done"]),
        doing={d["lease_id"]: Lease(**d) for d in data["doing"]},
        failure_counts={k: v for k, v in data["failure_counts"]},
        failed=[FailedRange(**f) for f in data["failed"]],
        done_leases=IntervalSet((s, e) for s, e in data["done_leases"]),
        prev_done_leases=IntervalSet((s, e) for s, e in data["prev_done_leases"]),
        positions={k: (kind, value) for k, kind, value in data["positions"]},
        next_position=data["next_position"],
        consumers={k: ConsumerState(**v) for k, v in data["consumers"].items()},
        restore_key=data["restore_key"],
        max_lease_id=data["max_lease_id"],
    )


def _lease_key(lease: Lease) -> int:
    return lease.lease_id
