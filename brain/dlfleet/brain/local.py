"""`LocalBrain`: the brain in-process, a `Repository` plus the optimizer.

Plans are decided one at a time (a lock), so two concurrent requests of a
job cannot store two plans for one situation. A decision equal to the job's
latest plan, still unapplied, returns that plan instead of storing a copy:
the master may ask as often as it likes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dlfleet.api.errors import InvalidArgument
from dlfleet.brain.optimizer.curve import Curve
from dlfleet.brain.optimizer.planner import OptimizerSettings, PlanContext, decide
from dlfleet.brain.records import (
    JobInfo,
    JobReport,
    MetricsBatch,
    Plan,
    PlanId,
    PlanKind,
    PlanRequest,
    RoundSpan,
    SizeThroughput,
)
from dlfleet.brain.repository import Repository


def system_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def min_round_s(job: JobInfo, default: float) -> float:
    """The job's own minimum measured round, where its master recorded one."""
    value = job.config.get("min_round_s")
    return float(value) if isinstance(value, int | float) and value >= 0 else default


class LocalBrain:
    def __init__(
        self,
        repository: Repository,
        *,
        settings: OptimizerSettings | None = None,
        clock: Callable[[], int] = system_clock_ms,
    ) -> None:
        self.repository = repository
        self.settings = settings or OptimizerSettings()
        self.clock = clock
        self._lock = threading.Lock()

    @classmethod
    def open(
        cls,
        db_url: str,
        *,
        settings: OptimizerSettings | None = None,
        clock: Callable[[], int] = system_clock_ms,
    ) -> LocalBrain:
        return cls(Repository.open(db_url), settings=settings, clock=clock)

    def close(self) -> None:
        self.repository.close()

    def persist(self, batch: MetricsBatch) -> None:
        self.repository.persist(batch, self.clock())

    def plan(self, request: PlanRequest) -> Plan:
        job = request.job.name
        with self._lock:
            now = self.clock()
            repo = self.repository
            repo.upsert_job(request.job, now)
            plans = repo.plans(job)
            relaunch = request.oom_relaunch
            if request.nodes == 0:
                context = PlanContext(
                    request, now, history=repo.history(request.job.signature, exclude=job)
                )
            else:
                peak = 0
                if relaunch is not None:
                    peak = repo.peak_rss(job, relaunch.node) or repo.peak_rss(job)
                horizon = self.settings.stragglers.horizon_ms
                context = PlanContext(
                    request,
                    now,
                    rounds=repo.rounds(job),
                    recent_samples=repo.node_samples(job, since_ms=now - horizon),
                    peak_rss_bytes=peak,
                    plans=plans,
                    node_checks=repo.node_checks(job),
                )
            decision = decide(context, self.settings)
            if decision.kind is PlanKind.NONE:
                return Plan.unstored(job, decision, request.nodes, now)
            latest = plans[-1] if plans else None
            if latest is not None and not latest.applied and decision.same_action(latest):
                return latest
            return repo.save_plan(job, decision, request.nodes, now)

    def mark_applied(self, plan_id: PlanId) -> Plan:
        if plan_id <= 0:
            raise InvalidArgument(f"plan id must be > 0, not {plan_id} (a NONE plan is not stored)")
        return self.repository.mark_applied(plan_id, self.clock())

    def report(self, job: str) -> JobReport:
        """Throughput per node count over every round the job reported (the
        optimizer counts only rounds of `min_round_s`: the job's own, kept in
        its config by the master, else this brain's setting)."""
        stored = self.repository.job(job)
        rounds = self.repository.rounds(job)
        curve = Curve.from_rounds(rounds)
        sizes = []
        for n in curve.sizes:
            point = curve.point(n)
            assert point is not None
            sizes.append(
                SizeThroughput(
                    nodes=n,
                    world_size=point.world_size,
                    rounds=point.rounds,
                    samples_per_s=point.samples_per_s,
                    efficiency=curve.efficiency(n) if curve.reference > 0 else 0.0,
                )
            )
        return JobReport(
            job=stored.info,
            created_ms=stored.created_ms,
            updated_ms=stored.updated_ms,
            sizes=sizes,
            plans=self.repository.plans(job),
            failures=self.repository.failure_counts(job),
            rounds=[RoundSpan(r.round, r.nodes, r.duration_s) for r in rounds],
            min_round_s=min_round_s(stored.info, self.settings.scaling.min_round_s),
            node_checks=sorted(self.repository.node_checks(job).values(), key=lambda c: c.node),
        )
