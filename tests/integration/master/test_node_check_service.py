"""The NodeCheck service through a real server and clients: simulated check
processes (threads that report made-up timings, no torch) begin, measure what
they are told and get their verdicts; the verdicts show in the master's
status, its timeline and its metrics; a late node pairs with a node past its
check through that node's session; a master restarted mid-check checks the
nodes again."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from harness import TOKEN, Running

from dlfleet.api.client import AgentSession, MasterClient
from dlfleet.api.v1 import nodecheck_pb2
from dlfleet.master.core.liveness import LivenessSettings
from dlfleet.master.core.node_check import NodeCheckSettings
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.state import MasterSettings
from dlfleet.master.service.status_service import job_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

HOST = "127.0.0.1"


def settings(expected: int) -> MasterSettings:
    return MasterSettings(
        job_name="job",
        rendezvous=RendezvousSettings(min_nodes=1, max_nodes=4, last_call_timeout_ms=100),
        liveness=LivenessSettings(heartbeat_interval_ms=100, heartbeat_timeout_ms=5_000),
        node_check=NodeCheckSettings(expected_nodes=expected, step_timeout_ms=3_000),
    )


@dataclass
class SimulatedNode:
    """A registered node whose 'check process' reports made-up numbers."""

    address: str
    name: str
    compute_ms: float = 10.0
    link_ms: float = 5.0
    links: dict[str, float] = field(default_factory=dict)  # every node's link time, by id
    before_compute: threading.Event | None = None  # set: report the matmul; unset: wait
    host: str = HOST
    got_compute: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.client = MasterClient(self.address, token=TOKEN, timeout_s=10)
        reg = self.client.register_node(job_name="job", node_name=self.name, local_world_size=1)
        self.node_id, self.incarnation = reg.node_id, reg.incarnation
        self.session: AgentSession = self.client.agent_session(self.node_id, self.incarnation, 0.1)
        self.links[self.node_id] = self.link_ms

    def report(self, check_id: str, done: int, **result: object) -> nodecheck_pb2.NodeCheckReport:
        return nodecheck_pb2.NodeCheckReport(
            node_id=self.node_id,
            incarnation=self.incarnation,
            check_id=check_id,
            done_order=done,
            host=self.host,
            store_port=20_000,
            **result,  # type: ignore[arg-type]
        )

    def check(self) -> tuple[nodecheck_pb2.NodeCheckVerdict, set[str]]:
        """Begin, carry out orders, and return the verdict and every check id seen."""
        check_id = self.client.node_check_begin(self.node_id, self.incarnation, self.host).check_id
        seen, done = {check_id}, 0
        report = self.report(check_id, 0, ready=nodecheck_pb2.NodeCheckPoll())
        while True:
            order = self.client.node_check_next(report, timeout_s=15)
            if order.check_id != check_id:
                check_id, done = order.check_id, 0
                seen.add(check_id)
            what = order.WhichOneof("what")
            if what == "verdict":
                return order.verdict, seen
            if what == "compute":
                self.got_compute.set()
                if self.before_compute is not None:
                    self.before_compute.wait(20)
                    self.before_compute = None  # only the first time
                done = order.order
                timing = nodecheck_pb2.ComputeResult(best_ms=self.compute_ms, device="cpu")
                report = self.report(check_id, done, compute=timing)
            elif what == "pair":
                done = order.order
                ms = max(self.link_ms, self.links[order.pair.peer])
                result = nodecheck_pb2.PairResult(pair=order.pair.pair, ok=True, allreduce_ms=ms)
                report = self.report(check_id, done, pair=result)
            else:
                report = self.report(check_id, done, poll=nodecheck_pb2.NodeCheckPoll())

    def close(self) -> None:
        self.session.close()
        self.client.close()


def check_all(nodes: list[SimulatedNode]) -> dict[str, nodecheck_pb2.NodeCheckVerdict]:
    with ThreadPoolExecutor(len(nodes)) as pool:
        verdicts = list(pool.map(lambda node: node.check()[0], nodes))
    return {v.node_id: v for v in verdicts}


def test_a_node_slow_on_the_wire_is_found_and_shown_in_status_events_and_metrics(
    start_master: Callable[..., Running],
) -> None:
    master = start_master(settings(expected=3))
    links: dict[str, float] = {}
    nodes = [
        SimulatedNode(master.address, f"node-{i}", link_ms=25.0 if i == 1 else 5.0, links=links)
        for i in range(3)
    ]
    try:
        verdicts = check_all(nodes)
        slow = verdicts["node-1#1"]
        assert slow.faulty and slow.rule == "pairs_slow", slow.reason
        assert [p.outcome for p in slow.pairs] == ["slow", "slow"]
        assert slow.pair_reference_ms == 5.0 and slow.slow_factor == 2.0
        assert not verdicts["node-0#1"].faulty and not verdicts["node-2#1"].faulty

        status = master.client.master_status()
        assert {c.node_id: c.rule for c in status.node_checks} == {
            "node-0#1": "healthy", "node-1#1": "pairs_slow", "node-2#1": "healthy",
        }  # fmt: skip
        document = job_status(master.state, [], None, 0)
        by_name = {n.name: n for n in document.nodes}
        check = by_name["node-1"].check
        assert check.rule == "pairs_slow"
        assert "all-reduce with node-0#1 25.00 ms, 5.0x the median" in check.reason

        events = [e.to_json() for e in master.server.timeline.since()]
        checked = {e["node_id"]: e for e in events if e["kind"] == "node_checked"}
        assert checked["node-1#1"]["verdict"] == "faulty"
        assert checked["node-1#1"]["rule"] == "pairs_slow"
        assert {p["outcome"] for p in checked["node-1#1"]["pairs"]} == {"slow"}
        assert checked["node-0#1"]["verdict"] == "healthy"

        registry = master.server.metrics.registry
        count = registry.get_sample_value(
            "dlfleet_node_checks_total", {"verdict": "faulty", "rule": "pairs_slow"}
        )
        assert count == 1
        assert registry.get_sample_value("dlfleet_node_check_duration_seconds_count") == 3
    finally:
        for node in nodes:
            node.close()


def test_a_late_node_pairs_with_a_node_past_its_check_through_its_session(
    start_master: Callable[..., Running],
) -> None:
    master = start_master(settings(expected=1))
    links: dict[str, float] = {}
    first = SimulatedNode(master.address, "node-0", links=links)
    late: SimulatedNode | None = None
    try:
        assert not first.check()[0].faulty
        first.client.join_rendezvous(  # into a round: past its check, training
            node_id=first.node_id, incarnation=1, local_world_size=1, host=HOST,
            bootstrap_port=29_500, timeout_s=10,
        )  # fmt: skip
        # On a host of its own: compared with node-0's matmul (on one host, node-0
        # would be training on the device the late node is measured on).
        late = SimulatedNode(master.address, "node-1", compute_ms=11.0, links=links, host="h2")
        with ThreadPoolExecutor(1) as pool:
            checking = pool.submit(late.check)
            order = first.session.check_pairs.get(timeout=10)  # pushed on its session
            assert order.peer == late.node_id and order.rank == 1
            assert order.store_port == 20_000 and order.backend == "gloo"
            first.client.node_check_next(
                nodecheck_pb2.NodeCheckReport(
                    node_id=first.node_id,
                    incarnation=1,
                    check_id=order.check_id,
                    helper=True,
                    pair=nodecheck_pb2.PairResult(pair=order.pair, ok=True, allreduce_ms=6.0),
                )
            )
            verdict, _ = checking.result(timeout=20)
        assert not verdict.faulty, verdict.reason
        assert verdict.compute_reference_ms == 10.0  # node-0's matmul
        [pair] = verdict.pairs
        assert (pair.peer, pair.helper, pair.outcome) == (first.node_id, True, "good")
    finally:
        first.close()
        if late is not None:
            late.close()


def test_a_master_restarted_mid_check_checks_the_nodes_again(
    start_master: Callable[..., Running],
) -> None:
    master = start_master(settings(expected=2))
    port = master.server.port
    hold = threading.Event()
    links: dict[str, float] = {}
    nodes = [
        SimulatedNode(master.address, "node-0", links=links, before_compute=hold),
        SimulatedNode(master.address, "node-1", links=links),
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            checks = [pool.submit(node.check) for node in nodes]
            assert nodes[0].got_compute.wait(10)  # mid-check: a matmul ordered
            first_board = master.state.node_checks.check_id
            start_master.stop(master)  # type: ignore[attr-defined]
            restarted = start_master(settings(expected=2), port=port)
            hold.set()
            results = [check.result(timeout=40) for check in checks]
        for verdict, seen in results:
            assert not verdict.faulty, verdict.reason
            assert seen == {first_board, restarted.state.node_checks.check_id}
        assert {c.node_id for c in restarted.client.master_status().node_checks} == {
            "node-0#1",
            "node-1#1",
        }
    finally:
        for node in nodes:
            node.close()
