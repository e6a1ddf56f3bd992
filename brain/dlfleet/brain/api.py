"""What the master talks to: `BrainApi`, served in-process (`LocalBrain`, a
database plus the optimizer) or by a `dlbrain` service (`RemoteBrain`), and
`open_brain` to pick one. `BrainReporter` sends metrics without ever making
the caller wait.

All calls are synchronous and thread-safe; an asyncio caller runs `plan` in a
thread (`asyncio.to_thread`) and reports through a `BrainReporter`. Failures
raise `dlfleet.api.errors` (Unavailable when the brain or its database cannot
be reached, InvalidArgument for bad fields, NotFound for unknown jobs/plans).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from dlfleet.brain.records import JobReport, MetricsBatch, Plan, PlanId, PlanRequest

if TYPE_CHECKING:
    from dlfleet.brain.optimizer.planner import OptimizerSettings

DEFAULT_DB_URL = "sqlite:///brain.db"


class BrainApi(Protocol):
    def persist(self, batch: MetricsBatch) -> None:
        """Store what one job measured (registering it if `batch.info` is set)."""

    def plan(self, request: PlanRequest) -> Plan:
        """The plan for the job now. Registers/updates `request.job`. A NONE plan
        (id 0) is not stored; asking again before a stored plan is applied
        returns that same plan when nothing changed."""

    def mark_applied(self, plan_id: PlanId) -> Plan:
        """Record that the master carried out the plan (idempotent)."""

    def report(self, job: str) -> JobReport:
        """Throughput per node count, every stored plan, failure counts."""

    def close(self) -> None: ...


def open_brain(
    url: str | None,
    db_url: str = DEFAULT_DB_URL,
    *,
    token: str = "",
    tls_ca: bytes | None = None,
    settings: OptimizerSettings | None = None,
) -> BrainApi:
    """A `dlbrain` service at `url` ("host:port", with `token`), or, when `url`
    is None or empty, an in-process brain on the database at `db_url`
    (migrated to the current schema on open), deciding with `settings`."""
    if url:
        from dlfleet.brain.client import RemoteBrain

        return RemoteBrain(url, token=token, tls_ca=tls_ca)
    from dlfleet.brain.local import LocalBrain

    return LocalBrain.open(db_url, settings=settings)
