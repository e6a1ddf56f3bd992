"""Rendezvous benchmark: N agents form a world through dlfleet's master and, in
the same run, through torch's c10d rendezvous; N = 8, 32, 128, 512.

    python bench/rendezvous.py              # N = 8, 32, 128, 512
    python bench/rendezvous.py --quick      # N = 8, 32
    python bench/rendezvous.py --sizes 8,64

What is measured: the wall time from "all N agents start joining" to "every
agent has its rendezvous result", i.e. the largest completion time over the N
agents of one run, for

* c10d: torch's `DynamicRendezvousHandler` on the `C10dRendezvousBackend`, what
  `torchrun --rdzv-backend=c10d` runs (torch 2.13.0): one TCPStore server in a
  process of its own, and per agent its own TCPStore client, backend and handler
  (built as torch's registry builds them), then one `next_rendezvous()`;
  driver bench/_rdzv_driver_c10d.py.
* dlfleet: `python -m dlfleet.master` on a fresh SQLite store, and per agent
  its own `MasterClient` (own channel and connection), then `register_node` and
  `join_rendezvous`, both timed; driver bench/_rdzv_driver_dlfleet.py.

Same rules for both: min_nodes = max_nodes = N, so a round completes the moment
its N-th node has joined (c10d never waits out its last-call timeout; nor does
ours). Same harness (bench/_rdzv_harness.py), same Python (this one), same layout:
the N agents are threads, one per agent, spread evenly over K = min(N, --procs)
processes. The default K = 4 is the layout that gave c10d its best times on the
2-core machine this was written on (at 128 nodes: K = 1, 11-25 s; K = 2,
4.5-5.3 s; K = 4, 2.6-3.8 s; K = 8, 3.2-3.8 s; K = 16, 3.6-4.3 s; at 32 nodes
every K from 1 to 32 gave 1.3-1.4 s). Each agent builds its client and connects
before the clock starts (c10d: its TCPStore client, backend and handler;
dlfleet: its channel, connected); every
process gets, once all are ready, the same start instant on the machine's
monotonic clock, and each agent records when its own join returned. Every run
gets a fresh server (so a fresh rendezvous); servers and agents all run on this
machine over 127.0.0.1, so the agents' client-side CPU competes with the
server's: the table shows both (CPU seconds over the run, user+system). Note
that c10d's agents do real work per join attempt (every attempt at its
compare-and-set rewrites the whole pickled state, O(N), and the attempts of
all N agents race), which here runs on two shared cores: from 128 nodes on its
agents keep the machine busy, and a cluster with a CPU per agent would see c10d
do better than this machine does at 128 nodes and above. dlfleet's agents use
a few milliseconds of CPU each.

Each run is validated: all N agents have a result, of the same round and the
same group, each sees a world of N, and the group ranks are exactly 0..N-1.
A run that fails validation fails the bench (exit 1).

Repetitions: 3 per size up to 128 nodes, 2 above (`--reps` sets them all); the
systems take turns run by run, and the median run counts. Every run is capped
(`--cap`, 120 s). A c10d run that has not finished by its cap shows as "> cap"
(a lower bound; a dlfleet run that has not finished fails the bench). Above 128
nodes c10d gets one run (unless `--reps`), capped at `--budget` (60 s), and is
skipped, saying so, when its projected time is over the budget: projected from
the two largest sizes it ran, as the larger of a power law through their times
and one through its agents' CPU time spread over this machine's cores (its
agents' CPU grows much faster than its time at small sizes), or as "over the
cap" if a smaller size already timed out.

The last line is `ratio: X`: c10d's median over dlfleet's median at 128 nodes
(at the largest size both ran when 128 is not run); higher is better.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from _common import BenchError, ServerProcess, free_port, kill_group, load_driver, say

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
HARNESS = BENCH / "_rdzv_harness.py"
PYTHON = Path(sys.executable)
SYSTEMS = ("c10d", "dlfleet")
SIZES = (8, 32, 128, 512)
QUICK_SIZES = (8, 32)
RATIO_NODES = 128
GOAL_RATIO = 20.0
GOAL_512_S = 3.0
# How long before the common start instant the GO goes out.
GO_MARGIN_S = 0.5
SERVER_READY_S = 60.0
SETUP_S = 120.0


def child_env() -> dict[str, str]:
    """The environment of every process the bench starts, both systems alike.

    torch's TCPStore looks up the peer's name (a PTR query for 127.0.0.1) on
    every connect and accept; this machine's resolver drops some of those
    queries, and glibc then waits its default 5 s. One try of 1 s instead
    (unless RES_OPTIONS is set already) keeps that out of the c10d agents'
    connects, and out of the one connect inside its rendezvous (rank 0 starts
    the store it shares, which connects to itself). dlfleet makes no such query.
    """
    env = dict(os.environ)
    env.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    return env


def tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return f"{path}, last lines:\n" + "\n".join(text[-lines:])


def _line_reader(index: int, stream: IO[str], lines: queue.Queue[tuple[int, str | None]]) -> None:
    for line in stream:
        lines.put((index, line.rstrip("\n")))
    lines.put((index, None))


# --------------------------------------------------------------------------- one run


@dataclass
class Run:
    system: str
    nodes: int
    wall_s: float | None  # None: timed out
    cap_s: float
    client_cpu_s: float
    server_cpu_s: float
    agents: list[dict[str, Any]] = field(default_factory=list)


def spread(nodes: int, procs: int) -> list[tuple[int, int]]:
    """(first agent, agents) of each of min(nodes, procs) processes, as even as can be."""
    k = max(1, min(nodes, procs))
    out: list[tuple[int, int]] = []
    first = 0
    for i in range(k):
        count = nodes // k + (1 if i < nodes % k else 0)
        out.append((first, count))
        first += count
    return out


def validate(system: str, nodes: int, agents: list[dict[str, Any]]) -> None:
    where = f"{system} at {nodes} nodes"
    if len(agents) != nodes or sorted(a["agent"] for a in agents) != list(range(nodes)):
        raise BenchError(f"{where}: {len(agents)} agent results for {nodes} agents")
    rounds = {a["round"] for a in agents}
    groups = {a["group"] for a in agents}
    sizes = {a["world_size"] for a in agents}
    ranks = sorted(a["rank"] for a in agents)
    if len(rounds) != 1:
        raise BenchError(f"{where}: agents ended in different rounds {sorted(rounds)}")
    if len(groups) != 1:
        raise BenchError(f"{where}: agents ended in different groups {sorted(groups)[:5]}")
    if sizes != {nodes}:
        raise BenchError(f"{where}: world sizes {sorted(sizes)}, not {nodes}")
    if ranks != list(range(nodes)):
        dupes = sorted({r for r in ranks if ranks.count(r) > 1})[:5]
        raise BenchError(f"{where}: group ranks are not 0..{nodes - 1} (repeated: {dupes})")


class AgentProcesses:
    """The harness processes of one run, spread over K processes."""

    def __init__(
        self,
        system: str,
        nodes: int,
        target: str,
        tag: str,
        procs: int,
        cap_s: float,
        options: dict[str, str],
        workdir: Path,
    ) -> None:
        self._tag = tag
        self._workdir = workdir
        self._lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self.procs: list[subprocess.Popen[str]] = []
        self._logs: list[IO[str]] = []
        for index, (first, count) in enumerate(spread(nodes, procs)):
            argv = [str(PYTHON), str(HARNESS), "run", "--driver", system, "--target", target]
            argv += ["--nodes", str(nodes), "--run-id", f"bench-{tag}", "--first", str(first)]
            argv += ["--threads", str(count), "--deadline", str(cap_s)]
            for key, value in options.items():
                argv += ["--option", f"{key}={value}"]
            log = open(self.log_path(index), "w", encoding="utf-8")  # noqa: SIM115 - in stop()
            self._logs.append(log)
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
                env=child_env(),
            )
            self.procs.append(proc)
            assert proc.stdout is not None
            threading.Thread(
                target=_line_reader, args=(index, proc.stdout, self._lines), daemon=True
            ).start()

    def log_path(self, index: int) -> Path:
        return self._workdir / f"agents-{self._tag}-{index}.log"

    def expect(self, prefix: str, deadline: float) -> dict[int, str]:
        """The text after `prefix` of each process's first line starting with it."""
        got: dict[int, str] = {}
        while len(got) < len(self.procs):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(len(self.procs))) - set(got))
                raise BenchError(
                    f"{self._tag}: no {prefix} from agent processes {missing} in time; "
                    + tail(self.log_path(missing[0]))
                )
            try:
                index, line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None and index not in got:
                with suppress(subprocess.TimeoutExpired):
                    self.procs[index].wait(timeout=10)
                raise BenchError(
                    f"{self._tag}: agent process {index} exited ({self.procs[index].returncode}) "
                    f"before {prefix}; " + tail(self.log_path(index))
                )
            if line is not None and line.startswith(prefix):
                got[index] = line[len(prefix) :].strip()
        return got

    def go(self, t0: float) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(f"GO {t0!r}\n")
            proc.stdin.flush()

    def stop(self) -> None:
        for proc in self.procs:
            kill_group(proc, grace=2.0)
        for log in self._logs:
            log.close()


def run_once(
    system: str,
    nodes: int,
    rep: int,
    cap_s: float,
    args: argparse.Namespace,
    workdir: Path,
    token: str,
) -> Run:
    """One fresh server, N agents joining it from the same instant, validated."""
    driver = load_driver("_rdzv_driver_", system)
    # The drivers' own timeouts lie past the harness's deadline, which decides.
    options = {"token": token, "timeout_s": str(int(cap_s) + 15)}
    tag = f"{system}-{nodes}-{rep}"
    port = free_port()
    argv, ready = driver.server_command(str(PYTHON), port, nodes, workdir, options)
    server = ServerProcess(
        f"{system} server", argv, workdir / f"server-{tag}.log", ready, env=child_env()
    )
    agents_procs: AgentProcesses | None = None
    try:
        server.wait_ready(port, SERVER_READY_S)
        target = f"127.0.0.1:{port}"
        agents_procs = AgentProcesses(
            system, nodes, target, tag, args.procs, cap_s, options, workdir
        )
        agents_procs.expect("READY", time.monotonic() + SETUP_S)
        cpu0 = server.cpu_seconds()
        t0 = time.monotonic() + GO_MARGIN_S
        agents_procs.go(t0)
        results = agents_procs.expect("RESULT", t0 + cap_s + 30.0)
        server_cpu = server.cpu_seconds() - cpu0
    finally:
        if agents_procs is not None:
            agents_procs.stop()
        server.stop()
    reports = [json.loads(text) for _, text in sorted(results.items())]
    agents = [agent for report in reports for agent in report["agents"]]
    client_cpu = sum(float(report["cpu_s"]) for report in reports)
    late = [r["go_margin_s"] for r in reports if r["go_margin_s"] < 0]
    if late:
        say(f"  note: {len(late)} agent process(es) got the GO {-min(late):.3f} s late")
    failed = [a for a in agents if "error" in a]
    timeouts = [a for a in failed if str(a["error"]).startswith("no result")]
    if system == "c10d" and failed and len(timeouts) == len(failed):
        say(f"  {system} at {nodes}: {len(failed)} of {nodes} agents had no result by the cap")
        return Run(system, nodes, None, cap_s, client_cpu, server_cpu, agents)
    if failed:
        first = failed[0]
        raise BenchError(
            f"{system} at {nodes} nodes: {len(failed)} agents failed, "
            f"e.g. agent {first['agent']}: {first['error']} (logs in {workdir})"
        )
    validate(system, nodes, agents)
    wall = max(float(a["t_s"]) for a in agents)
    return Run(system, nodes, wall, cap_s, client_cpu, server_cpu, agents)


# --------------------------------------------------------------------------- the bench


def median_wall(runs: list[Run]) -> float | None:
    """The median run's time; a timed-out run counts as longer than any other."""
    if not runs:
        return None
    mid = statistics.median(math.inf if r.wall_s is None else r.wall_s for r in runs)
    return None if math.isinf(mid) else mid


def power_law(points: dict[int, float], nodes: int, default_exponent: float) -> float:
    """y at `nodes` on the power law through the two largest points (through
    the largest with `default_exponent` when there is one)."""
    below = sorted(points)
    n2 = below[-1]
    exponent = default_exponent
    if len(below) > 1 and points[below[-2]] > 0 and points[n2] > 0:
        n1 = below[-2]
        exponent = math.log(points[n2] / points[n1]) / math.log(n2 / n1)
    scale: float = (nodes / n2) ** exponent
    return points[n2] * scale


def fmt_s(value: float | None, cap_s: float) -> str:
    return f"> {cap_s:.0f}" if value is None else f"{value:.3f}"


@dataclass
class Bench:
    args: argparse.Namespace
    sizes: list[int]
    systems: list[str]
    workdir: Path
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    runs: dict[tuple[str, int], list[Run]] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)

    def project_c10d(self, nodes: int) -> float | None:
        """c10d's projected time for one run at `nodes`, from the sizes below."""
        walls: dict[int, float] = {}
        cpus: dict[int, float] = {}
        for (system, n), runs in self.runs.items():
            if system != "c10d" or n >= nodes:
                continue
            wall = median_wall(runs)
            if wall is None:
                return math.inf  # a smaller size already timed out
            walls[n] = wall
            cpus[n] = statistics.median(r.client_cpu_s for r in runs)
        if not walls:
            return None
        cores = os.cpu_count() or 1
        return max(power_law(walls, nodes, 1.0), power_law(cpus, nodes, 2.0) / cores)

    def plan(self, nodes: int) -> dict[str, tuple[int, float]]:
        """(runs, cap in seconds) per system at `nodes`."""
        args = self.args
        reps = args.reps or (3 if nodes <= RATIO_NODES else 2)
        plan = {system: (reps, args.cap) for system in self.systems}
        if "c10d" not in plan or nodes <= RATIO_NODES:
            return plan
        cap = min(args.cap, args.budget)
        projected = self.project_c10d(nodes)
        if projected is not None and projected > cap:
            plan["c10d"] = (0, cap)
            why = "a smaller size timed out" if math.isinf(projected) else f"{projected:.0f} s"
            self.skipped[nodes] = (
                f"c10d: skipped at {nodes} (projected > {cap:.0f} s, the --budget; "
                f"projection: {why})"
            )
            say(self.skipped[nodes])
        else:
            plan["c10d"] = (args.reps or 1, cap)
        return plan

    def run(self) -> None:
        for nodes in self.sizes:
            plan = self.plan(nodes)
            for rep in range(max(runs for runs, _ in plan.values())):
                # The systems take turns, first one first, then the other.
                order = self.systems if rep % 2 == 0 else self.systems[::-1]
                for system in order:
                    runs, cap_s = plan[system]
                    if rep >= runs:
                        continue
                    run = run_once(system, nodes, rep, cap_s, self.args, self.workdir, self.token)
                    self.runs.setdefault((system, nodes), []).append(run)
                    say(
                        f"  {system:8s} N={nodes:4d} run {rep + 1}: "
                        f"{fmt_s(run.wall_s, run.cap_s)} s  (agents' CPU "
                        f"{run.client_cpu_s:.1f} s, server's {run.server_cpu_s:.1f} s)"
                    )

    def both(self, nodes: int) -> tuple[float, float, bool] | None:
        """(c10d s, dlfleet s, c10d timed out) where both systems ran at `nodes`."""
        c10d, ours = self.runs.get(("c10d", nodes)), self.runs.get(("dlfleet", nodes))
        ours_s = median_wall(ours or [])
        if not c10d or ours_s is None:
            return None
        c10d_s = median_wall(c10d)
        if c10d_s is None:
            return min(r.cap_s for r in c10d), ours_s, True
        return c10d_s, ours_s, False

    def table(self) -> None:
        say()
        say(
            f"{'nodes':>5}  {'system':8s} {'median s':>9}  {'runs s':24s} "
            f"{'agents CPU s':>12} {'server CPU s':>12}"
        )
        for nodes in self.sizes:
            for system in self.systems:
                these = self.runs.get((system, nodes), [])
                if not these:
                    continue
                cap = min(r.cap_s for r in these)
                walls = " ".join(fmt_s(r.wall_s, r.cap_s) for r in these)
                say(
                    f"{nodes:5d}  {system:8s} {fmt_s(median_wall(these), cap):>9}  {walls:24s} "
                    f"{statistics.median(r.client_cpu_s for r in these):12.2f} "
                    f"{statistics.median(r.server_cpu_s for r in these):12.2f}"
                )
            if nodes in self.skipped:
                say(f"{nodes:5d}  {self.skipped[nodes]}")

    def verdict(self) -> None:
        """The ratios, the goals, and `ratio: X` last."""
        say()
        common = [n for n in self.sizes if self.both(n) is not None]
        for nodes in common:
            c10d_s, ours_s, timed_out = self.both(nodes) or (0.0, 1.0, False)
            bound = ">= " if timed_out else ""
            say(f"c10d / dlfleet at {nodes:4d} nodes: {bound}{c10d_s / ours_s:.1f}x")
        if ("dlfleet", 512) in self.runs:
            ours_512 = median_wall(self.runs[("dlfleet", 512)])
            verdict = "yes" if ours_512 is not None and ours_512 < GOAL_512_S else "NO"
            say(f"goal: dlfleet at 512 nodes under {GOAL_512_S:.0f} s: {verdict}")
        if not common:
            say("ratio: n/a (no size run by both systems)")
            return
        ratio_nodes = RATIO_NODES if RATIO_NODES in common else common[-1]
        c10d_s, ours_s, timed_out = self.both(ratio_nodes) or (0.0, 1.0, False)
        ratio = c10d_s / ours_s
        if ratio_nodes == RATIO_NODES:
            verdict = "yes" if ratio >= GOAL_RATIO else "NO"
            say(f"goal: >= {GOAL_RATIO:.0f}x at {RATIO_NODES} nodes: {verdict}")
        else:
            say(f"(the ratio is at {ratio_nodes} nodes: {RATIO_NODES} was not run by both)")
        if timed_out:
            say("(c10d timed out there: the ratio is a lower bound)")
        say(f"ratio: {ratio:.2f}")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"N = {QUICK_SIZES} only")
    parser.add_argument("--sizes", help="comma-separated N (default 8,32,128,512)")
    parser.add_argument("--reps", type=int, help="runs per size and system (3; 2 above 128)")
    parser.add_argument("--procs", type=int, default=4, help="agent processes per run (4)")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds a run may take (120)")
    parser.add_argument(
        "--budget", type=float, default=60.0, help="cap of c10d's run above 128 nodes (60)"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    parser.add_argument("--keep", action="store_true", help="keep the logs' directory")
    args = parser.parse_args(argv)
    try:
        sizes = sorted({int(s) for s in (args.sizes or "").split(",") if s.strip()})
    except ValueError:
        parser.error("--sizes wants comma-separated integers")
    if not args.sizes:
        sizes = sorted(QUICK_SIZES if args.quick else SIZES)
    if not sizes or min(sizes) < 1:
        parser.error("--sizes wants positive integers")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        parser.error(f"--systems wants some of {', '.join(SYSTEMS)}")
    if args.procs < 1 or args.cap <= 0 or args.budget <= 0 or (args.reps or 1) < 1:
        parser.error("--procs, --cap, --budget and --reps must be positive")
    return args, sizes, systems


def main(argv: list[str] | None = None) -> int:
    args, sizes, systems = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="dlfleet-rdzv-bench-"))
    say(f"rendezvous benchmark: sizes {sizes}, systems {systems}, up to {args.procs} agent")
    say(f"processes per run, cap {args.cap:.0f} s per run; logs in {workdir}")
    bench = Bench(args, sizes, systems, workdir)
    started = time.monotonic()
    try:
        bench.run()
    except BaseException:
        say(f"logs kept in {workdir}")
        raise
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    bench.table()
    say(f"(the bench took {time.monotonic() - started:.0f} s)")
    bench.verdict()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"rendezvous bench failed: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
