"""Restores from images: in place into a template, or whole without one; replicas;
resharding of chunks saved by several ranks; clear errors."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from unit.checkpoint.states import assert_same, sharded_images

from dlfleet.worker.checkpoint import files
from dlfleet.worker.checkpoint.errors import (
    ImageChangedError,
    RestoreError,
    TemplateRequiredError,
)
from dlfleet.worker.checkpoint.image import BytesImage, ImageSource, ImageWriter, LocalImage
from dlfleet.worker.checkpoint.restore import load_full, restore_into


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its AdamW after one step (the optimizer's state exists)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    return model, optim


def training_state(seed: int) -> dict[str, Any]:
    model, optim = trained(seed)
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "loader": {"epoch": seed, "consumed": [seed, 7, 9]},
        "rng": {"torch": torch.get_rng_state(), "python": random.Random(seed).getstate()},
        "step": 10 + seed,
    }


def save(directory: Path, state: dict[str, Any], *, rank: int = 0, world: int = 1) -> Path:
    with ImageWriter(directory, rank=rank) as writer:
        return writer.write(1, state, round=0, world_size=world, protect=None).header_path


def test_a_fresh_model_and_optimizer_get_the_saved_values(tmp_path: Path) -> None:
    saved = training_state(0)
    header = save(tmp_path, saved)
    model, optim = trained(1)
    template: dict[str, Any] = {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "loader": {"epoch": -1, "consumed": []},
        "rng": {"torch": torch.empty_like(saved["rng"]["torch"]), "python": None},
        "step": 0,
    }
    restore_into(template, [LocalImage(header)], rank=0, world_size=1)
    model.load_state_dict(template["model"])
    optim.load_state_dict(template["optim"])
    assert_same(model.state_dict(), saved["model"])
    assert_same(optim.state_dict()["state"], saved["optim"]["state"])
    assert optim.param_groups[0]["lr"] == saved["optim"]["param_groups"][0]["lr"]
    assert template["loader"] == saved["loader"]
    assert template["rng"]["python"] == saved["rng"]["python"]
    assert torch.equal(template["rng"]["torch"], saved["rng"]["torch"])
    assert template["step"] == 10


def test_shipped_bytes_restore_the_same_values_as_the_local_file(tmp_path: Path) -> None:
    header = save(tmp_path, training_state(0))
    shipped = BytesImage(*files.read_image_bytes(header))
    from_file, from_bytes = trained(1)[0].state_dict(), trained(2)[0].state_dict()
    restore_into({"model": from_file}, [LocalImage(header)], rank=0, world_size=1)
    restore_into({"model": from_bytes}, [shipped], rank=0, world_size=1)
    assert_same(from_bytes, from_file)


def test_load_full_rebuilds_the_nested_state_without_a_template(tmp_path: Path) -> None:
    saved = training_state(0)
    full = load_full([LocalImage(save(tmp_path, saved))], rank=0, world_size=1)
    # DCP's flattening turns dict keys into strings: the optimizer's state is keyed "0".."3".
    assert_same(full, saved)


def test_stateful_values_are_restored_through_load_state_dict(tmp_path: Path) -> None:
    saved_model, _ = trained(0)
    header = save(tmp_path, {"model": saved_model})
    model, _ = trained(1)
    restore_into({"model": model}, [LocalImage(header)], rank=0, world_size=1)
    assert_same(model.state_dict(), saved_model.state_dict())


def per_rank_images(tmp_path: Path, *, shipped: frozenset[int] = frozenset()) -> list[ImageSource]:
    """Images of a world of two whose replicated values differ, so the chosen copy shows."""
    sources: list[ImageSource] = []
    for rank in range(2):
        header = save(
            tmp_path, {"x": torch.full((3,), float(rank)), "who": rank}, rank=rank, world=2
        )
        local = LocalImage(header)
        sources.append(BytesImage(*files.read_image_bytes(header)) if rank in shipped else local)
    return sources


def restored(sources: list[ImageSource], rank: int, world: int) -> tuple[float, int]:
    template: dict[str, Any] = {"x": torch.empty(3), "who": None}
    restore_into(template, sources, rank=rank, world_size=world)
    return float(template["x"][0]), int(template["who"])


def test_each_rank_of_an_unchanged_world_reads_its_own_replicas(tmp_path: Path) -> None:
    sources = per_rank_images(tmp_path)
    assert restored(sources, rank=0, world=2) == (0.0, 0)
    assert restored(sources, rank=1, world=2) == (1.0, 1)


def test_a_changed_world_reads_bytes_from_rank_0_and_tensors_from_local_files(
    tmp_path: Path,
) -> None:
    assert restored(per_rank_images(tmp_path), rank=0, world=3) == (0.0, 0)
    assert restored(per_rank_images(tmp_path, shipped=frozenset({0})), rank=2, world=3) == (1.0, 0)


def test_a_local_copy_of_a_rank_beats_its_shipped_copy(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0, slots=1) as writer:
        first = writer.write(1, {"x": torch.ones(3)}, round=0, world_size=1, protect=None)
        shipped = BytesImage(*files.read_image_bytes(first.header_path))
        again = writer.write(1, {"x": torch.full((3,), 2.0)}, round=0, world_size=1, protect=None)
    local = LocalImage(again.header_path)
    template = {"x": torch.zeros(3)}
    restore_into(template, [shipped, local], rank=0, world_size=1)
    assert torch.equal(template["x"], torch.full((3,), 2.0))


def test_shards_of_two_ranks_restore_into_one_whole_tensor(tmp_path: Path) -> None:
    full = torch.arange(30.0).reshape(6, 5)
    template: dict[str, Any] = {"w": torch.zeros(6, 5), "n": 0}
    restore_into(template, sharded_images(tmp_path, full, 2), rank=0, world_size=1)
    assert torch.equal(template["w"], full)
    assert template["n"] == 5


def test_shards_of_three_ranks_given_in_any_order_restore_the_whole(tmp_path: Path) -> None:
    full = torch.arange(30.0).reshape(6, 5)
    sources = sharded_images(tmp_path, full, 3)
    template: dict[str, Any] = {"w": torch.zeros(6, 5), "n": 0}
    restore_into(template, sources[::-1], rank=1, world_size=2)
    assert torch.equal(template["w"], full)


def test_load_full_asks_for_a_template_when_tensors_are_sharded(tmp_path: Path) -> None:
    sources = sharded_images(tmp_path, torch.ones(4, 2), 2)
    with pytest.raises(TemplateRequiredError, match=r"'w'.*template"):
        load_full(sources, rank=0, world_size=1)


def test_a_missing_rank_image_names_the_uncovered_tensor(tmp_path: Path) -> None:
    sources = sharded_images(tmp_path, torch.ones(4, 2), 2)
    with pytest.raises(RestoreError, match=r"w: the images of ranks \[1\] hold 4 of its 8"):
        restore_into({"w": torch.zeros(4, 2)}, sources[1:], rank=0, world_size=1)


def test_no_images_is_an_error() -> None:
    with pytest.raises(RestoreError, match="no images"):
        restore_into({}, [], rank=0, world_size=1)


def test_images_of_different_steps_are_refused(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0) as writer:
        a = writer.write(1, {"x": torch.ones(1)}, round=0, world_size=2, protect=None)
    with ImageWriter(tmp_path, rank=1) as writer:
        b = writer.write(2, {"x": torch.ones(1)}, round=0, world_size=2, protect=None)
    with pytest.raises(RestoreError, match=r"different saves: step 1 .* step 2"):
        restore_into(
            {}, [LocalImage(a.header_path), LocalImage(b.header_path)], rank=0, world_size=2
        )


def test_a_key_missing_from_the_images_is_a_clear_error(tmp_path: Path) -> None:
    header = save(tmp_path, {"x": torch.ones(2)})
    with pytest.raises(RestoreError, match=r"does not fit.*Missing key.*y"):
        restore_into(
            {"x": torch.zeros(2), "y": torch.zeros(2)}, [LocalImage(header)], rank=0, world_size=1
        )


def test_a_shape_mismatch_is_a_clear_error(tmp_path: Path) -> None:
    header = save(tmp_path, {"x": torch.ones(2)})
    with pytest.raises(RestoreError, match="Size mismatch"):
        restore_into({"x": torch.zeros(3)}, [LocalImage(header)], rank=0, world_size=1)


def test_a_rank_outside_the_world_is_refused(tmp_path: Path) -> None:
    header = save(tmp_path, {"x": torch.ones(2)})
    with pytest.raises(ValueError, match="outside"):
        restore_into({}, [LocalImage(header)], rank=1, world_size=1)


def test_an_image_overwritten_during_a_restore_is_detected(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0, slots=1) as writer:
        saved = writer.write(1, {"x": torch.ones(2)}, round=0, world_size=1, protect=None)
        source = LocalImage(saved.header_path)
        writer.write(2, {"x": torch.zeros(2)}, round=0, world_size=1, protect=None)
    with pytest.raises(ImageChangedError):
        restore_into({"x": torch.zeros(2)}, [source], rank=0, world_size=1)
