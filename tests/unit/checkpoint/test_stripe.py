"""Striped images: large plain (replicated) tensors cut by rows among the
ranks of a node, each rank's image holding its part. The node's images
restore whole (in memory, from disk, into another world size); one image
alone is refused, naming the ranks needed; small tensors and bytes items stay
whole in every image."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from unit.checkpoint.states import assert_same, template_like

from dlfleet.worker.checkpoint.errors import RestoreError
from dlfleet.worker.checkpoint.files import ItemKind
from dlfleet.worker.checkpoint.image import ImageWriter, LocalImage
from dlfleet.worker.checkpoint.persist import (
    finish,
    load_persisted,
    load_persisted_full,
    step_folder,
    write_part,
)
from dlfleet.worker.checkpoint.plan import STRIPE_MIN_BYTES, Stripe
from dlfleet.worker.checkpoint.restore import load_full, restore_into

ROWS = 257  # odd: the parts differ in size


def state() -> dict[str, Any]:
    """A DDP-like state: two large replicated tensors, a small one, bytes."""
    torch.manual_seed(0)
    width = STRIPE_MIN_BYTES // (4 * 128) + 1  # just over the limit at 128 rows
    return {
        "model": {"w": torch.randn(ROWS, width), "b": torch.randn(ROWS)},
        "optim": {"exp_avg": torch.randn(ROWS, width).t()},  # not contiguous
        "rng": torch.get_rng_state(),
        "step": 7,
    }


def striped_images(tmp_path: Path, saved: dict[str, Any], world: int, local: int) -> list[Any]:
    """The images every rank of `world` (nodes of `local` ranks) saves."""
    images = []
    for rank in range(world):
        with ImageWriter(tmp_path / f"node{rank // local}", rank=rank) as writer:
            image = writer.write(
                3, saved, round=1, world_size=world, protect=None,
                stripe=Stripe(rank % local, local),
            )  # fmt: skip
        images.append(LocalImage(image.header_path))
    return images


def test_each_rank_keeps_its_rows_of_the_large_tensors_and_all_of_the_small(
    tmp_path: Path,
) -> None:
    saved = state()
    rank0, rank1 = striped_images(tmp_path, saved, world=2, local=2)
    items0 = {i.fqn: i for i in rank0.header.items}
    items1 = {i.fqn: i for i in rank1.header.items}
    assert items0["model.w"].chunk_offsets == (0, 0) and items0["model.w"].chunk_sizes[0] == 129
    assert items1["model.w"].chunk_offsets == (129, 0) and items1["model.w"].chunk_sizes[0] == 128
    assert torch.equal(rank1.tensor(items1["model.w"]), saved["model"]["w"][129:])
    moment = saved["optim"]["exp_avg"]  # transposed: its rows are the other dimension
    rows = items0["optim.exp_avg"].chunk_sizes[0]
    assert rows == (moment.shape[0] + 1) // 2
    assert torch.equal(rank0.tensor(items0["optim.exp_avg"]), moment[:rows])
    for small in ("model.b", "rng"):  # under STRIPE_MIN_BYTES: whole everywhere
        assert items0[small].chunk_sizes == items1[small].chunk_sizes == items0[small].size
    assert items0["step"].kind is ItemKind.BYTES and items1["step"].kind is ItemKind.BYTES
    # The parts are primary on the first node's ranks, so that a persist has them all.
    assert items0["model.w"].primary and items1["model.w"].primary
    assert rank0.header.body_nbytes < 0.6 * (rank0.header.body_nbytes + rank1.header.body_nbytes)


@pytest.mark.parametrize("rank, world", [(0, 2), (1, 2), (0, 1), (2, 3)])
def test_the_nodes_images_restore_whole_into_any_world(
    tmp_path: Path, rank: int, world: int
) -> None:
    saved = state()
    images = striped_images(tmp_path, saved, world=2, local=2)
    assert_same(load_full(images, rank=rank, world_size=world), saved)
    template = template_like(saved)
    restore_into(template, images, rank=rank, world_size=world)
    assert_same(template, saved)


def test_one_image_of_a_striped_save_is_refused_naming_the_ranks_needed(tmp_path: Path) -> None:
    rank0, _ = striped_images(tmp_path, state(), world=2, local=2)
    with pytest.raises(RestoreError, match=r"images of ranks \[0\] hold .* every rank"):
        load_full([rank0], rank=0, world_size=2)


def test_two_nodes_hold_a_copy_each_and_the_first_nodes_parts_are_persisted(
    tmp_path: Path,
) -> None:
    saved = state()
    images = striped_images(tmp_path, saved, world=4, local=2)
    second_node = images[2:]
    assert_same(load_full(second_node, rank=0, world_size=4), saved)  # its own copy
    assert [i.header.items[0].primary for i in images] == [True, True, False, False]
    root = tmp_path / "disk"
    for image in images:
        write_part(image, root)
    folder = finish(step_folder(root, 3), world_size=4, round=1, timeout=5)
    assert_same(load_persisted_full(folder), saved)  # no template: nothing is a DTensor
    template = template_like(saved)
    load_persisted(template, folder)
    assert_same(template, saved)
    plain = template_like(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is unavailable ...": on purpose
        dcp_load(plain, checkpoint_id=folder)  # standard tools read it
    assert torch.equal(plain["model"]["w"], saved["model"]["w"])


def test_a_stripe_that_does_not_fit_the_world_is_refused(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0) as writer, pytest.raises(ValueError, match="world of 3"):
        writer.write(1, state(), round=0, world_size=3, protect=None, stripe=Stripe(0, 2))
