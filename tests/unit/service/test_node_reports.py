"""The status RPC's node reports, kept beat by beat: one report per node
with its latest metrics and when they came, whatever the order of updates
and removals."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from dlfleet.api.v1 import job_pb2, rendezvous_pb2
from dlfleet.master.service.node_reports import NodeReports

NODES = [f"n{i}#1" for i in range(6)]


def metrics(steps: int) -> rendezvous_pb2.NodeMetrics:
    return rendezvous_pb2.NodeMetrics(steps=steps, cpu_percent=90.0)


def reported(reports: NodeReports) -> dict[str, tuple[int, int]]:
    status = job_pb2.MasterStatus()
    reports.copy_into(status)
    out = {r.node_id: (r.metrics.steps, r.at_unix_ms) for r in status.nodes}
    assert len(out) == len(status.nodes), "a node reported twice"
    return out


def test_a_node_is_reported_with_its_latest_metrics_and_their_time() -> None:
    reports = NodeReports()
    reports.update("a#1", metrics(1), 100)
    reports.update("b#1", metrics(5), 150)
    reports.update("a#1", metrics(2), 200)
    assert reported(reports) == {"a#1": (2, 200), "b#1": (5, 150)}


def test_a_removed_node_is_no_longer_reported_and_the_others_are_intact() -> None:
    reports = NodeReports()
    for i, node in enumerate(NODES[:3]):
        reports.update(node, metrics(i), i)
    reports.remove(NODES[0])
    reports.remove("never-seen#1")
    assert reported(reports) == {NODES[1]: (1, 1), NODES[2]: (2, 2)}
    assert len(reports) == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from(NODES), st.integers(0, 1000))))
def test_reports_match_a_plain_dict_under_any_updates_and_removals(
    ops: list[tuple[bool, str, int]],
) -> None:
    reports = NodeReports()
    model: dict[str, tuple[int, int]] = {}
    for t, (update, node, steps) in enumerate(ops):
        if update:
            reports.update(node, metrics(steps), t)
            model[node] = (steps, t)
        else:
            reports.remove(node)
            model.pop(node, None)
    assert reported(reports) == model
    assert len(reports) == len(model)
