"""The job's link to the brain: metrics out, plans in.

The runner calls this from its event loop, and nothing here ever makes it
wait on the brain: metrics go through a `BrainReporter` (a bounded queue and
a thread of its own; what cannot be delivered is retried, then counted as
dropped), and plans are asked for on a worker thread every `plan_interval_s`;
the runner picks up the answer on a later tick. Only the memory of a node
relaunched after an OOM kill is asked for on the spot, with a short timeout
(the fallback is the job's own factor).

What it reports, from the master's status and the platform:
- rounds: for the active round, the median of the job's samples/s (the sum
  of the nodes' heartbeat metrics, once every node of the round has reported
  since the round began), re-reported every few seconds as the round goes on;
- node samples: each running node's CPU, RSS, memory limit, samples/s and
  step time;
- failures: node exits (lost, OOM-killed, evicted), nodes their pre-flight
  check found slow or broken (with its verdict), and worker failures the
  agents reported (crash, or hang from the step watchdog).

The brain's run of a job is `<name>-<run id>`, the run id kept in the
workdir: a restarted master continues the same run; the signature names "the
same kind of job", whose earlier runs seed a new run's initial plan.

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import secrets
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlfleet.api.errors import DlfleetError
from dlfleet.api.v1 import job_pb2, nodecheck_pb2
from dlfleet.brain import (
    BrainApi,
    BrainReporter,
    FailureKind,
    FailureRecord,
    InitialSettings,
    JobInfo,
    JobStatus,
    NodeCheckRecord,
    NodeSample,
    OomRelaunch,
    OptimizerSettings,
    Plan,
    PlanKind,
    PlanRequest,
    RoundMetrics,
    ScalingSettings,
    open_brain,
)
from dlfleet.master.job.jobconfig import JobConfig
from dlfleet.master.job.platform import REASON_EVICTED, REASON_OOM, Node
from dlfleet.master.job.tally import SupervisorTally

_log = logging.getLogger(__name__)

REPORT_EVERY_S = 2.0
OOM_PLAN_TIMEOUT_S = 3.0
RUN_FILE = "brain-run"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def signature(config: JobConfig) -> str:
    """What makes two runs "the same kind of job": the name, and the hash of
    what they run and on what."""
    if config.brain.signature:
        return config.brain.signature
    what = {
        "command": config.command,
        "args": config.args,
        "module": config.module,
        "nproc_per_node": config.nproc_per_node,
        "platform": config.platform,
        "image": config.kubernetes.image if config.kubernetes else "",
    }
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return f"{config.name}:{digest}"


def run_id(config: JobConfig) -> str:
    path = config.work_dir / RUN_FILE
    try:
        return path.read_text().strip()
    except OSError:
        value = secrets.token_hex(4)
        path.write_text(value + "\n")
        return value


@dataclass
class _Round:
    round: int
    nodes: int
    world_size: int
    started_ms: int
    totals: list[float] = field(default_factory=list)  # samples/s of the job, sampled
    step_times: list[float] = field(default_factory=list)  # seconds, per node sample


class BrainLink:
    def __init__(self, config: JobConfig, token: str, tally: SupervisorTally | None = None) -> None:
        """`tally`: where each plan that comes back is counted, by action."""
        self.config = config
        self.token = token
        self.tally = tally
        self.mode = config.brain.mode
        self.api: BrainApi | None = None
        self.reporter: BrainReporter | None = None
        self.info: JobInfo | None = None
        self.last_plan = ""
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="brain")
        self._asked: concurrent.futures.Future[Plan] | None = None
        self._asked_at = 0.0
        self._round: _Round | None = None
        self._reported_at = 0.0
        self._failures_seen: set[tuple[str, int, int, int]] = set()
        self._down = False

    @property
    def enabled(self) -> bool:
        return self.api is not None

    # ------------------------------------------------------------- life

    def open(self) -> None:
        """Open the brain (in-process: migrate its database). A brain that
        cannot be opened is logged, and the job runs without it."""
        config = self.config
        if self.mode == "off":
            return
        brain = config.brain
        self.info = JobInfo(
            name=f"{config.name}-{run_id(config)}",
            signature=signature(config),
            min_nodes=config.nodes.min,
            max_nodes=config.nodes.maximum,
            initial_nodes=config.nodes.start,
            memory_limit_bytes=(config.kubernetes.memory_bytes or 0) if config.kubernetes else 0,
            config={"name": config.name, "platform": config.platform,
                    "nproc_per_node": config.nproc_per_node,
                    "min_round_s": brain.min_round_s},
        )  # fmt: skip
        settings = OptimizerSettings(
            scaling=ScalingSettings(min_round_s=brain.min_round_s, grow_share=brain.grow_share),
            initial=InitialSettings(min_round_s=brain.min_round_s),
        )
        try:
            if brain.address:
                token = self.token
                if brain.token_file is not None:
                    token = config.path(brain.token_file).read_text().strip()
                self.api = open_brain(brain.address, token=token)
            else:
                (config.base_dir / ".dlfleet").mkdir(parents=True, exist_ok=True)
                self.api = open_brain(None, config.brain_db_url, settings=settings)
        except (DlfleetError, OSError) as error:
            _log.warning("the brain is not available (%s): the job runs without it", error)
            self.last_plan = f"brain unavailable: {error}"
            return
        self.reporter = BrainReporter(self.api, self.info)
        where = brain.address or config.brain_db_url
        _log.info("brain: %s (%s), job run %s", where, self.mode, self.info.name)

    def close(self, code: int | None) -> None:
        if self.reporter is not None and self.info is not None and code is not None:
            status = JobStatus.SUCCEEDED if code == 0 else JobStatus.FAILED
            self.reporter.update_job(dataclasses.replace(self.info, status=status))
        if self.reporter is not None:
            stats = self.reporter.close(timeout_s=5.0)
            if stats.dropped:
                _log.warning("brain: %d metrics records could not be delivered (%s)",
                             stats.dropped, stats.last_error)  # fmt: skip
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.api is not None:
            self.api.close()
            if self.info is not None and not self.config.brain.address:
                _log.info("brain report: dlbrain report %s --db %s",
                          self.info.name, self.config.brain_db_url)  # fmt: skip

    # ------------------------------------------------------------- plans

    def initial_nodes(self, default: int, timeout_s: float = 10.0) -> int:
        """The node count to start with: the brain's initial plan in `auto`
        mode (from past runs of the same kind), else `default`."""
        if self.api is None:  # brain.mode off, or a brain that could not open
            return default
        plan = self._ask_now(PlanRequest(job=self._job(), nodes=0), timeout_s)
        if plan is None:
            return default
        self._note(plan, applied=self.mode == "auto" and plan.kind is PlanKind.INITIAL)
        if self.mode != "auto" or plan.kind is not PlanKind.INITIAL or not plan.target_nodes:
            return default
        self._mark_applied(plan)
        low, high = self.config.nodes.min, self.config.nodes.maximum
        return min(max(plan.target_nodes, low), high)

    def poll_plan(self, target: int, memory_bytes: int | None) -> Plan | None:
        """A plan to carry out, when one came back; asks for the next one
        every `plan_interval_s`. Never blocks."""
        if self.api is None:
            return None
        if self._asked is not None and self._asked.done():
            asked, self._asked = self._asked, None
            try:
                plan = asked.result()
            except DlfleetError as error:
                if not self._down:
                    _log.warning("brain: no plan (%s); training goes on", error)
                self._down = True
                self.last_plan = f"brain unavailable: {error}"
                return None
            self._down = False
            if plan.kind is PlanKind.NONE:
                self._count(plan, applied=False)
                self.last_plan = f"keep {target} nodes: {plan.reason}"
                return None
            return plan
        interval = self.config.brain.plan_interval_s
        if self._asked is None and time.monotonic() - self._asked_at >= interval:
            self._asked_at = time.monotonic()
            request = PlanRequest(
                job=self._job(), nodes=target, memory_limit_bytes=memory_bytes or 0
            )
            self._asked = self._executor.submit(self._plan, request)
        return None

    def applied(self, plan: Plan, applied: bool, note: str = "") -> None:
        """Record what became of a plan (carried out, or only advice)."""
        self._note(plan, applied, note)
        if applied:
            self._mark_applied(plan)

    def memory_after_oom(self, node: Node, target: int) -> int | None:
        """The memory for a node relaunched after an OOM kill: the brain's
        (observed peak x margin, or limit x factor, capped), or None."""
        if self.api is None or node.memory_bytes is None or self.mode != "auto":
            return None
        request = PlanRequest(
            job=self._job(),
            nodes=max(1, target),
            memory_limit_bytes=node.memory_bytes,
            oom_relaunch=OomRelaunch(node.name, node.memory_bytes),
        )
        plan = self._ask_now(request, OOM_PLAN_TIMEOUT_S)
        if plan is None or plan.kind is not PlanKind.MEMORY or plan.memory_bytes <= 0:
            return None
        self.applied(plan, True)
        return plan.memory_bytes

    # ----------------------------------------------------------- metrics

    def observe(self, view: job_pb2.MasterStatus, nodes: Sequence[Node]) -> None:
        """Fold the master's latest status into round and node metrics."""
        if self.reporter is None:
            return
        now = now_ms()
        self._report_worker_failures(view)
        if view.round != (self._round.round if self._round else 0):
            self._end_round(now)
            if view.round and view.round_nodes:
                self._round = _Round(view.round, view.round_nodes, view.world_size, now)
        current = self._round
        if current is None:
            return
        fresh = [
            r for r in view.nodes if view.now_unix_ms - r.at_unix_ms < 3_000 and r.metrics.steps > 0
        ]
        if len(fresh) >= current.nodes and all(r.metrics.step_time_ms > 0 for r in fresh):
            current.totals.append(sum(r.metrics.samples_per_second for r in fresh))
            current.step_times.extend(r.metrics.step_time_ms / 1000 for r in fresh)
        if time.monotonic() - self._reported_at < REPORT_EVERY_S:
            return
        self._reported_at = time.monotonic()
        self._report_round(current, now)
        names = {node.name: node for node in nodes}
        for report in fresh:
            name = report.node_id.rpartition("#")[0]
            node = names.get(name)
            m = report.metrics
            self.reporter.report_node_sample(
                NodeSample(
                    node=name,
                    round=current.round,
                    at_ms=now,
                    cpu_percent=m.cpu_percent,
                    memory_rss_bytes=m.rss_bytes,
                    memory_limit_bytes=m.memory_limit_bytes
                    or ((node.memory_bytes or 0) if node else 0),
                    samples_per_s=m.samples_per_second,
                    step_time_s=m.step_time_ms / 1000,
                )
            )

    def node_checked(self, name: str, verdict: nodecheck_pb2.NodeCheckVerdict) -> None:
        """Every node's pre-flight check, healthy or not, with its numbers:
        the straggler detector remembers a node the check measured slow."""
        if self.reporter is None:
            return
        pairs = [
            p.allreduce_ms
            for p in verdict.pairs
            if p.outcome in ("good", "slow") and not p.helper and p.allreduce_ms > 0
        ]
        self.reporter.report_node_check(
            NodeCheckRecord(
                node=name,
                at_ms=verdict.at_ms,
                faulty=verdict.faulty,
                rule=verdict.rule or "healthy",
                compute_ms=verdict.compute_ms,
                compute_reference_ms=verdict.compute_reference_ms,
                pair_ms=min(pairs, default=0.0),
                pair_reference_ms=verdict.pair_reference_ms,
                reason=verdict.reason,
            )
        )

    def node_check_failed(self, node: Node, why: str) -> None:
        """A node its pre-flight check found slow or broken: remembered as a
        failure of that kind, with the numbers (`dlbrain report` counts them)."""
        if self.reporter is None:
            return
        self.reporter.report_failure(
            FailureRecord(node.name, FailureKind.NODE_CHECK, now_ms(), exit_code=6, message=why)
        )

    def node_ended(self, node: Node, code: int, reason: str, lost: bool) -> None:
        if self.reporter is None:
            return
        if reason == REASON_OOM:
            kind = FailureKind.OOM
        elif reason == REASON_EVICTED:
            kind = FailureKind.EVICTED
        elif lost:
            kind = FailureKind.LOST
        else:
            kind = FailureKind.CRASH
        self.reporter.report_failure(
            FailureRecord(node.name, kind, now_ms(), exit_code=code, message=reason)
        )

    # ------------------------------------------------------------ helpers

    def _job(self) -> JobInfo:
        assert self.info is not None
        return self.info

    def _plan(self, request: PlanRequest) -> Plan:
        assert self.api is not None
        return self.api.plan(request)

    def _ask_now(self, request: PlanRequest, timeout_s: float) -> Plan | None:
        if self.api is None:
            return None
        future = self._executor.submit(self._plan, request)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            _log.warning("brain: no answer within %.0fs; going on without it", timeout_s)
        except DlfleetError as error:
            _log.warning("brain: %s; going on without it", error)
        return None

    def _mark_applied(self, plan: Plan) -> None:
        api = self.api
        if api is None or not plan.id:
            return

        def mark() -> None:
            try:
                api.mark_applied(plan.id)
            except DlfleetError as error:
                _log.warning("brain: could not record plan %d as applied: %s", plan.id, error)

        self._executor.submit(mark)

    def _count(self, plan: Plan, applied: bool) -> None:
        if self.tally is not None:
            self.tally.plan(plan.kind.value, applied)

    def _note(self, plan: Plan, applied: bool, note: str = "") -> None:
        self._count(plan, applied)
        what = {
            PlanKind.INITIAL: f"start with {plan.target_nodes} nodes",
            PlanKind.SCALE: f"scale {plan.current_nodes} -> {plan.target_nodes} nodes",
            PlanKind.MEMORY: f"memory {plan.memory_bytes >> 20} MiB for {plan.node}",
            PlanKind.REPLACE_NODE: f"replace {plan.node}",
            PlanKind.NONE: "no change",
        }[plan.kind]
        how = "done" if applied else note or f"advice (brain.mode: {self.mode})"
        self.last_plan = f"{what} [{how}]: {plan.reason}"
        _log.info("brain plan %d: %s", plan.id, self.last_plan)

    def _end_round(self, now: int) -> None:
        if self._round is not None:
            self._report_round(self._round, now)
        self._round = None

    def _report_round(self, current: _Round, now: int) -> None:
        assert self.reporter is not None
        if not current.totals:
            return
        times = sorted(current.step_times) or [0.0]
        self.reporter.report_round(
            RoundMetrics(
                round=current.round,
                nodes=current.nodes,
                world_size=max(current.world_size, current.nodes),
                started_ms=current.started_ms,
                ended_ms=max(now, current.started_ms),
                samples_per_s=statistics.median(current.totals),
                step_time_mean_s=statistics.fmean(times),
                step_time_p50_s=times[len(times) // 2],
                step_time_p90_s=times[min(len(times) - 1, int(len(times) * 0.9))],
            )
        )

    def _report_worker_failures(self, view: job_pb2.MasterStatus) -> None:
        assert self.reporter is not None
        for failure in view.failures:
            key = (failure.node_id, failure.round, failure.local_rank, failure.restart_count)
            if key in self._failures_seen:
                continue
            self._failures_seen.add(key)
            hang = failure.message.lstrip().startswith("hung:")
            self.reporter.report_failure(
                FailureRecord(
                    failure.node_id.rpartition("#")[0] or failure.node_id,
                    FailureKind.HANG if hang else FailureKind.CRASH,
                    now_ms(),
                    exit_code=failure.exit_code,
                    message=failure.message[-500:],
                )
            )
