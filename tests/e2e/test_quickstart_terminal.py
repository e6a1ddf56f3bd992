"""`scripts/quickstart.sh` as a new user runs it: in a terminal (here a
pseudo-terminal), where the job draws its live status block at the bottom.
While the first epoch trains, the block's records done move; and every block
that shows the nodes' rates shows a job rate within 10% of their sum."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Block:
    """One drawing of the status block, as the terminal showed it."""

    records: list[tuple[int, int, int]] = field(default_factory=list)  # (epoch, done, total)
    job_rate: float | None = None
    node_rates: dict[str, float] = field(default_factory=dict)


def run_in_a_terminal(argv: list[str], timeout_s: float) -> tuple[int, str]:
    """Run `argv` on a 120x40 pseudo-terminal; (exit code, what it showed)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        argv, cwd=REPO, stdin=follower, stdout=follower, stderr=follower,
        env={**os.environ, "TERM": "xterm-256color"}, start_new_session=True,
    )  # fmt: skip
    os.close(follower)
    shown = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not chunk:
                break
            shown += chunk
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
        os.close(leader)
    return code, ANSI.sub("", shown.decode(errors="replace")).replace("\r", "")


def blocks(shown: str) -> list[Block]:
    found: list[Block] = []
    for line in shown.splitlines():
        if line.startswith("job quickstart:"):
            found.append(Block())
        elif found and (m := re.match(r"\s+\S+: epoch (\d+)/\d+ \| (\d+)/(\d+) records", line)):
            found[-1].records.append((int(m.group(1)), int(m.group(2)), int(m.group(3))))
        elif found and (m := re.match(r"\s+([\d.]+) samples/s \| ETA", line)):
            found[-1].job_rate = float(m.group(1))
        elif found and (m := re.match(r"\s+(node-\d+): ([\d.]+) samples/s \| step", line)):
            found[-1].node_rates[m.group(1)] = float(m.group(2))
    return found


def test_the_quickstart_in_a_terminal_shows_records_moving_and_rates_that_agree() -> None:
    code, shown = run_in_a_terminal([str(REPO / "scripts" / "quickstart.sh")], timeout_s=270)
    assert code == 0, shown[-4000:]
    drawn = blocks(shown)
    assert drawn, shown[-4000:]
    # Records done move during the first epoch, not only at its end.
    moving = [
        done
        for b in drawn
        for epoch, done, total in b.records
        if epoch == 1 and 0 < done < total // 2
    ]
    assert moving, [b.records for b in drawn]
    # Every block that shows both nodes' rates shows the job's within 10% of their sum.
    paced = [b for b in drawn if b.job_rate and len(b.node_rates) == 2]
    assert paced, [(b.job_rate, b.node_rates) for b in drawn]
    for b in paced:
        total, job = sum(b.node_rates.values()), b.job_rate or 0.0
        assert abs(job - total) <= 0.1 * total, (job, b.node_rates)
