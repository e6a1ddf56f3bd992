"""Persisting images as torch.distributed.checkpoint folders, readable by plain DCP."""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from unit.checkpoint.states import assert_same, sharded_images, template_like, training_state

from dlfleet.worker.checkpoint import presence
from dlfleet.worker.checkpoint.errors import (
    ImageChangedError,
    PersistError,
    PersistTimeoutError,
    TemplateRequiredError,
)
from dlfleet.worker.checkpoint.files import REPLICAS
from dlfleet.worker.checkpoint.image import ImageSource, ImageWriter, LocalImage
from dlfleet.worker.checkpoint.persist import (
    MANIFEST,
    METADATA,
    SHARDED,
    Absent,
    finish,
    finish_newest,
    load_persisted,
    load_persisted_full,
    missing_parts,
    newest_persisted,
    node_stand_in,
    partial_folder,
    persist,
    prune,
    step_folder,
    verify_folder,
    write_part,
)
from dlfleet.worker.checkpoint.structure import SKELETON_KEY


def image_of(directory: Path, state: dict[str, Any], step: int = 1) -> LocalImage:
    with ImageWriter(directory, rank=0) as writer:
        saved = writer.write(step, state, round=0, world_size=1, protect=None)
    return LocalImage(saved.header_path)


def test_a_persisted_image_loads_with_plain_dcp_load(tmp_path: Path) -> None:
    state = training_state(0)
    folder = persist(image_of(tmp_path / "shm", state), tmp_path / "disk")
    assert folder == step_folder(tmp_path / "disk", 1) and (folder / METADATA).is_file()
    template = template_like(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is unavailable ...": on purpose
        dcp_load(template, checkpoint_id=folder)
    assert_same(template, state)


def test_a_persisted_image_converts_with_dcp_to_torch_save(tmp_path: Path) -> None:
    state = training_state(0)
    folder = persist(image_of(tmp_path / "shm", state), tmp_path / "disk")
    dcp_to_torch_save(folder, tmp_path / "full.pt")
    converted = torch.load(tmp_path / "full.pt", weights_only=False)
    # The skeleton travels as one more (string) value: the saved shape, for
    # restores without a template.
    assert isinstance(converted.pop(SKELETON_KEY), str)
    assert_same(converted, state)


def test_load_persisted_fills_a_template_and_load_persisted_full_needs_none(
    tmp_path: Path,
) -> None:
    state = training_state(0)
    folder = persist(image_of(tmp_path / "shm", state), tmp_path / "disk")
    template = template_like(state)
    load_persisted(template, folder)
    assert_same(template, state)
    assert_same(load_persisted_full(folder), state)


def test_a_folder_is_complete_only_once_every_rank_wrote_its_part(tmp_path: Path) -> None:
    full = torch.arange(12.0).reshape(4, 3)
    rank0, rank1 = sharded_images(tmp_path, full, 2)
    root = tmp_path / "disk"
    write_part(rank0, root)
    assert newest_persisted(root) is None
    persist(rank1, root)  # rank 1 does not finish
    assert newest_persisted(root) is None
    folder = finish(step_folder(root, 1), world_size=2, round=4, timeout=1.0)
    assert newest_persisted(root) == (1, folder)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [MANIFEST, SHARDED, METADATA, "__0_0.distcp", "__1_0.distcp"]
    assert not partial_folder(folder).exists()
    template: dict[str, Any] = {"w": torch.zeros(4, 3), "n": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(template, checkpoint_id=folder)
    assert torch.equal(template["w"], full) and template["n"] == 5


def test_the_finishing_rank_gives_up_naming_the_missing_ranks(tmp_path: Path) -> None:
    rank0, _ = sharded_images(tmp_path, torch.ones(4, 3), 2)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    folder = write_part(rank0, tmp_path / "disk")
    with pytest.raises(PersistTimeoutError, match=r"ranks \[1\] of round 4"):
        finish(folder, world_size=2, round=4, timeout=5.0, clock=lambda: now[0], sleep=sleep)
    assert not (folder / METADATA).exists()
    assert now[0] >= 5.0


def test_a_part_of_another_round_does_not_count(tmp_path: Path) -> None:
    rank0, rank1 = sharded_images(tmp_path, torch.ones(4, 3), 2)
    folder = write_part(rank0, tmp_path / "disk")
    write_part(rank1, tmp_path / "disk")
    with pytest.raises(PersistTimeoutError, match=r"ranks \[0, 1\] of round 5"):
        finish(folder, world_size=2, round=5, timeout=0.0)


def test_missing_parts_names_the_ranks_still_to_write_then_none(tmp_path: Path) -> None:
    rank0, rank1 = sharded_images(tmp_path, torch.ones(4, 3), 2)
    folder = write_part(rank0, tmp_path / "disk")
    assert missing_parts(folder, world_size=2, round=4) == [1]
    assert missing_parts(folder, world_size=2, round=5) == [0, 1]  # another round's parts
    write_part(rank1, tmp_path / "disk")
    assert missing_parts(folder, world_size=2, round=4) == []
    finish(folder, world_size=2, round=4, timeout=0.0)
    assert missing_parts(folder, world_size=2, round=4) == []  # complete


def test_two_finishes_of_one_folder_at_once_both_find_it_complete(tmp_path: Path) -> None:
    """A rank 0's persister and its SIGTERM handler may finish the same step
    together: neither fails, and the folder is whole."""
    full = torch.arange(12.0).reshape(4, 3)
    rank0, rank1 = sharded_images(tmp_path, full, 2)
    for attempt in range(20):
        root = tmp_path / f"disk{attempt}"
        folder = write_part(rank0, root)
        write_part(rank1, root)
        together = threading.Barrier(2)

        def finish_it(
            use_newest: bool, folder: Path = folder, together: threading.Barrier = together
        ) -> Path | None:
            together.wait()
            if use_newest:  # as on SIGTERM
                return finish_newest([(folder, 2, 4)], timeout=1.0)
            return finish(folder, world_size=2, round=4, timeout=1.0)

        with ThreadPoolExecutor(2) as pool:
            done = list(pool.map(finish_it, [False, True]))
        assert done == [folder, folder]
        verify_folder(folder)
        assert sorted(p.name for p in root.iterdir()) == [folder.name]  # no .partial left


def test_a_missing_part_is_written_from_the_image_a_stand_in_gives(tmp_path: Path) -> None:
    """Rank 1 is gone; its image is at hand: the folder is finished at once."""
    full = torch.arange(12.0).reshape(4, 3)
    rank0, rank1 = sharded_images(tmp_path, full, 2)
    folder = write_part(rank0, tmp_path / "disk")
    asked: list[tuple[int, int, int]] = []

    def stand_in(step: int, round: int, rank: int) -> ImageSource | Absent:
        asked.append((step, round, rank))
        return rank1

    assert finish_newest([(folder, 2, 4)], timeout=0.0, stand_in=stand_in) == folder
    assert asked == [(1, 4, 1)]
    verify_folder(folder)
    template: dict[str, Any] = {"w": torch.zeros(4, 3), "n": 0}
    load_persisted(template, folder)
    assert torch.equal(template["w"], full)


def test_a_part_that_will_never_come_is_not_waited_for(tmp_path: Path) -> None:
    """Step 2 lacks rank 1's part, which will never come (its rank is gone
    without an image of step 2): step 1, whole, is finished at once, without
    waiting out the timeout for step 2."""
    root = tmp_path / "disk"
    older = sharded_images(tmp_path / "one", torch.ones(4, 3), 2)
    for image in older:
        write_part(image, root)
    with ImageWriter(tmp_path / "two", rank=0) as writer:
        saved = writer.write(2, {"n": 2}, round=4, world_size=2, protect=None)
    newer = write_part(LocalImage(saved.header_path), root)
    slept: list[float] = []

    def stand_in(step: int, round: int, rank: int) -> ImageSource | Absent:
        return Absent.NEVER if step == 2 else Absent.COMING

    folders = [(newer, 2, 4), (step_folder(root, 1), 2, 4)]
    done = finish_newest(folders, timeout=60.0, sleep=slept.append, stand_in=stand_in)
    assert done == step_folder(root, 1) and slept == []
    assert not (newer / METADATA).exists()
    alone = finish_newest([(newer, 2, 4)], timeout=60.0, sleep=slept.append, stand_in=stand_in)
    assert alone is None and slept == []


def test_a_part_whose_rank_may_still_write_it_is_waited_for(tmp_path: Path) -> None:
    rank0, _ = sharded_images(tmp_path, torch.ones(4, 3), 2)
    folder = write_part(rank0, tmp_path / "disk")
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    def coming(step: int, round: int, rank: int) -> ImageSource | Absent:
        return Absent.COMING

    done = finish_newest(
        [(folder, 2, 4)], timeout=5.0, clock=lambda: now[0], sleep=sleep, stand_in=coming
    )
    assert done is None and now[0] >= 5.0


def test_the_node_stand_in_writes_a_gone_ranks_part_from_its_image_of_this_round(
    tmp_path: Path,
) -> None:
    """Rank 1 wrote steps 1 and 2 of round 4 into the node's folder and is
    gone: step 2 comes from its image, step 3 never comes. A rank alive in
    the folder, or one with no image of this round there (its presence left
    by an earlier round, when it was on this node), may still write its
    part elsewhere: it is waited for."""
    with ImageWriter(tmp_path, rank=1, presence=True) as writer:
        for step in (1, 2):
            writer.write(step, {"n": step}, round=4, world_size=2, protect=None)
        assert node_stand_in(tmp_path, 2, 4, 1) is Absent.COMING  # it lives
    found = node_stand_in(tmp_path, 2, 4, 1)
    assert not isinstance(found, Absent)
    assert (found.header.rank, found.header.step, found.header.round) == (1, 2, 4)
    assert node_stand_in(tmp_path, 3, 4, 1) is Absent.NEVER
    assert node_stand_in(tmp_path, 2, 5, 1) is Absent.COMING  # renumbered in round 5
    assert node_stand_in(tmp_path, 2, 4, 0) is Absent.COMING  # never on this node


def test_the_node_stand_in_writes_a_dead_nodes_rank_from_its_replica_here(
    tmp_path: Path,
) -> None:
    """Rank 1 lived on another node, whose replicas of steps 1 and 2 of round
    4 this node keeps. Until the agent writes it down as gone in round 4 its
    part may still come; after, step 2 comes from the replica and step 3,
    which no replica holds, never comes. Nothing is said of other rounds."""
    own = tmp_path / "own"
    own.mkdir()
    with ImageWriter(tmp_path / REPLICAS / "node-b", rank=1) as writer:
        for step in (1, 2):
            writer.write(step, {"n": step}, round=4, world_size=2, protect=None)
    assert node_stand_in(own, 2, 4, 1) is Absent.COMING
    presence.mark_gone(own, 4, [1])
    found = node_stand_in(own, 2, 4, 1)
    assert not isinstance(found, Absent)
    assert (found.header.rank, found.header.step, found.header.round) == (1, 2, 4)
    assert node_stand_in(own, 3, 4, 1) is Absent.NEVER
    assert node_stand_in(own, 2, 5, 1) is Absent.COMING  # renumbered in round 5
    assert node_stand_in(own, 2, 4, 0) is Absent.COMING  # not said to be gone


@pytest.mark.parametrize("rank_first", [True, False], ids=["rank-first", "stand-in-first"])
def test_a_part_written_by_its_rank_and_by_a_stand_in_loads_whole(
    tmp_path: Path, rank_first: bool
) -> None:
    """A node wrongly taken for dead may persist its rank's part while a
    survivor writes it from the replica: each writes files of its own, and
    the part file names one whole set, whichever comes last."""
    full = torch.arange(12.0).reshape(4, 3)
    rank0, rank1 = sharded_images(tmp_path, full, 2)
    root = tmp_path / "disk"
    folder = write_part(rank0, root)
    prefixes: list[str | None] = [None, "__1_stand_in_"]  # the rank's own files, a stand-in's
    for prefix in prefixes if rank_first else prefixes[::-1]:
        write_part(rank1, root, prefix=prefix)
    assert finish_newest([(folder, 2, 4)], timeout=0.0) == folder
    verify_folder(folder)
    template: dict[str, Any] = {"w": torch.zeros(4, 3), "n": 0}
    load_persisted(template, folder)
    assert torch.equal(template["w"], full)


def test_load_persisted_full_asks_for_a_template_when_tensors_are_sharded(tmp_path: Path) -> None:
    rank0, rank1 = sharded_images(tmp_path, torch.ones(4, 3), 2)
    write_part(rank1, tmp_path / "disk")
    folder = persist(rank0, tmp_path / "disk", timeout=1.0)
    with pytest.raises(TemplateRequiredError, match=r"'w' is stored in 2 shards"):
        load_persisted_full(folder)


def test_persisting_a_complete_step_again_leaves_it_as_it_was(tmp_path: Path) -> None:
    folder = persist(image_of(tmp_path / "a", {"x": torch.ones(2)}), tmp_path / "disk")
    before = (folder / METADATA).stat().st_mtime_ns
    persist(image_of(tmp_path / "b", {"x": torch.zeros(2)}), tmp_path / "disk")
    assert (folder / METADATA).stat().st_mtime_ns == before
    assert torch.equal(load_persisted_full(folder)["x"], torch.ones(2))


def test_an_image_overwritten_while_persisting_records_no_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ImageWriter(tmp_path / "shm", rank=0, slots=1) as writer:
        saved = writer.write(1, {"x": torch.ones(2)}, round=0, world_size=1, protect=None)
        source = LocalImage(saved.header_path)
        real_write = FileSystemWriter.write_data

        def write_then_save_again(self: FileSystemWriter, *args: Any) -> Any:
            written = real_write(self, *args)
            writer.write(2, {"x": torch.zeros(2)}, round=0, world_size=1, protect=None)
            return written

        monkeypatch.setattr(FileSystemWriter, "write_data", write_then_save_again)
        with pytest.raises(ImageChangedError):
            persist(source, tmp_path / "disk")
    assert newest_persisted(tmp_path / "disk") is None
    assert not list(step_folder(tmp_path / "disk", 1).glob("*part*"))


def test_loading_an_incomplete_folder_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "step-0000000001").mkdir()
    with pytest.raises(PersistError, match="not a complete checkpoint"):
        load_persisted({}, tmp_path / "step-0000000001")


def test_newest_persisted_skips_incomplete_folders_and_strangers(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    assert newest_persisted(root) is None
    for step in (3, 5):
        persist(image_of(tmp_path / f"shm{step}", {"x": torch.ones(1)}, step), root)
    step_folder(root, 9).mkdir()
    (root / "step-notanumber").mkdir()
    (root / "notes.txt").write_text("x")
    assert newest_persisted(root) == (5, step_folder(root, 5))


def test_prune_keeps_the_newest_complete_folders_and_newer_ones_in_progress(
    tmp_path: Path,
) -> None:
    root = tmp_path / "disk"
    for step in (1, 3, 5, 7):
        persist(image_of(tmp_path / f"shm{step}", {"x": torch.ones(1)}, step), root)
    for step in (2, 9):
        step_folder(root, step).mkdir()  # 2: a crashed persist; 9: still being written
    removed = prune(root, keep=2)
    assert sorted(removed) == [step_folder(root, s) for s in (1, 2, 3)]
    assert sorted(p.name for p in root.iterdir()) == [step_folder(root, s).name for s in (5, 7, 9)]


def test_prune_must_keep_at_least_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one"):
        prune(tmp_path, keep=0)
