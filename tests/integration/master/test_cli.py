"""`dlmaster`'s command line: bad flags exit 2 naming the problem; nothing starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min-nodes", "3", "--max-nodes", "2"], "max_nodes (2) must be at least min_nodes (3)"),
        (["--node-unit", "2", "--min-nodes", "3", "--max-nodes", "3"], "no multiple of node_unit"),
        (["--heartbeat-interval", "5", "--heartbeat-timeout", "2"], "longer than"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--http-port", "-1"], "--http-port must be in 0..65535"),
        (["--lease-timeout", "0"], "must be > 0"),
        (["--token", ""], "no job token"),
        (["--min-nodes", "two"], "invalid int value"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    flags: list[str], message: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DLFLEET_TOKEN"}
    token = [] if "--token" in flags else ["--token", "t"]
    store = ["--store", f"sqlite:///{tmp_path / 'm.db'}"]
    done = subprocess.run(
        [sys.executable, "-m", "dlfleet.master", *token, *store, *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "m.db").exists(), "nothing may start on bad flags"
