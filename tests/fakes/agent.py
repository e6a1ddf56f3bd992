"""Fakes for the node agent's master (`dlfleet.worker.agent.loop.Agent`'s
`client` seam): a client that answers from memory and a session without a
stream, so a test drives a real Agent without a master."""

from __future__ import annotations

import queue
import threading
from typing import Any

from dlfleet.api.client import AgentSession, MasterClient, ReRendezvous, RetryPolicy
from dlfleet.api.v1 import nodecheck_pb2, nodes_pb2, rendezvous_pb2


class FakeSession(AgentSession):
    """Stands in for `AgentSession` (the node's session stream to the
    master): no stream and no heartbeats; what the master would push is put
    on `events` by the test (`push`), and the session's own reading of it
    (`next_push`, `waiting_pushes`, `drop_pushes`) is the real one; a beat
    sent at once (`beat_now`) keeps the metrics it carried in `beats`."""

    def __init__(self, node_id: str = "n#1", incarnation: int = 1, interval_s: float = 0.1) -> None:
        # No super().__init__: that opens the stream on the client's loop.
        self.node_id = node_id
        self.incarnation = incarnation
        self.round = 0
        self.events: queue.Queue[ReRendezvous] = queue.Queue()
        self.check_pairs: queue.Queue[nodecheck_pb2.PairOrder] = queue.Queue()
        self.broken = threading.Event()
        self.closed_by_master = threading.Event()
        self.interval = interval_s
        self.metrics: rendezvous_pb2.NodeMetrics | None = None
        self.restarts_in_place = False
        self.last_beat_s = 0.0
        self._leaving = False
        self.closed = False
        self.beats: list[tuple[int, rendezvous_pb2.NodeMetrics | None]] = []

    def push(self, closed_round: int, reason: str) -> None:
        """The master closes round `closed_round` for `reason`."""
        self.events.put(ReRendezvous(closed_round, reason, join_id=0, answer=None))

    def beat_now(self, timeout_s: float = 1.0) -> bool:
        self.beats.append((self.round, self.metrics))
        return True

    def close(self) -> None:
        self.closed = True


class FakeMasterClient(MasterClient):
    """Stands in for `MasterClient` as the agent uses it: registering answers
    node `node_id` with `heartbeat_interval_ms`, the session is `session`,
    and the agent's reports (failures, leaving) are kept in `calls`, in order.
    Its channel goes nowhere and is never used."""

    def __init__(
        self, session: FakeSession | None = None, *, heartbeat_interval_ms: int = 100
    ) -> None:
        super().__init__("127.0.0.1:1", token="fake", retry=RetryPolicy(attempts=1))
        self.session = session or FakeSession()
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.calls: list[tuple[str, Any]] = []

    def register_node(
        self,
        *,
        job_name: str,
        node_name: str,
        local_world_size: int,
        host: str = "",
        nnodes: tuple[int, int] | None = None,
    ) -> nodes_pb2.RegisterNodeResponse:
        self.calls.append(("register_node", node_name))
        return nodes_pb2.RegisterNodeResponse(
            node_id=self.session.node_id,
            incarnation=self.session.incarnation,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
        )

    def agent_session(
        self, node_id: str, incarnation: int, heartbeat_interval_s: float
    ) -> FakeSession:
        self.session.interval = heartbeat_interval_s
        return self.session

    def rendezvous_state(
        self, waiting_only: bool = False
    ) -> rendezvous_pb2.RendezvousStateResponse:
        return rendezvous_pb2.RendezvousStateResponse()

    def report_worker_failure(self, report: rendezvous_pb2.FailureReport) -> None:
        self.calls.append(("report_worker_failure", report))

    def leave_rendezvous(self, node_id: str, incarnation: int, reason: str) -> None:
        self.calls.append(("leave_rendezvous", reason))
