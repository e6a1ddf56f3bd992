"""The master's calls, one method each, blocking (with the client's
deadline and retries) or awaited on the client's loop.

Retrying is safe: leases carry a request id (a retry gets the same lease),
reports of a lease already DONE are duplicates, restores are idempotent.
The client is thread-safe (one channel, many threads).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from dlfleet.api.client.answers import CheckOrder, check_order
from dlfleet.api.client.channel import Connection, RetryPolicy
from dlfleet.api.client.leases import LeaseSession, rank_lease_request, round_lease_request
from dlfleet.api.client.session import AgentSession, join_request
from dlfleet.api.status import error_from_status
from dlfleet.api.v1 import (
    checkpoint_pb2,
    checkpoint_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    nodecheck_pb2,
    nodecheck_pb2_grpc,
    nodes_pb2,
    nodes_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    shards_pb2,
    shards_pb2_grpc,
)


class MasterClient(Connection):
    """One method per call of the master's services, on one connection; the
    sessions it opens (`agent_session`, `lease_session`) share it."""

    def _open_stubs(self) -> None:
        self._shards = shards_pb2_grpc.ShardsStub(self._channel)
        self._nodes = nodes_pb2_grpc.NodesStub(self._channel)
        self._rendezvous = rendezvous_pb2_grpc.RendezvousStub(self._channel)
        self._job = job_pb2_grpc.JobStub(self._channel)
        self._master = job_pb2_grpc.MasterStub(self._channel)
        self._checkpoints = checkpoint_pb2_grpc.CheckpointsStub(self._channel)
        self._node_check = nodecheck_pb2_grpc.NodeCheckStub(self._channel)

    def sharing_channel(self, *, timeout_s: float, retry: RetryPolicy) -> MasterClient:
        """A client on this one's channel with another deadline and retry
        policy (for callers that must answer quickly). Closing it closes the
        shared channel: close only this one."""
        token = self._metadata[0][1]
        return MasterClient(
            self.target, token=token, timeout_s=timeout_s, retry=retry, channel=self._channel
        )

    # ------------------------------------------------------------ datasets

    def register_dataset(self, spec: shards_pb2.DatasetSpec) -> shards_pb2.RegisterDatasetResponse:
        request = shards_pb2.RegisterDatasetRequest(spec=spec)
        return self._call("RegisterDataset", self._shards.RegisterDataset, request)

    def lease(
        self,
        dataset: str,
        *,
        node_id: str,
        rank: int,
        done: Iterable[int] = (),
        request_id: str | None = None,
    ) -> shards_pb2.LeaseResponse:
        """Async mode: a lease for this node-rank alone, after reporting the
        leases in `done` as finished (in the same round trip)."""
        request = rank_lease_request(dataset, node_id, rank, done, request_id)
        return self._call("Lease", self._shards.Lease, request)

    def lease_for_round(
        self,
        dataset: str,
        *,
        round: int,
        position: int,
        done: Iterable[int] = (),
        count: int = 1,
    ) -> shards_pb2.LeaseResponse:
        """Sync mode: the shard at `position` of rendezvous round `round`; every
        rank of the round gets the same answer. `count`: see round_lease_request."""
        request = round_lease_request(dataset, round, position, done, count)
        return self._call("Lease", self._shards.Lease, request)

    def renew(
        self, dataset: str, lease_id: int, consumed: int, *, round: int = 0
    ) -> shards_pb2.RenewResponse:
        request = shards_pb2.RenewRequest(
            dataset=dataset, lease_id=lease_id, round=round, consumed=consumed
        )
        return self._call("Renew", self._shards.Renew, request)

    def report_done(
        self, dataset: str, lease_id: int, *, round: int = 0
    ) -> shards_pb2.ReportResponse:
        request = shards_pb2.ReportRequest(
            dataset=dataset, lease_id=lease_id, round=round, done=shards_pb2.ShardDone()
        )
        return self._call("Report", self._shards.Report, request)

    def report_failure(
        self, dataset: str, lease_id: int, *, reason: str, consumed: int = 0, round: int = 0
    ) -> shards_pb2.ReportResponse:
        request = shards_pb2.ReportRequest(
            dataset=dataset,
            lease_id=lease_id,
            round=round,
            failure=shards_pb2.ShardFailure(reason=reason, consumed=consumed),
        )
        return self._call("Report", self._shards.Report, request)

    def snapshot(
        self, dataset: str, *, round: int = 0, progress: Iterable[tuple[int, int]] = ()
    ) -> shards_pb2.DatasetSnapshot:
        request = shards_pb2.SnapshotRequest(
            dataset=dataset,
            round=round,
            progress=[shards_pb2.LeaseProgress(lease_id=i, consumed=c) for i, c in progress],
        )
        return self._call("Snapshot", self._shards.Snapshot, request)

    def restore(
        self, snapshot: shards_pb2.DatasetSnapshot, *, round: int = 0
    ) -> shards_pb2.RestoreResponse:
        request = shards_pb2.RestoreRequest(snapshot=snapshot, round=round)
        return self._call("Restore", self._shards.Restore, request)

    def dataset_status(self, dataset: str) -> shards_pb2.DatasetStatus:
        request = shards_pb2.DatasetStatusRequest(dataset=dataset)
        return self._call("GetDatasetStatus", self._shards.GetDatasetStatus, request)

    # ---------------------------------------------------------- rendezvous

    def join_rendezvous(
        self,
        *,
        node_id: str,
        incarnation: int,
        local_world_size: int,
        host: str,
        bootstrap_port: int,
        timeout_s: float = 900.0,
        keeper_address: str = "",
    ) -> rendezvous_pb2.JoinResponse:
        """Blocks until this node is a member of a formed round. Retried across
        a master restart (joining again is idempotent). `keeper_address`: this
        node's checkpoint Keeper (host:port), told to the round's members."""
        request = join_request(
            node_id, incarnation, local_world_size, host, bootstrap_port, keeper_address
        )

        def once() -> rendezvous_pb2.JoinResponse:
            return self._rendezvous.Join(request, timeout=timeout_s, metadata=self._metadata)

        return self._with_retries("Join", once)

    def leave_rendezvous(self, node_id: str, incarnation: int, reason: str) -> None:
        request = rendezvous_pb2.LeaveRequest(
            node_id=node_id, incarnation=incarnation, reason=reason
        )
        self._call("Leave", self._rendezvous.Leave, request)

    def report_worker_failure(self, report: rendezvous_pb2.FailureReport) -> None:
        self._call("ReportFailure", self._rendezvous.ReportFailure, report)

    def rendezvous_state(
        self, waiting_only: bool = False
    ) -> rendezvous_pb2.RendezvousStateResponse:
        """The rendezvous now; `waiting_only`: just why nodes wait (no members)."""
        request = rendezvous_pb2.RendezvousStateRequest(waiting_only=waiting_only)
        return self._call("GetState", self._rendezvous.GetState, request)

    def agent_session(
        self, node_id: str, incarnation: int, heartbeat_interval_s: float
    ) -> AgentSession:
        """Open the node's session: heartbeats go up every interval, pushes
        (re-rendezvous) come down into `AgentSession.events`."""
        return AgentSession(self, node_id, incarnation, heartbeat_interval_s)

    def lease_session(self) -> LeaseSession:
        """A LeaseStream session for one consumer thread: the cheapest way to
        lease shard after shard (one message each way per shard)."""
        return LeaseSession(self)

    # --------------------------------------------------------- checkpoints

    def report_checkpoint(
        self, report: checkpoint_pb2.CheckpointReport
    ) -> checkpoint_pb2.CheckpointReportResponse:
        """The copies of one step this node holds now. Retrying is safe: a
        repeated report changes nothing."""
        return self._call("Report", self._checkpoints.Report, report)

    def latest_checkpoint(self, before_step: int = 0) -> checkpoint_pb2.CheckpointRecord:
        """The newest restorable step (below `before_step` when > 0);
        `found` is false when there is none."""
        request = checkpoint_pb2.LatestCheckpointRequest(before_step=before_step)
        return self._call("Latest", self._checkpoints.Latest, request)

    def report_persisted(self, report: checkpoint_pb2.PersistedReport) -> None:
        self._call("Persisted", self._checkpoints.Persisted, report)

    def checkpoint_status(self) -> checkpoint_pb2.CheckpointStatus:
        request = checkpoint_pb2.CheckpointStatusRequest()
        return self._call("Status", self._checkpoints.Status, request)

    # ---------------------------------------------------------- node check

    def node_check_begin(
        self, node_id: str, incarnation: int, host: str
    ) -> nodecheck_pb2.NodeCheckBeginResponse:
        """This node starts its pre-flight check (its agent, before the check
        process is up)."""
        request = nodecheck_pb2.NodeCheckBeginRequest(
            node_id=node_id, incarnation=incarnation, host=host
        )
        return self._call("Begin", self._node_check.Begin, request)

    def node_check_next(
        self, report: nodecheck_pb2.NodeCheckReport, timeout_s: float = 30.0
    ) -> nodecheck_pb2.NodeCheckOrder:
        """Report what the check process measured (or poll) and wait, a few
        seconds at most, for its next order. Retrying is safe: a repeated
        report changes nothing."""

        def once() -> nodecheck_pb2.NodeCheckOrder:
            return self._node_check.Next(report, timeout=timeout_s, metadata=self._metadata)

        return self._with_retries("Next", once)

    def next_check_order(
        self, report: nodecheck_pb2.NodeCheckReport, timeout_s: float = 30.0
    ) -> CheckOrder:
        """`node_check_next`, its order as a type: `CheckPoll | CheckCompute |
        CheckPair | CheckVerdict`."""
        return check_order(self.node_check_next(report, timeout_s))

    # ----------------------------------------------------------------- job

    def job_status(self) -> job_pb2.JobStatus:
        return self._call("GetStatus", self._job.GetStatus, job_pb2.JobStatusRequest())

    def master_status(
        self,
        supervisor: job_pb2.SupervisorTotals | None = None,
        job: job_pb2.JobStatus | None = None,
    ) -> job_pb2.MasterStatus:
        """The master's view of the job; the job's supervisor sends its
        running totals along (`supervisor`), for the master's /metrics, and
        its own status of the job (`job`), for the master's /api/v1/status."""
        request = job_pb2.MasterStatusRequest(supervisor=supervisor, job=job)
        return self._call("GetStatus", self._master.GetStatus, request)

    def scale(self, nodes: int) -> job_pb2.ScaleResponse:
        """Ask the job's platform for `nodes` nodes (within the job's min..max)."""
        return self._call("Scale", self._job.Scale, job_pb2.ScaleRequest(nodes=nodes))

    # --------------------------------------------------------------- nodes

    def register_node(
        self,
        *,
        job_name: str,
        node_name: str,
        local_world_size: int,
        host: str = "",
        nnodes: tuple[int, int] | None = None,
    ) -> nodes_pb2.RegisterNodeResponse:
        """`nnodes`: the (MIN, MAX) the node was started with, if it was given
        one: the master answers a range other than its own with
        `nnodes_warning`, and refuses one that cannot overlap it."""
        request = nodes_pb2.RegisterNodeRequest(
            job_name=job_name, node_name=node_name, local_world_size=local_world_size, host=host
        )
        if nnodes is not None:
            request.min_nodes, request.max_nodes = nnodes
        return self._call("Register", self._nodes.Register, request)

    # ------------------------------------------------- on the client's loop
    # The same requests as above, awaited on `io_loop` instead of blocking a
    # thread: one process can then drive thousands of nodes (the fleet
    # simulator). Register and Join are retried like their blocking twins
    # (under `retry`); a heartbeat is one attempt (the next beat is the retry).

    async def register_node_async(
        self, *, job_name: str, node_name: str, local_world_size: int, host: str = ""
    ) -> nodes_pb2.RegisterNodeResponse:
        request = nodes_pb2.RegisterNodeRequest(
            job_name=job_name, node_name=node_name, local_world_size=local_world_size, host=host
        )
        stub = nodes_pb2_grpc.NodesStub(self._io().channel)
        return await self._await_with_retries(
            "Register",
            lambda: stub.Register(request, timeout=self.timeout_s, metadata=self._metadata),
        )

    async def join_rendezvous_async(
        self,
        *,
        node_id: str,
        incarnation: int,
        local_world_size: int,
        host: str,
        bootstrap_port: int,
        timeout_s: float = 900.0,
        keeper_address: str = "",
    ) -> rendezvous_pb2.JoinResponse:
        request = join_request(
            node_id, incarnation, local_world_size, host, bootstrap_port, keeper_address
        )
        stub = self._io().rendezvous
        return await self._await_with_retries(
            "Join", lambda: stub.Join(request, timeout=timeout_s, metadata=self._metadata)
        )

    async def heartbeat_async(self, node_id: str, incarnation: int) -> nodes_pb2.HeartbeatResponse:
        request = nodes_pb2.HeartbeatRequest(node_id=node_id, incarnation=incarnation)
        stub = nodes_pb2_grpc.NodesStub(self._io().channel)
        try:
            return await stub.Heartbeat(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_status(error.code(), error.details() or "") from None

    def heartbeat(self, node_id: str, incarnation: int) -> nodes_pb2.HeartbeatResponse:
        request = nodes_pb2.HeartbeatRequest(node_id=node_id, incarnation=incarnation)
        return self._call("Heartbeat", self._nodes.Heartbeat, request)

    def deregister_node(self, node_id: str, incarnation: int) -> None:
        request = nodes_pb2.DeregisterNodeRequest(node_id=node_id, incarnation=incarnation)
        self._call("Deregister", self._nodes.Deregister, request)
