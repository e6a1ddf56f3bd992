"""An image whose large tensors are copied in the background
(`ImageWriter.begin` with `defer`): what is not deferred is copied before
`begin` returns, the image exists only once `finish` wrote its header, and
a copy that fails or a process that dies midway leaves no image of that step."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from dlfleet.worker.checkpoint import files, image
from dlfleet.worker.checkpoint.errors import SlotError
from dlfleet.worker.checkpoint.image import ImageWriter, LocalImage


def read(source: LocalImage, fqn: str) -> torch.Tensor:
    item = next(i for i in source.header.items if i.fqn == fqn)
    return source.tensor(item).clone()


def big() -> torch.Tensor:
    return torch.arange(300_000, dtype=torch.float32)


def test_deferred_tensors_are_copied_in_the_background_and_the_rest_at_once(
    tmp_path: Path,
) -> None:
    params, buffer = big(), torch.ones(4)
    state = {"weight": params, "running_mean": buffer, "epoch": 3}
    with ImageWriter(tmp_path, rank=0) as writer:
        pending = writer.begin(
            1, state, round=0, world_size=1, protect=None, defer=lambda t: t is params
        )
        buffer.fill_(7.0)  # copied before begin returned: the image keeps the ones
        pending.wait_copied()
        params.fill_(-1.0)  # the optimizer's step, after the copy: not in the image
        saved = pending.finish()
    source = LocalImage(saved.header_path)  # verifies every checksum
    assert torch.equal(read(source, "weight"), big())
    assert torch.equal(read(source, "running_mean"), torch.ones(4))


def test_an_unfinished_image_does_not_exist_and_the_older_one_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real_copy = image._copy_items

    def slow_copy(body: torch.Tensor, planned: list[Any], *rest: Any, **kw: Any) -> Any:
        if any(p.record.fqn == "weight" for p in planned):
            release.wait(10)
        return real_copy(body, planned, *rest, **kw)

    monkeypatch.setattr(image, "_copy_items", slow_copy)
    with ImageWriter(tmp_path, rank=0, slots=2) as writer:
        writer.write(1, {"x": torch.ones(2)}, round=0, world_size=1, protect=None)
        weight = big()
        pending = writer.begin(
            2, {"weight": weight}, round=0, world_size=1, protect=1, defer=lambda t: True
        )
        assert not pending.copied
        assert [i.header.step for i in files.list_images(tmp_path)] == [1]
        with pytest.raises(SlotError, match="step 2 is unfinished"):
            writer.begin(3, {"x": torch.ones(2)}, round=0, world_size=1, protect=1)
        release.set()
        pending.finish()
        assert [i.header.step for i in files.list_images(tmp_path)] == [1, 2]


def test_a_background_copy_that_fails_leaves_no_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_copy = image._copy_items

    def failing(body: torch.Tensor, planned: list[Any], *rest: Any, **kw: Any) -> Any:
        if any(p.record.fqn == "weight" for p in planned):
            raise OSError("device lost")
        return real_copy(body, planned, *rest, **kw)

    with ImageWriter(tmp_path, rank=0, slots=2) as writer:
        writer.write(1, {"weight": torch.ones(2)}, round=0, world_size=1, protect=None)
        monkeypatch.setattr(image, "_copy_items", failing)
        pending = writer.begin(
            2, {"weight": big()}, round=0, world_size=1, protect=1, defer=lambda t: True
        )
        with pytest.raises(OSError, match="device lost"):
            pending.finish()
    assert [i.header.step for i in files.list_images(tmp_path)] == [1]


def test_a_process_killed_during_the_background_copy_leaves_the_previous_image_only(
    tmp_path: Path,
) -> None:
    script = textwrap.dedent(
        f"""
        import os, pathlib, torch
        from dlfleet.worker.checkpoint.image import ImageWriter
        writer = ImageWriter(pathlib.Path({str(tmp_path)!r}), rank=0, slots=2)
        writer.write(1, {{"w": torch.ones(4)}}, round=0, world_size=1, protect=None)
        pending = writer.begin(
            2, {{"w": torch.ones(50_000_000)}}, round=0, world_size=1, protect=1,
            defer=lambda t: True,
        )
        os._exit(9)  # killed while the 200 MB copy runs
        """
    )
    done = subprocess.run([sys.executable, "-c", script], check=False, timeout=120)
    assert done.returncode == 9
    assert [i.header.step for i in files.list_images(tmp_path)] == [1]
    LocalImage(files.list_images(tmp_path)[0].header_path)  # whole and verified
