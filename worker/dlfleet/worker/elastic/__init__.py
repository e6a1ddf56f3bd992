"""Restarts without a cold start: see `runner.py`."""

from dlfleet.worker.elastic.runner import (
    Attempt,
    Interrupted,
    agent_channel,
    check,
    current,
    on_attempt_end,
    run,
)

__all__ = [
    "Attempt",
    "Interrupted",
    "agent_channel",
    "check",
    "current",
    "on_attempt_end",
    "run",
]
