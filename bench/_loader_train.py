"""The training script of the loader benchmark (bench/loader.py).

The same file under `torchrun` (`--loader plain`: torch's DataLoader over a
DistributedSampler) and under `dlworker` (`--loader dlfleet`: dlfleet's
ShardedDataLoader, which leases its shards from the master in sync mode). Only
the loader differs: same dataset, model, optimizer, batch size, num_workers,
shuffling (on, seed 0) and number of steps.

* dataset: `--records` synthetic records (a fixed random table of
  `--features` floats and a label each, built from seed 0); `__getitem__`
  does `--item-work` rounds of `tanh(x @ W)` with a fixed `features x
  features` matrix, a little CPU work per record, so loading is part of the
  step;
* model: an MLP `features -> hidden -> hidden -> 10`, DDP over gloo, SGD;
* `--warmup` steps, then `--steps` timed steps, per-rank batch
  `--batch-size`, `--num-workers` DataLoader workers per rank.

Rank 0 times the steps: the clock starts when the last warm-up step has
completed and stops when the last timed step has completed (DDP's all-reduce
keeps the ranks in step, so rank 0's clock is the job's). Process start-up,
the process group and the loader's first batches are all in the warm-up. It
writes `--result` (JSON): samples/s, seconds, step and data-wait times, and its
process's CPU time per step. The bench keeps the steps within one epoch: it
measures the loaders' steady state, not their epoch turnover.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

LOADERS = ("plain", "dlfleet")
CLASSES = 10


class SyntheticDataset(Dataset[tuple[torch.Tensor, int]]):
    """A fixed table of records; each read does a little CPU work."""

    def __init__(self, records: int, features: int, item_work: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randn(records, features, generator=generator)
        self.labels = torch.randint(0, CLASSES, (records,), generator=generator).tolist()
        self.mix = torch.randn(features, features, generator=generator) / features**0.5
        self.item_work = item_work

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.data[index]
        for _ in range(self.item_work):
            x = torch.tanh(x @ self.mix)
        return x, self.labels[index]


def build_model(features: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, CLASSES),
    )


def build_loader(args: argparse.Namespace, dataset: SyntheticDataset) -> Any:
    if args.loader == "plain":
        sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True, seed=0)
        return DataLoader(
            dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers
        )
    from dlfleet import ShardedDataLoader

    return ShardedDataLoader(
        dataset,
        args.batch_size,
        shuffle=True,
        seed=0,
        epochs=args.epochs,
        name=f"loader-bench-{args.records}",
        num_workers=args.num_workers,
        shard_size=args.shard_size,
    )


def batches(loader: Any, epochs: int) -> Generator[Any, None, None]:
    """The loader's batches, epoch after epoch (a ShardedDataLoader moves to
    its next epoch when iterated again; a DistributedSampler needs set_epoch)."""
    for epoch in range(epochs):
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        yield from loader


@dataclass
class Timings:
    started: float = 0.0  # end of the last warm-up step
    cpu_started: float = 0.0
    step_ends: list[float] = field(default_factory=list)
    data_waits: list[float] = field(default_factory=list)  # per timed step, seconds
    finished: float = 0.0
    cpu_s: float = 0.0


def train(args: argparse.Namespace, loader: Any, model: torch.nn.Module) -> Timings:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    timings = Timings()
    total = args.warmup + args.steps
    step = 0
    source = batches(loader, args.epochs)
    while step < total:
        asked = time.perf_counter()
        try:
            x, y = next(source)
        except StopIteration:
            break
        got = time.perf_counter()
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        now = time.perf_counter()
        if step == args.warmup:
            timings.started, timings.cpu_started = now, time.process_time()
        elif step > args.warmup:
            timings.step_ends.append(now)
            timings.data_waits.append(got - asked)
    timings.finished = time.perf_counter()
    timings.cpu_s = time.process_time() - timings.cpu_started
    source.close()
    if step != total:
        raise SystemExit(f"rank {dist.get_rank()}: the loader ran out after {step} of {total}")
    return timings


def result(args: argparse.Namespace, world: int, t: Timings) -> dict[str, Any]:
    seconds = t.finished - t.started
    gaps = sorted(b - a for a, b in zip([t.started, *t.step_ends[:-1]], t.step_ends, strict=True))
    waits = sorted(t.data_waits)
    samples = args.steps * args.batch_size * world
    return {
        "loader": args.loader,
        "world_size": world,
        "batch_size": args.batch_size,
        "num_workers": args.num_workers,
        "shard_size": args.shard_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "seconds": seconds,
        "samples": samples,
        "samples_per_s": samples / seconds,
        "step_ms_median": gaps[len(gaps) // 2] * 1000,
        "step_ms_max": gaps[-1] * 1000,
        "data_ms_median": waits[len(waits) // 2] * 1000,
        "data_ms_p90": waits[len(waits) * 9 // 10] * 1000,
        "data_ms_max": waits[-1] * 1000,
        "data_share": sum(waits) / seconds,
        # CPU time of rank 0's process, all its threads, per timed step
        "cpu_ms_per_step": t.cpu_s / args.steps * 1000,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--loader", choices=LOADERS, required=True)
    parser.add_argument("--result", required=True, help="rank 0 writes its JSON result here")
    parser.add_argument("--records", type=int, default=60_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--item-work", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--epochs", type=int, default=1, help="epochs the loader may run")
    parser.add_argument(
        "--shard-size", type=int, default=0, help="dlfleet: records per shard (0: the default)"
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dataset = SyntheticDataset(args.records, args.features, args.item_work)
    loader = build_loader(args, dataset)
    model = torch.nn.parallel.DistributedDataParallel(build_model(args.features, args.hidden))
    timings = train(args, loader, model)
    return finish(args, loader, model, timings)


def finish(args: argparse.Namespace, loader: Any, model: torch.nn.Module, t: Timings) -> int:
    """Rank 0 writes the result; then every rank takes its job down."""
    if dist.get_rank() == 0:
        tmp = f"{args.result}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result(args, dist.get_world_size(), t), f)
        os.replace(tmp, args.result)
    if hasattr(loader, "close"):
        loader.close()
    dist.barrier()
    # DDP's reducer holds the process group: drop it before the group goes.
    del model
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
