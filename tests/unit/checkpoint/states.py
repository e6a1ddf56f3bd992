"""State dicts and images that the checkpoint tests share."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import torch

from dlfleet.worker.checkpoint import files
from dlfleet.worker.checkpoint.files import ItemKind
from dlfleet.worker.checkpoint.image import BytesImage, ImageSource, ImageWriter


def training_state(seed: int) -> dict[str, Any]:
    """A model and its AdamW after one step, a loader's state, RNG states."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "loader": {"epoch": 3, "consumed": [seed, 7, 9], "name": "train"},
        "rng": {"torch": torch.get_rng_state(), "python": random.Random(seed).getstate()},
        "step": 10 + seed,
    }


def sharded_images(tmp_path: Path, full: torch.Tensor, world: int) -> list[ImageSource]:
    """Images of `full` split by rows over `world` ranks, as DTensor shards are stored."""
    sources: list[ImageSource] = []
    start = 0
    for rank, rows in enumerate(full.chunk(world)):
        with ImageWriter(tmp_path / f"r{rank}", rank=rank) as writer:
            state = {"w": rows.clone(), "n": 5}
            saved = writer.write(1, state, round=4, world_size=world, protect=None)
        header, body = files.read_image_bytes(saved.header_path)
        decoded = files.decode_header(header)
        items = tuple(
            dataclasses.replace(
                item,
                kind=ItemKind.SHARD,
                size=tuple(full.shape),
                chunk_offsets=(start, 0),
                primary=True,
            )
            if item.fqn == "w"
            else item
            for item in decoded.items
        )
        forged = dataclasses.replace(decoded, items=items)
        sources.append(BytesImage(files.encode_header(forged), body))
        start += rows.shape[0]
    return sources


def assert_same(actual: Any, expected: Any) -> None:
    """Restored equals saved (DCP's flattening turns dict keys into strings)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict)
        by_name = {str(k): v for k, v in actual.items()}  # DCP's flattening makes keys str
        assert set(by_name) == {str(k) for k in expected}
        for key, value in expected.items():
            assert_same(by_name[str(key)], value)
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    else:
        assert actual == expected


def template_like(state: dict[str, Any]) -> dict[str, Any]:
    """The same structure with every tensor zeroed and every other value blanked."""
    if isinstance(state, dict):
        return {k: template_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, list):
        return [template_like(v) for v in state]
    return None
