"""Fleet benchmark: one real `dlmaster` on its durable store against N
simulated nodes, N = 128, 1,000, 4,000, 10,000; torch's c10d at 128 nodes as
the reference.

    python bench/fleet.py                       # N = 128, 1000, 4000, 10000 on SQLite
    python bench/fleet.py --sizes 128,1000 --stores sqlite,postgres
    python bench/fleet.py --quick               # N = 128, 1000

The nodes (bench/_fleet_agents.py) are the real client's: per node its own
`MasterClient` and TCP connection, `Register`, the agent's session stream with
its heartbeats every `--interval` carrying node metrics, and `Join`, again after
every re-rendezvous push. They run on one asyncio loop per process, over K
processes (`--procs`, default 3), plus one process holding 1% of the nodes
(at least one), which is killed with SIGKILL for the loss test.

Per level, in order, on a fresh master and store:
* formation: every node registered and its session open (not timed), then all
  join from one instant; the time until the last join returned. Validated: one
  round, a world of N, ranks 0..N-1.
* steady state: after `--settle` s, over `--window` s: the master's CPU share
  (CPU seconds / wall seconds, all its threads; 1.0 = one core), its RSS at the
  end, the heartbeat round trip (p50/p99 of `Nodes.Heartbeat` calls that 64
  probe nodes make every second, through the loop that carries every node's
  session beats), and the status RPC (`Master.GetStatus`, the master's status of the job,
  20 calls: p50/max).
* loss: the 1% process is SIGKILLed. Detection: from the kill to the first
  survivor told to re-rendezvous; re-formed: from that push to the last
  survivor's new join result. Validated: every survivor in one new round of
  N - 1% nodes.
* partition: one heartbeat interval after that re-formation, one node stops
  heartbeating, its stream left open. Detection:
  from its last heartbeat to the first survivor told (the goal: within the
  heartbeat timeout + 1 s); re-formed as above, a world one smaller.

The master, the nodes and the bench share this machine: the nodes' CPU
competes with the master's. The last line is `ratio: X`: c10d's median
formation time at 128 nodes (bench/rendezvous.py's harness and driver, 3
runs) over dlfleet's at the largest level run (10,000 by default).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    BenchError,
    ServerProcess,
    cpu_seconds,
    exit_on_sigterm,
    free_port,
    kill_group,
    say,
)

ROOT = Path(__file__).resolve().parent.parent
AGENTS = Path(__file__).resolve().parent / "_fleet_agents.py"
PROFILED = Path(__file__).resolve().parent / "_profiled.py"
PYTHON = Path(sys.executable)
SIZES = (128, 1000, 4000, 10000)
QUICK_SIZES = (128, 1000)
PROBES = 64
STATUS_CALLS = 20
POSTGRES_URL = os.environ.get(
    "DLFLEET_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
# The goals at 10,000 nodes (issue #17).
GOAL_CPU = 1.0
GOAL_HB_P99_MS = 50.0
GOAL_DETECT_SLACK_S = 1.0
GOAL_REFORM_S = 2.0
GOAL_RSS_MB = 1024.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Level:
    store: str
    nodes: int
    setup_s: float = 0.0
    formation_s: float = 0.0
    # CPU seconds during formation: the master's, and the simulators' together.
    form_master_cpu_s: float = 0.0
    form_sims_cpu_s: float = 0.0
    cpu_share: float = 0.0
    hb_p50_ms: float = 0.0
    hb_p99_ms: float = 0.0
    hb_samples: int = 0
    rss_mb: float = 0.0
    status_p50_ms: float = 0.0
    status_max_ms: float = 0.0
    loss_detect_s: float = 0.0
    loss_reform_s: float = 0.0
    part_detect_s: float = 0.0
    part_reform_s: float = 0.0
    notes: list[str] = field(default_factory=list)


class AgentProc:
    """One simulator process and its line protocol."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self._log_file = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self.log = log
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"no {prefix} within {timeout_s:.0f} s; {self.tail()}") from None
            if line is None:
                raise BenchError(f"simulator exited before {prefix}; {self.tail()}")
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def ask(self, command: str, reply: str, timeout_s: float = 60.0) -> Any:
        self.send(command)
        return json.loads(self.expect(reply, timeout_s))

    def tail(self) -> str:
        text = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        return f"{self.log}:\n" + "\n".join(text[-10:])

    def cpu_seconds(self) -> float:
        try:
            return cpu_seconds(self.proc.pid)
        except OSError:
            return 0.0

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        kill_group(self.proc, grace=1.0)
        self._log_file.close()


def spread(nodes: int, procs: int) -> list[tuple[int, int]]:
    """(first, count) per process; the last one is the 1% killed at once."""
    lost = max(1, nodes // 100)
    rest = nodes - lost
    k = max(1, min(procs, rest))
    out: list[tuple[int, int]] = []
    first = 0
    for i in range(k):
        count = rest // k + (1 if i < rest % k else 0)
        out.append((first, count))
        first += count
    out.append((first, lost))
    return out


@dataclass
class Fleet:
    args: argparse.Namespace
    workdir: Path
    store: str
    nodes: int
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: list[AgentProc] = field(default_factory=list)

    def states(self, procs: list[AgentProc]) -> list[list[Any]]:
        for proc in procs:
            proc.send("STATE")
        return [s for proc in procs for s in json.loads(proc.expect("STATE", 60.0))]

    def wait_reformed(self, after_round: int, world: int, cap_s: float) -> tuple[int, float, float]:
        """(round, first push t, last join t) once every live node is in one
        round after `after_round`, of `world` nodes."""
        live = self.procs[:-1]
        deadline = time.monotonic() + cap_s
        while True:
            for proc in live:
                proc.send(f"SUMMARY {after_round} {world}")
            parts = [json.loads(proc.expect("SUMMARY", 60.0)) for proc in live]
            members = sum(p["members"] for p in parts)
            rounds = {r for p in parts for r in p["rounds"]}
            errors = [p["error"] for p in parts if p["errors"]]
            if errors:
                count = sum(p["errors"] for p in parts)
                raise BenchError(f"{count} nodes failed to join, e.g. {errors[0]}")
            if len(rounds) == 1 and members == world:
                pushed = min(p["first_push"] for p in parts if p["members"])
                last_push = max(p["last_push"] for p in parts if p["members"])
                say(f"    (round {next(iter(rounds))}: pushes reached the survivors over "
                    f"{last_push - pushed:.3f} s)")  # fmt: skip
                last_join = max(p["last_join"] for p in parts if p["members"])
                return rounds.pop(), pushed, last_join
            if time.monotonic() > deadline:
                raise BenchError(
                    f"no round of {world} within {cap_s:.0f} s: {members} nodes "
                    f"in rounds {sorted(rounds)[:5]}"
                )
            time.sleep(0.2)


def master_argv(
    port: int, store_url: str, nodes: int, args: argparse.Namespace, token: str
) -> list[str]:
    lost = max(1, nodes // 100)
    return [
        str(PYTHON), "-m", "dlfleet.master", "--port", str(port), "--store", store_url,
        "--token", token, "--job-name", "job",
        "--min-nodes", str(nodes - lost - 1 if nodes - lost > 1 else 1),
        "--max-nodes", str(nodes),
        "--heartbeat-interval", str(args.interval), "--heartbeat-timeout", str(args.timeout),
        "--last-call-timeout", "30", "--log-level", args.master_log_level,
    ]  # fmt: skip


def fresh_store(kind: str, workdir: Path, nodes: int) -> tuple[str, Any]:
    """A store URL and its clean-up."""
    if kind == "sqlite":
        return f"sqlite:///{workdir / f'fleet-{nodes}.db'}", lambda: None
    import psycopg

    schema = "fleet_" + secrets.token_hex(6)
    base = POSTGRES_URL.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")

    def drop() -> None:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")

    sep = "&" if "?" in POSTGRES_URL else "?"
    return f"{POSTGRES_URL}{sep}options=-csearch_path%3D{schema}", drop


def start_fleet(fleet: Fleet, target: str, level: Level) -> list[tuple[int, int]]:
    """The simulator processes, every node registered and its session open."""
    args = fleet.args
    layout = spread(fleet.nodes, args.procs)
    # The probes' unary Heartbeat calls time the master's loop; an agent
    # makes none (its beats go up its session), so a run may leave them out.
    probes_each = max(1, args.probes // len(layout)) if args.probes else 0
    started = time.monotonic()
    for index, (first, count) in enumerate(layout):
        argv = [str(PYTHON), str(AGENTS), "--target", target, "--token", fleet.token]
        argv += ["--run-id", f"f{fleet.nodes}", "--first", str(first), "--count", str(count)]
        argv += ["--probes", str(min(count, probes_each))]
        log = fleet.workdir / f"agents-{fleet.store}-{fleet.nodes}-{index}.log"
        fleet.procs.append(AgentProc(argv, log))
    for proc in fleet.procs:
        proc.expect("READY", args.cap)
    level.setup_s = time.monotonic() - started
    return layout


def form(fleet: Fleet, server: ServerProcess, level: Level) -> int:
    """Every node joins from one instant; the round, validated."""
    nodes = fleet.nodes
    t0 = time.monotonic() + 0.5
    master0 = server.cpu_seconds()
    sims0 = sum(proc.cpu_seconds() for proc in fleet.procs)
    for proc in fleet.procs:
        proc.send(f"GO {t0!r}")
    try:
        replies = [json.loads(proc.expect("JOINED", fleet.args.cap)) for proc in fleet.procs]
    except BenchError:
        states = fleet.states(fleet.procs)
        errors = [s[5] for s in states if s[5]]
        raise BenchError(
            f"not formed by the cap: {sum(1 for s in states if s[0])} nodes in a round, "
            f"{len(errors)} joins failed{', e.g. ' + errors[0] if errors else ''}"
        ) from None
    level.form_master_cpu_s = server.cpu_seconds() - master0
    level.form_sims_cpu_s = sum(proc.cpu_seconds() for proc in fleet.procs) - sims0
    joined = [j for reply in replies for j in reply]
    errors = [j[6] for j in joined if j[6]]
    if errors:
        raise BenchError(f"{len(errors)} of {nodes} joins failed, e.g. {errors[0]}")
    rounds = {j[1] for j in joined}
    worlds = {j[2] for j in joined}
    if len(rounds) != 1 or worlds != {nodes} or sorted(j[0] for j in joined) != list(range(nodes)):
        raise BenchError(f"bad world: rounds {rounds}, worlds {worlds}")
    level.formation_s = max(j[3] for j in joined) - t0
    round_: int = rounds.pop()
    return round_


def steady(fleet: Fleet, server: ServerProcess, target: str, level: Level) -> None:
    """CPU share, RSS, heartbeat round trips and status calls over the window."""
    from dlfleet.api.client import MasterClient, RetryPolicy

    args = fleet.args
    time.sleep(args.settle)
    with MasterClient(target, token=fleet.token, retry=RetryPolicy(attempts=1)) as client:
        for proc in fleet.procs:
            proc.ask("PROBES", "PROBES")
        cpu0, w0 = server.cpu_seconds(), time.monotonic()
        status_ms: list[float] = []
        gap = args.window / STATUS_CALLS
        for _ in range(STATUS_CALLS):
            t = time.monotonic()
            client.master_status()
            status_ms.append((time.monotonic() - t) * 1000)
            time.sleep(max(0.0, gap - (time.monotonic() - t)))
    level.cpu_share = (server.cpu_seconds() - cpu0) / (time.monotonic() - w0)
    level.rss_mb = server.rss_mb()
    rtts = [r for proc in fleet.procs for r in proc.ask("PROBES", "PROBES")]
    level.hb_p50_ms, level.hb_p99_ms = pct(rtts, 0.5), pct(rtts, 0.99)
    level.hb_samples = len(rtts)
    level.status_p50_ms, level.status_max_ms = pct(status_ms, 0.5), max(status_ms)


def lose(fleet: Fleet, layout: list[tuple[int, int]], round_: int, level: Level) -> int:
    """The 1% process SIGKILLed, then one node partitioned; the last round."""
    args, nodes = fleet.args, fleet.nodes
    lost = layout[-1][1]
    killed_t = time.monotonic()
    fleet.procs[-1].kill()
    round_, pushed, reformed = fleet.wait_reformed(round_, nodes - lost, args.cap)
    level.loss_detect_s, level.loss_reform_s = pushed - killed_t, reformed - pushed

    # A partition in the steady state: one interval on, every node has beaten
    # since the re-formation. (Silenced at once, the node's last message was
    # its join, which the master, busy with thousands of them, read up to a
    # second after it went out: that second counted as detection time.)
    time.sleep(args.interval)
    silent = fleet.procs[0]
    silent.send(f"SILENCE {layout[0][1] - 1}")  # not a probe node
    last_beat = float(silent.expect("SILENCED", 30.0).split()[0])
    round_, pushed, reformed = fleet.wait_reformed(
        round_, nodes - lost - 1, args.timeout + args.cap
    )
    level.part_detect_s, level.part_reform_s = pushed - last_beat, reformed - pushed
    return round_


def cut_profile(server: ServerProcess, args: argparse.Namespace) -> None:
    """With --profile: the master writes the profile of the phase just done."""
    if args.profile:
        os.kill(server.proc.pid, signal.SIGUSR1)
        time.sleep(1.0)


def run_level(store: str, nodes: int, args: argparse.Namespace, workdir: Path) -> Level:
    level = Level(store, nodes)
    url, drop = fresh_store(store, workdir, nodes)
    fleet = Fleet(args, workdir, store, nodes)
    port = free_port()
    argv = master_argv(port, url, nodes, args, fleet.token)
    if args.profile:
        # The same master under cProfile; a profile per phase (see _profiled.py).
        prefix = Path(args.profile).resolve() / f"master-{store}-{nodes}"
        argv = [str(PYTHON), str(PROFILED), str(prefix), *argv[3:]]
    server = ServerProcess(
        "dlmaster",
        argv,
        workdir / f"master-{store}-{nodes}.log",
        f"listening on 127.0.0.1:{port}",
    )
    try:
        server.wait_ready(port, 60.0)
        target = f"127.0.0.1:{port}"
        layout = start_fleet(fleet, target, level)
        round_ = form(fleet, server, level)
        cut_profile(server, args)
        steady(fleet, server, target, level)
        cut_profile(server, args)
        lose(fleet, layout, round_, level)
        cut_profile(server, args)
        return level
    finally:
        for proc in fleet.procs:
            proc.stop()
        server.stop()
        with suppress(Exception):
            drop()


def c10d_reference(args: argparse.Namespace, workdir: Path) -> float:
    """c10d's median formation time at 128 nodes, through bench/rendezvous.py."""
    from rendezvous import run_once

    rdzv_args = argparse.Namespace(procs=4)
    token = secrets.token_hex(16)
    walls: list[float] = []
    for rep in range(args.c10d_reps):
        run = run_once("c10d", 128, rep, 120.0, rdzv_args, workdir, token)
        walls.append(run.wall_s if run.wall_s is not None else 120.0)
        say(f"  c10d N=128 run {rep + 1}: {walls[-1]:.3f} s")
    return statistics.median(walls)


def table(levels: list[Level], args: argparse.Namespace) -> None:
    say()
    say(
        f"{'store':8s} {'nodes':>6} {'setup s':>8} {'form s':>7} {'CPU':>5} {'hb p50':>7} "
        f"{'hb p99':>7} {'RSS MB':>7} {'status':>13} {'loss det/ref s':>15} {'part det/ref s':>15}"
    )
    for lv in levels:
        say(
            f"{lv.store:8s} {lv.nodes:6d} {lv.setup_s:8.1f} {lv.formation_s:7.3f} "
            f"{lv.cpu_share:5.2f} {lv.hb_p50_ms:7.1f} {lv.hb_p99_ms:7.1f} {lv.rss_mb:7.0f} "
            f"{lv.status_p50_ms:6.1f}/{lv.status_max_ms:6.1f} "
            f"{lv.loss_detect_s:7.3f}/{lv.loss_reform_s:7.3f} "
            f"{lv.part_detect_s:7.3f}/{lv.part_reform_s:7.3f}"
        )
    say(
        f"(CPU: master's share of one core in steady state; hb: heartbeat round trip, ms; "
        f"status: Master.GetStatus p50/max ms; heartbeat interval {args.interval:g} s, "
        f"timeout {args.timeout:g} s)"
    )


def goals(levels: list[Level], args: argparse.Namespace) -> None:
    top = max(lv.nodes for lv in levels)
    for lv in (lv for lv in levels if lv.nodes == top):
        checks = {
            "CPU < 1 core": lv.cpu_share < GOAL_CPU,
            f"heartbeat p99 < {GOAL_HB_P99_MS:.0f} ms": lv.hb_p99_ms < GOAL_HB_P99_MS,
            "loss detected < timeout + 1 s": lv.loss_detect_s < args.timeout + GOAL_DETECT_SLACK_S,
            "partition detected < timeout + 1 s": lv.part_detect_s
            < args.timeout + GOAL_DETECT_SLACK_S,
            f"re-formed < {GOAL_REFORM_S:.0f} s after detection": max(
                lv.loss_reform_s, lv.part_reform_s
            )
            < GOAL_REFORM_S,
            "RSS < 1 GB": lv.rss_mb < GOAL_RSS_MB,
        }
        verdicts = ", ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in checks.items())
        where = "" if top >= 10_000 else " (the goals are for 10,000 nodes)"
        say(f"goals at {top} nodes ({lv.store}){where}: {verdicts}")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"N = {QUICK_SIZES}")
    parser.add_argument("--sizes", help="comma-separated N (default 128,1000,4000,10000)")
    parser.add_argument("--stores", default="sqlite", help="sqlite,postgres (default sqlite)")
    parser.add_argument("--procs", type=int, default=3, help="simulator processes (3) plus the 1%")
    parser.add_argument("--interval", type=float, default=5.0, help="heartbeat interval s (5)")
    parser.add_argument(
        "--probes", type=int, default=PROBES, help=f"nodes timing heartbeat RPCs ({PROBES})"
    )
    parser.add_argument("--timeout", type=float, default=15.0, help="heartbeat timeout s (15)")
    parser.add_argument("--settle", type=float, default=5.0, help="s before the window (5)")
    parser.add_argument("--window", type=float, default=15.0, help="steady-state window s (15)")
    parser.add_argument("--cap", type=float, default=300.0, help="s any one phase may take")
    parser.add_argument(
        "--profile", help="a folder: the master runs under cProfile, a file a phase"
    )
    parser.add_argument("--keep-logs", action="store_true", help="the master's and agents' logs")
    parser.add_argument(
        "--master-log-level", default="WARNING", help="INFO: rounds formed and closed, timed"
    )
    parser.add_argument("--c10d-reps", type=int, default=3, help="c10d runs at 128 (0: none)")
    args = parser.parse_args(argv)
    if args.sizes:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    else:
        sizes = list(QUICK_SIZES if args.quick else SIZES)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if not sizes or min(sizes) < 2 or any(s not in ("sqlite", "postgres") for s in stores):
        parser.error("--sizes wants integers >= 2, --stores some of sqlite,postgres")
    return args, sizes, stores


def main(argv: list[str] | None = None) -> int:
    args, sizes, stores = parse_args(argv)
    exit_on_sigterm()
    workdir = Path(tempfile.mkdtemp(prefix="dlfleet-fleet-bench-"))
    say(f"fleet benchmark: sizes {sizes}, stores {stores}; logs in {workdir}")
    started = time.monotonic()
    levels: list[Level] = []
    try:
        c10d_s = c10d_reference(args, workdir) if args.c10d_reps else None
        for store in stores:
            for nodes in sizes:
                level = run_level(store, nodes, args, workdir)
                levels.append(level)
                say(
                    f"  {store} N={nodes}: formed in {level.formation_s:.3f} s "
                    f"(setup {level.setup_s:.1f} s; CPU s in it: master "
                    f"{level.form_master_cpu_s:.2f}, simulators {level.form_sims_cpu_s:.2f}), "
                    f"CPU {level.cpu_share:.2f}, "
                    f"hb p99 {level.hb_p99_ms:.1f} ms, RSS {level.rss_mb:.0f} MB"
                )
    except BaseException:
        say(f"logs kept in {workdir}")
        raise
    if args.keep_logs:
        say(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    table(levels, args)
    goals(levels, args)
    say(f"(the bench took {time.monotonic() - started:.0f} s)")
    if c10d_s is None:
        say("ratio: n/a (c10d not run)")
        return 0
    top = max(levels, key=lambda lv: (lv.nodes, -lv.formation_s))
    say(
        f"c10d at 128 nodes: {c10d_s:.3f} s; dlfleet at {top.nodes} nodes ({top.store}): "
        f"{top.formation_s:.3f} s"
    )
    say(f"ratio: {c10d_s / top.formation_s:.2f}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"fleet bench failed: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
