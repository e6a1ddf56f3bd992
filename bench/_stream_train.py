"""The training script of the streaming loader benchmark (bench/stream_loader.py).

The same files, model, batch size and step count under both launchers; only
the loader differs:
* `--loader plain` (under torchrun): what users write today, an
  `IterableDataset` that takes the files `files[rank::world]`, visits them in a
  seeded order per epoch, reads each sequentially, and shuffles through a
  seeded buffer of `--shuffle-window` records (`FileStripes`);
* `--loader dlfleet` (under dlworker): `ShardedDataLoader` over a
  `FileCatalog` of the same files (blocks of `--block-size` records in a seeded
  order per epoch, a shuffle window of `--shuffle-window` positions), leasing
  its ranges from the master in sync mode.
Each record is a JSON line {"id", "x": [16 floats], "y"} decoded by
`decode` (json.loads, then a float tensor) in both.

Timing, steps and the result file are bench/_loader_train.py's (`train`,
`result`): rank 0's clock from the end of the warm-up to the last timed step.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from _loader_train import build_model, finish, train
from torch.utils.data import DataLoader, IterableDataset

FEATURES = 16


def decode(record: dict[str, Any]) -> tuple[torch.Tensor, int]:
    return torch.tensor(record["x"], dtype=torch.float32), int(record["y"])


def decode_line(line: bytes) -> tuple[torch.Tensor, int]:
    return decode(json.loads(line))


class FileStripes(IterableDataset[Any]):
    """Files strided by rank, read sequentially, shuffled through a buffer.
    `skip`: records of this rank's stream to pass over first (how such a
    loader resumes: each rank skips what it had consumed, counted in steps).
    `parse`: turns a line into the record yielded (the bench's `decode`)."""

    def __init__(
        self,
        files: list[str],
        rank: int,
        world: int,
        seed: int = 0,
        epoch: int = 0,
        window: int = 0,
        skip: int = 0,
        parse: Any = decode_line,
    ) -> None:
        self.files = files[rank::world]
        self.seed = seed
        self.epoch = epoch
        self.window = window
        self.skip = skip
        self.parse = parse

    def lines(self) -> Iterator[bytes]:
        order = list(self.files)
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        for path in order:
            with open(path, "rb") as f:
                yield from f

    def __iter__(self) -> Iterator[Any]:
        rng = random.Random(self.seed * 7_919 + self.epoch)
        buffer: list[bytes] = []
        skip = self.skip
        for read in self.lines():
            if len(buffer) < self.window:
                buffer.append(read)
                continue
            line = read
            if self.window:
                at = rng.randrange(self.window)
                buffer[at], line = read, buffer[at]
            if skip:
                skip -= 1
                continue
            yield self.parse(line)
        rng.shuffle(buffer)
        for line in buffer[skip:]:
            yield self.parse(line)


def build_loader(args: argparse.Namespace, files: list[str]) -> Any:
    if args.loader == "plain":
        stripes = FileStripes(
            files, dist.get_rank(), dist.get_world_size(), window=args.shuffle_window
        )
        return DataLoader(stripes, batch_size=args.batch_size, num_workers=args.num_workers)
    from dlfleet import FileCatalog, ShardedDataLoader

    catalog = FileCatalog(
        files,
        block_size=args.block_size,
        shuffle_window=args.shuffle_window,
        transform=decode,
        cache_dir=args.cache_dir,
    )
    return ShardedDataLoader(
        catalog,
        args.batch_size,
        shuffle=True,
        seed=0,
        name="stream-bench",
        num_workers=args.num_workers,
        shard_size=args.shard_size,
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--loader", choices=("plain", "dlfleet"), required=True)
    parser.add_argument("--result", required=True, help="rank 0 writes its JSON result here")
    parser.add_argument("--files", nargs="+", required=True)
    parser.add_argument("--cache-dir", required=True, help="the catalog's count cache")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--shuffle-window", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--shard-size", type=int, default=0, help="dlfleet: 0, the default")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    loader = build_loader(args, args.files)
    model = torch.nn.parallel.DistributedDataParallel(build_model(FEATURES, args.hidden))
    return finish(args, loader, model, train(args, loader, model))


if __name__ == "__main__":
    raise SystemExit(main())
