"""What both framework adapters need: the random generators' state as one
checkpoint value, the number of data epochs a step budget needs, and the
largest world that budget may be trained in.

Imports no framework."""

from __future__ import annotations

import math
import os
import pickle
import random
from typing import Any

import numpy as np
import torch

from dlfleet.api.env import MAX_NODES_ENV


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's, torch's CPU and (where there is one) CUDA generators,
    as checkpoint values (bytes and tensors)."""
    state: dict[str, Any] = {
        "python": pickle.dumps(random.getstate()),
        "numpy": pickle.dumps(np.random.get_state()),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(pickle.loads(state["python"]))  # our own checkpoint's bytes
    np.random.set_state(pickle.loads(state["numpy"]))
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def epochs_for_steps(
    max_steps: int, records: int, batch_per_rank: int, world: int, accumulation: int = 1
) -> int:
    """Data epochs that `max_steps` optimizer steps take at this world size
    (each step `accumulation` batches of `batch_per_rank` records a rank)."""
    batches = math.ceil(records / (batch_per_rank * world))
    steps_per_epoch = max(math.ceil(batches / accumulation), 1)
    return max(math.ceil(max_steps / steps_per_epoch), 1)


def largest_world(world: int) -> int:
    """The largest world size this job may train in: the master's node
    count at most (dlworker and the dlfleet rendezvous say it) times this
    node's processes; `world` (the current one) where nothing says so."""
    nodes = os.environ.get(MAX_NODES_ENV, "")
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if nodes.isdigit() and local.isdigit():
        return max(world, int(nodes) * int(local))
    return world
