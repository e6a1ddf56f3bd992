"""Node membership and liveness: who is registered, and who stopped beating.

A node is known by a stable name; every registration is a new incarnation, so
heartbeats and reports of an older incarnation are stale. A node whose last
heartbeat is older than the timeout is dead: `expire` reports it once, and the
owner releases what it held. Time is an argument; nothing here reads a clock.

Nodes are kept in the order of their last heartbeat, so `expire` looks only at
the silent ones (O(expired), not O(nodes): the master runs it several times a
second at ten thousand nodes). The order holds while time does not go back; if
it does, a node can be found up to that much late.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dlfleet.api.errors import InvalidArgument, StaleError
from dlfleet.master.settings import STANDALONE

MAX_NODE_NAME = 200


@dataclass(frozen=True)
class LivenessSettings:
    heartbeat_interval_ms: int = STANDALONE.heartbeat_interval_ms
    heartbeat_timeout_ms: int = STANDALONE.heartbeat_timeout_ms


@dataclass
class NodeRecord:
    node_id: str
    name: str
    incarnation: int
    local_world_size: int
    host: str
    last_seen_ms: int


def node_id_of(name: str, incarnation: int) -> str:
    return f"{name}#{incarnation}"


class NodeTable:
    def __init__(self, settings: LivenessSettings | None = None) -> None:
        self.settings = settings or LivenessSettings()
        self.nodes: dict[str, NodeRecord] = {}  # by name: the live incarnation
        self._incarnations: dict[str, int] = {}
        # The names of `nodes`, the longest silent first.
        self._by_beat: OrderedDict[str, None] = OrderedDict()

    def register(self, name: str, local_world_size: int, host: str, now_ms: int) -> NodeRecord:
        """A new incarnation of `name`; a previous live one is replaced (the
        caller releases what it held: see `register` callers)."""
        if not name or len(name) > MAX_NODE_NAME or not name.isprintable() or "#" in name:
            raise InvalidArgument(
                f"node name must be 1..{MAX_NODE_NAME} printable characters without '#', "
                f"got {name!r}"
            )
        if not 1 <= local_world_size <= 1024:
            raise InvalidArgument(f"local_world_size must be in 1..1024, got {local_world_size}")
        incarnation = self._incarnations.get(name, 0) + 1
        self._incarnations[name] = incarnation
        record = NodeRecord(
            node_id_of(name, incarnation), name, incarnation, local_world_size, host, now_ms
        )
        self.nodes[name] = record
        self._beat(name)
        return record

    def restore(
        self, name: str, incarnation: int, local_world_size: int, host: str, now_ms: int
    ) -> None:
        """Rebuild a node after a master restart; it gets a full timeout."""
        self._incarnations[name] = max(self._incarnations.get(name, 0), incarnation)
        self.nodes[name] = NodeRecord(
            node_id_of(name, incarnation), name, incarnation, local_world_size, host, now_ms
        )
        self._beat(name)

    def forget(self, name: str) -> None:
        self.nodes.pop(name, None)
        self._by_beat.pop(name, None)

    def _beat(self, name: str) -> None:
        self._by_beat[name] = None
        self._by_beat.move_to_end(name)

    def live(self, node_id: str, incarnation: int) -> NodeRecord:
        name = node_id.rpartition("#")[0]
        record = self.nodes.get(name)
        if record is None or record.incarnation != incarnation or record.node_id != node_id:
            raise StaleError(f"node {node_id!r} incarnation {incarnation} is not registered")
        return record

    def heartbeat(self, node_id: str, incarnation: int, now_ms: int) -> None:
        record = self.live(node_id, incarnation)
        record.last_seen_ms = max(record.last_seen_ms, now_ms)
        self._by_beat.move_to_end(record.name)

    def expire(self, now_ms: int) -> list[NodeRecord]:
        """Nodes silent for longer than the timeout; they are removed."""
        timeout = self.settings.heartbeat_timeout_ms
        dead: list[NodeRecord] = []
        for name in self._by_beat:
            record = self.nodes[name]
            if now_ms - record.last_seen_ms <= timeout:
                break
            dead.append(record)
        for record in dead:
            del self.nodes[record.name]
            del self._by_beat[record.name]
        return dead
