"""A job's phase, as its status says it (`JobStatus.phase` on the wire): the
job supervisor sets it, the display and the dashboard read it, and a master
without a supervisor reports RUNNING."""

from __future__ import annotations

import enum


class JobPhase(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @classmethod
    def ended(cls, exit_code: int) -> JobPhase:
        """The phase of a job that ended with `exit_code` (0: every node finished)."""
        return cls.SUCCEEDED if exit_code == 0 else cls.FAILED
