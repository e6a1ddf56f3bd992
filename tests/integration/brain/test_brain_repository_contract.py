"""One contract for `Repository`, run on SQLite, PostgreSQL and MariaDB; and the
schema's migrations on each (from empty, down and up again, agreeing with the
models)."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from dlfleet.api.errors import InvalidArgument, NotFound
from dlfleet.brain import db, schema
from dlfleet.brain.errors import DatabaseError, SchemaError
from dlfleet.brain.models import Base
from dlfleet.brain.records import (
    Decision,
    FailureKind,
    FailureRecord,
    JobInfo,
    JobStatus,
    MetricsBatch,
    NodeCheckRecord,
    NodeSample,
    PlanKind,
    RoundMetrics,
)
from dlfleet.brain.repository import Repository

pytestmark = pytest.mark.integration

GIB = 1 << 30
T0 = 1_700_000_000_123  # ms: the milliseconds must survive every backend
JOB = JobInfo(
    name="résnet-run-1",
    signature="resnet50/bs256",
    min_nodes=1,
    max_nodes=8,
    initial_nodes=2,
    memory_request_bytes=6 * GIB,
    memory_limit_bytes=8 * GIB,
    cpu_request=3.5,
    config={"image": "trainer:1", "args": ["--lr", 0.1]},
)
TABLES = {
    "brain_jobs",
    "brain_rounds",
    "brain_node_samples",
    "brain_failures",
    "brain_plans",
    "brain_node_checks",
}


def batch(**kwargs: object) -> MetricsBatch:
    return MetricsBatch(JOB.name, JOB, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------ contract


def test_a_job_round_trips_with_its_config(repository: Repository) -> None:
    repository.upsert_job(JOB, T0)
    stored = repository.job(JOB.name)
    assert stored.info == JOB
    assert (stored.created_ms, stored.updated_ms) == (T0, T0)


def test_registering_again_updates_only_what_changed(repository: Repository) -> None:
    repository.upsert_job(JOB, T0)
    repository.upsert_job(JOB, T0 + 1_000)
    assert repository.job(JOB.name).updated_ms == T0
    done = JobInfo(**{**JOB.__dict__, "status": JobStatus.SUCCEEDED})
    repository.upsert_job(done, T0 + 2_000)
    stored = repository.job(JOB.name)
    assert stored.info.status is JobStatus.SUCCEEDED
    assert (stored.created_ms, stored.updated_ms) == (T0, T0 + 2_000)
    assert [j.info.name for j in repository.jobs()] == [JOB.name]


def test_a_later_report_of_a_round_replaces_it(repository: Repository) -> None:
    first = RoundMetrics(3, 2, 8, T0, T0 + 30_000, 120.5, 0.25, 0.24, 0.3)
    later = RoundMetrics(3, 2, 8, T0, T0 + 90_000, 125.25, 0.26, 0.25, 0.31)
    other = RoundMetrics(4, 4, 16, T0 + 90_000, T0 + 150_000, 230.0)
    repository.persist(batch(rounds=[first]), T0)
    repository.persist(MetricsBatch(JOB.name, rounds=[later, other]), T0)
    assert repository.rounds(JOB.name) == [later, other]


def test_samples_and_failures_are_appended_and_read_back_exactly(
    repository: Repository,
) -> None:
    samples = [
        NodeSample("node-0", 1, T0 + i, 150.5, (5 + i) * GIB, 8 * GIB, 6 * GIB, 50.0, 0.5)
        for i in range(3)
    ]
    failures = [
        FailureRecord("node-1", FailureKind.OOM, T0 + 5, 137, "OOMKilled: ✗"),
        FailureRecord("node-2", FailureKind.LOST, T0 + 6),
    ]
    repository.persist(batch(samples=samples[:2], failures=failures), T0)
    repository.persist(MetricsBatch(JOB.name, samples=samples[2:]), T0)
    assert repository.node_samples(JOB.name) == samples
    assert repository.node_samples(JOB.name, since_ms=T0 + 1, node="node-0") == samples[1:]
    assert repository.failures(JOB.name) == failures
    assert repository.failure_counts(JOB.name) == {FailureKind.OOM: 1, FailureKind.LOST: 1}
    assert repository.peak_rss(JOB.name) == 7 * GIB
    assert repository.peak_rss(JOB.name, "node-9") == 0


def test_node_checks_are_kept_and_the_latest_per_node_read_back(repository: Repository) -> None:
    first = NodeCheckRecord("node-1", T0, False, "healthy", 12.25, 10.0, 0.5, 0.5, "matmul ✓")
    again = NodeCheckRecord("node-1", T0 + 9, True, "compute_slow", 31.5, 10.0, 0.0, 0.5, "slow")
    other = NodeCheckRecord("node-0", T0 + 1, False, "healthy", 10.0, 12.25, 0.5, 0.5)
    repository.persist(batch(node_checks=[first, other]), T0)
    repository.persist(MetricsBatch(JOB.name, node_checks=[again]), T0)
    assert repository.node_checks(JOB.name) == {"node-1": again, "node-0": other}


def test_metrics_of_an_unknown_job_are_refused_and_change_nothing(
    repository: Repository,
) -> None:
    with pytest.raises(NotFound, match="no job"):
        repository.persist(MetricsBatch("ghost", rounds=[RoundMetrics(1, 1, 1, T0, T0, 1.0)]), T0)
    assert repository.jobs() == []


def test_a_failed_batch_stores_none_of_it(repository: Repository) -> None:
    repository.upsert_job(JOB, T0)
    good, bad = NodeSample("a", 1, T0), NodeSample("b", 1, T0)
    object.__setattr__(bad, "node", None)  # past the checks: the database refuses it
    with pytest.raises(DatabaseError, match="storing 3 records"):
        repository.persist(
            MetricsBatch(
                JOB.name, rounds=[RoundMetrics(1, 1, 1, T0, T0, 1.0)], samples=[good, bad]
            ),
            T0,
        )
    assert repository.rounds(JOB.name) == []
    assert repository.node_samples(JOB.name) == []


def test_plans_are_stored_with_reason_and_evidence_and_marked_applied_once(
    repository: Repository,
) -> None:
    repository.upsert_job(JOB, T0)
    evidence = {"throughput": {"1": 100.0, "2": 199.5}, "abandoned": [], "note": "ü"}
    decision = Decision(PlanKind.SCALE, "scale up from 2 to 4 nodes", evidence, target_nodes=4)
    plan = repository.save_plan(JOB.name, decision, 2, T0)
    assert (plan.kind, plan.current_nodes, plan.target_nodes, plan.evidence) == (
        PlanKind.SCALE,
        2,
        4,
        evidence,
    )
    assert not plan.applied
    applied = repository.mark_applied(plan.id, T0 + 10)
    again = repository.mark_applied(plan.id, T0 + 99)
    assert applied.applied and again.applied_ms == applied.applied_ms == T0 + 10
    memory = repository.save_plan(
        JOB.name, Decision(PlanKind.MEMORY, "oom", node="n", memory_bytes=12 * GIB), 2, T0 + 20
    )
    assert [p.id for p in repository.plans(JOB.name)] == [plan.id, memory.id]
    assert repository.plans(JOB.name)[1].memory_bytes == 12 * GIB
    with pytest.raises(NotFound):
        repository.mark_applied(memory.id + 1000, T0)


def test_history_is_what_other_runs_of_the_signature_measured(repository: Repository) -> None:
    for i, rss in enumerate((4 * GIB, 6 * GIB)):
        run = JobInfo(name=f"old-{i}", signature=JOB.signature)
        repository.persist(
            MetricsBatch(
                run.name,
                run,
                rounds=[RoundMetrics(1, 2, 2, T0, T0 + 60_000, 10.0 * (i + 1))],
                samples=[NodeSample("a", 1, T0, cpu_percent=90.0 + i, memory_rss_bytes=rss)],
                failures=[FailureRecord("a", FailureKind.OOM, T0)] * i,
            ),
            T0 + i,
        )
    other = JobInfo(name="other", signature="different")
    repository.upsert_job(other, T0)
    repository.upsert_job(JOB, T0)
    history = repository.history(JOB.signature, exclude=JOB.name)
    assert [(h.name, h.peak_rss_bytes, h.peak_cpu_percent, h.ooms) for h in history] == [
        ("old-1", 6 * GIB, 91.0, 1),
        ("old-0", 4 * GIB, 90.0, 0),
    ]
    assert history[0].rounds[0].samples_per_s == 20.0


def test_deleting_a_job_deletes_its_records(repository: Repository) -> None:
    repository.persist(
        batch(
            rounds=[RoundMetrics(1, 1, 1, T0, T0, 1.0)],
            samples=[NodeSample("a", 1, T0)],
            failures=[FailureRecord("a", FailureKind.HANG, T0)],
            node_checks=[NodeCheckRecord("a", T0, False, "healthy")],
        ),
        T0,
    )
    repository.save_plan(JOB.name, Decision(PlanKind.SCALE, "r", target_nodes=2), 1, T0)
    repository.delete_job(JOB.name)
    with pytest.raises(NotFound):
        repository.job(JOB.name)
    with repository.engine.connect() as conn:
        for table in TABLES:
            assert conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar() == 0


def test_concurrent_first_registrations_of_one_job_both_succeed(
    repository: Repository,
) -> None:
    errors: list[BaseException] = []

    def register() -> None:
        try:
            repository.persist(batch(samples=[NodeSample("a", 1, T0)]), T0)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=register) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] or all(isinstance(e, DatabaseError) for e in errors)
    assert len(repository.jobs()) == 1


# ---------------------------------------------------------------- migrations


def test_the_migration_from_empty_creates_every_table(empty_db_url: str) -> None:
    assert schema.migrate(empty_db_url) == schema.head()
    engine = db.create(empty_db_url)
    try:
        names = set(inspect(engine).get_table_names())
        assert TABLES | {schema.VERSION_TABLE} <= names
        with engine.connect() as conn:
            assert schema.current(conn) == schema.head()
        schema.upgrade(engine)  # at head: nothing to do
    finally:
        engine.dispose()


def test_the_models_and_the_migrations_agree(empty_db_url: str) -> None:
    schema.migrate(empty_db_url)
    engine = db.create(empty_db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "version_table": schema.VERSION_TABLE}
            )
            diff = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_downgrade_to_empty_and_upgrade_again(empty_db_url: str) -> None:
    schema.migrate(empty_db_url)
    engine = db.create(empty_db_url)
    try:
        schema.downgrade(engine, "base")
        assert not TABLES & set(inspect(engine).get_table_names())
        schema.upgrade(engine)
        assert set(inspect(engine).get_table_names()) >= TABLES
    finally:
        engine.dispose()
    with Repository.open(empty_db_url) as repo:
        repo.upsert_job(JOB, T0)
        assert repo.job(JOB.name).info == JOB


def test_a_schema_from_a_newer_brain_is_refused(empty_db_url: str) -> None:
    schema.migrate(empty_db_url)
    engine = db.create(empty_db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"UPDATE {schema.VERSION_TABLE} SET version_num = '9999'"))
        with pytest.raises(SchemaError, match="9999"):
            Repository.open(empty_db_url)
    finally:
        engine.dispose()


def test_bad_urls_are_refused_clearly() -> None:
    with pytest.raises(InvalidArgument, match="bad database URL"):
        Repository.open("not a url")
    with pytest.raises(InvalidArgument, match="unsupported database"):
        Repository.open("oracle://scott:tiger@db/x")


def test_an_unreachable_database_names_it_without_the_password() -> None:
    with pytest.raises(DatabaseError) as caught:
        Repository.open("postgresql+psycopg://brain:s3cret@127.0.0.1:1/brain")
    assert "127.0.0.1:1" in str(caught.value) and "s3cret" not in str(caught.value)
