"""DatasetConfig.create: validates once, names the bad field, fills defaults;
the derived epoch geometry and the spec digest."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.core.datasets import (
    DEFAULT_MAX_SHARD_FAILURES,
    MAX_EPOCHS,
    MAX_NAME_LENGTH,
    MAX_RECORDS,
    MAX_SHARD_FAILURES,
    MAX_SHARDS_PER_EPOCH,
    DatasetConfig,
)

GOOD: dict[str, Any] = {"name": "imagenet", "size": 1000, "batch_size": 10}


def create(**overrides: Any) -> DatasetConfig:
    return DatasetConfig.create(**{**GOOD, **overrides})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"size": 0}, "size"),
        ({"size": -5}, "size"),
        ({"size": MAX_RECORDS + 1, "shard_size": 1 << 30}, "size"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -1}, "batch_size"),
        ({"batch_size": 1001, "drop_last": True}, "batch_size"),
        ({"shard_size": -1}, "shard_size"),
        ({"size": MAX_SHARDS_PER_EPOCH + 1, "batch_size": 1, "shard_size": 1}, "shard_size"),
        ({"epochs": 0}, "epochs"),
        ({"epochs": -1}, "epochs"),
        ({"epochs": MAX_EPOCHS + 1}, "epochs"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 64}, "seed"),
        ({"max_shard_failures": -1}, "max_shard_failures"),
        ({"max_shard_failures": MAX_SHARD_FAILURES + 1}, "max_shard_failures"),
        ({"name": ""}, "name"),
        ({"name": "x" * (MAX_NAME_LENGTH + 1)}, "name"),
        ({"name": "bad\nname"}, "name"),
        ({"name": "tab\there"}, "name"),
        ({"name": "nul\x00"}, "name"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidArgument, match=rf"\b{field}\b"):
        create(**overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        {"size": 1, "batch_size": 1},
        {"batch_size": 1000},
        {"batch_size": 1001},  # one short batch per epoch
        {"size": MAX_SHARDS_PER_EPOCH, "batch_size": 1, "shard_size": 1},
        {"epochs": MAX_EPOCHS},
        {"seed": (1 << 64) - 1},
        {"max_shard_failures": MAX_SHARD_FAILURES},
        {"name": "x" * MAX_NAME_LENGTH},
        {"name": "spaces and ünïcode are fine"},
        {"size": 10**9, "batch_size": 256, "shard_size": 10**4},
    ],
)
def test_limits_themselves_are_accepted(overrides: dict[str, Any]) -> None:
    create(**overrides)


def test_zero_shard_size_defaults_to_sixteen_batches() -> None:
    assert create(shard_size=0).shard_size == 160


def test_default_shard_size_is_capped_at_the_dataset_size() -> None:
    assert create(size=25, batch_size=10).shard_size == 25


def test_explicit_shard_size_is_kept() -> None:
    assert create(shard_size=7).shard_size == 7


def test_zero_max_shard_failures_defaults_to_three() -> None:
    assert DEFAULT_MAX_SHARD_FAILURES == 3
    assert create(max_shard_failures=0).max_shard_failures == 3
    assert create(max_shard_failures=1).max_shard_failures == 1


def test_epoch_length_is_the_size_unless_drop_last_cuts_the_partial_batch() -> None:
    assert create(size=1003, batch_size=10).epoch_length == 1003
    assert create(size=1003, batch_size=10, drop_last=True).epoch_length == 1000
    assert create(size=1000, batch_size=10, drop_last=True).epoch_length == 1000


def test_shards_per_epoch_rounds_up_over_the_epoch_length() -> None:
    assert create(size=100, batch_size=10, shard_size=30).shards_per_epoch == 4
    assert create(size=90, batch_size=10, shard_size=30).shards_per_epoch == 3
    assert create(size=95, batch_size=10, shard_size=30, drop_last=True).shards_per_epoch == 3


def test_the_last_shard_ends_at_the_epoch_length() -> None:
    config = create(size=95, batch_size=10, shard_size=30, drop_last=True)
    assert [config.shard_end(s) for s in range(3)] == [30, 60, 90]
    assert config.shard_of(0) == 0
    assert config.shard_of(59) == 1
    assert config.shard_of(60) == 2


def test_digest_is_stable_for_equal_specs() -> None:
    assert create().digest() == create().digest()
    assert create(shard_size=0).digest() == create(shard_size=160).digest()
    assert len(create().digest()) == 16


@pytest.mark.parametrize(
    "change",
    [
        {"name": "other"},
        {"size": 999},
        {"batch_size": 20},
        {"shard_size": 50},
        {"epochs": 2},
        {"shuffle": False},
        {"seed": 1},
        {"drop_last": True},
        {"max_shard_failures": 4},
    ],
)
def test_digest_differs_for_a_different_spec(change: dict[str, Any]) -> None:
    assert create(**change).digest() != create().digest()


def test_to_dict_and_from_dict_round_trip() -> None:
    config = create(shard_size=33, epochs=5, shuffle=False, seed=(1 << 64) - 1, drop_last=True)
    data = config.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(DatasetConfig)}
    assert DatasetConfig.from_dict(data) == config
    assert DatasetConfig.from_dict(data).digest() == config.digest()


def test_config_is_immutable() -> None:
    config = create()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.size = 5  # type: ignore[misc]
