"""A padding batch's loss: its value kept, its gradient zero.

A rank of a synchronous step that got no records (`ShardedDataLoader(...,
pad_empty=True)`, see loader.py) trains a padding batch instead: one record
that another rank trains in the same step. Its forward and backward run, so
the rank takes part in every collective of the step, but its loss must not
move the weights, or that record would be trained twice.
"""

from __future__ import annotations

import torch


def zero_weight(loss: torch.Tensor) -> torch.Tensor:
    """`loss` itself, made to send a zero gradient into the graph behind it.

    The value stays (a framework logs it; a NaN check sees a real number),
    and every parameter it reaches gets a zero gradient, which DDP or FSDP
    still reduce: the step's gradient is the other ranks' alone. A hook on
    the loss, not `loss * 0`, so that a framework that owns the backward
    (Lightning) needs no other loss."""
    if loss.requires_grad:
        loss.register_hook(torch.zeros_like)  # type: ignore[no-untyped-call]
    return loss
