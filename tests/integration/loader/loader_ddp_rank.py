"""One rank of a real gloo process group reading through a ShardedDataLoader;
run as a subprocess by test_loader_process_group.py. Every step all-reduces,
so a rank with a batch more than the others would hang (and time out).

argv: output file, dataset size, per-rank batch size, epochs."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from dlfleet.worker.loader import ShardedDataLoader


class Records(Dataset[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def main() -> None:
    out, size, batch_size, epochs = sys.argv[1], *map(int, sys.argv[2:5])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    seen: list[list[int]] = []
    steps: list[int] = []
    with ShardedDataLoader(
        Records(size), batch_size, epochs=epochs, shard_size=5, name="ddp-records"
    ) as loader:
        for _ in range(epochs):
            records: list[int] = []
            count = 0
            for batch in loader:
                records += [int(x) for x in batch]
                total = torch.tensor([len(batch)])
                dist.all_reduce(total)  # the step's collective
                count += 1
            seen.append(records)
            steps.append(count)
        assert list(loader) == []
        expected = len(loader)
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"seen": seen, "steps": steps, "len": expected}, f)


if __name__ == "__main__":
    main()
