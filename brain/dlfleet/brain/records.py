"""The brain's values: what the master reports and what the brain answers.

Frozen dataclasses checked on construction (a bad field raises InvalidArgument
naming it, so a bad RPC is answered INVALID_ARGUMENT). Times are Unix
milliseconds, sizes bytes, throughput samples per second; 0 means "not known"
where a field says so.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

from dlfleet.api.errors import InvalidArgument

PlanId = NewType("PlanId", int)

MAX_NAME_LENGTH = 255
MAX_SIGNATURE_LENGTH = 255
MAX_NODES = 100_000
MAX_INT64 = 2**63 - 1


class JobStatus(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class FailureKind(enum.Enum):
    CRASH = "crash"
    OOM = "oom"
    EVICTED = "evicted"
    HANG = "hang"
    LOST = "lost"
    NODE_CHECK = "node_check"  # found slow or broken by its pre-flight check, before training


class PlanKind(enum.Enum):
    NONE = "none"
    INITIAL = "initial"
    SCALE = "scale"
    MEMORY = "memory"
    REPLACE_NODE = "replace_node"


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidArgument(what)


def _name(value: str, what: str, limit: int = MAX_NAME_LENGTH) -> None:
    _require(bool(value), f"{what} is empty")
    _require(len(value) <= limit, f"{what} is longer than {limit} characters")


def _finite(value: float, what: str) -> None:
    _require(math.isfinite(value) and value >= 0, f"{what} must be a finite number >= 0")


def _non_negative(value: int, what: str) -> None:
    """A count, size or time: it fits a BIGINT column on every backend."""
    _require(0 <= value <= MAX_INT64, f"{what} must lie in 0..2**63-1, not {value}")


@dataclass(frozen=True)
class JobInfo:
    """One job run. `name` identifies the run; `signature` "the same kind of
    job", whose earlier runs seed the initial plan."""

    name: str
    signature: str
    min_nodes: int = 1
    max_nodes: int = 1
    initial_nodes: int = 0  # 0: max_nodes
    memory_request_bytes: int = 0
    memory_limit_bytes: int = 0
    cpu_request: float = 0.0
    status: JobStatus = JobStatus.RUNNING
    config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _name(self.name, "job name")
        _name(self.signature, f"job {self.name!r}: signature", MAX_SIGNATURE_LENGTH)
        _require(
            1 <= self.min_nodes <= self.max_nodes <= MAX_NODES,
            f"job {self.name!r}: nodes must satisfy 1 <= min ({self.min_nodes}) <= "
            f"max ({self.max_nodes}) <= {MAX_NODES}",
        )
        _require(
            self.initial_nodes == 0 or self.min_nodes <= self.initial_nodes <= self.max_nodes,
            f"job {self.name!r}: initial_nodes ({self.initial_nodes}) must lie in "
            f"{self.min_nodes}..{self.max_nodes}",
        )
        _non_negative(self.memory_request_bytes, "memory_request_bytes")
        _non_negative(self.memory_limit_bytes, "memory_limit_bytes")
        _finite(self.cpu_request, "cpu_request")

    @property
    def start_nodes(self) -> int:
        return self.initial_nodes or self.max_nodes


@dataclass(frozen=True)
class RoundMetrics:
    """A rendezvous round's throughput so far (a later report of the same
    round replaces it)."""

    round: int
    nodes: int
    world_size: int
    started_ms: int
    ended_ms: int
    samples_per_s: float
    step_time_mean_s: float = 0.0
    step_time_p50_s: float = 0.0
    step_time_p90_s: float = 0.0

    def __post_init__(self) -> None:
        _non_negative(self.round, "round")
        _require(
            1 <= self.nodes <= MAX_NODES, f"round {self.round}: nodes must lie in 1..{MAX_NODES}"
        )
        _require(
            self.nodes <= self.world_size <= 2**31 - 1,
            f"round {self.round}: world_size must lie in nodes..2**31-1",
        )
        _non_negative(self.started_ms, "started_ms")
        _non_negative(self.ended_ms, "ended_ms")
        _require(self.ended_ms >= self.started_ms, f"round {self.round}: ends before it starts")
        _finite(self.samples_per_s, "samples_per_s")
        for name in ("step_time_mean_s", "step_time_p50_s", "step_time_p90_s"):
            _finite(getattr(self, name), name)

    @property
    def duration_s(self) -> float:
        return (self.ended_ms - self.started_ms) / 1000


@dataclass(frozen=True)
class NodeSample:
    node: str
    round: int
    at_ms: int
    cpu_percent: float = 0.0
    memory_rss_bytes: int = 0
    memory_limit_bytes: int = 0
    memory_request_bytes: int = 0
    samples_per_s: float = 0.0
    step_time_s: float = 0.0

    def __post_init__(self) -> None:
        _name(self.node, "node name")
        _non_negative(self.round, "round")
        _non_negative(self.at_ms, "at_ms")
        _finite(self.cpu_percent, "cpu_percent")
        _finite(self.samples_per_s, "samples_per_s")
        _finite(self.step_time_s, "step_time_s")
        for name in ("memory_rss_bytes", "memory_limit_bytes", "memory_request_bytes"):
            _non_negative(getattr(self, name), name)


@dataclass(frozen=True)
class FailureRecord:
    node: str
    kind: FailureKind
    at_ms: int
    exit_code: int | None = None
    message: str = ""

    def __post_init__(self) -> None:
        _name(self.node, "node name")
        _non_negative(self.at_ms, "at_ms")
        _require(
            self.exit_code is None or -(2**31) <= self.exit_code < 2**31,
            "exit_code must fit 32 bits",
        )


@dataclass(frozen=True)
class NodeCheckRecord:
    """A node's pre-flight check, healthy or not, with the numbers that
    decided: its matmul and best all-reduce times against the medians of the
    other nodes' (0: not measured). The straggler detector remembers it."""

    node: str
    at_ms: int
    faulty: bool
    rule: str  # "healthy", "compute_slow", "pairs_slow", ...
    compute_ms: float = 0.0
    compute_reference_ms: float = 0.0
    pair_ms: float = 0.0
    pair_reference_ms: float = 0.0
    reason: str = ""

    def __post_init__(self) -> None:
        _name(self.node, "node name")
        _non_negative(self.at_ms, "at_ms")
        _name(self.rule, "node check rule", 64)
        for name in ("compute_ms", "compute_reference_ms", "pair_ms", "pair_reference_ms"):
            _finite(getattr(self, name), name)

    @property
    def slowdown(self) -> float:
        """How many times slower than the others the check measured the node,
        in compute or communication, whichever is worse (0: nothing compared)."""
        ratios = [
            mine / reference
            for mine, reference in (
                (self.compute_ms, self.compute_reference_ms),
                (self.pair_ms, self.pair_reference_ms),
            )
            if mine > 0 and reference > 0
        ]
        return max(ratios, default=0.0)


@dataclass(frozen=True)
class MetricsBatch:
    """What one job measured since its last batch. `info` registers or updates
    the job; a job the brain does not know needs it."""

    job: str
    info: JobInfo | None = None
    rounds: Sequence[RoundMetrics] = ()
    samples: Sequence[NodeSample] = ()
    failures: Sequence[FailureRecord] = ()
    node_checks: Sequence[NodeCheckRecord] = ()

    def __post_init__(self) -> None:
        _name(self.job, "job name")
        if self.info is not None:
            _require(
                self.info.name == self.job,
                f"batch of job {self.job!r} carries the info of job {self.info.name!r}",
            )

    def __len__(self) -> int:
        return len(self.rounds) + len(self.samples) + len(self.failures) + len(self.node_checks)


@dataclass(frozen=True)
class OomRelaunch:
    """A node the platform is about to relaunch after an OOM kill."""

    node: str
    memory_limit_bytes: int

    def __post_init__(self) -> None:
        _name(self.node, "node name")
        _non_negative(self.memory_limit_bytes, "memory_limit_bytes")


@dataclass(frozen=True)
class PlanRequest:
    """The job as the master sees it now. `nodes` is its target node count
    (0 before it starts: the answer is then the initial plan)."""

    job: JobInfo
    nodes: int
    memory_limit_bytes: int = 0
    oom_relaunch: OomRelaunch | None = None

    def __post_init__(self) -> None:
        _require(0 <= self.nodes <= MAX_NODES, f"nodes must lie in 0..{MAX_NODES}")
        _non_negative(self.memory_limit_bytes, "memory_limit_bytes")


@dataclass(frozen=True)
class Decision:
    """What the optimizer decided, before it is stored: the action, a sentence
    saying why, and the numbers it was based on (JSON-able)."""

    kind: PlanKind
    reason: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    target_nodes: int = 0
    node: str = ""
    memory_bytes: int = 0
    cpu: float = 0.0

    def same_action(self, other: Decision | Plan) -> bool:
        return (self.kind, self.target_nodes, self.node, self.memory_bytes, self.cpu) == (
            other.kind,
            other.target_nodes,
            other.node,
            other.memory_bytes,
            other.cpu,
        )


@dataclass(frozen=True)
class Plan:
    """A decision as stored (id 0: a NONE decision, never stored)."""

    id: PlanId
    job: str
    kind: PlanKind
    reason: str
    evidence: Mapping[str, Any]
    created_ms: int
    current_nodes: int = 0
    target_nodes: int = 0
    node: str = ""
    memory_bytes: int = 0
    cpu: float = 0.0
    applied: bool = False
    applied_ms: int | None = None

    @staticmethod
    def unstored(job: str, decision: Decision, current_nodes: int, now_ms: int) -> Plan:
        return Plan(
            id=PlanId(0),
            job=job,
            kind=decision.kind,
            reason=decision.reason,
            evidence=dict(decision.evidence),
            created_ms=now_ms,
            current_nodes=current_nodes,
            target_nodes=decision.target_nodes,
            node=decision.node,
            memory_bytes=decision.memory_bytes,
            cpu=decision.cpu,
        )


@dataclass(frozen=True)
class SizeThroughput:
    """The throughput measured at one node count: the median over its rounds."""

    nodes: int
    world_size: int
    rounds: int
    samples_per_s: float
    efficiency: float


@dataclass(frozen=True)
class RoundSpan:
    """How long a reported round lasted, at how many nodes."""

    round: int
    nodes: int
    duration_s: float


@dataclass(frozen=True)
class JobReport:
    job: JobInfo
    created_ms: int
    updated_ms: int
    sizes: Sequence[SizeThroughput]
    plans: Sequence[Plan]
    failures: Mapping[FailureKind, int]
    rounds: Sequence[RoundSpan] = ()  # every round the job reported, oldest first
    min_round_s: float = 0.0  # the shortest round the optimizer counts
    node_checks: Sequence[NodeCheckRecord] = ()  # each node's latest pre-flight check
