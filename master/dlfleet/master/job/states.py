"""What the job supervisor holds about the job, as one frozen value.

The runner keeps a `JobState` and replaces it as the job goes: the target
it wants, the relaunches the job has left, the nodes it is retiring, and
how the job ended. The policy (`dlfleet.master.job.policy`) reads it and
never changes it; each change is a method that returns the next state, so
a reader finds every way the job can move here. A job's first result
stands: a second reason to end it (a node exiting during the shutdown) is
not its cause.

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from dlfleet.api.job_phase import JobPhase


@dataclass(frozen=True)
class JobResult:
    code: int  # the process exit code of dlmaster
    reason: str


@dataclass(frozen=True)
class JobState:
    target: int  # the nodes the job wants (job.yaml nodes.start, a brain plan, Scale)
    relaunches_left: int  # of job.yaml max_node_relaunches
    result: JobResult | None = None  # set once: how the job ended
    phase: JobPhase = JobPhase.RUNNING  # ended only once its nodes are shut down
    # Nodes being retired as network suspects: name -> why. They are stopped
    # first, then marked faulty when they exit.
    retiring: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def ended(self) -> bool:
        return self.result is not None

    @property
    def reason(self) -> str:
        """Why the job ended, once its phase says it has."""
        if self.phase is JobPhase.RUNNING or self.result is None:
            return ""
        return self.result.reason

    def finish(self, code: int, reason: str) -> JobState:
        if self.result is not None:
            return self
        return dataclasses.replace(self, result=JobResult(code, reason))

    def conclude(self) -> JobState:
        """The phase the result says, once the nodes are shut down."""
        assert self.result is not None
        return dataclasses.replace(self, phase=JobPhase.ended(self.result.code))

    def scaled(self, target: int) -> JobState:
        return dataclasses.replace(self, target=target)

    def spent(self, relaunches_left: int) -> JobState:
        """After a relaunch the policy granted (it says how many are left)."""
        assert 0 <= relaunches_left <= self.relaunches_left
        return dataclasses.replace(self, relaunches_left=relaunches_left)

    def retire(self, name: str, why: str) -> JobState:
        retiring = MappingProxyType({**self.retiring, name: why})
        return dataclasses.replace(self, retiring=retiring)

    def retired(self, name: str) -> JobState:
        """`name` is no longer being retired (it exited, or never ran)."""
        rest = {other: why for other, why in self.retiring.items() if other != name}
        return dataclasses.replace(self, retiring=MappingProxyType(rest))
