"""The same rules with a master and without one (plain torchrun): a dataset
too small for its batch, or empty, behaves the same and says the same under
both, because both apply `dlfleet.api.epochs`."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from harness import TOKEN, Running, run_ranks
from integration.loader.loader_ddp_rank import Records

from dlfleet.api.errors import InvalidArgument
from dlfleet.worker.loader import LoaderEnvironment, ShardedDataLoader

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:ShardedDataLoader")]

WHERE = ["no-master", "master"]
EMPTY = "dataset 'records' has no records (size 0): an epoch would train nothing"
DROPPED = (
    "dataset 'records' has 3 records, fewer than one global batch of 4 (batch_size x world "
    "size): with drop_last no record would train; pass drop_last=False for one short batch "
    "per epoch, or a smaller batch_size"
)


@pytest.fixture
def environment(
    request: pytest.FixtureRequest, start_master: Callable[..., Running]
) -> Callable[[int, int], LoaderEnvironment]:
    """(rank, world) -> the environment of a loader with or without a master."""
    if request.param == "no-master":
        return lambda rank, world: LoaderEnvironment(master=None, rank=rank, world_size=world)
    running = start_master()
    return lambda rank, world: LoaderEnvironment(
        running.address, TOKEN, round=1, node_id="n0", rank=rank, world_size=world
    )


def loader(
    environment: Callable[[int, int], LoaderEnvironment],
    size: int,
    batch_size: int,
    *,
    drop_last: bool = False,
    rank: int = 0,
    world: int = 1,
) -> ShardedDataLoader:
    return ShardedDataLoader(
        Records(size),
        batch_size,
        epochs=2,
        drop_last=drop_last,
        name="records",
        environment=environment(rank, world),
    )


def ids(batches: list[torch.Tensor]) -> list[int]:
    return sorted(int(x) for b in batches for x in b)


@pytest.mark.parametrize("environment", WHERE, indirect=True)
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
def test_an_empty_dataset_is_refused_at_construction_saying_so(
    environment: Callable[[int, int], LoaderEnvironment], drop_last: bool
) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(EMPTY)):
        loader(environment, 0, 4, drop_last=drop_last)


@pytest.mark.parametrize("environment", WHERE, indirect=True)
def test_a_batch_larger_than_the_dataset_is_one_short_batch_per_epoch(
    environment: Callable[[int, int], LoaderEnvironment],
) -> None:
    with loader(environment, 3, 4) as one:
        assert len(one) == 1
        epochs = [list(one) for _ in range(3)]
    assert [[len(b) for b in epoch] for epoch in epochs] == [[3], [3], []]
    assert [ids(epoch) for epoch in epochs[:2]] == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("environment", WHERE, indirect=True)
def test_a_global_batch_larger_than_the_dataset_is_split_between_the_ranks(
    environment: Callable[[int, int], LoaderEnvironment],
) -> None:
    """batch 2 x world 2 over 3 records: one step per epoch on every rank."""
    got: dict[int, list[list[torch.Tensor]]] = {}

    def rank_main(rank: int) -> None:
        with loader(environment, 3, 2, rank=rank, world=2) as mine:
            got[rank] = [list(mine) for _ in range(2)]

    run_ranks(2, rank_main)
    for epoch in range(2):
        assert [len(got[rank][epoch]) for rank in (0, 1)] == [1, 1]
        assert ids(got[0][epoch] + got[1][epoch]) == [0, 1, 2]


@pytest.mark.parametrize("environment", WHERE, indirect=True)
def test_drop_last_with_a_batch_larger_than_the_dataset_is_refused_saying_so(
    environment: Callable[[int, int], LoaderEnvironment],
) -> None:
    """Without a master at construction; with one at registration, the first
    iteration (the constructor does no I/O): the same error either way."""
    with (
        pytest.raises(InvalidArgument, match=re.escape(DROPPED)),
        loader(environment, 3, 4, drop_last=True) as dropped,
    ):
        list(dropped)
