"""The largest world a step budget is turned into data epochs for
(dlfleet.integrations.common.largest_world)."""

from __future__ import annotations

import pytest

from dlfleet.integrations.common import epochs_for_steps, largest_world


@pytest.mark.parametrize(
    ("nodes", "local", "world", "expected"),
    [
        (None, "2", 4, 4),  # nothing says: the current world
        ("3", "2", 4, 6),  # the master's 3 nodes x 2 processes
        ("1", "2", 4, 4),  # never below the world the job has now
        ("x", "2", 4, 4),  # not a count: ignored
    ],
)
def test_largest_world(
    monkeypatch: pytest.MonkeyPatch, nodes: str | None, local: str, world: int, expected: int
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    if nodes is None:
        monkeypatch.delenv("DLFLEET_MAX_NODES", raising=False)
    else:
        monkeypatch.setenv("DLFLEET_MAX_NODES", nodes)
    assert largest_world(world) == expected


def test_more_ranks_need_more_epochs_for_the_same_steps() -> None:
    assert epochs_for_steps(100, 400, 4, 1) == 1  # 100 steps an epoch
    assert epochs_for_steps(100, 400, 4, 4) == 4  # 25 steps an epoch
