"""`Repository`: the brain's records in a SQLite, PostgreSQL or MySQL/MariaDB
database (see `models` for the tables, `schema` for their migrations).

Invariants:
- `Repository.open` upgrades the schema to head before anything else.
- Every method is one transaction: it has committed when it returns, or it
  raised and changed nothing. Database failures raise DatabaseError naming the
  URL without its password; unknown jobs and plans raise NotFound.
- A round is keyed by (job, round number): a later report of a round replaces
  the earlier one. Node samples, failures and node checks are appended.
- Times go in and out as Unix milliseconds; the tables hold naive UTC.
- Thread-safe: sessions come from the engine's pool, one per call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, delete, func, insert, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from dlfleet.api.errors import NotFound
from dlfleet.brain import db, schema
from dlfleet.brain.errors import DatabaseError
from dlfleet.brain.models import (
    FailureRow,
    JobRow,
    NodeCheckRow,
    NodeSampleRow,
    PlanRow,
    RoundRow,
)
from dlfleet.brain.optimizer.initial import JobHistory
from dlfleet.brain.records import (
    Decision,
    FailureKind,
    FailureRecord,
    JobInfo,
    JobStatus,
    MetricsBatch,
    NodeCheckRecord,
    NodeSample,
    Plan,
    PlanId,
    PlanKind,
    RoundMetrics,
)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
HISTORY_RUNS = 20  # the most recent runs of a signature the initial plan looks at
_JOB_FIELDS = (
    "min_nodes",
    "max_nodes",
    "initial_nodes",
    "memory_request_bytes",
    "memory_limit_bytes",
    "cpu_request",
)


def to_datetime(ms: int) -> datetime:
    return EPOCH + timedelta(milliseconds=ms)


def to_ms(at: datetime) -> int:
    return (at - EPOCH) // timedelta(milliseconds=1)


@dataclass(frozen=True)
class StoredJob:
    info: JobInfo
    created_ms: int
    updated_ms: int


class Repository:
    def __init__(self, engine: Engine) -> None:
        """Use `Repository.open`: this does not migrate."""
        self.engine = engine
        self.url = db.safe_url(engine.url)
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def open(cls, url: str, *, migrate: bool = True) -> Repository:
        engine = db.create(url)
        try:
            if migrate:
                schema.upgrade(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self, what: str) -> Iterator[Session]:
        try:
            with self._sessions() as session, session.begin():
                yield session
        except SQLAlchemyError as exc:
            raise DatabaseError(f"{what} in {self.url}: {db.describe(exc)}") from exc

    # ------------------------------------------------------------------ jobs

    def upsert_job(self, info: JobInfo, now_ms: int) -> None:
        """Register the job, or update what changed."""
        try:
            with self._transaction(f"saving job {info.name!r}") as session:
                self._upsert_job(session, info, now_ms)
        except DatabaseError as error:
            if not isinstance(error.__cause__, IntegrityError):
                raise
            # Another writer registered it between our select and insert.
            with self._transaction(f"saving job {info.name!r}") as session:
                self._upsert_job(session, info, now_ms)

    def _upsert_job(self, session: Session, info: JobInfo, now_ms: int) -> JobRow:
        row = session.scalars(select(JobRow).where(JobRow.name == info.name)).one_or_none()
        config = _config_of(info)
        now = to_datetime(now_ms)
        if row is None:
            row = JobRow(
                name=info.name,
                signature=info.signature,
                config=config,
                status=info.status.value,
                created_at=now,
                updated_at=now,
            )
            session.add(row)
            session.flush()
        elif (row.signature, row.config, row.status) != (info.signature, config, info.status.value):
            row.signature, row.config, row.status = info.signature, config, info.status.value
            row.updated_at = now
        return row

    def job(self, name: str) -> StoredJob:
        with self._transaction(f"reading job {name!r}") as session:
            row = _job_row(session, name)
            return StoredJob(_info_of(row), to_ms(row.created_at), to_ms(row.updated_at))

    def jobs(self) -> list[StoredJob]:
        """Every job, the most recently updated first."""
        with self._transaction("listing jobs") as session:
            rows = session.scalars(select(JobRow).order_by(JobRow.updated_at.desc(), JobRow.id))
            return [StoredJob(_info_of(r), to_ms(r.created_at), to_ms(r.updated_at)) for r in rows]

    def delete_job(self, name: str) -> None:
        """Forget the job and everything recorded about it."""
        with self._transaction(f"deleting job {name!r}") as session:
            job_id = _job_row(session, name).id
            for table in (PlanRow, FailureRow, NodeCheckRow, NodeSampleRow, RoundRow):
                session.execute(delete(table).where(table.job_id == job_id))
            session.execute(delete(JobRow).where(JobRow.id == job_id))

    # --------------------------------------------------------------- metrics

    def persist(self, batch: MetricsBatch, now_ms: int) -> None:
        """Store one batch; the job must be known or registered by `batch.info`."""
        with self._transaction(f"storing {len(batch)} records of job {batch.job!r}") as session:
            if batch.info is not None:
                job_id = self._upsert_job(session, batch.info, now_ms).id
            else:
                job_id = _job_row(session, batch.job).id
            if batch.rounds:
                _upsert_rounds(session, job_id, batch.rounds)
            if batch.samples:
                session.execute(
                    insert(NodeSampleRow), [_sample_row(job_id, s) for s in batch.samples]
                )
            if batch.failures:
                session.execute(
                    insert(FailureRow), [_failure_row(job_id, f) for f in batch.failures]
                )
            if batch.node_checks:
                session.execute(
                    insert(NodeCheckRow), [_check_row(job_id, c) for c in batch.node_checks]
                )

    def rounds(self, job: str) -> list[RoundMetrics]:
        with self._transaction(f"reading the rounds of job {job!r}") as session:
            job_id = _job_row(session, job).id
            rows = session.scalars(
                select(RoundRow).where(RoundRow.job_id == job_id).order_by(RoundRow.round)
            )
            return [_round_of(r) for r in rows]

    def node_samples(
        self, job: str, *, since_ms: int | None = None, node: str | None = None
    ) -> list[NodeSample]:
        """Oldest first."""
        with self._transaction(f"reading the node samples of job {job!r}") as session:
            query = select(NodeSampleRow).where(NodeSampleRow.job_id == _job_row(session, job).id)
            if since_ms is not None:
                query = query.where(NodeSampleRow.at >= to_datetime(since_ms))
            if node is not None:
                query = query.where(NodeSampleRow.node == node)
            rows = session.scalars(query.order_by(NodeSampleRow.at, NodeSampleRow.id))
            return [_sample_of(r) for r in rows]

    def peak_rss(self, job: str, node: str | None = None) -> int:
        """The largest RSS a node of the job (or `node`) reported; 0 if none."""
        with self._transaction(f"reading the peak RSS of job {job!r}") as session:
            query = select(func.max(NodeSampleRow.memory_rss_bytes)).where(
                NodeSampleRow.job_id == _job_row(session, job).id
            )
            if node is not None:
                query = query.where(NodeSampleRow.node == node)
            return int(session.scalar(query) or 0)

    def failures(self, job: str) -> list[FailureRecord]:
        """Oldest first."""
        with self._transaction(f"reading the failures of job {job!r}") as session:
            job_id = _job_row(session, job).id
            rows = session.scalars(
                select(FailureRow)
                .where(FailureRow.job_id == job_id)
                .order_by(FailureRow.at, FailureRow.id)
            )
            return [_failure_of(r) for r in rows]

    def node_checks(self, job: str) -> dict[str, NodeCheckRecord]:
        """Each node's latest pre-flight check."""
        with self._transaction(f"reading the node checks of job {job!r}") as session:
            job_id = _job_row(session, job).id
            rows = session.scalars(
                select(NodeCheckRow)
                .where(NodeCheckRow.job_id == job_id)
                .order_by(NodeCheckRow.at, NodeCheckRow.id)
            )
            return {row.node: _check_of(row) for row in rows}

    def failure_counts(self, job: str) -> dict[FailureKind, int]:
        with self._transaction(f"counting the failures of job {job!r}") as session:
            job_id = _job_row(session, job).id
            rows = session.execute(
                select(FailureRow.kind, func.count())
                .where(FailureRow.job_id == job_id)
                .group_by(FailureRow.kind)
            )
            return {FailureKind(kind): int(count) for kind, count in rows}

    def history(self, signature: str, *, exclude: str | None = None) -> list[JobHistory]:
        """What the latest runs of `signature` (but `exclude`) measured."""
        with self._transaction(f"reading the history of signature {signature!r}") as session:
            query = select(JobRow).where(JobRow.signature == signature)
            if exclude is not None:
                query = query.where(JobRow.name != exclude)
            jobs = session.scalars(
                query.order_by(JobRow.updated_at.desc(), JobRow.id.desc()).limit(HISTORY_RUNS)
            ).all()
            found = []
            for job in jobs:
                rounds = session.scalars(
                    select(RoundRow).where(RoundRow.job_id == job.id).order_by(RoundRow.round)
                )
                rss, cpu = session.execute(
                    select(
                        func.max(NodeSampleRow.memory_rss_bytes),
                        func.max(NodeSampleRow.cpu_percent),
                    ).where(NodeSampleRow.job_id == job.id)
                ).one()
                ooms = session.scalar(
                    select(func.count()).where(
                        FailureRow.job_id == job.id, FailureRow.kind == FailureKind.OOM.value
                    )
                )
                found.append(
                    JobHistory(
                        name=job.name,
                        rounds=[_round_of(r) for r in rounds],
                        peak_rss_bytes=int(rss or 0),
                        peak_cpu_percent=float(cpu or 0.0),
                        ooms=int(ooms or 0),
                    )
                )
            return found

    # ----------------------------------------------------------------- plans

    def save_plan(self, job: str, decision: Decision, current_nodes: int, now_ms: int) -> Plan:
        with self._transaction(f"saving a {decision.kind.value} plan of job {job!r}") as session:
            row = PlanRow(
                job_id=_job_row(session, job).id,
                kind=decision.kind.value,
                current_nodes=current_nodes,
                target_nodes=decision.target_nodes,
                node=decision.node,
                memory_bytes=decision.memory_bytes,
                cpu=decision.cpu,
                reason=decision.reason,
                evidence=dict(decision.evidence),
                created_at=to_datetime(now_ms),
                applied=False,
                applied_at=None,
            )
            session.add(row)
            session.flush()
            return _plan_of(row, job)

    def mark_applied(self, plan_id: int, now_ms: int) -> Plan:
        """Idempotent: a plan applied before keeps its first time."""
        with self._transaction(f"marking plan {plan_id} applied") as session:
            found = session.execute(
                select(PlanRow, JobRow.name)
                .join(JobRow, JobRow.id == PlanRow.job_id)
                .where(PlanRow.id == plan_id)
            ).one_or_none()
            if found is None:
                raise NotFound(f"no plan {plan_id}")
            row, job = found
            if not row.applied:
                row.applied, row.applied_at = True, to_datetime(now_ms)
            return _plan_of(row, job)

    def plans(self, job: str) -> list[Plan]:
        """Oldest first."""
        with self._transaction(f"reading the plans of job {job!r}") as session:
            job_id = _job_row(session, job).id
            rows = session.scalars(
                select(PlanRow).where(PlanRow.job_id == job_id).order_by(PlanRow.id)
            )
            return [_plan_of(r, job) for r in rows]


# ------------------------------------------------------------ row <-> record


def _job_row(session: Session, name: str) -> JobRow:
    row = session.scalars(select(JobRow).where(JobRow.name == name)).one_or_none()
    if row is None:
        raise NotFound(f"no job {name!r} in the brain")
    return row


def _config_of(info: JobInfo) -> dict[str, Any]:
    config: dict[str, Any] = {name: getattr(info, name) for name in _JOB_FIELDS}
    config["extra"] = dict(info.config)
    return config


def _info_of(row: JobRow) -> JobInfo:
    config = dict(row.config)
    return JobInfo(
        name=row.name,
        signature=row.signature,
        status=JobStatus(row.status),
        config=config.pop("extra", {}),
        **{name: config[name] for name in _JOB_FIELDS if name in config},
    )


def _upsert_rounds(session: Session, job_id: int, rounds: Sequence[RoundMetrics]) -> None:
    latest = {r.round: r for r in rounds}  # the last report of a round in the batch wins
    existing = {
        row.round: row
        for row in session.scalars(
            select(RoundRow).where(RoundRow.job_id == job_id, RoundRow.round.in_(latest))
        )
    }
    for number, metrics in latest.items():
        values = _round_values(metrics)
        row = existing.get(number)
        if row is None:
            session.add(RoundRow(job_id=job_id, **values))
        else:
            for key, value in values.items():
                setattr(row, key, value)


def _round_values(r: RoundMetrics) -> dict[str, Any]:
    return {
        "round": r.round,
        "nodes": r.nodes,
        "world_size": r.world_size,
        "started_at": to_datetime(r.started_ms),
        "ended_at": to_datetime(r.ended_ms),
        "samples_per_s": r.samples_per_s,
        "step_time_mean_s": r.step_time_mean_s,
        "step_time_p50_s": r.step_time_p50_s,
        "step_time_p90_s": r.step_time_p90_s,
    }


def _round_of(row: RoundRow) -> RoundMetrics:
    return RoundMetrics(
        round=row.round,
        nodes=row.nodes,
        world_size=row.world_size,
        started_ms=to_ms(row.started_at),
        ended_ms=to_ms(row.ended_at),
        samples_per_s=row.samples_per_s,
        step_time_mean_s=row.step_time_mean_s,
        step_time_p50_s=row.step_time_p50_s,
        step_time_p90_s=row.step_time_p90_s,
    )


def _sample_row(job_id: int, s: NodeSample) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "node": s.node,
        "round": s.round,
        "at": to_datetime(s.at_ms),
        "cpu_percent": s.cpu_percent,
        "memory_rss_bytes": s.memory_rss_bytes,
        "memory_limit_bytes": s.memory_limit_bytes,
        "memory_request_bytes": s.memory_request_bytes,
        "samples_per_s": s.samples_per_s,
        "step_time_s": s.step_time_s,
    }


def _sample_of(row: NodeSampleRow) -> NodeSample:
    return NodeSample(
        node=row.node,
        round=row.round,
        at_ms=to_ms(row.at),
        cpu_percent=row.cpu_percent,
        memory_rss_bytes=row.memory_rss_bytes,
        memory_limit_bytes=row.memory_limit_bytes,
        memory_request_bytes=row.memory_request_bytes,
        samples_per_s=row.samples_per_s,
        step_time_s=row.step_time_s,
    )


def _failure_row(job_id: int, f: FailureRecord) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "node": f.node,
        "kind": f.kind.value,
        "exit_code": f.exit_code,
        "message": f.message,
        "at": to_datetime(f.at_ms),
    }


def _failure_of(row: FailureRow) -> FailureRecord:
    return FailureRecord(
        node=row.node,
        kind=FailureKind(row.kind),
        at_ms=to_ms(row.at),
        exit_code=row.exit_code,
        message=row.message,
    )


def _check_row(job_id: int, c: NodeCheckRecord) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "node": c.node,
        "at": to_datetime(c.at_ms),
        "faulty": c.faulty,
        "rule": c.rule,
        "compute_ms": c.compute_ms,
        "compute_reference_ms": c.compute_reference_ms,
        "pair_ms": c.pair_ms,
        "pair_reference_ms": c.pair_reference_ms,
        "reason": c.reason,
    }


def _check_of(row: NodeCheckRow) -> NodeCheckRecord:
    return NodeCheckRecord(
        node=row.node,
        at_ms=to_ms(row.at),
        faulty=row.faulty,
        rule=row.rule,
        compute_ms=row.compute_ms,
        compute_reference_ms=row.compute_reference_ms,
        pair_ms=row.pair_ms,
        pair_reference_ms=row.pair_reference_ms,
        reason=row.reason,
    )


def _plan_of(row: PlanRow, job: str) -> Plan:
    return Plan(
        id=PlanId(row.id),
        job=job,
        kind=PlanKind(row.kind),
        reason=row.reason,
        evidence=dict(row.evidence),
        created_ms=to_ms(row.created_at),
        current_nodes=row.current_nodes,
        target_nodes=row.target_nodes,
        node=row.node,
        memory_bytes=row.memory_bytes,
        cpu=row.cpu,
        applied=row.applied,
        applied_ms=None if row.applied_at is None else to_ms(row.applied_at),
    )
