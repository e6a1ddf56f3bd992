"""The supervisor's view merged into the master's own status (/api/v1/status):
the master's live facts stay, the supervisor's own facts are added, and a view
that stopped coming is dropped."""

from __future__ import annotations

from dlfleet.api.v1 import job_pb2
from dlfleet.master.service.status_service import SupervisorView
from dlfleet.master.service.timeline import EventKind, Timeline


def master_side() -> job_pb2.JobStatus:
    status = job_pb2.JobStatus(job_name="demo", phase="running", round=3, world_size=2)
    status.eta_seconds = -1
    for name, ranks in (("node-0", [0]), ("node-2", [1])):
        node = status.nodes.add(name=name, state="running", node_id=f"{name}#1", ranks=ranks)
        node.metrics.samples_per_second = 10.0
    return status


def supervisor_side() -> job_pb2.JobStatus:
    status = job_pb2.JobStatus(
        job_name="demo", phase="running", target_nodes=2, last_plan="scale to 2: grow",
        master_pid=42, master_restarts=1, eta_seconds=120.0,
    )  # fmt: skip
    status.nodes.add(name="node-0", state="running", pid=100, relaunches=0)
    status.nodes.add(name="node-1", state="faulty", pid=0, relaunches=0, detail="GPU")
    return status


def test_the_supervisors_facts_join_the_masters_live_ones() -> None:
    view = SupervisorView(fresh_ms=5_000)
    view.heard(supervisor_side(), now_ms=1_000)
    merged = view.merge(master_side(), now_ms=2_000)
    assert (merged.round, merged.world_size) == (3, 2)  # the master's, live
    assert (merged.target_nodes, merged.last_plan) == (2, "scale to 2: grow")
    assert (merged.master_pid, merged.master_restarts, merged.eta_seconds) == (42, 1, 120.0)
    nodes = {n.name: n for n in merged.nodes}
    assert list(nodes) == ["node-0", "node-1", "node-2"]
    assert (nodes["node-0"].pid, list(nodes["node-0"].ranks)) == (100, [0])
    assert nodes["node-0"].metrics.samples_per_second == 10.0
    assert (nodes["node-1"].state, nodes["node-1"].detail) == ("faulty", "GPU")  # not a member
    assert list(nodes["node-2"].ranks) == [1]  # registered after the supervisor's view


def test_without_a_fresh_view_the_master_answers_alone() -> None:
    view = SupervisorView(fresh_ms=5_000)
    assert view.merge(master_side(), now_ms=0) == master_side()
    view.heard(supervisor_side(), now_ms=1_000)
    assert view.merge(master_side(), now_ms=6_001) == master_side()


def test_new_plans_and_retired_nodes_go_into_the_timeline_once() -> None:
    timeline = Timeline()
    view = SupervisorView(timeline=timeline)
    for at in (1_000, 1_200, 1_400):  # the same view, polled three times
        view.heard(supervisor_side(), now_ms=at)
    later = supervisor_side()
    later.last_plan = "replace node-3: straggler"
    view.heard(later, now_ms=1_600)
    events = [(e.kind, e.fields) for e in timeline.since(0)]
    assert events == [
        (EventKind.BRAIN_PLAN, {"plan": "scale to 2: grow"}),
        (EventKind.NODE_RETIRED, {"node": "node-1", "detail": "GPU"}),
        (EventKind.BRAIN_PLAN, {"plan": "replace node-3: straggler"}),
    ]
