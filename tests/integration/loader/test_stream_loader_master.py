"""ShardedDataLoader over a FileCatalog of real files, against a real
in-process master (gRPC on 127.0.0.1:0): ranks are threads of one process that
end every step in a barrier, as DDP's all-reduce would. For random catalogs,
shard sizes and world-size histories in which each round is killed after
a checkpoint, every record of every epoch is trained exactly once."""

from __future__ import annotations

import itertools
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import TOKEN, Running, run_ranks
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from stream_files import record_id, write_catalog

from dlfleet.api.errors import InvalidArgument
from dlfleet.worker.loader import LoaderEnvironment, ShardedDataLoader
from dlfleet.worker.loader.files import FileCatalog

pytestmark = pytest.mark.integration

_names = itertools.count()
_shared: dict[int, Running] = {}


def env(running: Running, round_: int, rank: int = 0, world: int = 1) -> LoaderEnvironment:
    return LoaderEnvironment(
        master=running.address, token=TOKEN, round=round_, node_id=f"n{rank}", rank=rank,
        world_size=world,
    )  # fmt: skip


def ids_of(batch: Any) -> list[int]:
    return [record_id(r) for r in batch]


def keep_records(batch: list[Any]) -> list[Any]:
    """collate_fn: the records as they are (dicts, samples, arrays)."""
    return batch


class Job:
    """Rounds of one dataset: each trains, checkpoints (rank 0's state_dict)
    after `keep` steps, trains `lost` more steps and is killed; the steps
    after the checkpoint are rolled back, as a restore would."""

    def __init__(self, running: Running, catalog: FileCatalog, **loader: Any) -> None:
        self.running = running
        self.catalog = catalog
        self.loader = loader
        self.name = f"stream-{next(_names)}"
        self.round = 0
        self.state: dict[str, Any] | None = None
        self.kept: dict[int, list[int]] = {}  # epoch -> records trained for good
        self.ended = False

    def run_round(self, world: int, keep: int | None, lost: int) -> None:
        self.round += 1
        steps: dict[int, list[tuple[int, list[int]]]] = {}
        barrier = threading.Barrier(world, timeout=30)
        checkpoint: list[dict[str, Any]] = []
        epochs = int(self.loader.get("epochs", 1))

        def rank_main(rank: int) -> None:
            loader = ShardedDataLoader(
                self.catalog, name=self.name, collate_fn=keep_records,
                environment=env(self.running, self.round, rank, world), **self.loader,
            )  # fmt: skip
            steps[rank] = []
            with loader:
                if self.state is not None:
                    loader.load_state_dict(self.state)
                for _ in range(epochs + 1):
                    for batch in loader:
                        steps[rank].append((loader.epoch, ids_of(batch)))
                        barrier.wait()  # the step's all-reduce
                        if keep is not None and len(steps[rank]) == keep:
                            if rank == 0:
                                checkpoint.append(loader.state_dict())
                            barrier.wait()
                        if keep is not None and len(steps[rank]) == keep + lost:
                            return  # killed

        run_ranks(world, rank_main)
        counts = {len(s) for s in steps.values()}
        assert len(counts) == 1, f"ranks ran different numbers of steps: {counts}"
        killed = keep is not None and checkpoint and counts.pop() == keep + lost
        for rank_steps in steps.values():
            for epoch, ids in rank_steps[:keep] if killed else rank_steps:
                self.kept.setdefault(epoch, []).extend(ids)
        if killed:
            self.state = checkpoint[0]
        else:
            self.ended = True

    def assert_exactly_once(self, ids: list[int], epochs: int) -> None:
        assert self.ended
        assert sorted(self.kept) == list(range(epochs))
        for epoch in range(epochs):
            assert sorted(self.kept[epoch]) == ids, f"epoch {epoch}"


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    # At least the largest global batch (3 ranks x 3): the master's rule.
    counts=st.lists(st.integers(0, 30), min_size=1, max_size=5).filter(lambda c: sum(c) >= 9),
    formats=st.lists(st.sampled_from(("jsonl", "parquet", "tar")), min_size=1, max_size=3),
    block=st.integers(1, 8),
    batch=st.integers(1, 3),
    shard=st.integers(1, 12),
    epochs=st.integers(1, 2),
    history=st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(0, 3)), max_size=3
    ),
    last_world=st.integers(1, 3),
)
def test_random_catalogs_and_world_histories_with_kills_train_every_record_once(
    start_master: Callable[..., Running],
    counts: list[int],
    formats: list[str],
    block: int,
    batch: int,
    shard: int,
    epochs: int,
    history: list[tuple[int, int, int]],
    last_world: int,
) -> None:
    # One master for all examples (each example is a dataset of its own).
    running = _shared.get(id(start_master)) or _shared.setdefault(id(start_master), start_master())
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        paths, ids = write_catalog(root, counts, formats)
        catalog = FileCatalog(
            [str(p) for p in paths], cache_dir=root / "cache", block_size=block,
            shuffle_window=2 * block,
        )  # fmt: skip
        job = Job(running, catalog, batch_size=batch, shard_size=shard, epochs=epochs, seed=11)
        for world, keep, lost in history:
            job.run_round(world, keep, lost)
            if job.ended:
                break
        if not job.ended:
            job.run_round(last_world, None, 0)
        event(f"rounds: {job.round}")
        job.assert_exactly_once(ids, epochs)
        catalog.close()


def test_dataloader_workers_split_the_leased_batches_of_a_catalog(
    start_master: Callable[..., Running], tmp_path: Path
) -> None:
    running = start_master()
    paths, ids = write_catalog(tmp_path, [17, 9, 12], ["parquet", "tar", "jsonl"])
    catalog = FileCatalog([str(p) for p in paths], cache_dir=tmp_path / "c", block_size=4)
    loader = ShardedDataLoader(
        catalog, 3, epochs=2, num_workers=2, persistent_workers=True,
        collate_fn=keep_records, environment=env(running, 1),
    )  # fmt: skip
    with loader:
        epochs = [[i for b in loader for i in ids_of(b)] for _ in range(2)]
    assert [sorted(e) for e in epochs] == [ids, ids]
    assert epochs[0] != epochs[1]  # another block order each epoch


def test_async_ranks_lease_catalog_ranges_for_themselves(
    start_master: Callable[..., Running], tmp_path: Path
) -> None:
    running = start_master()
    paths, ids = write_catalog(tmp_path, [20, 15], ["jsonl", "tar"])
    catalog = FileCatalog([str(p) for p in paths], cache_dir=tmp_path / "c", block_size=5)
    seen: dict[int, list[int]] = {}

    def rank_main(rank: int) -> None:
        loader = ShardedDataLoader(
            catalog, 4, shard_size=6, mode="async", name="stream-async",
            collate_fn=keep_records, environment=env(running, 0, rank, 2),
        )  # fmt: skip
        with loader:
            seen[rank] = [i for b in loader for i in ids_of(b)]

    run_ranks(2, rank_main)
    assert sorted(seen[0] + seen[1]) == ids
    assert running.client.dataset_status("stream-async").finished


@pytest.mark.filterwarnings("ignore:ShardedDataLoader")
def test_under_plain_torchrun_a_catalog_is_strided_by_rank(tmp_path: Path) -> None:
    paths, ids = write_catalog(tmp_path, [13, 8], ["jsonl"])
    catalog = FileCatalog([str(p) for p in paths], cache_dir=tmp_path / "c", block_size=3)
    union: list[int] = []
    lengths = set()
    for rank in range(2):
        local = LoaderEnvironment(master=None, rank=rank, world_size=2)
        with pytest.warns(UserWarning, match="DLFLEET_MASTER is unset"):
            loader = ShardedDataLoader(catalog, 2, collate_fn=keep_records, environment=local)
        batches = list(loader)
        lengths.add(len(batches))
        union += [i for b in batches for i in ids_of(b)]
    assert sorted(union) == ids and len(lengths) == 1


def test_a_state_of_a_catalog_whose_files_changed_is_refused(
    start_master: Callable[..., Running], tmp_path: Path
) -> None:
    running = start_master()
    paths, _ = write_catalog(tmp_path, [12, 9], ["jsonl"])
    files = [str(p) for p in paths]
    before = FileCatalog(files, cache_dir=tmp_path / "c")
    with ShardedDataLoader(before, 2, collate_fn=keep_records, environment=env(running, 1)) as a:
        next(iter(a))
        state = a.state_dict()
    write_catalog(tmp_path, [12, 10], ["jsonl"])  # a record appended to the second file
    after = FileCatalog(files, cache_dir=tmp_path / "c")
    b = ShardedDataLoader(after, 2, collate_fn=keep_records, environment=env(running, 2))
    with b, pytest.raises(InvalidArgument, match="the state is of dataset 'FileCatalog-"):
        b.load_state_dict(state)
