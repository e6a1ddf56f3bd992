"""Saves that copy parameters and optimizer state while the next step's
forward and backward run: which tensors may be deferred, and the optimizer
step that waits for their copy."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from dlfleet.worker.checkpoint import image
from dlfleet.worker.checkpoint.image import ImageWriter, LocalImage
from dlfleet.worker.checkpoint.overlap import StepGuard, deferrable


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Linear]:
    """A model, its optimizer after one step, and the model's first layer."""
    torch.manual_seed(0)
    first = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(first, torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return model, optimizer, first


def test_parameters_and_optimizer_state_are_deferred_buffers_and_plain_tensors_are_not() -> None:
    model, optimizer, first = trained()
    extra = torch.ones(3)
    defer = deferrable({"model": model, "optim": optimizer, "extra": extra})
    sd = model.state_dict()  # detached views of the same memory
    assert defer(sd["0.weight"]) and defer(sd["1.bias"])
    assert not defer(sd["1.running_mean"])  # forward changes it
    moments = optimizer.state[first.weight]
    assert defer(moments["exp_avg"]) and defer(moments["exp_avg_sq"])
    assert not defer(extra)
    assert defer(sd["0.weight"][4:])  # a part of one (a stripe of a node's ranks)
    # A state dict taken beforehand says nothing of when its tensors change...
    assert not deferrable({"model": sd})(sd["0.weight"])
    # ...unless the save is told whose it is (get_state_dict's views too).
    model_sd, optim_sd = cast(
        tuple[dict[str, Any], dict[str, Any]], get_state_dict(model, optimizer)
    )
    told = deferrable({"model": model_sd, "optim": optim_sd}, (model, optimizer))
    assert told(model_sd["0.weight"]) and not told(model_sd["1.running_mean"])
    assert told(optim_sd["state"]["0.weight"]["exp_avg"])


def test_the_optimizer_step_waits_for_the_copy_and_the_image_holds_the_values_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer, first = trained()
    state = {"model": model, "optim": optimizer}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    release = threading.Event()
    real_copy = image._copy_items

    def slow_copy(body: torch.Tensor, planned: list[Any], *rest: Any, **kw: Any) -> Any:
        if any(p.record.fqn == "model.0.weight" for p in planned):
            assert release.wait(10)
        return real_copy(body, planned, *rest, **kw)

    monkeypatch.setattr(image, "_copy_items", slow_copy)
    guard = StepGuard()
    with ImageWriter(tmp_path, rank=0) as writer:
        pending = writer.begin(
            1, state, round=0, world_size=1, protect=None, defer=deferrable(state)
        )
        guard.hold(pending)
        # The next step's forward and backward run while the copy is under way.
        model(torch.randn(4, 8)).sum().backward()
        stepped = threading.Thread(target=optimizer.step)
        stepped.start()
        stepped.join(0.3)
        assert stepped.is_alive()  # held
        assert torch.equal(first.weight.detach(), before["0.weight"])
        release.set()
        stepped.join(10)
        assert not stepped.is_alive()
        assert not torch.equal(first.weight.detach(), before["0.weight"])  # it stepped
        assert guard.release() is pending
        saved = pending.finish()
    source = LocalImage(saved.header_path)
    for item in source.header.items:
        if item.fqn.startswith("model.") and item.fqn != "model.1.num_batches_tracked":
            assert torch.equal(source.tensor(item), before[item.fqn.removeprefix("model.")])
    assert guard.held_s > 0.2
    # With nothing held, a step does not wait.
    optimizer.step()
