"""Events of the node table (`liveness.py`): the only way it changes.

Plain values with a stable JSON form, journaled in the master's "nodes" stream
and replayed with `NodeTable.apply` after a restart, like the shard, the
rendezvous and the checkpoint events. Their JSON is the one that stream held
before node changes were events, so that a store written then still recovers:
`{"t": "node", ...}` for a registration and `{"t": "node_gone", ...}` for a
node the table forgot, each with the node's name, incarnation, local world
size and host. A registration also says when it happened (`registered_ms`); an
older entry without it reads as 0, which changes nothing, since recovery gives
every node a fresh timeout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def node_id_of(name: str, incarnation: int) -> str:
    return f"{name}#{incarnation}"


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """One incarnation of a node, as the table holds it."""

    name: str
    incarnation: int
    local_world_size: int
    host: str

    @property
    def node_id(self) -> str:
        return node_id_of(self.name, self.incarnation)

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "t": _TAGS[type(self)],
            "name": self.name,
            "incarnation": self.incarnation,
            "local_world_size": self.local_world_size,
            "host": self.host,
        }
        if isinstance(self, NodeRegistered):
            data["registered_ms"] = self.registered_ms
        return json.dumps(data, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> NodeEvent:
        data = json.loads(text)
        kind = NODE_EVENTS[data["t"]]
        fields = (data["name"], data["incarnation"], data["local_world_size"], data["host"])
        if kind is NodeRegistered:
            return NodeRegistered(*fields, registered_ms=data.get("registered_ms", 0))
        return kind(*fields)


@dataclass(frozen=True, slots=True)
class NodeRegistered(NodeEvent):
    """A new incarnation of `name`, live from `registered_ms` (it replaces any
    older one: see `NodeTable.register`)."""

    registered_ms: int


@dataclass(frozen=True, slots=True)
class NodeForgotten(NodeEvent):
    """The table no longer holds this incarnation: it missed its heartbeats,
    lost its session, left, finished, or a newer incarnation replaced it."""


# The stream's tags, as written before these were events.
NODE_EVENTS: dict[str, type[NodeEvent]] = {"node": NodeRegistered, "node_gone": NodeForgotten}
_TAGS: dict[type[NodeEvent], str] = {kind: tag for tag, kind in NODE_EVENTS.items()}
