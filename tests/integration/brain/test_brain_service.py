"""The brain over real gRPC on 127.0.0.1:0: one `BrainApi` contract run on the
in-process brain and on the remote one, the service's own rules (token,
health, malformed requests, status codes), and a reporter that must not care
whether the brain is up."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dlfleet.api.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable
from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.brain.api import BrainApi, open_brain
from dlfleet.brain.client import RemoteBrain
from dlfleet.brain.local import LocalBrain
from dlfleet.brain.records import (
    FailureKind,
    FailureRecord,
    JobInfo,
    MetricsBatch,
    NodeSample,
    OomRelaunch,
    PlanId,
    PlanKind,
    PlanRequest,
    RoundMetrics,
)
from dlfleet.brain.reporter import BrainReporter, ReporterSettings
from dlfleet.brain.server import BrainServer
from dlfleet.brain.wire import SERVICE_NAME

pytestmark = pytest.mark.integration

TOKEN = "brain-test-token"
GIB = 1 << 30
JOB = JobInfo(name="svc-job", signature="sig", min_nodes=1, max_nodes=4, memory_limit_bytes=GIB)


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalBrain]:
    brain = LocalBrain.open(f"sqlite:///{tmp_path / 'brain.db'}")
    yield brain
    brain.close()


@pytest.fixture
def server(local: LocalBrain) -> Iterator[BrainServer]:
    s = BrainServer(local, token=TOKEN, max_workers=4)
    s.start()
    yield s
    s.stop(grace_s=0)


@pytest.fixture
def remote(server: BrainServer) -> Iterator[RemoteBrain]:
    client = RemoteBrain(server.address, token=TOKEN, timeout_s=10)
    yield client
    client.close()


@pytest.fixture(params=["local", "remote"])
def brain(request: pytest.FixtureRequest) -> BrainApi:
    """Each implementation of BrainApi, on a fresh database."""
    if request.param == "local":
        return request.getfixturevalue("local")  # type: ignore[no-any-return]
    return request.getfixturevalue("remote")  # type: ignore[no-any-return]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# ------------------------------------------------------------ the contract


def test_metrics_persist_and_come_back_in_the_report(brain: BrainApi) -> None:
    t = now_ms()
    brain.persist(
        MetricsBatch(
            JOB.name,
            JOB,
            rounds=[
                RoundMetrics(1, 1, 4, t - 120_000, t - 60_000, 100.0),
                RoundMetrics(2, 2, 8, t - 60_000, t, 190.0),
            ],
            samples=[NodeSample("node-0", 2, t, 80.0, GIB // 2)],
            failures=[FailureRecord("node-1", FailureKind.EVICTED, t, None, "Evicted")],
        )
    )
    report = brain.report(JOB.name)
    assert report.job == JOB
    assert [(s.nodes, s.world_size, s.samples_per_s) for s in report.sizes] == [
        (1, 4, 100.0),
        (2, 8, 190.0),
    ]
    assert report.sizes[1].efficiency == pytest.approx(0.95)
    assert report.failures == {FailureKind.EVICTED: 1}


def test_plan_then_mark_applied(brain: BrainApi) -> None:
    t = now_ms()
    brain.persist(MetricsBatch(JOB.name, JOB, [RoundMetrics(1, 1, 1, t - 90_000, t, 100.0)]))
    plan = brain.plan(PlanRequest(JOB, nodes=1))
    assert (plan.kind, plan.current_nodes, plan.target_nodes) == (PlanKind.SCALE, 1, 2)
    assert plan.id > 0 and plan.reason.startswith("scale up from 1 to 2 nodes")
    assert plan.evidence["throughput"] == {"1": 100.0}
    assert brain.plan(PlanRequest(JOB, nodes=1)) == plan  # asked again: the same plan
    applied = brain.mark_applied(plan.id)
    assert applied.applied and applied.applied_ms is not None
    assert brain.report(JOB.name).plans == [applied]


def test_none_plans_and_memory_plans(brain: BrainApi) -> None:
    idle = brain.plan(PlanRequest(JOB, nodes=2))
    assert (idle.kind, idle.id) == (PlanKind.NONE, 0)
    assert idle.reason
    oom = brain.plan(PlanRequest(JOB, nodes=2, oom_relaunch=OomRelaunch("node-1", 2 * GIB)))
    assert (oom.kind, oom.node, oom.memory_bytes) == (PlanKind.MEMORY, "node-1", 3 * GIB)


def test_initial_plan(brain: BrainApi) -> None:
    plan = brain.plan(PlanRequest(JOB, nodes=0))
    assert (plan.kind, plan.target_nodes) == (PlanKind.INITIAL, 4)


def test_errors_are_the_same_domain_errors_both_ways(brain: BrainApi) -> None:
    with pytest.raises(NotFound, match="no job 'ghost'"):
        brain.report("ghost")
    with pytest.raises(NotFound, match="no plan 4242"):
        brain.mark_applied(PlanId(4242))
    with pytest.raises(InvalidArgument, match="plan id must be > 0"):
        brain.mark_applied(PlanId(0))
    with pytest.raises(NotFound):
        brain.persist(MetricsBatch("ghost", None, [RoundMetrics(1, 1, 1, 0, 1, 1.0)]))


# ------------------------------------------------------------ the service


def test_open_brain_picks_local_or_remote(server: BrainServer, tmp_path: Path) -> None:
    local = open_brain(None, f"sqlite:///{tmp_path / 'other.db'}")
    remote = open_brain(server.address, "ignored", token=TOKEN)
    try:
        assert isinstance(local, LocalBrain) and isinstance(remote, RemoteBrain)
        assert remote.plan(PlanRequest(JOB, nodes=0)).kind is PlanKind.INITIAL
    finally:
        local.close()
        remote.close()


def test_a_wrong_or_missing_token_is_unauthenticated_but_health_needs_none(
    server: BrainServer,
) -> None:
    for token in ("wrong", ""):
        with RemoteBrain(server.address, token=token) as client, pytest.raises(Unauthenticated):
            client.report(JOB.name)
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_bad_fields_and_malformed_bytes_are_invalid_argument(
    server: BrainServer, remote: RemoteBrain
) -> None:
    with pytest.raises(InvalidArgument, match="job_name is empty"):
        remote.report("")
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.unary_unary(
            "/dlfleet.api.v1.Brain/Plan",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff", timeout=5, metadata=((TOKEN_METADATA_KEY, TOKEN),))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        bad_job = b"\x0a\x02\x0a\x00"  # PlanRequest{job: BrainJob{name: ""}}
        with pytest.raises(grpc.RpcError) as caught:
            raw(bad_job, timeout=5, metadata=((TOKEN_METADATA_KEY, TOKEN),))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "job name is empty" in (caught.value.details() or "")


def test_a_stopped_brain_is_unavailable_quickly(tmp_path: Path) -> None:
    brain = LocalBrain.open(f"sqlite:///{tmp_path / 'gone.db'}")
    s = BrainServer(brain, token=TOKEN)
    s.start()
    address = s.address
    s.stop(grace_s=0)
    brain.close()
    with RemoteBrain(address, token=TOKEN, timeout_s=2) as client:
        start = time.monotonic()
        with pytest.raises(Unavailable, match=f"brain at {address}"):
            client.report(JOB.name)
        assert time.monotonic() - start < 5
        assert not client.healthy(timeout_s=0.5)


# ------------------------------------------------- reporting to a bad brain


class SlowBrain(LocalBrain):
    """A brain whose every write takes `delay_s`."""

    delay_s = 2.0

    def persist(self, batch: MetricsBatch) -> None:
        time.sleep(self.delay_s)
        super().persist(batch)


def _report_many(reporter: BrainReporter, count: int) -> list[float]:
    took = []
    t = now_ms()
    for i in range(count):
        start = time.perf_counter()
        if i % 100 == 0:
            reporter.report_round(RoundMetrics(i, 1, 1, t, t, 1.0))
        else:
            reporter.report_node_sample(NodeSample("node-0", 1, t + i))
        took.append(time.perf_counter() - start)
    return took


def _assert_fast(took: list[float]) -> None:
    # Microseconds each; a call that waited on the brain would take seconds.
    assert sum(took) / len(took) < 0.001
    assert max(took) < 0.05


@pytest.fixture
def start_server() -> Iterator[Callable[[LocalBrain], BrainServer]]:
    started: list[BrainServer] = []

    def start(brain: LocalBrain) -> BrainServer:
        s = BrainServer(brain, token=TOKEN, max_workers=2)
        s.start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop(grace_s=0)


def test_a_slow_remote_brain_never_slows_the_reporter(
    tmp_path: Path, start_server: Callable[[LocalBrain], BrainServer]
) -> None:
    slow = SlowBrain.open(f"sqlite:///{tmp_path / 'slow.db'}")
    server = start_server(slow)
    client = RemoteBrain(server.address, token=TOKEN, timeout_s=0.5)
    settings = ReporterSettings(
        capacity=200,
        batch_size=50,
        linger_s=0.01,
        attempts=2,
        initial_backoff_s=0.01,
        give_up_after_s=2.0,
    )
    reporter = BrainReporter(client, JOB, settings)
    try:
        _assert_fast(_report_many(reporter, 2000))
        stats = reporter.close(timeout_s=1.0)
        # Nothing got through the 0.5 s deadline; everything is accounted for.
        assert stats.delivered == 0
        assert stats.dropped_overflow >= 2000 - 250
        assert stats.dropped + stats.pending == 2000
        assert "no answer within 0.5 s" in stats.last_error
    finally:
        client.close()
        slow.close()


def test_a_brain_that_is_down_costs_the_reporter_nothing_and_drops_are_counted(
    tmp_path: Path,
) -> None:
    brain = LocalBrain.open(f"sqlite:///{tmp_path / 'down.db'}")
    s = BrainServer(brain, token=TOKEN)
    s.start()
    address = s.address
    s.stop(grace_s=0)
    client = RemoteBrain(address, token=TOKEN, timeout_s=0.5)
    settings = ReporterSettings(
        capacity=500,
        batch_size=100,
        linger_s=0.01,
        attempts=3,
        initial_backoff_s=0.01,
        max_backoff_s=0.05,
    )
    reporter = BrainReporter(client, JOB, settings)
    try:
        _assert_fast(_report_many(reporter, 1000))
        stats = reporter.close(timeout_s=2.0)
        assert stats.delivered == 0
        assert stats.dropped == 1000 and stats.pending == 0
        assert stats.failed_attempts >= 3
    finally:
        client.close()
        brain.close()


def test_the_reporter_delivers_to_a_healthy_remote_brain(
    remote: RemoteBrain, local: LocalBrain
) -> None:
    reporter = BrainReporter(remote, JOB, ReporterSettings(linger_s=0.01))
    took = _report_many(reporter, 1000)
    stats = reporter.close(timeout_s=10)
    _assert_fast(took)
    assert (stats.delivered, stats.dropped, stats.pending) == (1000, 0, 0)
    assert len(local.repository.node_samples(JOB.name)) == 990
    assert len(local.repository.rounds(JOB.name)) == 10


def test_concurrent_plans_of_one_job_store_one_plan(remote: RemoteBrain) -> None:
    t = now_ms()
    remote.persist(MetricsBatch(JOB.name, JOB, [RoundMetrics(1, 1, 1, t - 90_000, t, 100.0)]))
    plans = []
    threads = [
        threading.Thread(target=lambda: plans.append(remote.plan(PlanRequest(JOB, 1))))
        for _ in range(6)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len({p.id for p in plans}) == 1
    assert len(remote.report(JOB.name).plans) == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_tls_brain_answers_clients_that_verify_it_and_nobody_else(tmp_path: Path) -> None:
    cert, key = tmp_path / "brain.crt", tmp_path / "brain.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=brain",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    brain = LocalBrain.open(f"sqlite:///{tmp_path / 'tls.db'}")
    server = BrainServer(brain, token=TOKEN, tls=(cert.read_bytes(), key.read_bytes()))
    server.start()
    try:
        with RemoteBrain(server.address, token=TOKEN, tls_ca=cert.read_bytes()) as client:
            assert client.plan(PlanRequest(JOB, nodes=0)).kind is PlanKind.INITIAL
        with (
            RemoteBrain(server.address, token=TOKEN, timeout_s=2) as plain,
            pytest.raises(Unavailable),
        ):
            plain.plan(PlanRequest(JOB, nodes=0))
    finally:
        server.stop(grace_s=0)
        brain.close()
