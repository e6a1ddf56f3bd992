"""The pre-flight node check end to end: `dlmaster --job-config` runs three
local nodes with the check on, and the test hook makes node-2 four times
slower (its matmul and its all-reduces). The check finds it before it trains;
the runner marks it faulty and starts a fresh node at once, which checks in
turn (late: it pairs with a node past its check) and trains with the other
two. The verdicts show in `dlmaster status`, /api/v1/status and
/api/v1/events, and the runner's log says why, with the numbers. And an
agent preempted in the middle of its check leaves at once, its check process
with it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness import JobProcess, MasterProcess

from dlfleet.master.job.brain_link import RUN_FILE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

WORKER = textwrap.dedent(
    """
    import os, sys, time
    out = sys.argv[1]
    open(os.path.join(out, os.environ["DLFLEET_NODE_ID"]), "w").close()
    while not os.path.exists(os.path.join(out, "stop")):
        time.sleep(0.05)
    """
)


def get(url: str, token: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_a_slow_node_is_found_and_replaced_before_it_trains(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "worker.py").write_text(WORKER)
    job = JobProcess(
        tmp_path,
        {
            "name": "check-job",
            "command": "worker.py",
            "args": [str(out)],
            "nodes": {"min": 3, "max": 3},
            "display": "plain",
            "node_check": {"enabled": "auto", "slow_factor": 2.0, "timeout_s": 20},
            "env": {"DLFLEET_NODE_CHECK_SLOWDOWN": "node-2#1:4"},  # the test hook
            "rendezvous": {"last_call_timeout_s": 0.3},
            "heartbeat": {"interval_s": 0.5, "timeout_s": 5},
        },
    )
    started = time.monotonic()
    job.start()
    try:
        trained = {"node-0#1", "node-1#1", "node-3#1"}
        job.wait_for(lambda: trained <= {p.name for p in out.iterdir()}, "3 nodes training", 120)
        took = time.monotonic() - started
        assert not (out / "node-2#1").exists()  # the slow node never trained

        status = job.status()
        nodes = {n["name"]: n for n in status["nodes"]}
        assert nodes["node-2"]["state"] == "faulty"
        slow = nodes["node-2"]["check"]
        assert slow["faulty"] and slow["rule"] in ("compute_slow", "pairs_slow"), slow
        assert float(slow["compute_ms"]) > 2 * float(slow["compute_reference_ms"]) > 0
        assert {p["outcome"] for p in slow["pairs"]} == {"slow"}
        late = nodes["node-3"]["check"]
        assert not late["faulty"], late
        [helper_pair] = late["pairs"]  # late: one pair, with a node past its check
        assert helper_pair["helper"] and helper_pair["outcome"] == "good"
        for name in ("node-0", "node-1"):
            assert nodes[name]["check"]["rule"] == "healthy"

        token = (job.root / ".dlfleet" / "check-job" / "token").read_text().strip()
        document = get(status["http_url"] + "/api/v1/status", token)
        by_id = {n["node_id"]: n for n in document["nodes"]}
        assert by_id["node-3#1"]["check"]["rule"] == "healthy"
        events = get(status["http_url"] + "/api/v1/events", token)["events"]
        checked = {e["node_id"]: e for e in events if e["kind"] == "node_checked"}
        assert checked["node-2#1"]["verdict"] == "faulty"
        assert checked["node-2#1"]["rule"] == slow["rule"]
        assert checked["node-3#1"]["verdict"] == "healthy"
        assert all(checked[n]["took_ms"] < 60_000 for n in checked)

        (out / "stop").write_text("")
        code, stdout, stderr = job.finish()
        assert code == 0, stderr
        logged = stdout + stderr
        assert f"node-2: failed its pre-flight node check (rule {slow['rule']}): " in logged
        assert "marked faulty, replaced at once by node-3" in logged
        assert_brain_remembers(job.root, slow["rule"])
        print(f"slow node found and replaced, 3 nodes training after {took:.1f}s")
    finally:
        job.kill()


def assert_brain_remembers(root: Path, slow_rule: str) -> None:
    """The brain keeps every node's check with its numbers (the straggler
    detector reads them): `dlbrain report` lists them."""
    brain_db = f"sqlite:///{root / '.dlfleet' / 'brain.db'}"
    run = (root / ".dlfleet" / "check-job" / RUN_FILE).read_text().strip()
    dlbrain = Path(sys.executable).parent / "dlbrain"
    report = subprocess.run(
        [str(dlbrain), "report", f"check-job-{run}", "--db", brain_db],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert report.returncode == 0, report.stderr
    print(report.stdout)
    listed = dict(re.findall(r"^  (node-\d): (.*)$", report.stdout, re.MULTILINE))
    assert listed["node-2"].startswith(f"faulty ({slow_rule}); matmul"), report.stdout
    healthy = {n for n, v in listed.items() if v.startswith("healthy;")}
    assert healthy == {"node-0", "node-1", "node-3"}, report.stdout


def test_an_agent_preempted_mid_check_exits_143_and_its_check_process_with_it(
    tmp_path: Path, master_process: Callable[..., MasterProcess]
) -> None:
    master = master_process(
        f"sqlite:///{tmp_path / 'm.db'}", "--min-nodes", "2", "--max-nodes", "2"
    )
    (tmp_path / "worker.py").write_text("print('never trains')\n")
    argv = [
        sys.executable, "-m", "dlfleet.worker.agent.loop", "--master", master.address,
        "--node-name", "lonely", "--nnodes", "2:2", "--node-check", str(tmp_path / "worker.py"),
    ]  # fmt: skip
    agent = subprocess.Popen(
        argv,
        env={**os.environ, "DLFLEET_TOKEN": "test-token"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert agent.stdout is not None
        lines = []
        for line in agent.stdout:
            lines.append(line)
            began = re.search(r"node check: begun \(check \w+\), its process is (\d+)", line)
            if began:
                break
        assert began, "".join(lines)
        check_pid = int(began.group(1))
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=30)
        assert agent.returncode == 143, out
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{check_pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{check_pid}"), "the check process outlived its agent"
        assert "never trains" not in out
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
