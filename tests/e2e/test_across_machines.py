"""Across machines, as a new user runs it: README's "Across machines" commands,
word for word, each on a machine of its own (tests/netns.py: a network
namespace with its own hostname, /etc/hosts, /tmp and /dev/shm), in a user's
environment with nothing dlfleet-specific set but the token.

- DDP (gloo) trains with in-memory checkpoints persisted to the one shared
  folder; a node's machine is lost (every process killed), a node on a new
  machine takes its place and restores from the peer replica; the lost
  machine's node comes back and the world grows to three; the ledger of
  trained records is exact. Host a resolves its own hostname to 127.0.1.1
  (Debian's default /etc/hosts) and host b has a second interface on a
  network nobody else reaches, its hostname resolving there: what torchrun
  would publish on either is unreachable, and the route to the master is not.
- The same machines through stock `torchrun --rdzv-backend=dlfleet`.
- A node that publishes a loopback address into a job on several machines is
  refused at once, with a message naming --local-addr.
"""

from __future__ import annotations

import re
import secrets
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.ledger import assert_exactly_once, read_ledger
from netns import NetLab, Output, require_netns, user_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TOKEN = secrets.token_hex(16)
HOSTS = {"m": "10.232.0.1", "a": "10.232.0.2", "b": "10.232.0.3", "c": "10.232.0.4"}
SIZE = 360
FORMED = r"round (\d+) formed: (.*)"


def readme_commands() -> dict[str, list[str]]:
    """The commands of README's "Across machines" section, by program."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Across machines", 1)[1].split("\n## ", 1)[0]
    commands: dict[str, list[str]] = {}
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#", 1)[0])
            if words and words[0] in ("dlmaster", "dlworker", "torchrun"):
                commands.setdefault(words[0], words)
    return commands


def with_script(command: list[str], script: Path, *args: str) -> list[str]:
    """README's command with its `train.py` replaced by `script` and `args`."""
    assert command[-1] == "train.py", command
    return [*command[:-1], str(script), *args]


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    require_netns()
    net = NetLab(dict(HOSTS), debian_hosts=frozenset({"a"}), second_net={"b": "10.99.0.3"}).start()
    try:
        yield net
    finally:
        net.close()


@pytest.fixture
def job(lab: NetLab) -> Iterator[Path]:
    """A folder on the shared file system for this test; the master started
    on host m with README's command."""
    folder = lab.shared / secrets.token_hex(4)
    folder.mkdir()
    yield folder
    lab.kill_processes()


def start_master(lab: NetLab, job: Path) -> Output:
    """README's dlmaster, run in the test's own folder: its default store is
    the one a user starting there gets (a store holds one job, and host m's
    /tmp outlives a test)."""
    command = readme_commands()["dlmaster"]
    master = Output("dlmaster", lab.popen("m", command, env(), cwd=str(job)))
    master.wait_for(r"listening on", timeout=60)
    return master


def env() -> dict[str, str]:
    return user_env(DLFLEET_TOKEN=TOKEN)


def members(master: Output, since: float = 0.0) -> list[set[str]]:
    return [
        set(re.findall(r"\('([^']+)', \d+\)", match.group(2)))
        for _, match in master.matches(FORMED, since)
    ]


def wait_round(master: Output, hosts: set[str], timeout: float, since: float = 0.0) -> float:
    """Until a round of exactly the nodes of `hosts` forms (node names start
    with their hostnames); when it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for at, match in master.matches(FORMED, since):
            names = re.findall(r"\('([^']+)', \d+\)", match.group(2))
            if sorted(n[4] for n in names) == sorted(hosts):  # 'hosta...#1' -> 'a'
                return at
        time.sleep(0.05)
    raise AssertionError(f"no round of {sorted(hosts)}; rounds: {members(master)}\n{master.tail()}")


def steps_logged(ledger: Path) -> int:
    return sum(1 for e in read_ledger(ledger)[0]) if ledger.exists() else 0


def wait_steps(ledger: Path, count: int, timeout: float, *outputs: Output) -> float:
    deadline = time.monotonic() + timeout
    while steps_logged(ledger) < count:
        if time.monotonic() > deadline:
            tails = "\n\n".join(f"{o.name}:\n{o.tail()}" for o in outputs)
            raise AssertionError(f"fewer than {count} steps logged in {timeout}s\n{tails}")
        time.sleep(0.05)
    return time.monotonic()


def test_readme_commands_train_across_machines_through_a_lost_and_an_added_node(
    lab: NetLab, job: Path
) -> None:
    ledger, checkpoints = job / "ledger", job / "checkpoints"
    worker = with_script(
        readme_commands()["dlworker"],
        SCRIPTS / "ledger_train.py",
        "--ledger-dir", str(ledger), "--checkpoint-dir", str(checkpoints),
        "--in-memory", "--persist-every", "40", "--size", str(SIZE), "--epochs", "1",
        "--batch-size", "2", "--sleep-per-step", "0.15",
    )  # fmt: skip
    started = time.monotonic()
    master = start_master(lab, job)
    nodes = {host: Output(f"node {host}", lab.popen(host, worker, env())) for host in "ab"}
    wait_round(master, {"a", "b"}, timeout=90)
    first_step = wait_steps(ledger, 2 * 12, 120, master, *nodes.values())
    print(f"lab: first step {first_step - started:.1f}s after the master started")

    # Host b is lost; a node on a new machine, c, takes its place.
    lab.kill_host("b")
    lost = time.monotonic()
    before = steps_logged(ledger)
    nodes["c"] = Output("node c", lab.popen("c", worker, env()))
    wait_round(master, {"a", "c"}, timeout=90, since=lost)
    recovered = wait_steps(ledger, before + 2 * 4, 90, master, *nodes.values())
    print(f"lab: trained again {recovered - lost:.1f}s after host b was lost (c started then)")

    # b's node comes back: the world grows to three.
    grown = time.monotonic()
    nodes["b"] = Output("node b again", lab.popen("b", worker, env()))
    wait_round(master, {"a", "b", "c"}, timeout=90, since=grown)
    for host in "acb":
        assert nodes[host].wait_exit(150) == 0, nodes[host].tail()

    report = assert_exactly_once(ledger, size=SIZE, epochs=1)
    worlds = {entry.world for entry in read_ledger(ledger)[0]}
    assert worlds == {2, 3}, worlds
    restored = [r.restored_step for r in report.restores]
    # After the loss, from memory (the peer's replica), not from the start nor
    # from the persisted folder (every 40 steps: none by then).
    assert any(step >= 10 for step in restored), report.restores
    for host in "ac":
        assert re.search(r"this node's address: 10\.232\.0\.", nodes[host].text()), nodes[
            host
        ].tail()


def test_stock_torchrun_trains_across_machines_through_a_lost_and_an_added_node(
    lab: NetLab, job: Path
) -> None:
    """README's torchrun command: the master re-forms the world when host b
    is lost and a node on host c joins, then again when b's node comes back.
    torchrun's own process keeps each node's checkpoint images and copies
    them to its peer (the dlfleet rendezvous handler runs the keeper): after
    b's loss the world of a and c restores from memory, b's ranks from their
    replica on a (nothing is persisted), and the ledger is exact."""
    ledger = job / "ledger"
    command = with_script(
        readme_commands()["torchrun"],
        SCRIPTS / "ledger_train.py",
        "--ledger-dir", str(ledger), "--checkpoint-dir", str(job / "checkpoints"),
        "--in-memory", "--size", str(SIZE), "--epochs", "1", "--batch-size", "2",
        "--sleep-per-step", "0.15",
    )  # fmt: skip
    master = start_master(lab, job)
    runs = {host: Output(f"torchrun {host}", lab.popen(host, command, env())) for host in "ab"}
    wait_round(master, {"a", "b"}, timeout=90)
    wait_steps(ledger, 2 * 12, 120, master, *runs.values())
    lab.kill_host("b")
    lost = time.monotonic()
    before = steps_logged(ledger)
    runs["c"] = Output("torchrun c", lab.popen("c", command, env()))
    wait_round(master, {"a", "c"}, timeout=90, since=lost)
    wait_steps(ledger, before + 2 * 4, 90, master, *runs.values())
    grown = time.monotonic()
    runs["b"] = Output("torchrun b again", lab.popen("b", command, env()))
    wait_round(master, {"a", "b", "c"}, timeout=90, since=grown)
    for host in "acb":
        assert runs[host].wait_exit(150) == 0, runs[host].tail()

    report = assert_exactly_once(ledger, size=SIZE, epochs=1)
    assert {entry.world for entry in read_ledger(ledger)[0]} == {2, 3}
    assert any(r.restored_step >= 10 for r in report.restores), report.restores
    assert not (job / "checkpoints" / "persisted").exists()


def test_a_loopback_address_in_a_job_on_several_machines_is_refused_naming_the_flag(
    lab: NetLab, job: Path
) -> None:
    master = start_master(lab, job)
    command = readme_commands()["dlworker"]
    loopback = [*command[:1], "--local-addr", "127.0.0.1", *command[1:-1]]
    loopback.append(str(SCRIPTS / "allreduce_steps.py"))
    loopback += [str(job), "5", "0.05"]
    runs = [Output(f"node {host}", lab.popen(host, loopback, env())) for host in "ab"]
    for run in runs:
        code = run.wait_exit(60)
        assert code != 0, run.tail()
        assert "--local-addr" in run.text() and "loopback" in run.text(), run.tail()
    assert not members(master), master.tail()


def test_a_store_published_where_a_node_cannot_reach_it_ends_that_node_naming_the_address(
    lab: NetLab, job: Path
) -> None:
    """Node a names an address no other machine reaches (--local-addr 10.77.0.9)
    and leads the round: node b says so within the probe's bound, instead of
    waiting on it until the process group's timeout."""
    start_master(lab, job)
    command = readme_commands()["dlworker"]
    script = [str(SCRIPTS / "allreduce_steps.py"), str(job), "5", "0.05"]
    flagged = [*command[:-1], "--local-addr", "10.77.0.9", *script]
    leader = Output("node a", lab.popen("a", flagged, env()))
    leader.wait_for(r"this node's address: 10\.77\.0\.9", timeout=60)
    leader.wait_for(r"waiting \d+s for a round", timeout=30)  # joined first: it leads
    other = Output("node b", lab.popen("b", [*command[:-1], *script], env()))
    code = other.wait_exit(90)
    assert code != 0, other.tail()
    said = re.search(
        r"cannot reach its round's process-group store at 10\.77\.0\.9:\d+", other.text()
    )
    assert said, other.tail()
    assert "--local-addr" in other.text(), other.tail()


def test_a_persist_location_on_each_machines_own_disk_is_reported_at_start(
    lab: NetLab, job: Path
) -> None:
    """Checkpoints persisted to /tmp/checkpoints: a folder of each machine's
    own. The first round of the two machines says so, naming the location,
    before any step is persisted there."""
    start_master(lab, job)
    worker = with_script(
        readme_commands()["dlworker"],
        SCRIPTS / "ledger_train.py",
        "--ledger-dir", str(job / "ledger"), "--checkpoint-dir", "/tmp/checkpoints",
        "--in-memory", "--persist-every", "2", "--size", "40", "--epochs", "1",
    )  # fmt: skip
    nodes = [Output(f"node {host}", lab.popen(host, worker, env())) for host in "ab"]
    for node in nodes:
        node.wait_for(
            r"persist location /tmp/checkpoints/persisted is not shared by every host", timeout=90
        )
    for host in "ab":  # nothing half-written on either machine's disk
        done = lab.run(host, ["sh", "-c", "ls /tmp/checkpoints/persisted 2>/dev/null | wc -l"])
        assert done.stdout.strip() == "0", done.stdout
