"""`Checkpointer.save` with overlap: the parameters and optimizer state of
the modules and optimizers it is given are copied while the next step's
forward and backward run, that step's `optimizer.step()` waits for the copy,
the image (finished in the background, checksums included) holds the values
of the saved step, and the time held counts as the save's blocking. Without
a node agent: the images live in the process's private folder. The states
here are small, which a save copies whole in the call (`INLINE_IMAGE_BYTES`):
the tests of the background path set that size to 0; the last test keeps it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dlfleet.worker.checkpoint import checkpointer, image
from dlfleet.worker.checkpoint.checkpointer import Checkpointer
from dlfleet.worker.checkpoint.errors import CheckpointError
from dlfleet.worker.checkpoint.image import LocalImage, PendingImage

HOLD_S = 0.3


@pytest.fixture(autouse=True)
def in_the_background(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "small_state" not in request.node.name:
        monkeypatch.setattr(checkpointer, "INLINE_IMAGE_BYTES", 0)


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    step(model, optimizer)
    return model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def slow_copy_of(monkeypatch: pytest.MonkeyPatch, fqn: str, seconds: float) -> list[float]:
    """Copies that include `fqn` take `seconds` longer; returns when each began."""
    began: list[float] = []
    real = image._copy_items

    def slow(body: torch.Tensor, planned: list[Any], *rest: Any, **kw: Any) -> Any:
        if any(p.record.fqn == fqn for p in planned):
            began.append(time.perf_counter())
            time.sleep(seconds)
        return real(body, planned, *rest, **kw)

    monkeypatch.setattr(image, "_copy_items", slow)
    return began


def test_the_next_optimizer_step_waits_for_the_copy_and_counts_as_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = trained()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(persist_dir=tmp_path / "persist") as ckpt:
        ckpt.save(0, {"model": model, "optim": optimizer})  # the slots exist from now on
        slow_copy_of(monkeypatch, "model.0.weight", HOLD_S)
        held_before, blocked_before = ckpt.step_held_s, ckpt.blocked_s
        started = time.perf_counter()
        ckpt.save(1, {"model": model, "optim": optimizer})
        returned = time.perf_counter() - started
        assert returned < HOLD_S  # the parameters are copied in the background
        step(model, optimizer)  # its optimizer.step() waits for the copy
        assert time.perf_counter() - started >= HOLD_S
        assert not torch.equal(model.state_dict()["0.weight"], saved["0.weight"])
        image_file = ckpt.last_image
        assert image_file is not None and image_file.step == 1
        source = LocalImage(image_file.header_path)  # verifies every checksum
        for item in source.header.items:
            name = item.fqn.removeprefix("model.")
            if item.fqn.startswith("model.") and name != "1.num_batches_tracked":
                assert torch.equal(source.tensor(item), saved[name]), item.fqn
        ckpt.save(2, {"model": model, "optim": optimizer})
        # The hold in the optimizer step after save 1 is reported with save 2.
        held = ckpt.step_held_s - held_before
        assert held > HOLD_S / 2
        assert ckpt.blocked_s - blocked_before >= returned + held


def test_state_dicts_overlap_when_the_save_is_told_whose_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = trained()
    with Checkpointer(persist_dir=tmp_path / "persist") as ckpt:
        ckpt.save(0, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        slow_copy_of(monkeypatch, "model.0.weight", HOLD_S)
        started = time.perf_counter()
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        ckpt.save(1, state, overlap=(model, optimizer))
        assert time.perf_counter() - started < HOLD_S
        step(model, optimizer)
        assert time.perf_counter() - started >= HOLD_S


def test_without_overlap_the_save_itself_copies_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = trained()
    with Checkpointer(persist_dir=tmp_path / "persist", overlap=False) as ckpt:
        ckpt.save(0, {"model": model, "optim": optimizer})
        slow_copy_of(monkeypatch, "model.0.weight", HOLD_S)
        started = time.perf_counter()
        ckpt.save(1, {"model": model, "optim": optimizer})
        assert time.perf_counter() - started >= HOLD_S
        held = time.perf_counter()
        step(model, optimizer)
        assert time.perf_counter() - held < HOLD_S


def test_state_dicts_are_copied_at_save_and_summed_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = trained()
    summed = threading.Event()
    real_digests = image._digests

    def digests(view: memoryview, planned: Any) -> Any:
        summed.set()
        assert threading.current_thread().name.startswith("dlfleet-image-copy")
        return real_digests(view, planned)

    monkeypatch.setattr(image, "_digests", digests)
    with Checkpointer(persist_dir=tmp_path / "persist") as ckpt:
        ckpt.save(1, {"model": model.state_dict(), "optim": optimizer.state_dict()})
        image_file = ckpt.last_image
        assert image_file is not None and summed.is_set()
        LocalImage(image_file.header_path)


def test_an_image_that_could_not_be_finished_fails_the_next_save_by_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = trained()

    def full(self: PendingImage) -> Any:
        raise OSError(28, "No space left on device")

    with Checkpointer(persist_dir=tmp_path / "persist") as ckpt:
        ckpt.save(1, {"model": model, "optim": optimizer})
        assert ckpt.last_image is not None
        monkeypatch.setattr(PendingImage, "finish", full)
        ckpt.save(2, {"model": model, "optim": optimizer})
        with pytest.raises(CheckpointError, match=r"step 2 was not written: .*No space left"):
            ckpt.save(3, {"model": model, "optim": optimizer})
        monkeypatch.undo()
        ckpt.save(4, {"model": model, "optim": optimizer})  # the next one is written
        image_file = ckpt.last_image
        assert image_file is not None and image_file.step == 4


def test_a_small_state_is_copied_and_finished_in_the_save_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below INLINE_IMAGE_BYTES the copy, its checksums and the header are
    written before save() returns, on the caller's thread: the image exists
    at once, and the next optimizer step holds nothing."""
    model, optimizer = trained()
    copied_on: list[str] = []
    real = image._copy_items

    def noted(*args: Any, **kwargs: Any) -> Any:
        copied_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(image, "_copy_items", noted)
    with Checkpointer(persist_dir=tmp_path / "persist") as ckpt:
        for at in range(3):
            saved = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.save(at, {"model": model, "optim": optimizer})
            with ckpt._lock:  # finished before save() returned
                assert ckpt._last_image is not None and ckpt._last_image.step == at
                assert ckpt._sealing is None
            held = ckpt.step_held_s
            step(model, optimizer)
            assert ckpt.step_held_s == held
            source = LocalImage(ckpt._last_image.header_path)  # verifies every checksum
            weight = next(i for i in source.header.items if i.fqn == "model.0.weight")
            assert torch.equal(source.tensor(weight), saved["0.weight"])
    assert set(copied_on) == {threading.current_thread().name}
