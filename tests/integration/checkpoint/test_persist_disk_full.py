"""The persist directory on a small tmpfs that fills up: the step that does
not fit fails with a line naming it, the disk's error and the newest
complete step; its incomplete folder is removed (its bytes would make every
later step fail too); the complete folders stay whole and verify; training
goes on (save never raises for it). A real tmpfs mount (root, as in CI)."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from harness import missing

from dlfleet.worker.checkpoint import persist
from dlfleet.worker.checkpoint.checkpointer import Checkpointer

MIB = 2**20
TENSOR_MIB = 5  # a step's folder is a little more than this
DISK_MIB = 12  # room for two steps' folders, not three


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        missing(f"cannot mount a tmpfs (root needed): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def wait_for(done: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f}s for {what}")
        time.sleep(0.05)


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((TENSOR_MIB * MIB // 4,), float(step))}


def test_a_full_disk_fails_the_step_clearly_keeps_the_last_folder_and_training_goes_on(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = small_disk / "ckpt"
    caplog.set_level(logging.ERROR, logger="dlfleet.checkpoint")
    with Checkpointer(persist_every=1, persist_dir=root, keep_persisted=2) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state(step))
            metadata = persist.step_folder(root, step) / persist.METADATA
            wait_for(metadata.is_file, f"step {step} on disk")
        ckpt.save(3, state(3))  # does not fit: 2 x 5 MiB are there already
        wait_for(lambda: "persisting step 3" in caplog.text, "the line about step 3")
        ckpt.save(4, state(4))  # training goes on; this one does not fit either
        wait_for(lambda: "persisting step 4" in caplog.text, "the line about step 4")
        assert [step for step, _ in persist.complete_folders(root)] == [1, 2]
        # close() persists the last image once more: it fails the same way.
    (line,) = [r.getMessage() for r in caplog.records if "persisting step 3" in r.getMessage()]
    assert "No space left on device" in line
    assert "the newest complete step on disk is 2" in line
    assert "training goes on" in line
    # No incomplete folder is left to fill the disk; the complete ones verify.
    assert sorted(p.name for p in root.iterdir()) == [
        persist.step_folder(root, 1).name,
        persist.step_folder(root, 2).name,
    ]
    for step in (1, 2):
        persist.verify_folder(persist.step_folder(root, step))
        loaded = persist.load_persisted_full(persist.step_folder(root, step))
        assert torch.equal(loaded["w"], state(step)["w"])
