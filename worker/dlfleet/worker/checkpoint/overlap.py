"""Which tensors a save may copy while training goes on, and the hold that
keeps them unchanged until they are copied.

A model's parameters and its optimizer's state change in `optimizer.step()`
and nowhere else in an ordinary training step: forward and backward read the
parameters and write gradients, which are not saved. So a save taken between
steps can copy them while the next step's forward and backward run, and only
that step's `optimizer.step()` must wait for the copy (`StepGuard`: a
pre-step hook on every optimizer of the process, which returns at once when
no copy is under way).

Deferred: the parameters of the `nn.Module`s and the state tensors of the
optimizers that the saved state holds as objects, or that the save is told
of beside a state dict of them (`save(step, state, overlap=(model,
optimizer))`): their tensors are recognised by their memory. Copied at
save time, as before: everything else — buffers (BatchNorm's running
statistics change in forward), plain tensors a user put in the state,
tensors of modules and optimizers the save is not told of — since nothing
says when they change. A script that changes parameters outside
`optimizer.step()` (an EMA written into the model, weights clipped in place)
must save without overlap.

Lives in every training process (rank) that saves.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dlfleet.worker.checkpoint.image import PendingImage


def guarded_tensors(objects: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors that change only in an optimizer step, of those of
    `objects` that are modules (their parameters) or optimizers (their
    parameters and state; local shards of DTensors)."""
    for value in objects:
        if isinstance(value, torch.nn.Module):
            yield from value.parameters()
        elif isinstance(value, torch.optim.Optimizer):
            for group in value.param_groups:
                yield from group["params"]
            for per_param in value.state.values():
                yield from (t for t in per_param.values() if isinstance(t, torch.Tensor))


def deferrable(
    state: Mapping[str, Any], also: Iterable[Any] = ()
) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor the save plans to copy is (a part of) a guarded
    tensor of the modules and optimizers in `state` or in `also` (by its
    memory: a state dict, `get_state_dict`'s too, hands out views of the
    same tensors)."""
    objects = [*state.values(), *also]

    @functools.cache  # found at the first question (a small image, copied whole, asks none)
    def addresses() -> set[int]:
        found = {_address(t) for t in guarded_tensors(objects)}
        found.discard(0)  # empty tensors and meta tensors have no memory to hold
        return found

    return lambda tensor: _address(tensor) in addresses()


def _address(tensor: torch.Tensor) -> int:
    """Where the memory of `tensor` begins: its storage's, so that a view of
    a part (a stripe of a node's ranks, a row range) is known by its whole."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return int(local.untyped_storage().data_ptr()) if local.numel() else 0


class StepGuard:
    """Holds every optimizer's step until the image being copied has read
    its sources. One per process: the hook is registered once, on the first
    hold, for every optimizer (torch's global optimizer pre-step hook)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: PendingImage | None = None
        self._hooked = False
        self.held_s = 0.0  # time optimizer steps waited for a copy, in total

    def hold(self, pending: PendingImage) -> None:
        """Optimizer steps wait for `pending`'s copy from now on."""
        with self._lock:
            self._pending = pending
            if not self._hooked:
                register_optimizer_step_pre_hook(self._before_step)
                self._hooked = True

    def release(self) -> PendingImage | None:
        """The image under way, if any, no longer held for (the caller
        finishes it)."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending = self._pending
        if pending is None or pending.copied:
            return
        started = time.perf_counter()
        pending.hold_step()  # a failed copy is raised by finish()
        self.held_s += time.perf_counter() - started
