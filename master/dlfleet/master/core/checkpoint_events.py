"""Events of the checkpoint table (`checkpoints.py`): the only way it changes.

Plain values with a stable JSON form, journaled in the master's "checkpoints"
stream and replayed with `CheckpointTable.apply` after a restart.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ImageCopy:
    """One rank's image of one step, held by one node."""

    rank: int
    node_id: str
    address: str
    replica: bool
    size: int

    @property
    def key(self) -> tuple[int, str, bool]:
        return (self.rank, self.node_id, self.replica)


@dataclass(frozen=True, slots=True)
class CheckpointEvent:
    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        return json.dumps({"t": type(self).__name__, **data}, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> CheckpointEvent:
        data = json.loads(text)
        kind = CHECKPOINT_EVENTS[data.pop("t")]
        if kind is CopiesReported:
            data["copies"] = tuple(ImageCopy(**c) for c in data["copies"])
        return kind(**data)


@dataclass(frozen=True, slots=True)
class CopiesReported(CheckpointEvent):
    """Adds (or updates) copies of `step`, creating its record if needed."""

    node_id: str
    step: int
    round: int
    world_size: int
    copies: tuple[ImageCopy, ...]


@dataclass(frozen=True, slots=True)
class StepsAbandoned(CheckpointEvent):
    """Round `round` saved `from_step`: older rounds' steps from there on go."""

    round: int
    from_step: int


@dataclass(frozen=True, slots=True)
class StepDropped(CheckpointEvent):
    """Over `keep_steps`: the record goes."""

    step: int


@dataclass(frozen=True, slots=True)
class CopiesDropped(CheckpointEvent):
    """`node_id` no longer holds its copies of steps below `below_step`."""

    node_id: str
    below_step: int


@dataclass(frozen=True, slots=True)
class NodeGone(CheckpointEvent):
    node_id: str


@dataclass(frozen=True, slots=True)
class StepPersisted(CheckpointEvent):
    step: int
    path: str
    round: int
    world_size: int


CHECKPOINT_EVENTS: dict[str, type[CheckpointEvent]] = {
    kind.__name__: kind
    for kind in (
        CopiesReported,
        StepsAbandoned,
        StepDropped,
        CopiesDropped,
        NodeGone,
        StepPersisted,
    )
}
