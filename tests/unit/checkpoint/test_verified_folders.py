"""Persisted folders carry a manifest (each data file's size and checksums),
are written under a `.partial` name and renamed once complete, and a restore
verifies a folder before it reads it, falling back to an older one with a
line naming the damaged file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from dlfleet.api.env import CHECKPOINT_DIR_ENV, MASTER_ENV
from dlfleet.worker.checkpoint import persist
from dlfleet.worker.checkpoint.checkpointer import Checkpointer
from dlfleet.worker.checkpoint.errors import PersistCorruptError
from dlfleet.worker.checkpoint.image import ImageWriter, LocalImage
from dlfleet.worker.checkpoint.persist import (
    MANIFEST,
    newest_persisted,
    partial_folder,
    prune,
    step_folder,
    verify_folder,
    write_part,
)


def image_of(directory: Path, step: int, world_size: int = 1, rank: int = 0) -> LocalImage:
    with ImageWriter(directory, rank=rank) as writer:
        state = {"w": torch.full((1000,), float(step)), "step": step}
        saved = writer.write(step, state, round=0, world_size=world_size, protect=None)
    return LocalImage(saved.header_path)


def data_file(folder: Path) -> Path:
    return next(folder.glob("__0_*.distcp"))


def test_a_complete_folder_has_a_manifest_of_its_data_files_that_verifies(
    tmp_path: Path,
) -> None:
    folder = persist.persist(image_of(tmp_path / "shm", 3), tmp_path / "disk")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert sorted(manifest["files"]) == ["__0_0.distcp"]
    entry = manifest["files"]["__0_0.distcp"]
    assert entry["bytes"] == data_file(folder).stat().st_size and len(entry["xxh3"]) == 1
    verify_folder(folder)


def test_a_truncated_or_damaged_file_is_named(tmp_path: Path) -> None:
    folder = persist.persist(image_of(tmp_path / "shm", 3), tmp_path / "disk")
    target = data_file(folder)
    body = target.read_bytes()
    target.write_bytes(body[:-10])
    with pytest.raises(PersistCorruptError, match=f"{target} has {len(body) - 10} bytes"):
        verify_folder(folder)
    damaged = bytearray(body)
    damaged[len(body) // 2] ^= 0x40
    target.write_bytes(bytes(damaged))
    with pytest.raises(PersistCorruptError, match=f"{target} does not match its checksum"):
        verify_folder(folder)
    target.unlink()
    with pytest.raises(PersistCorruptError, match=f"{target} is missing"):
        verify_folder(folder)


def test_a_folder_whose_writers_died_midway_is_never_the_newest_and_is_pruned_later(
    tmp_path: Path,
) -> None:
    root = tmp_path / "disk"
    persist.persist(image_of(tmp_path / "shm1", 1), root)
    # Step 2 of a two-rank world: rank 0 wrote its part, then both died.
    write_part(image_of(tmp_path / "shm2", 2, world_size=2), root)
    assert partial_folder(step_folder(root, 2)).is_dir()
    assert not step_folder(root, 2).exists()
    assert newest_persisted(root) == (1, step_folder(root, 1))
    persist.persist(image_of(tmp_path / "shm3", 3), root)
    removed = prune(root, keep=2)
    assert removed == [partial_folder(step_folder(root, 2))]


def test_a_restore_falls_back_from_a_damaged_folder_to_an_older_one_and_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in (MASTER_ENV, CHECKPOINT_DIR_ENV, "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "disk"
    with Checkpointer(persist_every=1, persist_dir=root, keep_persisted=3) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((4,), float(step))})
    assert newest_persisted(root) == (2, step_folder(root, 2))
    damaged = data_file(step_folder(root, 2))
    damaged.write_bytes(damaged.read_bytes()[:-1])
    caplog.set_level(logging.WARNING)
    with Checkpointer(persist_dir=root) as ckpt:
        restored = ckpt.load({"w": torch.zeros(4)})
    assert restored is not None and restored.step == 1
    assert restored.state["w"].tolist() == [1.0] * 4
    said = caplog.text
    assert "restoring step 1 from older persisted" in said
    assert f"passed over persisted step 2 ({step_folder(root, 2)}): checksum: {damaged}" in said
