"""How much a rank of a sync round reads of a file catalog: the records of the
blocks it reads, counted in the reader, over the records it trains. Ranks
split each global batch by block (slicing.py), so a rank reads about its own
blocks plus those it shares with its neighbours, not every block of every
shuffle window (W times what it trains, as slices of positions did)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import pytest

from dlfleet.worker.loader import LoaderEnvironment, ShardedDataLoader
from dlfleet.worker.loader.files import FileCatalog, JsonLines
from dlfleet.worker.loader.files.readers import Block

pytestmark = pytest.mark.filterwarnings("ignore:ShardedDataLoader")

# As bench/stream_loader.py: blocks of 256 records, a shuffle window of 4
# blocks, 32 records a rank a step.
BLOCK = 256
WINDOW_BLOCKS = 4
BATCH = 32


class CountingJsonLines(JsonLines):
    """JSON lines, counting the records of every block read."""

    def __init__(self) -> None:
        self.read = 0

    def read_block(
        self, f: IO[bytes], url: str, hints: Sequence[int], block: int, first: int, stop: int
    ) -> Block:
        self.read += stop - first
        return super().read_block(f, url, hints, block, first, stop)


def write_files(root: Path, files: int, records: int) -> list[str]:
    paths = []
    for f in range(files):
        path = root / f"part-{f}.jsonl"
        ids = range(f * records, (f + 1) * records)
        path.write_text("".join(json.dumps({"id": i, "text": "x" * 40}) + "\n" for i in ids))
        paths.append(str(path))
    return paths


def keep_ids(batch: list[Any]) -> list[int]:
    return [int(r["id"]) for r in batch]


def epoch_of_each_rank(paths: list[str], root: Path, world: int) -> list[tuple[float, list[int]]]:
    """(records read / records trained, ids trained) of each rank, in one
    epoch; each rank has a catalog (block cache) of its own, as a process does."""
    out = []
    for rank in range(world):
        reader = CountingJsonLines()
        catalog = FileCatalog(
            paths, reader, block_size=BLOCK, shuffle_window=WINDOW_BLOCKS * BLOCK,
            cache_dir=root / "counts",
        )  # fmt: skip
        loader = ShardedDataLoader(
            catalog, BATCH, seed=5, collate_fn=keep_ids,
            environment=LoaderEnvironment(master=None, rank=rank, world_size=world),
        )  # fmt: skip
        trained = [i for batch in loader for i in batch]
        out.append((reader.read / len(trained), trained))
        catalog.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_reads_about_the_blocks_it_trains_not_every_block_of_the_round(
    tmp_path: Path, world: int
) -> None:
    # Files of 2,000 records: blocks of 256 and a last one of 208, so windows
    # and blocks do not line up.
    paths = write_files(tmp_path, files=4, records=2000)
    ranks = epoch_of_each_rank(paths, tmp_path, world)
    assert sorted(i for _, ids in ranks for i in ids) == list(range(8000))
    amplification = [a for a, _ in ranks]
    # A window's K blocks hold K/W blocks' worth of each rank's records; a
    # rank also reads the block on each side of the cut between its run of
    # the read order and a neighbour's (where the cut falls moves from batch
    # to batch): about 1 + 2 (W - 1) / K a rank on average, and at most
    # 1 + 2 W / K for a rank with two neighbours. Slices of positions read
    # every block of every window: W (2.1 at W=2, 4.2 at W=4).
    mean = sum(amplification) / world
    assert mean <= 1 + 2 * (world - 1) / WINDOW_BLOCKS + 0.1, amplification
    assert max(amplification) <= 1 + 2 * world / WINDOW_BLOCKS + 0.1, amplification
