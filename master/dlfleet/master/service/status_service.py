"""The `Master` status service: what this master knows about the job (the
active round, each dataset's progress over all epochs, the latest worker
failures, the in-memory checkpoints, the node check verdicts, the goodput
ledger), for the job's
supervisor and its display. The supervisor's requests carry what only it
sees (its running totals: brain plans, node exits, master restarts, handed to
`on_supervisor` for /metrics; and its own status of the job, merged into
/api/v1/status by `SupervisorView`).

Lives in the master service process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from dlfleet.api.job_phase import JobPhase
from dlfleet.api.node_state import NodeState
from dlfleet.api.serving.answers import rpc
from dlfleet.api.status_document import samples_per_second
from dlfleet.api.v1 import job_pb2, job_pb2_grpc, rendezvous_pb2
from dlfleet.master.core.goodput import Cause, Goodput
from dlfleet.master.service import wire
from dlfleet.master.service.node_reports import NodeReports
from dlfleet.master.service.state import MasterState
from dlfleet.master.service.timeline import EventKind, Timeline

# The supervisor asks every 0.2 s; a view older than this is from a supervisor
# that is gone (a standalone master then answers alone).
SUPERVISOR_FRESH_MS = 5_000


def goodput_to_wire(report: Goodput) -> job_pb2.Goodput:
    return job_pb2.Goodput(
        ratio=report.ratio,
        window_seconds=report.window_ms / 1000,
        productive_seconds=report.productive_ms / 1000,
        badput=[
            job_pb2.Badput(cause=cause.value, seconds=report.lost_ms[cause] / 1000)
            for cause in Cause
        ],
        opened_unix_ms=report.opened_ms or 0,
        as_of_unix_ms=report.as_of_ms,
        phase=report.phase.value if report.phase is not None else "",
    )


def master_status(
    state: MasterState,
    failures: Iterable[rendezvous_pb2.FailureReport],
    reports: NodeReports | None = None,
    now_ms: int = 0,
    goodput: Goodput | None = None,
) -> job_pb2.MasterStatus:
    status = job_pb2.MasterStatus(nodes_live=len(state.nodes.nodes), now_unix_ms=now_ms)
    if goodput is not None:
        status.goodput.CopyFrom(goodput_to_wire(goodput))
    active = state.rendezvous.state.active
    if active is not None:
        status.round = active.round
        status.world_size = active.world_processes
        status.round_nodes = active.world_size
    if reports is not None:
        reports.copy_into(status)
    for name in sorted(state.book.datasets):
        view = state.book.status(name)
        per_epoch, epochs = view.records_per_epoch, view.config.epochs
        status.datasets.append(
            job_pb2.DatasetProgress(
                name=name,
                epoch=view.epoch,
                epochs=epochs,
                records_per_epoch=per_epoch,
                records_done=view.records_trained,
                records_total=per_epoch * epochs,
                failed_shards=len(view.failed),
            )
        )
    status.failures.extend(failures)
    status.checkpoints.CopyFrom(wire.checkpoint_status_to_wire(state.checkpoints.status()))
    status.node_checks.extend(wire.verdict_to_wire(v) for v in state.node_checks.verdicts.values())
    # A round counts once a newer one formed (its survivors reported before rejoining).
    for suspect in state.suspicion.suspects(state.rendezvous.state.last_round):
        status.network_suspects.append(
            job_pb2.NetworkSuspect(
                node_id=suspect.node_id, rounds=suspect.rounds, reason=suspect.describe()
            )
        )
    return status


def global_ranks(state: MasterState) -> dict[str, range]:
    """Each member of the active round: the global ranks of its processes
    (members in group-rank order, each taking its local world size of ranks)."""
    active = state.rendezvous.state.active
    found: dict[str, range] = {}
    start = 0
    for member in active.members if active is not None else ():
        found[member.node_id] = range(start, start + member.local_world_size)
        start += member.local_world_size
    return found


def job_status(
    state: MasterState,
    failures: Iterable[rendezvous_pb2.FailureReport],
    reports: NodeReports | None,
    now_ms: int,
    goodput: Goodput | None = None,
) -> job_pb2.JobStatus:
    """The job's status as this master alone knows it: the document of
    `dlmaster status --json`, less what only the job's supervisor knows
    (target nodes, processes, relaunches, the brain's plan: zero), plus the
    ranks each node holds in the active round."""
    view = master_status(state, failures, reports, now_ms, goodput)
    status = job_pb2.JobStatus(
        job_name=state.settings.job_name,
        phase=JobPhase.RUNNING.value,
        round=view.round,
        world_size=view.world_size,
        datasets=view.datasets,
        eta_seconds=-1,
        master_up=True,
    )
    by_node = {report.node_id: report for report in view.nodes}
    checks = {check.node_id: check for check in view.node_checks}
    ranks = global_ranks(state)
    for record in sorted(state.nodes.nodes.values(), key=lambda r: r.name):
        entry = job_pb2.NodeStatus(
            name=record.name,
            state=NodeState.RUNNING.value,
            node_id=record.node_id,
            ranks=ranks.get(record.node_id, ()),
        )
        report = by_node.get(record.node_id)
        if report is not None:
            entry.metrics.CopyFrom(report.metrics)
        if record.node_id in checks:
            entry.check.CopyFrom(checks[record.node_id])
        status.nodes.append(entry)
    status.samples_per_second = samples_per_second(status.nodes)
    if view.failures:
        status.last_failure.CopyFrom(view.failures[-1])
    status.checkpoints.CopyFrom(view.checkpoints)
    if view.HasField("goodput"):
        status.goodput.CopyFrom(view.goodput)
    return status


class SupervisorView:
    """The job supervisor's latest status of the job, as its requests bring
    it, merged into the master's own (`job_status`) while it is fresh."""

    def __init__(
        self, fresh_ms: int = SUPERVISOR_FRESH_MS, timeline: Timeline | None = None
    ) -> None:
        self.fresh_ms = fresh_ms
        self.timeline = timeline
        self.latest: job_pb2.JobStatus | None = None
        self.at_ms = 0
        self._plan = ""
        self._retired: set[str] = set()

    def heard(self, status: job_pb2.JobStatus, now_ms: int) -> None:
        """Keep `status`; a new brain plan, or a node newly retired as
        faulty, goes into the timeline."""
        self.latest, self.at_ms = status, now_ms
        if self.timeline is None:
            return
        if status.last_plan and status.last_plan != self._plan:
            self.timeline.record(EventKind.BRAIN_PLAN, now_ms, plan=status.last_plan[:500])
        self._plan = status.last_plan
        for node in status.nodes:
            if node.state == NodeState.FAULTY.value and node.name not in self._retired:
                self._retired.add(node.name)
                self.timeline.record(
                    EventKind.NODE_RETIRED, now_ms, node=node.name, detail=node.detail[:500]
                )

    def merge(self, status: job_pb2.JobStatus, now_ms: int) -> job_pb2.JobStatus:
        """`status` (the master's, live) with what only the supervisor knows:
        the job's phase, target, ETA and brain plan, the master's restarts,
        each node's state, process and relaunches, and the nodes that are not
        (or no more) members: starting, lost, faulty."""
        seen = self.latest
        if seen is None or now_ms - self.at_ms > self.fresh_ms:
            return status
        merged = job_pb2.JobStatus()
        merged.CopyFrom(status)
        merged.phase, merged.reason = seen.phase, seen.reason
        merged.target_nodes, merged.last_plan = seen.target_nodes, seen.last_plan
        merged.master_pid, merged.master_restarts = seen.master_pid, seen.master_restarts
        merged.http_url = seen.http_url
        if status.eta_seconds < 0:
            merged.eta_seconds = seen.eta_seconds
        own = {node.name: node for node in status.nodes}
        del merged.nodes[:]
        for theirs in seen.nodes:
            entry = merged.nodes.add()
            entry.CopyFrom(own.pop(theirs.name, theirs))
            entry.state, entry.pid, entry.detail = theirs.state, theirs.pid, theirs.detail
            entry.relaunches, entry.memory_bytes = theirs.relaunches, theirs.memory_bytes
        merged.nodes.extend(own.values())  # registered since the supervisor's view
        return merged


class MasterStatusService(job_pb2_grpc.MasterServicer):
    def __init__(
        self,
        state: MasterState,
        failures: Iterable[rendezvous_pb2.FailureReport],
        reports: NodeReports,
        clock: Callable[[], int],
        on_supervisor: Callable[[job_pb2.SupervisorTotals], None] | None = None,
        supervisor_view: SupervisorView | None = None,
        goodput: Callable[[], Goodput] | None = None,
    ) -> None:
        self.state = state
        self.goodput = goodput
        self.failures = failures
        self.reports = reports
        self.clock = clock
        self.on_supervisor = on_supervisor
        self.supervisor_view = supervisor_view

    @rpc
    async def GetStatus(
        self, request: job_pb2.MasterStatusRequest, context: Any
    ) -> job_pb2.MasterStatus:
        if self.on_supervisor is not None and request.HasField("supervisor"):
            self.on_supervisor(request.supervisor)
        if self.supervisor_view is not None and request.HasField("job"):
            self.supervisor_view.heard(request.job, self.clock())
        goodput = self.goodput() if self.goodput is not None else None
        return master_status(self.state, self.failures, self.reports, self.clock(), goodput)
