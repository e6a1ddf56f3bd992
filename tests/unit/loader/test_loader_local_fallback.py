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


@pytest.mark.filterwarnings("ignore:ShardedDataLoader")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pad_empty_gives_a_rank_without_records_one_of_another_ranks_marked_padding(
    num_workers: int,
) -> None:
    # An epoch of 2 records and 3 ranks (as a round that resumes an epoch
    # with 2 records left): one rank has none of the one global batch.
    world = 3
    loaders = [
        ShardedDataLoader(
            Records(2),
            1,
            pad_empty=True,
            num_workers=num_workers,
            environment=local(r, world),
        )
        for r in range(world)
    ]
    seen: list[list[tuple[list[int], bool]]] = []
    for loader in loaders:
        seen.append([(flat([batch]), loader.padding) for batch in loader])
    assert [len(s) for s in seen] == [1, 1, 1]  # lockstep kept
    trained = [x for s in seen for batch, padding in s if not padding for x in batch]
    assert sorted(trained) == list(range(2))  # each record once, padding aside
    padded = [(r, batch) for r, s in enumerate(seen) for batch, padding in s if padding]
    assert len(padded) == 1
    rank, batch = padded[0]
    assert len(batch) == 1
    # the stand-in is a record that another rank trains in the same step
    others = [x for r in range(world) if r != rank for x in seen[r][0][0]]
    assert batch[0] in others


@pytest.mark.filterwarnings("ignore:ShardedDataLoader")
def test_without_pad_empty_a_rank_without_records_gets_an_empty_list() -> None:
    loader = ShardedDataLoader(Records(2), 1, environment=local(0, 3))
    batches = [(batch, loader.padding) for batch in loader]
    assert batches == [([], False)]


def test_zero_weight_keeps_the_loss_and_sends_no_gradient() -> None:
    from dlfleet import zero_weight

    weight = torch.nn.Parameter(torch.ones(3))
    loss = zero_weight((weight * 2.0).sum())
    assert loss.item() == 6.0
    loss.backward()
    assert weight.grad is not None and weight.grad.abs().sum().item() == 0.0


@pytest.mark.filterwarnings("ignore:ShardedDataLoader")
def test_a_state_after_an_epochs_last_batch_resumes_with_the_next_epoch() -> None:
    first = ShardedDataLoader(Records(12), 3, epochs=2, environment=local())
    for step, _ in enumerate(first):
        if step == 3:  # the epoch's last batch
            state = first.state_dict()
    again = ShardedDataLoader(Records(12), 3, epochs=2, environment=local())
    assert again.resumes_in_epoch(state) == 1
    again.load_state_dict(state)
    assert sorted(flat(list(again))) == list(range(12))  # epoch 1 at once, whole
    assert list(again) == []


@pytest.mark.filterwarnings("ignore:ShardedDataLoader")
def test_a_renewed_loader_serves_the_world_it_is_in_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made in a world of one, renewed once the process is rank 1 of 2 (a
    restart in place sets the new round's variables): the same object now
    serves rank 1's slice of each batch, with the arguments it was made with."""
    for name in ("DLFLEET_MASTER", "DLFLEET_ROUND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    loader = ShardedDataLoader(Records(10), 2, shuffle=False, epochs=2)
    assert flat(list(loader)) == list(range(10))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader.renew()
    assert (loader.global_batch, loader.epochs) == (4, 2)
    twin = ShardedDataLoader(Records(10), 2, environment=local(1, 2), shuffle=False, epochs=2)
    assert flat(list(loader)) == flat(list(twin)) != []
