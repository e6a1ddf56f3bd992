"""`dlmaster` on a store that holds an earlier run's job, as a user meets it:
the default store left in the current directory is refused, exit 2, with
one line naming the store, its job and the two ways on (--resume, another
--state-store); --resume continues it; a job of another name is refused
even so, naming the --job-name that would continue it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import TOKEN

from dlfleet.api.client import MasterClient

pytestmark = pytest.mark.integration

ENV = {**os.environ, "DLFLEET_TOKEN": TOKEN}


def dlmaster(*flags: str) -> list[str]:
    return [sys.executable, "-m", "dlfleet.master", "--port", "0", "--log-level", "WARNING", *flags]


def serving(cwd: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(dlmaster(*flags), cwd=cwd, env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = re.search(r"listening on ([\d.]+:\d+)", line)
    if match is None:
        proc.kill()
        pytest.fail(f"dlmaster did not start: {line!r}")
    return proc, match.group(1)


def refused(cwd: Path, *flags: str) -> str:
    done = subprocess.run(
        dlmaster(*flags), cwd=cwd, env=ENV, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
    return done.stderr


def test_a_new_master_where_an_earlier_one_ran_refuses_the_default_store_unless_resumed(
    tmp_path: Path,
) -> None:
    earlier, address = serving(tmp_path)
    try:
        with MasterClient(address, token=TOKEN) as client:
            client.register_node(job_name="job", node_name="old", local_world_size=1)
    finally:
        earlier.kill()
        earlier.wait(10)

    line = refused(tmp_path)
    assert re.match(
        r"dlmaster: --state-store sqlite:///dlfleet-master\.db holds job 'job' \(id [0-9a-f]{16}, "
        r"started [-\d]+ [:\d]+ UTC; no round formed yet, 0 datasets, 1 node registered\), and a "
        r"store holds one job: pass --resume to continue that job, or another --state-store "
        r"\(a new file or database\) to start a new job \(the default store: "
        r"sqlite:///dlfleet-master\.db in the current directory, ",
        line,
    ), line
    assert str(tmp_path) in line

    other = refused(tmp_path, "--job-name", "other", "--resume")
    assert "holds job 'job' (id " in other and ", not job 'other': pass --job-name job " in other

    resumed, address = serving(tmp_path, "--resume")
    try:
        with MasterClient(address, token=TOKEN) as client:
            again = client.register_node(job_name="job", node_name="old", local_world_size=1)
        assert again.node_id == "old#2"  # the same job: its node's next incarnation
    finally:
        resumed.kill()
        resumed.wait(10)
