"""The job's goodput ledger through a real master: a node joins a round, its
session's heartbeats carry its steps, a hang is reported through ReportFailure
and the node steps again; the ledger is read back from /metrics and
/api/v1/status over HTTP, and from the Master service's status."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from harness import TOKEN, Running
from prometheus_client.parser import text_string_to_metric_families

from dlfleet.api.client import AgentSession, MasterClient
from dlfleet.api.v1 import rendezvous_pb2
from dlfleet.master.core.goodput import Cause
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.http_api import HttpSettings
from dlfleet.master.service.state import MasterSettings

pytestmark = pytest.mark.integration

STEP_MS = 10.0


def get(running: Running, path: str) -> str:
    assert running.server.http is not None
    request = urllib.request.Request(
        str(running.server.http.url) + path, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return str(answer.read().decode())


def metrics(running: Running) -> dict[tuple[str, str], float]:
    return {
        (sample.name, sample.labels.get("cause", "")): sample.value
        for family in text_string_to_metric_families(get(running, "/metrics"))
        for sample in family.samples
        if sample.name.startswith(("dlfleet_goodput", "dlfleet_badput", "dlfleet_productive"))
    }


def train_for(session: Any, steps: int, seconds: float) -> int:
    """Step at one step per STEP_MS for `seconds`, as the heartbeats say."""
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        session.metrics = rendezvous_pb2.NodeMetrics(
            steps=steps + int(elapsed * 1000 / STEP_MS), step_time_ms=STEP_MS
        )
        time.sleep(0.01)
    return steps + int(seconds * 1000 / STEP_MS)


def wait_for_beats(seconds: float = 0.3) -> None:
    time.sleep(seconds)


# A job of one node: each round forms as soon as it joins.
ONE_NODE = MasterSettings(
    job_name="job",
    rendezvous=RendezvousSettings(min_nodes=1, max_nodes=1, last_call_timeout_ms=0),
)


def node_session(
    client: MasterClient, name: str, interval_s: float = 0.05
) -> tuple[Any, AgentSession]:
    """Register `name` and open its heartbeat session."""
    node = client.register_node(job_name="job", node_name=name, local_world_size=1)
    return node, client.agent_session(node.node_id, node.incarnation, interval_s)


def join(client: MasterClient, node: Any, port: int = 29500) -> int:
    """Join the rendezvous; the round it formed."""
    answer = client.join_rendezvous(
        node_id=node.node_id,
        incarnation=node.incarnation,
        local_world_size=1,
        host="127.0.0.1",
        bootstrap_port=port,
    )
    return int(answer.round)


def fail(client: MasterClient, node: Any, round_: int, message: str) -> None:
    """The node's agent reports a worker failure in `round_`; it restarts."""
    client.report_worker_failure(
        rendezvous_pb2.FailureReport(
            node_id=node.node_id,
            incarnation=node.incarnation,
            round=round_,
            exit_code=1,
            message=message,
            restarting=True,
        )
    )


def test_a_hang_and_its_restart_are_accounted_beside_the_productive_time(
    start_master: Callable[..., Running],
) -> None:
    running = start_master(ONE_NODE, http=HttpSettings())
    client = running.client
    node, session = node_session(client, "node-a")
    try:
        round_ = join(client, node)
        session.metrics = rendezvous_pb2.NodeMetrics(steps=0)
        wait_for_beats()
        steps = train_for(session, 0, 1.0)
        # Hung: the heartbeats say no step for 0.5 s, then the watchdog's report.
        wait_for_beats(0.5)
        fail(client, node, round_, "hung: no training step for 0.5s")
        wait_for_beats(0.3)  # the restart
        steps = train_for(session, steps, 1.0)
        wait_for_beats()

        samples = metrics(running)
        document: dict[str, Any] = json.loads(get(running, "/api/v1/status"))
        status = client.master_status()
    finally:
        session.close()

    lost = {cause: samples[("dlfleet_badput_seconds_total", cause.value)] for cause in Cause}
    productive = samples[("dlfleet_productive_seconds", "")]
    ratio = samples[("dlfleet_goodput_ratio", "")]
    assert productive == pytest.approx(2.0, abs=0.25)
    assert lost[Cause.HANG_DETECTION] == pytest.approx(0.5, abs=0.2)
    assert lost[Cause.RESTART] == pytest.approx(0.3, abs=0.2)
    assert lost[Cause.NODE_REPLACEMENT] == lost[Cause.WAITING_FOR_NODES] == 0
    assert 0.6 < ratio < 0.8
    window = productive + sum(lost.values())
    assert ratio == pytest.approx(productive / window, abs=1e-6)

    goodput = document["goodput"]
    badput = {item["cause"]: item["seconds"] for item in goodput["badput"]}
    assert set(badput) == {cause.value for cause in Cause}
    assert goodput["productive_seconds"] + sum(badput.values()) == pytest.approx(
        goodput["window_seconds"], abs=1e-3
    )
    assert goodput["ratio"] == pytest.approx(ratio, abs=0.02)
    assert goodput["phase"] == ""
    assert goodput["opened_unix_ms"] <= goodput["as_of_unix_ms"]
    assert status.goodput.ratio == pytest.approx(ratio, abs=0.02)


def test_losing_the_only_node_waits_for_nodes_then_for_the_replacement_to_step(
    start_master: Callable[..., Running],
) -> None:
    running = start_master(ONE_NODE, http=HttpSettings())
    client = running.client
    first, session = node_session(client, "node-a")
    join(client, first)
    session.metrics = rendezvous_pb2.NodeMetrics(steps=0)
    wait_for_beats()
    train_for(session, 0, 0.5)
    session.close()  # the agent died: its session ends, and the node is lost
    wait_for_beats(0.4)
    second, replacement = node_session(client, "node-b")
    try:
        join(client, second, 29501)
        replacement.metrics = rendezvous_pb2.NodeMetrics(steps=0)
        wait_for_beats()
        train_for(replacement, 0, 0.5)
        wait_for_beats()
        samples = metrics(running)
    finally:
        replacement.close()
    # No node left: waiting for nodes until the replacement's round forms;
    # from then until its first step, the replacement.
    assert samples[("dlfleet_badput_seconds_total", "waiting_for_nodes")] == pytest.approx(
        0.4, abs=0.2
    )
    assert samples[("dlfleet_badput_seconds_total", "node_replacement")] == pytest.approx(
        0.3, abs=0.2
    )
    assert samples[("dlfleet_productive_seconds", "")] == pytest.approx(1.0, abs=0.25)


def test_the_checkpoint_blocking_a_heartbeat_reports_is_lost_to_checkpoint(
    start_master: Callable[..., Running],
) -> None:
    running = start_master(ONE_NODE, http=HttpSettings())
    client = running.client
    node, session = node_session(client, "node-a")
    try:
        join(client, node)
        session.metrics = rendezvous_pb2.NodeMetrics(steps=0)
        wait_for_beats()
        steps = train_for(session, 0, 1.0)
        # The saves kept the steps waiting 0.2 s in all, as rank 0 reports.
        session.metrics = rendezvous_pb2.NodeMetrics(
            steps=steps + 1, step_time_ms=STEP_MS, checkpoint_blocked_s=0.2, trained_step=steps
        )
        wait_for_beats()
        samples = metrics(running)
    finally:
        session.close()

    assert samples[("dlfleet_badput_seconds_total", Cause.CHECKPOINT.value)] == pytest.approx(
        0.2, abs=1e-3
    )


def test_a_restarted_master_goes_on_with_the_ledger_of_the_one_before(
    start_master: Callable[..., Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first master writes its ledger every 0.2 s and is then stopped as
    if killed (nothing written at exit); the second, on the same store, goes
    on from the last write: the same window, the first master's productive
    time kept, and the steps the node made while no master ran counted too
    (it trains throughout, a step per STEP_MS)."""
    from dlfleet.master.service import server as server_module

    monkeypatch.setattr(server_module, "GOODPUT_WRITE_MS", 200)
    first = start_master(ONE_NODE, http=HttpSettings())
    # The node's own client (the master's goes with it).
    client = MasterClient(first.address, token=TOKEN, timeout_s=5)
    node, session = node_session(client, "node-a")
    training = threading.Event()

    def train() -> None:
        start = time.monotonic()
        while not training.wait(0.01):
            steps = int((time.monotonic() - start) * 1000 / STEP_MS)
            session.metrics = rendezvous_pb2.NodeMetrics(steps=steps, step_time_ms=STEP_MS)

    trainer = threading.Thread(target=train)
    try:
        join(client, node)
        session.metrics = rendezvous_pb2.NodeMetrics(steps=0)
        wait_for_beats()
        trainer.start()
        wait_for_beats(1.2)
        before: dict[str, Any] = json.loads(get(first, "/api/v1/status"))["goodput"]
        # Stands in for SIGKILL: the exit writes nothing.
        monkeypatch.setattr(first.server, "_write_goodput", lambda now_ms: None)
        start_master.stop(first)  # type: ignore[attr-defined]
        port = int(first.address.rsplit(":", 1)[1])
        second = start_master(ONE_NODE, port=port, http=HttpSettings())
        heard = second.server.rendezvous.metrics
        deadline = time.monotonic() + 15
        while node.node_id not in heard:
            assert time.monotonic() < deadline, "the session did not reach the new master"
            time.sleep(0.01)
        wait_for_beats(1.0)
        after: dict[str, Any] = json.loads(get(second, "/api/v1/status"))["goodput"]
    finally:
        training.set()
        if trainer.is_alive():
            trainer.join()
        session.close()
        client.close()

    assert before["productive_seconds"] == pytest.approx(1.2, abs=0.3)
    assert after["opened_unix_ms"] == before["opened_unix_ms"]
    assert after["productive_seconds"] >= before["productive_seconds"] + 0.9
    assert after["ratio"] > 0.9, after
    assert after["window_seconds"] == pytest.approx(
        (after["as_of_unix_ms"] - after["opened_unix_ms"]) / 1000, abs=0.01
    )


def test_the_final_count_of_stopped_workers_is_productive_not_lost_to_the_restart(
    start_master: Callable[..., Running],
) -> None:
    """Beats go out only when the test sends them (`beat_now`; the session's
    own interval is longer than the test). The node's workers step 0.3 s
    past its last beat, one fails, and its agent's last word tells their
    final count on the closed round's session: those steps are productive."""
    running = start_master(ONE_NODE)
    client = running.client
    node, session = node_session(client, "node-a", 600.0)

    def beat(steps: int) -> None:
        session.metrics = rendezvous_pb2.NodeMetrics(steps=steps, step_time_ms=STEP_MS)
        assert session.beat_now()

    def rejoin() -> int:
        session.round = join(client, node)
        return session.round

    try:
        first = rejoin()
        beat(0)
        start = time.monotonic()
        time.sleep(1.0)
        beat(100)
        time.sleep(0.3)  # 30 steps no heartbeat tells, then a worker fails
        failed = time.monotonic()
        fail(client, node, first, "killed")
        beat(130)  # the last word, about round `first`
        time.sleep(0.2)
        assert rejoin() == first + 1
        beat(0)  # the next process
        restarted = time.monotonic()
        time.sleep(0.5)
        beat(50)
        status = client.master_status().goodput
    finally:
        session.close()
    lost = {item.cause: item.seconds for item in status.badput}
    stepped = (failed - start) + (time.monotonic() - restarted)
    assert status.productive_seconds == pytest.approx(stepped, abs=0.1)
    # Without the last word, its 0.3 s would be here.
    assert lost[Cause.RESTART.value] == pytest.approx(restarted - failed, abs=0.1)


def test_a_beat_that_carries_earlier_metrics_ages_them_to_when_it_goes_out(
    start_master: Callable[..., Running],
) -> None:
    """The agent measures once per interval and the session beats on its own
    timer: the master takes the ages a beat tells as of its arrival, so the
    time since the measurement is added (before: resumed training read up to
    a heartbeat late in the ledger). Ages of 0 (not said) stay 0."""
    running = start_master(ONE_NODE)
    client = running.client
    node, session = node_session(client, "node-a", 600.0)
    heard: dict[str, tuple[rendezvous_pb2.NodeMetrics, int]] = running.server.rendezvous.metrics

    def heard_beat(steps: int) -> rendezvous_pb2.NodeMetrics:
        assert session.beat_now()
        deadline = time.monotonic() + 10
        while (beat := heard.get(node.node_id)) is None or beat[0].steps != steps:
            assert time.monotonic() < deadline, f"the beat of {steps} steps was not heard"
            time.sleep(0.01)
        return beat[0]

    try:
        session.round = join(client, node)
        session.metrics = rendezvous_pb2.NodeMetrics(steps=10, steps_age_s=0.2, stepping_age_s=1.0)
        time.sleep(0.5)
        aged = heard_beat(10)
        session.metrics = rendezvous_pb2.NodeMetrics(steps=11)
        time.sleep(0.3)
        unsaid = heard_beat(11)
    finally:
        session.close()
        client.close()

    assert aged.steps_age_s == pytest.approx(0.7, abs=0.15)
    assert aged.stepping_age_s == pytest.approx(1.5, abs=0.15)
    assert unsaid.steps_age_s == 0 and unsaid.stepping_age_s == 0
