"""Which datasets ShardedDataLoader takes: map-style ones (indexed, with a
length), since leases name records by index. Anything else is refused at
construction, naming the class and what to use instead, with a master or
without (no I/O happens before the check)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from torch.utils.data import Dataset, IterableDataset

from dlfleet.worker.loader import LoaderEnvironment, ShardedDataLoader

pytestmark = pytest.mark.filterwarnings("ignore:ShardedDataLoader")

ENVIRONMENTS = {
    "no-master": LoaderEnvironment(master=None),
    "master": LoaderEnvironment(master="127.0.0.1:1", token="t", round=1, node_id="n0"),
}


class It(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


class SizedIt(It):
    def __len__(self) -> int:
        return 10


class NoLength(Dataset[int]):
    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("where", ENVIRONMENTS)
@pytest.mark.parametrize("dataset", [It(), SizedIt()], ids=["iterable", "iterable-with-len"])
def test_an_iterable_dataset_is_refused_naming_it_and_what_to_use_instead(
    where: str, dataset: It
) -> None:
    with pytest.raises(TypeError) as refused:
        ShardedDataLoader(dataset, 4, environment=ENVIRONMENTS[where])
    message = str(refused.value)
    assert f"cannot lease {type(dataset).__qualname__}, a torch IterableDataset" in message
    assert "dlfleet.FileCatalog" in message  # streamed files, exactly once
    assert "a map-style Dataset with __len__ and __getitem__" in message


@pytest.mark.parametrize("where", ENVIRONMENTS)
def test_a_dataset_without_a_length_is_refused_naming_it(where: str) -> None:
    with pytest.raises(TypeError, match="cannot lease NoLength, without __len__ and __getitem__"):
        ShardedDataLoader(NoLength(), 4, environment=ENVIRONMENTS[where])


def test_any_indexed_sequence_with_a_length_is_a_dataset() -> None:
    loader = ShardedDataLoader(list(range(5)), 2, environment=ENVIRONMENTS["no-master"])  # type: ignore[arg-type]
    assert sorted(int(x) for batch in loader for x in batch) == [0, 1, 2, 3, 4]
