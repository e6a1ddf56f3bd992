"""README's Troubleshooting quotes the lines a new user meets: each quote must
match what the code really says (placeholders aside), or the section lies."""

from __future__ import annotations

import errno
import logging
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import DlfleetError
from dlfleet.master.core.reachability import Published, unreachable
from dlfleet.master.core.rendezvous import Rendezvous, RendezvousSettings
from dlfleet.worker.agent.store_probe import StoreProbe
from dlfleet.worker.checkpoint.location import Sighting, judge

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
# What README writes for a value that differs from run to run.
PLACEHOLDERS = {"X": r"\S+?", "ADDR:PORT": r"\S+?", "hostm:50051": r"\S+?"}


def quotes() -> dict[str, str]:
    """Each Troubleshooting bullet's first quote, by its first word."""
    section = README.read_text().split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    found = {}
    for bullet in re.split(r"\n- ", section)[1:]:
        quote = re.match(r"(?:\w+ )?`([^`]+)`", bullet.replace("\n", " "))
        if quote:
            text = " ".join(quote.group(1).split())
            found[text.split()[0]] = text
    return found


def pattern(quote: str) -> re.Pattern[str]:
    """The quote as a regular expression: '...' stands for anything,
    placeholders for a value, numbers for any number."""
    parts = []
    for word in quote.split(" "):
        bare = word.rstrip(":,;")
        if bare in PLACEHOLDERS:
            parts.append(PLACEHOLDERS[bare] + re.escape(word[len(bare) :]))
            continue
        escaped = re.escape(word).replace(re.escape("..."), ".*?")
        parts.append(re.sub(r"\d+", r"\\d+", escaped))
    return re.compile(r"\s+".join(parts))


def said(quote_start: str, real: str) -> None:
    quote = quotes()[quote_start]
    assert pattern(quote).search(real), f"README says:\n  {quote}\nthe code says:\n  {real}"


def test_the_loopback_refusal_is_quoted_as_the_master_says_it() -> None:
    refused = unreachable(
        {
            "hosta#1": Published("127.0.0.1", "10.0.0.2"),
            "hostb#1": Published("10.0.0.3", "10.0.0.3"),
        }
    )
    said("node", refused["hosta#1"])


def test_the_unreachable_store_is_quoted_as_the_agent_says_it() -> None:
    probe = StoreProbe("10.0.0.9", 29500)
    said("this", probe._describe(OSError(errno.ENETUNREACH, "Network is unreachable")))


def test_the_waiting_line_is_quoted_as_the_agent_logs_it() -> None:
    rdzv = Rendezvous(RendezvousSettings(min_nodes=2, max_nodes=2, join_timeout_ms=600_000))
    rdzv.join("hosta#1", 1, "10.0.0.2", 29500, now_ms=0)
    said("waiting", f"waiting 15s for a round: {rdzv.why_waiting(15_000)}")


def test_a_retry_is_quoted_as_the_client_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    retry = RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.01, total_budget_s=5)
    with (
        caplog.at_level(logging.WARNING),
        MasterClient(f"127.0.0.1:{port}", token="t", retry=retry) as client,
        pytest.raises(DlfleetError),
    ):
        client.register_node(job_name="job", node_name="a", local_world_size=1)
    said("Register", "\n".join(r.getMessage() for r in caplog.records))


def test_a_port_in_use_is_quoted_as_dlmaster_prints_it(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "dlfleet.master", "--host", "0.0.0.0", "--port", str(port),
             "--state-store", f"sqlite:///{tmp_path / 'm.db'}"],
            capture_output=True, text=True, timeout=60, check=False,
            env={"DLFLEET_TOKEN": "t", "PATH": ""},
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    said("dlmaster:", done.stderr)


def test_an_unshared_persist_location_is_quoted_as_every_rank_raises_it() -> None:
    error = judge(
        "/tmp/checkpoints",
        [Sighting(0, "hosta", True), Sighting(1, "hostb", False, "no such file")],
    )
    said("the", str(error))
