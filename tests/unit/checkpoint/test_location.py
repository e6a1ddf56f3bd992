"""The persist location check's decision and marker, without a process group
(the collectives run in tests/integration/checkpoint/test_shared_location.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlfleet.worker.checkpoint import location
from dlfleet.worker.checkpoint.checkpointer import Checkpointer
from dlfleet.worker.checkpoint.errors import PersistError, UnsharedLocationError
from dlfleet.worker.checkpoint.location import Sighting, judge

WHERE = "/mnt/ckpt"


def test_every_rank_seeing_the_marker_is_no_error() -> None:
    assert judge(WHERE, [Sighting(r, f"node {r // 2}", True) for r in range(4)]) is None


def test_nodes_that_cannot_see_the_marker_are_named_with_their_ranks_and_the_remedy() -> None:
    sightings = [
        Sighting(0, "node 0 on host a", True),
        Sighting(1, "node 0 on host a", True),
        Sighting(2, "node 1 on host b", False, "no such file"),
        Sighting(3, "node 1 on host b", False, "no such file"),
        Sighting(4, "node 2 on host c", False, "cannot read it: permission denied"),
    ]
    error = judge(WHERE, sightings)
    assert isinstance(error, UnsharedLocationError)
    message = str(error)
    assert f"persist location {WHERE} is not shared by every host" in message
    assert "rank 0 (node 0 on host a) wrote there" in message
    assert "node 1 on host b (ranks 2, 3: no such file)" in message
    assert "node 2 on host c (rank 4: cannot read it: permission denied)" in message
    assert "shared or network file system" in message and "on every host" in message


def test_a_thousand_blind_nodes_make_an_error_of_a_few_lines() -> None:
    sightings = [Sighting(0, "node 0", True)]
    sightings += [Sighting(r, f"node {r}", False, "no such file") for r in range(1, 1001)]
    message = str(judge(WHERE, sightings))
    assert "node 8 (rank 8" in message and "node 9 (" not in message
    assert "and 992 other nodes" in message and len(message) < 1200


def test_rank_0_unable_to_write_the_marker_is_a_persist_error_naming_why() -> None:
    sightings = [
        Sighting(0, "node 0 on host a", False, "[Errno 30] Read-only file system"),
        Sighting(1, "node 1 on host b", False, "rank 0 wrote no marker"),
    ]
    error = judge(WHERE, sightings)
    assert type(error) is PersistError
    assert str(error) == (
        f"rank 0 (node 0 on host a) cannot write to the checkpoint persist location {WHERE}: "
        "[Errno 30] Read-only file system"
    )


def test_a_written_marker_is_seen_in_its_folder_and_not_in_another(tmp_path: Path) -> None:
    token = location.write_marker(tmp_path / "made" / "on demand")
    assert location.look_for_marker(tmp_path / "made" / "on demand", token) == ""
    waited: list[float] = []
    now = [0.0]

    def sleep(seconds: float) -> None:
        waited.append(seconds)
        now[0] += seconds

    why = location.look_for_marker(
        tmp_path / "elsewhere", token, wait_s=0.35, clock=lambda: now[0], sleep=sleep
    )
    assert why == "no such file"
    assert 0.35 <= sum(waited) < 0.5  # looked again for a while, then gave up


def test_a_file_of_the_markers_name_with_other_content_is_not_the_marker(
    tmp_path: Path,
) -> None:
    location.marker_path(tmp_path, "abc").write_text("something else")
    why = location.look_for_marker(tmp_path, "abc", wait_s=0)
    assert why == "a file of that name holds something else"


@pytest.mark.parametrize("persist_every", [0, 1])
def test_a_single_process_saves_without_a_marker_or_an_error(
    tmp_path: Path, persist_every: int
) -> None:
    with Checkpointer(persist_every=persist_every, persist_dir=tmp_path / "disk") as ckpt:
        assert ckpt.load() is None
        ckpt.save(1, {"step": 1})
    assert not list(tmp_path.rglob(f"{location.MARKER_PREFIX}*"))
