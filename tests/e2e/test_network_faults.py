"""Network faults, end to end: a real `dlmaster` and two real `dlworker` nodes
(gloo workers included), each in a network namespace of its own, joined by
the link emulator of tests/netns.py.

- A partition: node b is cut off silently (every packet dropped, no RST). The
  master must drop it for missed heartbeats within the heartbeat timeout + 1 s,
  release the shard lease its worker held, and re-form the world without it
  within 5 s; node a trains on alone. When the link comes back, whatever b#1
  still sends is fenced (FAILED_PRECONDITION: its incarnation and round are
  stale) and disturbs nothing; b's agent ends as "node lost" (exit 3), and
  the node, started again as a platform would, rejoins in a later round.
- A slow link: b's packets delayed by 40 % of the heartbeat timeout each way
  for several timeouts: b is not mistaken for a dead node.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from netns import NetLab, Output, require_netns, user_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

BIN = Path(sys.executable).parent  # the venv's bin: dlmaster, dlworker
TOKEN = "test-token"
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0
HOSTS = {"m": "10.231.0.1", "a": "10.231.0.2", "b": "10.231.0.3"}
DATASET = "netfault"
DATASET_SIZE = 64

# Every rank all-reduces a one each step, forever (the test ends it), and logs
# the step; with HOLD_LEASE=1, local rank 0 first takes one shard lease of its
# node and holds it, unreported.
WORKER = f"""
import json, os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist


def hold_a_lease(out):
    from dlfleet.api.client import MasterClient
    from dlfleet.api.v1 import shards_pb2

    node = os.environ["DLFLEET_NODE_ID"]
    spec = shards_pb2.DatasetSpec(
        name="{DATASET}", size={DATASET_SIZE}, batch_size=4, shard_size=16, epochs=1
    )
    with MasterClient(os.environ["DLFLEET_MASTER"], token=os.environ["DLFLEET_TOKEN"]) as client:
        client.register_dataset(spec)
        response = client.lease("{DATASET}", node_id=node, rank=0, request_id=node + "-held")
    shard = response.shard
    lease = {{"lease_id": shard.lease_id, "deadline_ms": shard.deadline_unix_ms}}
    (out / f"lease-{{node}}.json").write_text(json.dumps(lease))


out, pause = Path(sys.argv[1]), float(sys.argv[2])
dist.init_process_group("gloo")
node, round_ = os.environ["DLFLEET_NODE_ID"], os.environ["DLFLEET_ROUND"]
if os.environ.get("HOLD_LEASE") == "1" and os.environ["LOCAL_RANK"] == "0":
    hold_a_lease(out)
with (out / f"steps-r{{round_}}-{{node}}.jsonl").open("a") as log:
    step = 0
    while True:
        total = torch.ones(1)
        dist.all_reduce(total)
        world, t = dist.get_world_size(), time.time()
        line = {{"step": step, "world": world, "sum": total.item(), "t": t}}
        log.write(json.dumps(line) + "\\n")
        log.flush()
        step += 1
        time.sleep(pause)
"""

# `probe.py status MASTER`: the dataset's lease counts, as JSON.
# `probe.py fence MASTER NODE_ID INCARNATION ROUND LEASE_ID HOST`: what the
# master answers to a stale node's heartbeat, failure report, lease report and
# join, as JSON {call: [error class or "accepted", message]}.
PROBE = f"""
import json, os, sys

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import DlfleetError
from dlfleet.api.v1 import rendezvous_pb2

mode, master = sys.argv[1], sys.argv[2]
retry = RetryPolicy(attempts=30, max_backoff_s=0.5, total_budget_s=20)
client = MasterClient(master, token=os.environ["DLFLEET_TOKEN"], timeout_s=5, retry=retry)
if mode == "status":
    s = client.dataset_status("{DATASET}")
    print(json.dumps({{"leases_active": s.leases_active, "records_todo": s.records_todo}}))
    sys.exit(0)
node, incarnation, round_, lease_id, host = sys.argv[3:]
incarnation, round_, lease_id = int(incarnation), int(round_), int(lease_id)
report = rendezvous_pb2.FailureReport(
    node_id=node, incarnation=incarnation, round=round_, local_rank=0, exit_code=1, message="x"
)
calls = {{
    "heartbeat": lambda: client.heartbeat(node, incarnation),
    "report_failure": lambda: client.report_worker_failure(report),
    "report_done": lambda: client.report_done("{DATASET}", lease_id),
    "join": lambda: client.join_rendezvous(
        node_id=node, incarnation=incarnation, local_world_size=1, host=host,
        bootstrap_port=1, timeout_s=5,
    ),
}}
results = {{}}
for name, call in calls.items():
    try:
        call()
        results[name] = ["accepted", ""]
    except DlfleetError as error:
        results[name] = [type(error).__name__, str(error)]
print(json.dumps(results))
"""


@dataclass(frozen=True)
class Formed:
    at: float  # monotonic time the master logged it
    round: int
    members: frozenset[str]


@dataclass
class Fleet:
    """A master in host m, agents in hosts a and b, their workers' outputs."""

    lab: NetLab
    root: Path
    master: Output
    port: int

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def master_address(self) -> str:
        return f"{HOSTS['m']}:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        return user_env(DLFLEET_TOKEN=TOKEN, PYTHONUNBUFFERED="1", **extra)

    def agent(self, host: str, **extra_env: str) -> Output:
        argv = [
            str(BIN / "dlworker"), "--nnodes", "1:2", "--nproc-per-node", "1",
            "--max-restarts", "3", "--monitor-interval", "0.1",
            "--master", self.master_address, "--node-name", host,
            "--log-dir", str(self.root / "logs" / host),
            str(self.root / "worker.py"), str(self.out), "0.1",
        ]  # fmt: skip
        env = self.env(**extra_env)
        return Output(f"agent {host}", self.lab.popen(host, argv, env))

    def formed(self, since: float = 0.0) -> list[Formed]:
        rounds = []
        for t, match in self.master.matches(r"round (\d+) formed: (.*)", since):
            members = frozenset(re.findall(r"\('([^']+)', \d+\)", match.group(2)))
            rounds.append(Formed(t, int(match.group(1)), members))
        return rounds

    def wait_formed(self, members: set[str], *, timeout: float, since: float = 0.0) -> Formed:
        deadline = time.monotonic() + timeout
        while True:
            for formed in self.formed(since):
                if formed.members == members:
                    return formed
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no round of {sorted(members)} formed within {timeout}s; master log:\n"
                    f"{self.master.tail()}"
                )
            time.sleep(0.02)

    def steps(self, round_: int, node: str) -> list[dict[str, Any]]:
        path = self.out / f"steps-r{round_}-{node}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait_steps(self, round_: int, node: str, count: int, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        while len(steps := self.steps(round_, node)) < count:
            assert time.monotonic() < deadline, (
                f"{node} made {len(steps)} of {count} steps in round {round_} within {timeout}s"
            )
            time.sleep(0.05)
        return steps

    def probe(self, host: str, *args: str) -> dict[str, Any]:
        argv = [sys.executable, str(self.root / "probe.py"), *args]
        done = self.lab.run(host, argv, env=self.env(), timeout=60)
        assert done.returncode == 0, f"probe {args} in {host}: {done.stdout}{done.stderr}"
        data: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return data

    def lease_status(self) -> dict[str, Any]:
        return self.probe("m", "status", f"127.0.0.1:{self.port}")


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    require_netns()
    net = NetLab(dict(HOSTS)).start()
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def fleet(lab: NetLab) -> Iterator[Callable[[], Fleet]]:
    # The hosts' /tmp are their own: the test's folder is on the lab's share.
    tmp_path = lab.shared / secrets.token_hex(4)

    def start() -> Fleet:
        (tmp_path / "out").mkdir(parents=True)
        (tmp_path / "worker.py").write_text(WORKER)
        (tmp_path / "probe.py").write_text(PROBE)
        argv = [
            str(BIN / "dlmaster"), "--host", "0.0.0.0", "--port", "0",
            "--store", f"sqlite:///{tmp_path / 'master.db'}",
            "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
            "--min-nodes", "1", "--max-nodes", "2", "--last-call-timeout", "0.3",
        ]  # fmt: skip
        master = Output("dlmaster", lab.popen("m", argv, user_env(DLFLEET_TOKEN=TOKEN)))
        _, listening = master.wait_for(r"listening on [\d.]+:(\d+)", timeout=30)
        return Fleet(lab, tmp_path, master, int(listening.group(1)))

    try:
        yield start
    finally:
        lab.kill_processes()
        for host in HOSTS:
            lab.heal(host)


def test_a_cut_off_node_is_dropped_in_time_fenced_and_rejoins_later(
    fleet: Callable[[], Fleet], lab: NetLab
) -> None:
    f = fleet()
    f.agent("a")
    b1 = f.agent("b", HOLD_LEASE="1")
    both = f.wait_formed({"a#1", "b#1"}, timeout=60)
    f.wait_steps(both.round, "a#1", 3, timeout=60)
    f.wait_steps(both.round, "b#1", 3, timeout=60)
    lease = json.loads((f.out / "lease-b#1.json").read_text())
    assert f.lease_status()["leases_active"] == 1

    # Cut b off: nothing from it or to it gets through, and nothing says so.
    cut_at = time.monotonic()  # taken first: the times measured are upper bounds
    lab.cut("b")
    detected_at, dropped = f.master.wait_for(
        r"node b#1 (missed its heartbeats|lost its session)", since=cut_at, timeout=30
    )
    alone = f.wait_formed({"a#1"}, since=cut_at, timeout=30)
    detection, reform = detected_at - cut_at, alone.at - detected_at
    print(f"partition: detected after {detection:.2f}s, re-formed {reform:.2f}s later")
    assert dropped.group(1) == "missed its heartbeats"  # a silent link breaks no stream
    assert detection <= HEARTBEAT_TIMEOUT_S + 1, f"detected {detection:.2f}s after the cut"
    assert reform <= 5, f"re-formed {reform:.2f}s after the detection"
    assert alone.round > both.round
    assert f.master.matches(rf"round {both.round} closed: .*b#1", since=cut_at)
    # Its lease went back to the queue when it was dropped, not at its deadline.
    status = f.lease_status()
    assert time.time() * 1000 < lease["deadline_ms"], "too slow to tell release from expiry"
    assert status == {"leases_active": 0, "records_todo": DATASET_SIZE}
    # a trains on alone.
    steps = f.wait_steps(alone.round, "a#1", 3, timeout=30)
    assert {(s["world"], s["sum"]) for s in steps} == {(1, 1.0)}

    # The link comes back: what b#1 says is stale, and changes nothing.
    lab.heal("b")
    healed_at = time.monotonic()
    fenced = f.probe(
        "b", "fence", f.master_address, "b#1", "1", str(both.round),
        str(lease["lease_id"]), HOSTS["b"],
    )  # fmt: skip
    assert {call: result[0] for call, result in fenced.items()} == {
        "heartbeat": "StaleError",
        "report_failure": "StaleError",
        "report_done": "StaleError",
        "join": "StaleError",
    }, fenced
    # b's own agent learns it was dropped, registers a new incarnation and
    # rejoins by itself, in a later round; its old workers never trained again.
    again = f.wait_formed({"a#1", "b#2"}, since=healed_at, timeout=60)
    assert again.round > alone.round
    assert "registered again as b#2" in b1.text(), b1.tail()
    for node in ("a#1", "b#2"):
        steps = f.wait_steps(again.round, node, 3, timeout=60)
        assert {(s["world"], s["sum"]) for s in steps} == {(2, 2.0)}
    trained_by_b1 = sorted(p.name for p in f.out.glob("steps-r*-b#1.jsonl"))
    assert trained_by_b1 == [f"steps-r{both.round}-b#1.jsonl"]


def test_a_slow_link_is_not_mistaken_for_a_dead_node(
    fleet: Callable[[], Fleet], lab: NetLab
) -> None:
    f = fleet()
    f.agent("a")
    f.agent("b")
    both = f.wait_formed({"a#1", "b#1"}, timeout=60)
    f.wait_steps(both.round, "b#1", 3, timeout=60)

    delay = 0.4 * HEARTBEAT_TIMEOUT_S  # each way: b's round trips take 2.4 s
    lab.delay("b", delay)
    slowed_at = time.monotonic()
    slowed_wall = time.time()
    time.sleep(4 * HEARTBEAT_TIMEOUT_S)
    lab.heal("b")
    healed_wall = time.time()

    assert not f.master.matches(r"node \S+ (missed its heartbeats|lost its session)"), (
        f.master.tail()
    )
    assert not f.master.matches(r"round \d+ (closed|formed)", since=slowed_at), f.master.tail()
    # The link was slow indeed: an all-reduce with b took a round trip or more.
    slow = [s for s in f.steps(both.round, "b#1") if slowed_wall < s["t"] <= healed_wall]
    assert len(slow) >= 2, slow
    gaps = [later["t"] - earlier["t"] for earlier, later in itertools.pairwise(slow)]
    assert max(gaps) >= 2 * delay, gaps
    # And both train on in the same round.
    before = len(f.steps(both.round, "b#1"))
    steps = f.wait_steps(both.round, "b#1", before + 5, timeout=30)
    assert {(s["world"], s["sum"]) for s in steps} == {(2, 2.0)}
    assert [r.round for r in f.formed()][-1] == both.round
