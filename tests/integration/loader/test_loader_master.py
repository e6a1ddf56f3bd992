"""ShardedDataLoader against a real in-process master (world size 1, and
several ranks as threads of one process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from harness import TOKEN, Running, run_ranks
from torch.utils.data import Dataset

from dlfleet.api.errors import InvalidArgument
from dlfleet.api.v1 import shards_pb2
from dlfleet.worker.loader import LoaderEnvironment, ShardedDataLoader, streams

pytestmark = pytest.mark.integration


class Records(Dataset[int]):
    """Record i is the integer i."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def env(running: Running, round_: int = 1, rank: int = 0, world: int = 1) -> LoaderEnvironment:
    return LoaderEnvironment(
        master=running.address, token=TOKEN, round=round_, node_id="n0", rank=rank, world_size=world
    )


def records(batches: list[torch.Tensor]) -> list[int]:
    return [int(x) for b in batches for x in b]


def test_one_epoch_yields_every_record_once_then_the_dataset_ends(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    with ShardedDataLoader(Records(23), 4, environment=env(running), shard_size=6) as loader:
        batches = list(loader)
        assert sorted(records(batches)) == list(range(23))
        assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 3]
        assert len(loader) == len(batches)
        assert list(loader) == []  # epochs=1: END_OF_DATASET ends iteration
    status = running.client.dataset_status(loader.name)
    assert status.finished


def test_two_epochs_differ_in_order_and_each_covers_the_dataset(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    with ShardedDataLoader(Records(20), 3, epochs=2, seed=7, environment=env(running)) as loader:
        first, second = records(list(loader)), records(list(loader))
        assert list(loader) == []
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != second


def test_worker_processes_and_persistent_workers_keep_working(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    loader = ShardedDataLoader(
        Records(30), 4, epochs=2, num_workers=2, persistent_workers=True,
        environment=env(running),
    )  # fmt: skip
    with loader:
        epochs = [records(list(loader)), records(list(loader))]
    assert [sorted(e) for e in epochs] == [list(range(30))] * 2


def test_ranks_of_a_round_see_the_same_steps_and_split_the_records(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    world = 3
    seen: dict[int, list[list[int]]] = {}
    # Every step ends in a barrier, like DDP's all-reduce: a rank with one
    # batch more or less than the others breaks it.
    step = threading.Barrier(world, timeout=30)

    def rank_main(rank: int) -> None:
        loader = ShardedDataLoader(
            Records(31), 2, epochs=2, shard_size=5, environment=env(running, rank=rank, world=world)
        )
        with loader:
            seen[rank] = []
            for _ in range(2):
                epoch: list[int] = []
                for batch in loader:
                    epoch += [int(x) for x in batch]
                    step.wait()
                seen[rank].append(epoch)
            assert list(loader) == []

    run_ranks(world, rank_main)
    for epoch in range(2):
        union = [x for r in range(world) for x in seen[r][epoch]]
        assert sorted(union) == list(range(31))


def test_state_dict_mid_epoch_then_restore_in_a_new_round_replays_only_untrained_records(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    trained: list[int] = []
    first = ShardedDataLoader(Records(40), 3, shard_size=7, environment=env(running, round_=1))
    with first:
        for step, batch in enumerate(first):
            trained += [int(x) for x in batch]  # the step
            if step == 4:
                state = first.state_dict()  # checkpoint after step 4
                break
        # Trained after the checkpoint, then lost with the process:
        trained_after = [int(x) for x in next(iter(first))]
    assert len(trained) == 15 and len(trained_after) == 3
    second = ShardedDataLoader(Records(40), 3, shard_size=7, environment=env(running, round_=2))
    with second:
        second.load_state_dict(state)
        rest = records(list(second))
        assert list(second) == []
    assert sorted(trained + rest) == list(range(40))


def test_load_state_dict_after_iterating_is_refused(start_master: Callable[..., Running]) -> None:
    running = start_master()
    with ShardedDataLoader(Records(10), 2, environment=env(running)) as loader:
        state = loader.state_dict()
        next(iter(loader))
        with pytest.raises(InvalidArgument, match="before iterating"):
            loader.load_state_dict(state)


def test_async_ranks_take_whole_shards_and_cover_the_epoch(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    seen: dict[int, list[int]] = {}

    def rank_main(rank: int) -> None:
        loader = ShardedDataLoader(
            Records(50), 4, shard_size=8, mode="async", name="evalset",
            environment=env(running, rank=rank, world=2),
        )  # fmt: skip
        with loader:
            seen[rank] = records(list(loader))

    run_ranks(2, rank_main)
    assert sorted(seen[0] + seen[1]) == list(range(50))
    assert running.client.dataset_status("evalset").finished


def test_breaking_out_of_an_epoch_and_iterating_again_loses_and_repeats_nothing(
    start_master: Callable[..., Running],
) -> None:
    running = start_master()
    loader = ShardedDataLoader(Records(30), 2, num_workers=2, environment=env(running))
    seen: list[int] = []
    with loader:
        for step, batch in enumerate(loader):
            seen += [int(x) for x in batch]
            if step == 3:
                break
        seen += records(list(loader))
        assert list(loader) == []
    assert sorted(seen) == list(range(30))


def test_the_package_root_exports_the_loader() -> None:
    import dlfleet

    assert dlfleet.ShardedDataLoader is ShardedDataLoader


def test_the_jobs_records_done_move_with_training_within_a_run_of_leased_shards(
    start_master: Callable[..., Running],
) -> None:
    """The whole epoch is leased in one request (4 shards), so no ack goes
    up before the epoch ends; the master still hears, every second, how far
    rank 0 has trained, and its status counts it."""
    running = start_master()

    def records_done() -> int:
        (dataset,) = running.client.master_status().datasets
        return int(dataset.records_done)

    with ShardedDataLoader(Records(400), 4, environment=env(running), shard_size=100) as loader:
        batches = iter(loader)
        for _ in range(30):
            next(batches)  # the 30th in hand: 29 batches trained
        deadline = time.monotonic() + 5
        while records_done() < 29 * 4:
            assert time.monotonic() < deadline, f"records done stayed at {records_done()}"
            time.sleep(0.1)
        assert records_done() == 29 * 4
        list(batches)
    assert records_done() == 400


def test_a_state_at_an_epochs_last_batch_resumes_in_the_next_epoch(
    start_master: Callable[..., Running],
) -> None:
    """`resumes_in_epoch` tells a framework which epoch the first records
    after a restore come from: the state's own mid-epoch, the next one after
    the epoch's last batch."""
    running = start_master()
    states = []
    first = ShardedDataLoader(Records(12), 3, epochs=2, environment=env(running, round_=1))
    with first:
        for step, _ in enumerate(first):
            if step in (1, 3):  # mid-epoch, and the epoch's last batch
                states.append(first.state_dict())
    for round_, (state, epoch) in enumerate(zip(states, [0, 1], strict=True), start=2):
        again = ShardedDataLoader(Records(12), 3, epochs=2, environment=env(running, round_))
        with again:
            assert again.resumes_in_epoch(state) == epoch
            again.load_state_dict(state)
            rest = [records(list(again)) for _ in range(3)]
            expected = [6, 12, 0] if epoch == 0 else [12, 0, 0]
            assert [len(r) for r in rest] == expected
            assert sorted(rest[expected.index(12)]) == list(range(12))


def test_the_state_a_loader_computes_itself_between_snapshots_is_the_masters(
    start_master: Callable[..., Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save per step does not ask the master for the loader's state each
    time: in between, the loader computes it from the master's last answer.
    Step by step, through an epoch's end and the dataset's, it equals the
    state asked of the master at every step (the same data under two names)."""
    running = start_master()
    book = running.state.book
    asks: list[str] = []  # the datasets of the snapshots the master answered

    def counted(dataset: str, *args: Any) -> Any:
        asks.append(dataset)
        return type(book).snapshot(book, dataset, *args)

    monkeypatch.setattr(book, "snapshot", counted)

    def states(name: str, refresh_s: float) -> list[shards_pb2.DatasetSnapshot]:
        monkeypatch.setattr(streams, "SNAPSHOT_REFRESH_S", refresh_s)
        loader = ShardedDataLoader(
            Records(40), 3, epochs=2, shard_size=7, name=name, environment=env(running)
        )
        with loader:
            saved = [loader.state_dict() for _epoch in range(2) for _ in loader]
        snapshots = [shards_pb2.DatasetSnapshot.FromString(s["snapshot"]) for s in saved]
        for snapshot in snapshots:
            snapshot.dataset = snapshot.spec_digest = ""  # the names differ
        return snapshots

    asked = states("asked", 0.0)  # the master answers every one
    computed = states("computed", 3600.0)  # the master answers the first only
    assert len(asked) == 2 * 14 and asked[13].epoch == 1 and asked[-1].finished
    assert computed == asked
    assert asks.count("asked") == 2 * 14 and asks.count("computed") == 1
