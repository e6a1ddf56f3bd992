"""A restore under the master's restart-loop ceiling: the master answers no
image at or above it and says the ceiling, and the Checkpointer's disk
ladder passes over the persisted folders at or above it too (a real master,
real folders)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from harness import TOKEN, Running

from dlfleet.api.env import CHECKPOINT_DIR_ENV, MASTER_ENV, TOKEN_ENV
from dlfleet.master.core.restart_loop import CeilingLowered
from dlfleet.worker.checkpoint.checkpointer import Checkpointer

pytestmark = pytest.mark.integration


def test_a_restore_under_the_ceiling_takes_an_older_persisted_folder(
    start_master: Callable[..., Running], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (MASTER_ENV, CHECKPOINT_DIR_ENV, TOKEN_ENV, "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "disk"
    with Checkpointer(persist_every=1, persist_dir=root, keep_persisted=3) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4,), float(step))})

    master = start_master()
    master.state.breaker.apply(CeilingLowered(3))  # three rounds failed after step 3
    monkeypatch.setenv(MASTER_ENV, master.address)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv(CHECKPOINT_DIR_ENV, str(tmp_path / "shm"))
    assert master.client.latest_checkpoint().below_step == 3
    with Checkpointer(persist_dir=root) as ckpt:
        restored = ckpt.load({"w": torch.zeros(4)})
    assert restored is not None and restored.step == 2
    assert restored.state["w"].tolist() == [2.0] * 4
