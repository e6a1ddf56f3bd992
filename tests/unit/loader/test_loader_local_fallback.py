"""Without DLFLEET_MASTER (plain torchrun): a warning, then rank-based slicing
of each epoch's seeded permutation, with the same lockstep guarantees."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from dlfleet.worker.loader import LoaderEnvironment, ShardedDataLoader


class Records(Dataset[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def local(rank: int = 0, world: int = 1) -> LoaderEnvironment:
    return LoaderEnvironment(master=None, rank=rank, world_size=world)


def flat(batches: list[torch.Tensor]) -> list[int]:
    return [int(x) for b in batches for x in b]


def test_no_master_warns_once_and_falls_back_to_rank_slicing() -> None:
    with pytest.warns(UserWarning, match="DLFLEET_MASTER is unset"):
        loader = ShardedDataLoader(Records(10), 3, environment=local())
    assert sorted(flat(list(loader))) == list(range(10))


@pytest.mark.filterwarnings("ignore:ShardedDataLoader")
@pytest.mark.parametrize(("size", "drop_last"), [(23, False), (21, False), (23, True)])
def test_ranks_get_equal_batch_counts_and_partition_each_epoch(size: int, drop_last: bool) -> None:
    world, batch = 3, 2
    loaders = [
        ShardedDataLoader(
            Records(size),
            batch,
            epochs=2,
            seed=5,
            drop_last=drop_last,
            environment=local(r, world),
        )
        for r in range(world)
    ]
    epochs = [[list(loader) for _ in range(2)] for loader in loaders]
    kept = size - size % (batch * world) if drop_last else size
    for e in range(2):
        assert {len(epochs[r][e]) for r in range(world)} == {len(loaders[0])}
        union = [x for r in range(world) for x in flat(epochs[r][e])]
        assert len(union) == len(set(union)) == kept
    assert flat(epochs[0][0]) != flat(epochs[0][1])  # reshuffled per epoch
    assert all(list(loader) == [] for loader in loaders)  # epochs are done


@pytest.mark.filterwarnings("ignore:ShardedDataLoader")
def test_state_dict_resumes_after_the_last_trained_batch() -> None:
    first = ShardedDataLoader(Records(20), 3, epochs=2, environment=local())
    trained: list[int] = []
    for step, batch in enumerate(first):
        trained += [int(x) for x in batch]
        if step == 2:
            state = first.state_dict()
            break
    second = ShardedDataLoader(Records(20), 3, epochs=2, environment=local())
    second.load_state_dict(state)
    assert sorted(trained + flat(list(second))) == list(range(20))
    assert sorted(flat(list(second))) == list(range(20))  # the second epoch, whole


@pytest.mark.filterwarnings("ignore:ShardedDataLoader")
def test_breaking_out_and_iterating_again_resumes_the_epoch() -> None:
    loader = ShardedDataLoader(Records(20), 2, num_workers=2, environment=local())
    seen: list[int] = []
    for step, batch in enumerate(loader):
        seen += [int(x) for x in batch]
        if step == 3:
            break
    seen += flat(list(loader))
    assert sorted(seen) == list(range(20))
