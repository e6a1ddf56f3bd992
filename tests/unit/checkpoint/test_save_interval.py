"""`Checkpointer(every=k)` saves the multiples of k and persists the saves
that reach a new multiple of `persist_every`; `every="auto"` measures a
round's first saves, then saves as rarely as keeps their blocking under its
target. One process, no agent, no group (the ranks' agreement is checked in
tests/integration/checkpoint/test_save_interval_ranks.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from dlfleet.api.env import CHECKPOINT_DIR_ENV, MASTER_ENV, ROUND_ENV
from dlfleet.worker.checkpoint import checkpointer as module
from dlfleet.worker.checkpoint.checkpointer import Checkpointer
from dlfleet.worker.checkpoint.persist import step_folder


@pytest.fixture(autouse=True)
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (MASTER_ENV, CHECKPOINT_DIR_ENV, "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_every_k_saves_the_multiples_and_persists_each_save_past_a_new_multiple(
    tmp_path: Path,
) -> None:
    root = tmp_path / "disk"
    with Checkpointer(every=3, persist_every=4, persist_dir=root, keep_persisted=10) as ckpt:
        assert [s for s in range(1, 13) if ckpt.due(s)] == [3, 6, 9, 12]
        for step in range(1, 13):
            ckpt.save(step, {"w": torch.full((2,), float(step))})
        assert ckpt.saves == 4
        image = ckpt.last_image
        assert image is not None and image.step == 12
    # Saves 6 (past 4), 9 (past 8) and 12 (a multiple); not 3.
    persisted = [s for s in (3, 6, 9, 12) if step_folder(root, s).is_dir()]
    assert persisted == [6, 9, 12]


@pytest.mark.parametrize("every", [0, -2, "often", 1.5])
def test_a_bad_interval_is_refused_naming_it(every: object) -> None:
    with pytest.raises(ValueError, match="every must be a step count >= 1"):
        Checkpointer(every=every)  # type: ignore[arg-type]


def test_auto_saves_every_step_while_it_measures_then_as_its_cost_allows(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of ~5 ms and a save of about a millisecond: past the measured
    saves (every step, then two a probe's interval apart) it saves every
    k > 1 steps, says why, and a new round measures again."""
    monkeypatch.setattr(module, "AUTO_SAMPLES", 6)
    monkeypatch.setattr(module, "AUTO_PROBE_EVERY", 4)
    caplog.set_level(logging.INFO, logger="dlfleet.checkpoint")
    saved: list[int] = []
    with Checkpointer(every="auto") as ckpt:
        for step in range(1, 80):
            before = ckpt.saves
            ckpt.save(step, {"w": torch.full((1024,), float(step))})
            if ckpt.saves > before:
                saved.append(step)
            time.sleep(0.005)
        every = ckpt.every
        assert every > 1
        # 6 intervals measured (steps 1-7), then the probes at 8 and 12: 12 chose.
        assert saved[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 12]
        assert all(step % every == 0 for step in saved[9:]) and saved[9:]
        assert f'every="auto": saving every {every} step(s) from step 12 on' in caplog.text
        ckpt.load()  # a new round's restore: it measures again
        assert ckpt.every == 1


def test_auto_measures_again_in_a_new_round_whatever_is_called_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank that only asks `due` (to skip building the state) in a new
    round answers as a rank new to the round does: every step, while
    measuring. Else a survivor (every k) and a spare (every step) would save
    different steps, and every="auto"'s all-reduce would pair them wrongly."""
    monkeypatch.setattr(module, "AUTO_SAMPLES", 4)
    monkeypatch.setattr(module, "AUTO_PROBE_EVERY", 2)
    monkeypatch.setattr(module, "_agreed_max", lambda value: 7)  # what the ranks agreed
    monkeypatch.setenv(ROUND_ENV, "1")
    with Checkpointer(every="auto") as ckpt:
        for step in range(1, 10):
            if ckpt.due(step):
                ckpt.save(step, {"w": torch.zeros(4)})
            time.sleep(0.002)
        assert ckpt.every == 7
        assert [s for s in range(15, 22) if ckpt.due(s)] == [21]
        monkeypatch.setenv(ROUND_ENV, "2")  # the next round, no load() called
        assert ckpt.due(22) and ckpt.due(23)
        assert ckpt.every == 1


def test_a_state_given_as_a_function_is_built_only_for_due_steps_and_its_time_counts() -> None:
    built: list[int] = []

    def state_of(step: int) -> dict[str, torch.Tensor]:
        built.append(step)
        time.sleep(0.02)  # a framework's state dict, slow to build
        return {"w": torch.full((2,), float(step))}

    with Checkpointer(every=2) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, lambda step=step: state_of(step))  # type: ignore[misc]
        assert built == [2, 4, 6]
        assert ckpt.saves == 3
        assert ckpt.blocked_s >= 3 * 0.02
        image = ckpt.last_image
        assert image is not None and image.step == 6


def test_auto_weighs_what_a_save_slows_the_steps_not_only_its_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A save that blocks little but slows the steps after it (as background
    work on a busy host does) is weighed by that slowdown: steps of 2 ms
    without saves, 6 ms with one each step: a save costs ~4 ms, 2 steps' worth,
    so every="auto" saves at most every ~200 steps at its 1%."""
    monkeypatch.setattr(module, "AUTO_SAMPLES", 6)
    monkeypatch.setattr(module, "AUTO_PROBE_EVERY", 4)
    slow_after_save = [False]
    with Checkpointer(every="auto") as ckpt:
        for step in range(1, 20):
            before = ckpt.saves
            ckpt.save(step, {"w": torch.zeros(8)})
            if ckpt.saves > before:
                slow_after_save[0] = True
            time.sleep(0.006 if slow_after_save[0] else 0.002)
            slow_after_save[0] = False
        assert 100 <= ckpt.every <= 400, ckpt.every


def test_a_forced_save_keeps_the_last_step_once() -> None:
    with Checkpointer(every=4) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, {"w": torch.full((2,), float(step))})
        ckpt.save(6, {"w": torch.full((2,), 6.0)}, force=True)  # the run's last step
        ckpt.save(6, {"w": torch.full((2,), 6.0)}, force=True)  # already saved: not again
        assert ckpt.saves == 2  # 4, then 6
        image = ckpt.last_image
        assert image is not None and image.step == 6
