"""A call to a master that is not there: each retry is one warning naming the
call, the master's address and the attempt, then `Unavailable` once the
retry budget is spent. A real client against a port nothing listens on."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import Unavailable

FAST = RetryPolicy(attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01, total_budget_s=10)


@pytest.fixture
def nothing_listening() -> Iterator[str]:
    """An address whose port is held (so nothing else takes it) but refuses."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{held.getsockname()[1]}"


def test_each_retry_logs_one_warning_naming_the_master_and_the_attempt(
    nothing_listening: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dlfleet.api.client")
    with (
        MasterClient(nothing_listening, token="t", timeout_s=2.0, retry=FAST) as client,
        pytest.raises(Unavailable, match="failed after 3 attempts"),
    ):
        client.register_node(job_name="job", node_name="n", local_world_size=1)
    lines = [r.getMessage() for r in caplog.records if r.name == "dlfleet.api.client"]
    assert len(lines) == 2, lines  # the last attempt ends the call: no retry to announce
    for attempt, line in enumerate(lines, start=1):
        assert line.startswith(f"Register to master {nothing_listening}: attempt {attempt} of 3")
        assert "UNAVAILABLE" in line and "\n" not in line
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_a_single_attempt_policy_logs_no_retry(
    nothing_listening: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dlfleet.api.client")
    once = RetryPolicy(attempts=1)
    with (
        MasterClient(nothing_listening, token="t", timeout_s=2.0, retry=once) as client,
        pytest.raises(Unavailable),
    ):
        client.register_node(job_name="job", node_name="n", local_world_size=1)
    assert not caplog.records
