"""`dlmaster --job-config`: a real master running a job of real dlworker
processes (the local platform), with training scripts that need no torch so
that the job logic is what is timed: success, a failing rank's root cause,
a killed node replaced, scaling up and down, status, and bad configs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from harness import JobProcess
from prometheus_client.parser import text_string_to_metric_families

from dlfleet.api.status_document import SCHEMA_PATH

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Each worker writes what it saw (round, world) and stays until the test drops
# a `stop` file (or for `SECONDS` seconds), then exits 0.
WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    out = sys.argv[1]
    env = os.environ
    me = f"{env['DLFLEET_NODE_ID']}-r{env['DLFLEET_ROUND']}-{env['LOCAL_RANK']}"
    with open(os.path.join(out, me + ".json"), "w") as f:
        json.dump({"world": int(os.environ["WORLD_SIZE"]), "rank": int(os.environ["RANK"])}, f)
    if env["DLFLEET_NODE_ID"].startswith(os.environ.get("KILL_AGENT_OF", "-")):
        os.kill(os.getppid(), 9)  # a node that keeps dying: SIGKILL its agent
    if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
        raise ZeroDivisionError("rank " + os.environ["RANK"] + " divides by zero")
    if os.environ.get("IMPORT_FAIL"):
        import dlfleet_no_such_module  # a typo in the script's imports
    if env["DLFLEET_NODE_ID"].startswith(os.environ.get("BROKEN_GPU_ON", "-")):
        print("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", file=sys.stderr)
        raise RuntimeError("CUDA error: unspecified launch failure")
    flaky = os.path.join(out, "network-failed-once")
    if env["DLFLEET_NODE_ID"].startswith(os.environ.get("NETWORK_FAIL_ON", "-")):
        if not os.path.exists(flaky):
            open(flaky, "w").close()
            raise RuntimeError("[gloo/tcp/pair.cc:534] Read error: Connection reset by peer")
    from dlfleet.worker import progress
    progress.announce()  # as ShardedDataLoader does when it is made
    if os.environ.get("FAIL_BEFORE_STEP"):
        raise KeyError("label")  # a bug met before the first step
    deadline = time.monotonic() + float(os.environ.get("SECONDS_TO_RUN", "60"))
    steps = 0
    while not os.path.exists(os.path.join(out, "stop")) and time.monotonic() < deadline:
        time.sleep(0.05)
        progress.step(4)  # a "step" of 4 samples every 50 ms
        steps += 1
        if steps == 3:
            open(os.path.join(out, me + ".stepped"), "w").close()
        if os.path.exists(os.path.join(out, "every-rank-fails")):
            raise ValueError("shapes (8,3) and (4,) not aligned")  # a bug on every rank
    """
)


class Job(JobProcess):
    def __init__(self, root: Path, **settings: Any) -> None:
        self.out = root / "out"
        self.out.mkdir()
        (root / "worker.py").write_text(WORKER)
        super().__init__(
            root,
            {
                "name": "test-job",
                "command": "worker.py",
                "args": [str(self.out)],
                "display": "plain",
                "relaunch_delay_s": 0.2,
                "rendezvous": {"last_call_timeout_s": 0.3},
                "heartbeat": {"interval_s": 0.5, "timeout_s": 5},
                # These scripts need no torch, and the job logic is what is
                # timed: tests/e2e/test_node_check_e2e.py runs the node check.
                "node_check": {"enabled": False},
                **settings,
            },
        )

    def seen(self) -> list[dict[str, Any]]:
        """What every worker process reported, with its file name."""
        return [
            {"file": p.name, **json.loads(p.read_text())}
            for p in sorted(self.out.glob("*.json"))
            if p.stat().st_size
        ]

    def stop_workers(self) -> None:
        (self.out / "stop").write_text("")


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[Any]:
    jobs: list[Job] = []

    def make(**settings: Any) -> Job:
        job = Job(tmp_path, **settings)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill()


def test_a_job_runs_every_node_and_exits_zero(make_job: Any) -> None:
    job = make_job(nodes={"min": 1, "max": 2}, nproc_per_node=2).start()
    job.wait_for(lambda: len(job.seen()) == 4, "4 workers")
    job.stop_workers()
    code, out, err = job.finish()
    assert code == 0, err
    assert sorted(s["rank"] for s in job.seen()) == [0, 1, 2, 3]
    assert {s["world"] for s in job.seen()} == {4}
    assert "job test-job succeeded" in out
    assert "[node-0]" in out and "[node-1]" in out  # the nodes' output, labelled
    assert (job.root / ".dlfleet" / "test-job" / "logs" / "node-1.log").stat().st_size > 0


def test_the_job_token_is_never_logged(make_job: Any) -> None:
    job = make_job(nodes={"min": 2, "max": 2}, nproc_per_node=2).start()
    job.wait_for(lambda: len(job.seen()) == 4, "4 workers")
    job.stop_workers()
    code, out, err = job.finish()
    assert code == 0, err
    workdir = job.root / ".dlfleet" / "test-job"
    token = (workdir / "token").read_text().strip()
    assert len(token) >= 32 and (workdir / "token").stat().st_mode & 0o077 == 0
    logs = [p for p in workdir.rglob("*") if p.is_file() and p.name != "token"]
    assert any(p.suffix == ".log" for p in logs)
    for text in [out, err, *(p.read_bytes().decode(errors="replace") for p in logs)]:
        assert token not in text


def test_a_failing_rank_fails_the_job_with_its_traceback(make_job: Any) -> None:
    job = make_job(nodes={"min": 2, "max": 2}, max_restarts=1, diagnosis={"enabled": False})
    code, _, err = job.start(env={"FAIL_RANK": "1"}).finish()
    assert code == 1
    reason = err[err.index("FAILED") :]
    assert ": rank 1 (local rank 0) failed with exit code 1" in reason
    assert "after 1 restarts (max_restarts=1)" in reason
    assert "ZeroDivisionError: rank 1 divides by zero" in reason


def test_the_same_error_twice_fails_the_job_without_spending_every_restart(
    make_job: Any,
) -> None:
    job = make_job(nodes={"min": 2, "max": 2}, max_restarts=10).start(env={"FAIL_RANK": "1"})
    code, _, err = job.finish()
    assert code == 1
    reason = err[err.index("FAILED") :]
    assert "diagnosed user_error (rule same-error-again): not restarted" in reason
    assert "ZeroDivisionError: rank 1 divides by zero" in reason
    assert "restart 2 of 10" not in err + reason  # one restart spent, not ten


def test_an_import_error_fails_the_job_in_one_attempt(make_job: Any) -> None:
    job = make_job(nodes={"min": 1, "max": 1}, max_restarts=5).start(env={"IMPORT_FAIL": "1"})
    code, out, err = job.finish()
    assert code == 1
    reason = err[err.index("FAILED") :]
    assert "in round 1, diagnosed user_error (rule import-or-syntax-error)" in reason
    assert "ModuleNotFoundError: No module named 'dlfleet_no_such_module'" in reason
    assert "restart 1 of 5" not in out + err


def test_an_error_before_the_first_step_fails_the_job_in_one_attempt(make_job: Any) -> None:
    job = make_job(nodes={"min": 1, "max": 1}, max_restarts=5)
    code, out, err = job.start(env={"FAIL_BEFORE_STEP": "1"}).finish()
    assert code == 1
    reason = err[err.index("FAILED") :]
    assert "diagnosed user_error (rule error-before-first-step)" in reason
    assert "KeyError: 'label'" in reason
    assert "restart 1 of 5" not in out + err


def test_the_same_error_on_every_rank_fails_the_job_at_once(make_job: Any) -> None:
    job = make_job(nodes={"min": 1, "max": 1}, nproc_per_node=2, max_restarts=5).start()
    job.wait_for(lambda: len(list(job.out.glob("*.stepped"))) == 2, "both ranks past step 2")
    (job.out / "every-rank-fails").write_text("")
    code, out, err = job.finish()
    assert code == 1
    reason = err[err.index("FAILED") :]
    assert "diagnosed user_error (rule same-error-on-every-rank)" in reason
    assert "ValueError: shapes (8,3) and (4,) not aligned" in reason
    assert "restart 1 of 5" not in out + err


def test_a_hardware_fault_replaces_the_node_at_once(make_job: Any) -> None:
    job = make_job(nodes={"min": 1, "max": 2}, max_restarts=3, max_node_relaunches=2)
    job.start(env={"BROKEN_GPU_ON": "node-1#"})

    def replaced() -> bool:
        states = {n["name"]: (n["state"], n["relaunches"]) for n in job.status()["nodes"]}
        return states.get("node-1") == ("faulty", 0) and states.get("node-2", ("",))[0] == "running"

    job.wait_for(replaced, "node-1 retired at its first failure and node-2 started")
    job.wait_for(lambda: any("node-2#1" in s["file"] for s in job.seen()), "node-2 working")
    failure = job.status()["last_failure"]
    assert (failure["rule"], failure["category"], failure["action"]) == (
        "gpu-hardware",
        "hardware",
        "replace_node",
    )
    assert failure["restart_count"] == 0
    event = job_events(job, "worker_failed")[-1]
    assert (event["rule"], event["action"]) == ("gpu-hardware", "replace_node")
    job.wait_for(
        lambda: [e["node"] for e in job_events(job, "node_retired")] == ["node-1"],
        "node-1 retired in the timeline",
    )
    job.stop_workers()
    code, out, err = job.finish()
    assert code == 0, err
    assert (
        "node-1: its agent diagnosed a hardware fault (rule gpu-hardware): marked faulty, "
        "replaced at once by node-2" in out
    )


def test_a_network_error_restarts_in_place(make_job: Any) -> None:
    job = make_job(nodes={"min": 2, "max": 2}, max_restarts=3)
    job.start(env={"NETWORK_FAIL_ON": "node-1#"})
    job.wait_for(
        lambda: (
            {s["file"].split("-r")[0] for s in job.seen() if "-r2-" in s["file"]}
            == {"node-0#1", "node-1#1"}
        ),
        "both nodes in the next round, the same agents",
    )
    failure = job.status()["last_failure"]
    assert (failure["rule"], failure["category"], failure["action"]) == (
        "network",
        "network",
        "restart",
    )
    (event,) = job_events(job, "worker_failed")
    assert (event["rule"], event["category"], event["node_id"]) == (
        "network",
        "network",
        "node-1#1",
    )
    job.stop_workers()
    code, _, err = job.finish()
    assert code == 0, err


def job_events(job: Job, kind: str) -> list[dict[str, Any]]:
    """The master's timeline entries of `kind`, through its HTTP API."""
    token = (job.root / ".dlfleet" / "test-job" / "token").read_text().strip()
    status, text = http_get(
        job.status()["http_url"] + "/api/v1/events", {"Authorization": f"Bearer {token}"}
    )
    assert status == 200, text
    return [e for e in json.loads(text)["events"] if e["kind"] == kind]


def test_a_killed_node_is_replaced_and_the_job_still_succeeds(make_job: Any) -> None:
    job = make_job(nodes={"min": 1, "max": 2}, max_node_relaunches=2).start()
    # A round of both nodes (under load, node-0 may first form a round alone).
    job.wait_for(lambda: sum(s["world"] == 2 for s in job.seen()) == 2, "2 workers")
    os.kill(job.node_pid("node-1"), signal.SIGKILL)  # the dlworker; its worker dies with it

    def relaunched() -> bool:
        return any(n["relaunches"] == 1 and n["state"] == "running" for n in job.status()["nodes"])

    job.wait_for(relaunched, "node-1 relaunched")
    job.wait_for(lambda: any("node-1#2" in s["file"] for s in job.seen()), "node-1#2 working")
    job.stop_workers()
    code, out, err = job.finish()
    assert code == 0, err
    assert "node-1 was lost (killed by SIGKILL): relaunching it" in out


def test_a_node_lost_three_times_is_marked_faulty_and_replaced(make_job: Any) -> None:
    job = make_job(nodes={"min": 1, "max": 2}, max_node_relaunches=5)
    job.start(env={"KILL_AGENT_OF": "node-1#"})

    def replaced() -> bool:
        states = {n["name"]: (n["state"], n["relaunches"]) for n in job.status()["nodes"]}
        return states.get("node-1") == ("faulty", 2) and states.get("node-2", ("",))[0] == "running"

    job.wait_for(replaced, "node-1 retired and node-2 started")
    job.wait_for(lambda: any("node-2#1" in s["file"] for s in job.seen()), "node-2 working")
    job.stop_workers()
    code, out, err = job.finish()
    assert code == 0, err
    assert "node-1 was lost 3 times (last: killed by SIGKILL): marked faulty, replaced" in out


def test_a_preempted_node_is_replaced_not_counted_as_done(make_job: Any) -> None:
    job = make_job(nodes={"min": 1, "max": 2}, max_node_relaunches=2).start()
    job.wait_for(lambda: len(job.seen()) == 2, "2 workers")
    os.kill(job.node_pid("node-1"), signal.SIGTERM)  # a spot reclaim, say
    job.wait_for(lambda: any("node-1#2" in s["file"] for s in job.seen()), "node-1 replaced")
    job.stop_workers()
    code, out, err = job.finish()
    assert code == 0, err
    assert "node-1 was lost (exit code 143, SIGTERM): relaunching it" in out


def test_a_lost_node_with_no_relaunch_left_below_min_fails_the_job(make_job: Any) -> None:
    job = make_job(nodes={"min": 2, "max": 2}, max_node_relaunches=0).start()
    job.wait_for(lambda: len(job.seen()) == 2, "2 workers")
    os.kill(job.node_pid("node-0"), signal.SIGKILL)
    code, _, err = job.finish()
    assert code == 1
    assert "node-0 was lost (killed by SIGKILL) and no relaunch is left" in err
    assert "fewer than nodes.min=2" in err


def test_scaling_up_and_down_changes_the_world(make_job: Any) -> None:
    job = make_job(nodes={"min": 1, "max": 3, "initial": 1}).start()
    job.wait_for(lambda: len(job.seen()) == 1, "1 worker")
    done = job.control("scale", "--nodes", "3")
    assert done.returncode == 0 and "scaled from 1 to 3 nodes" in done.stdout
    job.wait_for(lambda: {s["world"] for s in job.seen()} >= {1, 3}, "a world of 3")
    assert job.control("scale", "--nodes", "2").returncode == 0
    job.wait_for(lambda: 2 in {s["world"] for s in job.seen()}, "a world of 2")
    # The survivors can train in their world of 2 before node-2's process has
    # exited (it is "stopping" until then).
    expected = {"node-0": "running", "node-1": "running", "node-2": "stopped"}
    job.wait_for(
        lambda: {n["name"]: n["state"] for n in job.status()["nodes"]} == expected,
        "node-2 stopped, the others running",
    )
    refused = job.control("scale", "--nodes", "4")
    assert refused.returncode == 1 and "nodes must lie in 1..3" in refused.stderr
    job.stop_workers()
    code, _, err = job.finish()
    assert code == 0, err


def test_status_shows_the_round_and_the_nodes(make_job: Any) -> None:
    job = make_job(nodes={"min": 2, "max": 2}, nproc_per_node=2).start()
    job.wait_for(lambda: len(job.seen()) == 4, "4 workers")
    status = job.status()
    assert status["phase"] == "running" and int(status["round"]) >= 1
    assert status["world_size"] == 4 and status["target_nodes"] == 2
    text = job.control("status").stdout
    assert "job test-job: running" in text and "nodes 2 running" in text

    def measured() -> bool:  # the agents' heartbeats carry their workers' metrics
        nodes = job.status()["nodes"]
        return all(n.get("metrics", {}).get("steps_per_second", 0) > 0 for n in nodes)

    job.wait_for(measured, "node metrics")
    for node in job.status()["nodes"]:
        metrics = node["metrics"]
        assert int(metrics["rss_bytes"]) > 10 << 20, node  # two python processes
        # 2 ranks x 4 samples every ~50 ms (sleep plus a loaded machine's slack)
        assert 20 < metrics["samples_per_second"] <= 170, node
        assert 40 < metrics["step_time_ms"] < 400, node
    job.stop_workers()
    assert job.finish()[0] == 0


def test_a_bad_config_exits_2_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("name: x\ncommand: absent.py\nnodes: {min: 0}\n")
    done = subprocess.run(
        [sys.executable, "-m", "dlfleet.master", "--job-config", str(tmp_path / "job.yaml")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "invalid job config" in done.stderr and "nodes.min" in done.stderr
    assert not (tmp_path / ".dlfleet").exists()


def run_job_yaml(path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """`dlmaster --job-config` of a job whose script does nothing."""
    (path.parent / "train.py").write_text("")
    path.write_text(f"name: x\ncommand: train.py\ndisplay: plain\n{text}")
    return subprocess.run(
        [sys.executable, "-m", "dlfleet.master", "--job-config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,  # a master that never listens is given up on after 60 s
        check=False,
    )


@pytest.mark.parametrize("endpoint", ["master", "http"])
def test_a_port_in_use_exits_2_naming_the_job_yaml_setting_before_anything_starts(
    endpoint: str, tmp_path: Path
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = run_job_yaml(tmp_path / "job.yaml", f"{endpoint}: {{port: {port}}}\n")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"127.0.0.1:{port}: the port is in use ({endpoint}.port: {port} in " in done.stderr
    assert not (tmp_path / ".dlfleet").exists(), "no master, no node, no workdir"


def test_a_master_that_exits_as_it_starts_fails_the_job_at_once_with_its_reason(
    tmp_path: Path,
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Both free, until the master's gRPC server takes the port its HTTP
    # endpoint wants too.
    yaml = f"master: {{port: {port}}}\nhttp: {{port: {port}}}\n"
    done = run_job_yaml(tmp_path / "job.yaml", yaml)
    assert done.returncode == 1
    assert "the master exited (exit code 2) before it listened" in done.stderr
    assert f"(--http-port {port})" in done.stderr


# A worker that also leases shards from the job's master, one every 50 ms,
# acknowledging each with the next request.
SHARD_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from dlfleet.api.client import MasterClient
    from dlfleet.api.v1 import shards_pb2
    from dlfleet.worker import progress
    out, env = sys.argv[1], os.environ
    me = f"{env['DLFLEET_NODE_ID']}-r{env['DLFLEET_ROUND']}-{env['LOCAL_RANK']}"
    with open(os.path.join(out, me + ".json"), "w") as f:
        json.dump({"world": int(env["WORLD_SIZE"]), "rank": int(env["RANK"])}, f)
    client = MasterClient(env["DLFLEET_MASTER"], token=env["DLFLEET_TOKEN"])
    client.register_dataset(
        shards_pb2.DatasetSpec(name="data", size=100_000, batch_size=1, shard_size=10, epochs=1)
    )
    held = []
    while not os.path.exists(os.path.join(out, "stop")):
        resp = client.lease("data", node_id=env["DLFLEET_NODE_ID"], rank=0, done=held)
        held = [resp.shard.lease_id] if resp.WhichOneof("outcome") == "shard" else []
        time.sleep(0.05)
        progress.step(4)
    """
)


def test_the_master_serves_metrics_and_status_over_http_while_the_job_runs(
    make_job: Any,
) -> None:
    job = make_job(nodes={"min": 2, "max": 2}, max_node_relaunches=2)
    (job.root / "worker.py").write_text(SHARD_WORKER)
    job.start()
    job.wait_for(lambda: sum(s["world"] == 2 for s in job.seen()) == 2, "2 workers")
    printed = job.status()  # what `dlmaster status --json` prints
    jsonschema.validate(printed, json.loads(SCHEMA_PATH.read_text()))
    assert isinstance(printed["round"], int) and printed["round"] >= 1  # int64: not "1"
    url = printed["http_url"]
    assert url.startswith("http://127.0.0.1:")
    assert f"http: {url}" in job.control("status").stdout
    token = (job.root / ".dlfleet" / "test-job" / "token").read_text().strip()
    auth = {"Authorization": f"Bearer {token}"}
    assert http_get(url + "/metrics")[0] == 401
    status, text = http_get(url + "/api/v1/status", auth)
    assert status == 200
    document = json.loads(text)
    jsonschema.validate(document, json.loads(SCHEMA_PATH.read_text()))
    assert {n["name"] for n in document["nodes"]} == {"node-0", "node-1"}

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        status, text = http_get(url + "/metrics", auth)
        assert status == 200, text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def measured() -> bool:
        samples = scrape()
        rates = [v for (name, _), v in samples.items() if name == "dlfleet_node_samples_per_second"]
        return len(rates) == 2 and all(rate > 0 for rate in rates)

    job.wait_for(measured, "per-node samples/s in /metrics")
    before = scrape()
    assert before[("dlfleet_world_size", ())] == 2
    assert before[("dlfleet_nodes", (("state", "in_round"),))] == 2
    rounds = before[("dlfleet_rendezvous_rounds_formed_total", ())]
    done = (("dataset", "data"),)

    def shards_move() -> bool:
        samples = scrape()
        return (
            samples.get(("dlfleet_shards_done_total", done), 0)
            > before.get(("dlfleet_shards_done_total", done), 0)
            and samples[("dlfleet_dataset_records_done", done)] > 0
        )

    job.wait_for(shards_move, "shards done counted")
    os.kill(job.node_pid("node-1"), signal.SIGKILL)  # the dlworker; its worker dies with it

    def counted() -> bool:
        samples = scrape()
        lost = sum(v for (name, _), v in samples.items() if name == "dlfleet_node_failures_total")
        return lost >= 1 and samples[("dlfleet_rendezvous_rounds_formed_total", ())] > rounds

    job.wait_for(counted, "the lost node and the next round counted")
    # What only the supervisor sees reaches /metrics too: the node's exit as
    # the platform saw it, its relaunch, and the brain's first (advised) plan.
    job.wait_for(
        lambda: scrape()[("dlfleet_node_exits_total", (("reason", "killed"),))] == 1,
        "the killed node's exit counted",
    )
    samples = scrape()
    assert samples[("dlfleet_node_relaunches_total", ())] == 1
    assert samples[("dlfleet_master_restarts_total", ())] == 0
    plans = sum(v for (name, _), v in samples.items() if name == "dlfleet_brain_plans_total")
    assert plans >= 1
    shards = scrape()[("dlfleet_shards_done_total", done)]
    job.wait_for(
        lambda: scrape()[("dlfleet_shards_done_total", done)] > shards, "shards done after the loss"
    )
    job.stop_workers()
    code, out, _ = job.finish()
    assert code == 0
    assert f"metrics and status on {url}; log in at {url}/login?token=<the token in" in out


def test_the_masters_status_carries_what_only_the_supervisor_knows(make_job: Any) -> None:
    job = make_job(nodes={"min": 2, "max": 2}).start()
    job.wait_for(lambda: sum(s["world"] == 2 for s in job.seen()) == 2, "2 workers")
    url = job.status()["http_url"]
    token = (job.root / ".dlfleet" / "test-job" / "token").read_text().strip()

    def supervisor_facts() -> bool:
        status, text = http_get(url + "/api/v1/status", {"Authorization": f"Bearer {token}"})
        assert status == 200, text
        document = json.loads(text)
        pids = {n["name"]: int(n["pid"]) for n in document["nodes"]}
        return document["target_nodes"] == 2 and pids == {
            name: job.node_pid(name) for name in ("node-0", "node-1")
        }

    job.wait_for(supervisor_facts, "the supervisor's facts (target, pids) in /api/v1/status")
    job.stop_workers()
    code, _, err = job.finish()
    assert code == 0, err


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status), answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
