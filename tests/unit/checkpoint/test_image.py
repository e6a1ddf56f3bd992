"""Images of one rank's state: the writer's slots, the header, and both sources."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from unit.checkpoint.states import training_state

from dlfleet.worker.checkpoint import files, image
from dlfleet.worker.checkpoint.errors import (
    CheckpointError,
    ImageChangedError,
    ImageFormatError,
    SlotError,
)
from dlfleet.worker.checkpoint.files import ItemKind
from dlfleet.worker.checkpoint.image import BytesImage, ImageWriter, LocalImage


def read_tensor(source: image.ImageSource, fqn: str) -> torch.Tensor:
    (item,) = [i for i in source.header.items if i.fqn == fqn]
    return source.tensor(item)


def test_an_image_holds_every_item_of_a_nested_state_at_aligned_offsets(tmp_path: Path) -> None:
    state = training_state(0)
    with ImageWriter(tmp_path, rank=0) as writer:
        saved = writer.write(5, state, round=2, world_size=1, protect=None)
    header = files.read_header(saved.header_path)
    kinds = {item.fqn: item.kind for item in header.items}
    assert kinds["model.0.weight"] is ItemKind.TENSOR
    assert kinds["optim.state.0.exp_avg"] is ItemKind.TENSOR
    assert kinds["rng.torch"] is ItemKind.TENSOR
    assert kinds["loader.epoch"] is ItemKind.BYTES
    assert kinds["rng.python"] is ItemKind.BYTES
    assert header.paths["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")
    assert all(item.offset % files.ALIGNMENT == 0 for item in header.items)
    assert (header.step, header.rank, header.world_size, header.round) == (5, 0, 1, 2)
    assert saved.nbytes == header.body_nbytes <= saved.body_path.stat().st_size


def test_a_local_image_views_equal_the_saved_tensors_without_copying(tmp_path: Path) -> None:
    state = training_state(0)
    with ImageWriter(tmp_path, rank=0) as writer:
        saved = writer.write(1, state, round=0, world_size=1, protect=None)
    source = LocalImage(saved.header_path)
    weight = read_tensor(source, "model.2.weight")
    assert torch.equal(weight, state["model"]["2.weight"])
    assert torch.equal(
        read_tensor(source, "optim.state.1.exp_avg_sq"), state["optim"]["state"][1]["exp_avg_sq"]
    )
    assert weight.data_ptr() == read_tensor(source, "model.2.weight").data_ptr()


@pytest.mark.parametrize("threads", [1, 3])
def test_every_kind_of_tensor_view_is_saved_by_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """Contiguous host tensors are memmoved (split in pieces over threads when
    torch has several); views whose bytes are not their values are copied by
    torch: transposed, negated or conjugated lazily, or offset into storage."""
    monkeypatch.setattr(files, "DIGEST_PIECE_BYTES", 4096)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    base = torch.arange(6000, dtype=torch.float32).view(60, 100)
    complex_ = torch.randn(300, dtype=torch.complex64)
    state = {
        "whole": base.clone(),
        "offset": base[7:],
        "transposed": base.t(),
        "negated": torch._neg_view(base),
        "conjugated": complex_.conj(),
        "empty": torch.empty(0, 3),
        "bytes": torch.arange(70000, dtype=torch.uint8),
    }
    with ImageWriter(tmp_path, rank=0) as writer:
        saved = writer.write(1, state, round=0, world_size=1, protect=None)
    source = LocalImage(saved.header_path)
    for key, value in state.items():
        assert torch.equal(read_tensor(source, key), value.resolve_conj().resolve_neg()), key


def test_shipped_header_and_body_bytes_make_the_same_image(tmp_path: Path) -> None:
    state = training_state(1)
    with ImageWriter(tmp_path, rank=0) as writer:
        saved = writer.write(1, state, round=0, world_size=1, protect=None)
    header, body = files.read_image_bytes(saved.header_path)
    shipped = BytesImage(header, body)
    assert not shipped.local and LocalImage(saved.header_path).local
    assert shipped.header == files.read_header(saved.header_path)
    assert torch.equal(read_tensor(shipped, "model.0.bias"), state["model"]["0.bias"])
    # A body at an odd address (inside a larger network buffer) still gives aligned views.
    odd = BytesImage(header, memoryview(b"x" + body)[1:])
    assert torch.equal(read_tensor(odd, "model.0.bias"), state["model"]["0.bias"])


def test_the_header_encoding_round_trips(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0) as writer:
        saved = writer.write(3, training_state(0), round=1, world_size=1, protect=None)
    header = files.read_header(saved.header_path)
    assert files.decode_header(files.encode_header(header)) == header


@pytest.mark.parametrize(
    "data", [b"", b"not json", b"[]", b'{"format": "other/1"}', b'{"format": "dlfleet-image/1"}']
)
def test_a_foreign_or_malformed_header_is_rejected(data: bytes) -> None:
    with pytest.raises(ImageFormatError):
        files.decode_header(data)


def test_a_body_that_is_short_foreign_or_corrupt_is_rejected(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0) as writer:
        saved = writer.write(3, training_state(0), round=1, world_size=1, protect=None)
    header, body = files.read_image_bytes(saved.header_path)
    with pytest.raises(ImageFormatError, match="bytes"):
        BytesImage(header, body[:-1])
    with pytest.raises(ImageFormatError, match="another image"):
        BytesImage(header, b"\0" * len(body))
    flipped = bytearray(body)
    flipped[-1] ^= 0xFF
    with pytest.raises(ImageFormatError, match="checksum"):
        BytesImage(header, flipped)


def test_the_protected_step_is_never_overwritten(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0, slots=2) as writer:
        writer.write(1, {"x": torch.full((4,), 1.0)}, round=0, world_size=1, protect=None)
        writer.write(2, {"x": torch.full((4,), 2.0)}, round=0, world_size=1, protect=1)
        writer.write(3, {"x": torch.full((4,), 3.0)}, round=0, world_size=1, protect=1)
        assert [f.step for f in writer.images()] == [1, 3]
        writer.write(4, {"x": torch.full((4,), 4.0)}, round=0, world_size=1, protect=3)
        held = {f.step: f for f in writer.images()}
    assert sorted(held) == [3, 4]
    assert torch.equal(read_tensor(LocalImage(held[3].header_path), "x"), torch.full((4,), 3.0))


def test_saving_when_every_slot_holds_the_protected_step_is_refused(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0, slots=1) as writer:
        writer.write(1, {"x": torch.ones(2)}, round=0, world_size=1, protect=None)
        with pytest.raises(SlotError, match="more slots"):
            writer.write(2, {"x": torch.ones(2)}, round=0, world_size=1, protect=1)


def test_saving_the_protected_step_again_is_refused(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0) as writer:
        writer.write(1, {"x": torch.ones(2)}, round=0, world_size=1, protect=None)
        with pytest.raises(SlotError, match="protected"):
            writer.write(1, {"x": torch.ones(2)}, round=0, world_size=1, protect=1)


def test_the_old_header_is_gone_before_the_body_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[int]] = []
    real_copy = image._copy_items

    def copy_and_look(body: torch.Tensor, planned: list[Any]) -> list[tuple[int, ...]]:
        seen.append([i.header.step for i in files.list_images(tmp_path)])
        return real_copy(body, planned)

    monkeypatch.setattr(image, "_copy_items", copy_and_look)
    with ImageWriter(tmp_path, rank=0) as writer:
        for step in range(1, 5):
            writer.write(step, {"x": torch.ones(2)}, round=0, world_size=1, protect=step - 1)
    # While step 3 is copied, only step 2 (protected) is visible, not step 1 of the reused slot.
    assert seen == [[], [1], [2], [3]]


def test_a_save_that_fails_midway_leaves_no_half_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_copy(body: torch.Tensor, planned: list[Any]) -> list[tuple[int, ...]]:
        body[files.PREAMBLE_BYTES :].fill_(0xAB)
        raise OSError("device lost")

    with ImageWriter(tmp_path, rank=0) as writer:
        writer.write(1, {"x": torch.ones(2)}, round=0, world_size=1, protect=None)
        writer.write(2, {"x": torch.ones(2)}, round=0, world_size=1, protect=1)
        monkeypatch.setattr(image, "_copy_items", broken_copy)
        with pytest.raises(OSError, match="device lost"):
            writer.write(3, {"x": torch.ones(2)}, round=0, world_size=1, protect=2)
    assert [i.header.step for i in files.list_images(tmp_path)] == [2]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_value_that_cannot_be_saved_leaves_every_image_intact(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0) as writer:
        writer.write(1, {"x": torch.ones(2)}, round=0, world_size=1, protect=None)
        writer.write(2, {"x": torch.ones(2)}, round=0, world_size=1, protect=1)
        with pytest.raises(Exception, match="pickle"):
            writer.write(3, {"x": lambda: 0}, round=0, world_size=1, protect=2)
    assert [i.header.step for i in files.list_images(tmp_path)] == [1, 2]


def test_a_save_of_unchanged_size_reuses_its_slot_file(tmp_path: Path) -> None:
    state = {"big": torch.randn(1000, 100)}
    with ImageWriter(tmp_path, rank=0) as writer:
        first = writer.write(1, state, round=0, world_size=1, protect=None)
        stat = first.body_path.stat()
        writer.write(2, state, round=0, world_size=1, protect=1)
        third = writer.write(3, state, round=0, world_size=1, protect=2)
    assert third.body_path == first.body_path
    assert (third.body_path.stat().st_ino, third.body_path.stat().st_size) == (
        stat.st_ino,
        stat.st_size,
    )


def test_a_growing_state_grows_its_slot(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0, slots=1) as writer:
        writer.write(1, {"x": torch.ones(10)}, round=0, world_size=1, protect=None)
        big = torch.randn(3_000_000)
        saved = writer.write(2, {"x": big}, round=0, world_size=1, protect=None)
    assert torch.equal(read_tensor(LocalImage(saved.header_path), "x"), big)


def test_a_writer_keeps_the_protected_step_and_every_newer_image_while_it_has_room(
    tmp_path: Path,
) -> None:
    """The agent's answers trail the saves: the images from the protected
    step on stay readable, and slots are only made as they are needed."""
    with ImageWriter(tmp_path, rank=0, slots=8) as writer:
        for step in range(1, 7):
            assert writer.has_room(step, protect=1)
            writer.write(
                step, {"x": torch.full((2,), float(step))}, round=0, world_size=1, protect=1
            )
        assert [i.step for i in writer.images()] == [1, 2, 3, 4, 5, 6]
        # The answers catch up: the older images go first, no new slot is made.
        writer.write(7, {"x": torch.ones(2)}, round=0, world_size=1, protect=5)
        writer.write(8, {"x": torch.ones(2)}, round=0, world_size=1, protect=7)
        assert [i.step for i in writer.images()] == [3, 4, 5, 6, 7, 8]
        assert len(list(tmp_path.glob("*.body"))) == 6
        for step in (9, 10):  # the answers stuck at step 3: the last two slots
            writer.write(step, {"x": torch.ones(2)}, round=0, world_size=1, protect=3)
        assert not writer.has_room(11, protect=3)
        # No room: the oldest image goes, never the protected one.
        writer.write(11, {"x": torch.ones(2)}, round=0, world_size=1, protect=3)
        assert [i.step for i in writer.images()] == [3, 5, 6, 7, 8, 9, 10, 11]


def test_large_images_take_fewer_slots(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0, slots=8, memory_bytes=7 << 19) as writer:
        big = {"x": torch.zeros(1 << 18)}  # 1 MiB
        for step in range(1, 6):
            writer.write(step, big, round=0, world_size=1, protect=1)
        assert [i.step for i in writer.images()] == [1, 4, 5]


def test_a_restarted_writer_adopts_the_images_of_its_predecessor(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=1) as writer:
        writer.write(7, {"x": torch.ones(2)}, round=0, world_size=2, protect=None)
        writer.write(8, {"x": torch.ones(2)}, round=0, world_size=2, protect=7)
    with ImageWriter(tmp_path, rank=1) as successor:
        assert [f.step for f in successor.images()] == [7, 8]
        successor.write(9, {"x": torch.zeros(2)}, round=1, world_size=2, protect=8)
        assert [f.step for f in successor.images()] == [8, 9]


def test_a_reader_detects_a_body_rewritten_under_it(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0, slots=1) as writer:
        saved = writer.write(1, {"x": torch.ones(2)}, round=0, world_size=1, protect=None)
        source = LocalImage(saved.header_path)
        shipped_header = saved.header_path.read_bytes()
        writer.write(2, {"x": torch.zeros(2)}, round=0, world_size=1, protect=None)
    with pytest.raises(ImageChangedError):
        source.check_unchanged()
    with pytest.raises(ImageFormatError, match="another image"):
        BytesImage(shipped_header, saved.body_path.read_bytes())


def test_newest_complete_step_needs_every_rank_of_its_world(tmp_path: Path) -> None:
    for rank, steps in [(0, [4, 5]), (1, [4])]:
        with ImageWriter(tmp_path, rank=rank) as writer:
            for step in steps:
                writer.write(step, {"x": torch.ones(1)}, round=0, world_size=2, protect=None)
    headers = [i.header for i in files.list_images(tmp_path)]
    assert files.newest_complete_step(headers) == 4
    assert files.newest_complete_step(h for h in headers if h.rank == 0) is None
    lone = dataclasses.replace(headers[0], world_size=1, step=9)
    assert files.newest_complete_step([*headers, lone]) == 9


@pytest.mark.parametrize(
    ("rank", "slots", "message"), [(-1, 2, "rank"), (0, 0, "at least one slot")]
)
def test_a_writer_with_bad_arguments_is_refused(
    tmp_path: Path, rank: int, slots: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ImageWriter(tmp_path, rank=rank, slots=slots)


def test_a_save_by_a_rank_outside_its_world_is_refused(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=2) as writer, pytest.raises(ValueError, match="outside"):
        writer.write(1, {"x": torch.ones(1)}, round=0, world_size=2, protect=None)


def test_a_meta_tensor_is_refused_with_its_key(tmp_path: Path) -> None:
    with (
        ImageWriter(tmp_path, rank=0) as writer,
        pytest.raises(CheckpointError, match="w is a meta tensor"),
    ):
        writer.write(1, {"w": torch.empty(3, device="meta")}, round=0, world_size=1, protect=None)


def test_the_files_module_imports_no_torch() -> None:
    code = "import sys, dlfleet.worker.checkpoint.files; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def blob_value(source: image.ImageSource, fqn: str) -> Any:
    (item,) = [i for i in source.header.items if i.fqn == fqn]
    return torch.load(io.BytesIO(source.blob(item)), weights_only=False)


def test_plain_values_are_serialized_again_only_when_they_change_type_for_type(
    tmp_path: Path,
) -> None:
    """A writer keeps the bytes of the last image's plain values; each image
    still holds the values of its own state."""
    values: list[object] = [0.1, 0.1, 0.2, 1, 1.0, True, 0.0, -0.0, [1, 2], [1, 2, 3], (1, 2)]
    items = [1, 2] * 300  # more leaves than BlobCache holds: serialized each time
    with ImageWriter(tmp_path, rank=0, slots=1) as writer:
        for step, value in enumerate(values):
            state = {"w": torch.ones(2), "lr": value, "big": items}
            saved = writer.write(step, state, round=0, world_size=1, protect=None)
            source = LocalImage(saved.header_path)
            got = blob_value(source, "lr")
            assert (got, type(got)) == (value, type(value))
            assert str(got) == str(value)  # -0.0 stays -0.0
            assert blob_value(source, "big") == items
            items.append(step)  # changed in place, after the save


def test_a_value_changed_in_place_after_a_save_is_serialized_again(tmp_path: Path) -> None:
    ids = [0, 1]
    with ImageWriter(tmp_path, rank=0, slots=1) as writer:
        writer.write(0, {"ids": ids}, round=0, world_size=1, protect=None)
        ids.append(2)
        saved = writer.write(1, {"ids": ids}, round=0, world_size=1, protect=None)
        assert blob_value(LocalImage(saved.header_path), "ids") == [0, 1, 2]
