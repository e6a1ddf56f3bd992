"""Recovery benchmark: one rank of a 2-node gloo DDP job is SIGKILLed mid-run;
how long until the job trains again, under dlfleet's `dlworker` and under
`torchrun --max-restarts`, side by side.

    .venv/bin/python bench/recovery.py              # 10 trials per system
    .venv/bin/python bench/recovery.py --quick      # 3 trials per system
    .venv/bin/python bench/recovery.py --trials 5 --keep

The job (both systems, same script bench/_recovery_train.py, same Python):
2 nodes x 2 processes, all on this machine over 127.0.0.1 (GLOO_SOCKET_IFNAME=lo),
DDP over gloo on a Linear(32, 32), `--steps` optimizer steps per attempt, each
padded to `--step-ms`; every rank appends `<wall time> <attempt> <rank> <step>
<pid>` to the trial's step log after each step (and step -1 once its process
group is up).

* dlfleet: `python -m dlfleet.master --port 0 --store sqlite:///<trial>/m.db
  --min-nodes 2 --max-nodes 2 --last-call-timeout 0.3`, then two agents
  `python -m dlfleet.worker.agent.loop --nnodes 2:2 --nproc-per-node 2
  --max-restarts 3 --monitor-interval 0.1 --master 127.0.0.1:P --node-name
  nodeA|nodeB --log-dir <trial>/... train.py ...` (token in DLFLEET_TOKEN).
* torchrun: two `torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3
  --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P --rdzv-id <fresh>
  --rdzv-conf is_host=1|0 --local-addr 127.0.0.1 --monitor-interval 0.1
  train.py ...`. Both nodes resolve to this machine, so torch's heuristic
  (`_matches_machine_hostname`) would make both try to host the c10d store;
  `is_host` says explicitly that node A hosts it, as on two real hosts.

One trial: start the system, wait until every rank of the first attempt has
completed `--kill-after` steps, then SIGKILL one worker of node B (local rank
0 in even-numbered trials, 1 in odd ones, the same for both systems; found by
its pid file and its ancestry) and note the wall time. Recovery time = the
completion time of the first step logged by a worker process started after the
kill, minus the kill time. The trial succeeds when training recovered, both
agents exited 0 and a post-kill attempt completed all its steps, within
`--timeout` seconds of the kill; otherwise every process of the trial is
killed and the failure is recorded with what the logs said. The two systems
alternate trial by trial (dlfleet first in even trials, torchrun first in odd
ones) so machine drift hits both.

Every trial gets fresh ports, a fresh temporary folder, a fresh rendezvous /
job, and an environment marker; at its end every process carrying the marker
(agents, workers, orphans, the master) is SIGKILLed and the bench checks none
is left before the next trial.

Printed per system: successes, median and max recovery time of the successful
trials, the medians of kill -> first post-kill worker process started and kill
-> first post-kill process group up (what the control plane costs versus what
the script's own start costs), and how many trials needed more than one
restart. The last line is `ratio: X`, torchrun's median recovery time over
dlfleet's (higher is better); a system with no successful trial counts as
`--timeout`, and the bench says so.

Expect a full run (10 trials each) to take about 10-15 minutes on a 2-core
machine: each trial starts 4 torch processes twice, and a torchrun trial that
hangs costs the whole `--timeout`. `--quick` takes about 4-5 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from _common import free_port, say, tagged_pids

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TRAIN = BENCH / "_recovery_train.py"
PYTHON = ROOT / ".venv" / "bin" / "python"
TORCHRUN = ROOT / ".venv" / "bin" / "torchrun"
SYSTEMS = ("dlfleet", "torchrun")
NODES = ("nodeA", "nodeB")
NPROC = 2
WORLD = len(NODES) * NPROC
MAX_RESTARTS = 3
TAG_ENV = "RECOVERY_BENCH_TAG"
POLL_S = 0.02
MASTER_READY_S = 30.0
CLEANUP_S = 15.0
GOAL_RATIO = 2.0
# Lines of a log worth quoting when a trial fails, most telling first.
TELLING = re.compile(
    r"connectFullMesh|Connection refused|Connection reset|timed out|Timeout|"
    r"RendezvousError|RendezvousClosedError|RendezvousTimeoutError|"
    r"Error|error|FAILED|failed|exiting with"
)


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1])


def descends_from(pid: int, ancestor: int, hops: int = 6) -> bool:
    current: int | None = pid
    for _ in range(hops):
        current = parent_pid(current) if current is not None else None
        if current is None or current <= 1:
            return False
        if current == ancestor:
            return True
    return False


def tail(path: Path, lines: int) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return text.rstrip().splitlines()[-lines:]


# --------------------------------------------------------------------------- one trial


@dataclass(frozen=True)
class StepLine:
    wall: float
    attempt: str
    rank: int
    step: int
    pid: int


@dataclass
class Trial:
    system: str
    index: int
    ok: bool = False
    recovery_s: float | None = None  # kill -> first step of a post-kill worker
    spawn_s: float | None = None  # kill -> first post-kill worker started
    pg_s: float | None = None  # kill -> first post-kill process group up
    victim: str = ""
    new_workers: int = 0  # worker processes started after the kill
    reason: str = ""
    details: list[str] = field(default_factory=list)
    workdir: Path | None = None


class StepLog:
    """Reads the trial's step log incrementally, whole lines only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.lines: list[StepLine] = []

    def read(self) -> list[StepLine]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        complete, _, self._partial = data.rpartition(b"\n")
        new: list[StepLine] = []
        for raw in complete.decode("utf-8", errors="replace").splitlines():
            parts = raw.split()
            if len(parts) != 5:
                continue
            with suppress(ValueError):
                new.append(
                    StepLine(float(parts[0]), parts[1], int(parts[2]), int(parts[3]), int(parts[4]))
                )
        self.lines.extend(new)
        return new


def read_pid_files(folder: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for path in folder.glob("*.json"):
        with suppress(OSError, ValueError):
            info = json.loads(path.read_text(encoding="utf-8"))
            out[int(info["pid"])] = info
    return out


class TrialRun:
    """The processes of one trial of one system, and its bookkeeping."""

    def __init__(self, system: str, index: int, args: argparse.Namespace, root: Path) -> None:
        self.system = system
        self.index = index
        self.args = args
        self.dir = root / f"{index:02d}-{system}"
        self.dir.mkdir(parents=True)
        self.pids_dir = self.dir / "pids"
        self.pids_dir.mkdir()
        self.step_log = StepLog(self.dir / "steps.log")
        self.tag = secrets.token_hex(8)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        env.update(
            {
                TAG_ENV: self.tag,
                "DLFLEET_TOKEN": secrets.token_hex(16),
                "GLOO_SOCKET_IFNAME": "lo",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    # ------------------------------------------------------------- starting

    def log_path(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.log_path(name), "wb")  # noqa: SIM115 - closed in cleanup()
        self._logs.append(log)
        self.procs[name] = subprocess.Popen(
            argv,
            cwd=self.dir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def train_args(self) -> list[str]:
        return [
            str(TRAIN),
            # Not `--log`: torchrun's argparse would take it for `--log-dir`.
            "--step-log",
            str(self.step_log.path),
            "--pids-dir",
            str(self.pids_dir),
            "--steps",
            str(self.args.steps),
            "--step-ms",
            str(self.args.step_ms),
            "--pg-timeout",
            str(self.args.pg_timeout),
        ]

    def start(self) -> None:
        if self.system == "dlfleet":
            self._start_dlfleet()
        else:
            self._start_torchrun()

    def _start_dlfleet(self) -> None:
        self.spawn(
            "master",
            [
                str(PYTHON),
                "-m",
                "dlfleet.master",
                "--port",
                "0",
                "--store",
                f"sqlite:///{self.dir / 'm.db'}",
                "--min-nodes",
                "2",
                "--max-nodes",
                "2",
                "--last-call-timeout",
                "0.3",
            ],
        )
        port = self._master_port()
        for node in NODES:
            self.spawn(
                node,
                [
                    str(PYTHON),
                    "-m",
                    "dlfleet.worker.agent.loop",
                    "--nnodes",
                    f"{len(NODES)}:{len(NODES)}",
                    "--nproc-per-node",
                    str(NPROC),
                    "--max-restarts",
                    str(MAX_RESTARTS),
                    "--monitor-interval",
                    "0.1",
                    "--master",
                    f"127.0.0.1:{port}",
                    "--node-name",
                    node,
                    "--log-dir",
                    str(self.dir / f"worker-logs-{node}"),
                    *self.train_args(),
                ],
            )

    def _master_port(self) -> int:
        deadline = time.monotonic() + MASTER_READY_S
        pattern = re.compile(rb"listening on 127\.0\.0\.1:(\d+)")
        master = self.procs["master"]
        while time.monotonic() < deadline:
            found = pattern.search(self.log_path("master").read_bytes())
            if found:
                return int(found.group(1))
            if master.poll() is not None:
                raise TrialError(f"the master exited with {master.returncode}", self.log_tails())
            time.sleep(0.05)
        raise TrialError(f"the master did not listen within {MASTER_READY_S:.0f} s", [])

    def _start_torchrun(self) -> None:
        port = free_port()
        for node in NODES:
            self.spawn(
                node,
                [
                    str(TORCHRUN),
                    "--nnodes",
                    str(len(NODES)),
                    "--nproc-per-node",
                    str(NPROC),
                    "--max-restarts",
                    str(MAX_RESTARTS),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-id",
                    f"recovery-{self.tag}",
                    "--rdzv-conf",
                    f"is_host={1 if node == NODES[0] else 0}",
                    "--local-addr",
                    "127.0.0.1",
                    "--monitor-interval",
                    "0.1",
                    "--log-dir",
                    str(self.dir / f"worker-logs-{node}"),
                    *self.train_args(),
                ],
            )

    # ------------------------------------------------------------- the trial

    def agents_exited(self) -> bool:
        return all(self.procs[node].poll() is not None for node in NODES)

    def wait_until_mid_run(self) -> None:
        """Until every rank of the first attempt completed `--kill-after` steps."""
        deadline = time.monotonic() + self.args.start_timeout
        best: dict[int, int] = {}
        while time.monotonic() < deadline:
            for line in self.step_log.read():
                best[line.rank] = max(best.get(line.rank, -1), line.step)
            if len(best) == WORLD and min(best.values()) >= self.args.kill_after:
                return
            for node in NODES:
                if self.procs[node].poll() is not None:
                    raise TrialError(
                        f"{node}'s agent exited with {self.procs[node].returncode} before the kill",
                        self.log_tails(),
                    )
            time.sleep(POLL_S)
        raise TrialError(
            f"the job did not reach step {self.args.kill_after} on all {WORLD} ranks within "
            f"{self.args.start_timeout:.0f} s (ranks' last steps: {dict(sorted(best.items()))})",
            self.log_tails(),
        )

    def pick_victim(self) -> tuple[int, dict[str, Any], set[int]]:
        """(pid, its pid file, all worker pids now) of node B's chosen local rank."""
        workers = read_pid_files(self.pids_dir)
        node_b = self.procs[NODES[1]].pid
        local_rank = self.index % NPROC
        for pid, info in sorted(workers.items()):
            if info.get("local_rank") == local_rank and descends_from(pid, node_b):
                return pid, info, set(workers)
        raise TrialError(
            f"no live worker with local rank {local_rank} under {NODES[1]}'s agent (pid "
            f"{node_b}); pid files: {sorted(workers)}",
            self.log_tails(),
        )

    def run(self, result: Trial) -> None:
        self.start()
        self.wait_until_mid_run()
        victim, info, old_pids = self.pick_victim()
        result.victim = f"rank {info['rank']} (local rank {info['local_rank']} of {NODES[1]})"
        killed_at = time.time()
        kill_mono = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        deadline = kill_mono + self.args.timeout
        first_new: float | None = None
        while time.monotonic() < deadline and not self.agents_exited():
            for line in self.step_log.read():
                if line.pid not in old_pids and line.step >= 0:
                    first_new = line.wall if first_new is None else min(first_new, line.wall)
            time.sleep(POLL_S)
        ended_s = time.monotonic() - kill_mono
        self.step_log.read()
        new_lines = [
            line for line in self.step_log.lines if line.pid not in old_pids and line.step >= 0
        ]
        if new_lines:
            first_new = min(line.wall for line in new_lines)
            result.recovery_s = first_new - killed_at
        pg_up = [
            line.wall for line in self.step_log.lines if line.pid not in old_pids and line.step < 0
        ]
        if pg_up:
            result.pg_s = min(pg_up) - killed_at
        new_workers = {
            pid: w for pid, w in read_pid_files(self.pids_dir).items() if pid not in old_pids
        }
        result.new_workers = len(new_workers)
        if new_workers:
            result.spawn_s = min(float(w["started"]) for w in new_workers.values()) - killed_at
        finished = {line.rank for line in new_lines if line.step == self.args.steps - 1} == set(
            range(WORLD)
        )
        codes = {node: self.procs[node].poll() for node in NODES}
        if None in codes.values():
            result.reason = (
                f"timed out: {self.args.timeout:.0f} s after the kill the agents were still "
                f"running ({'recovered' if new_lines else 'no step since the kill'}"
                f"{', job not finished' if not finished else ''})"
            )
        elif any(codes.values()):
            result.reason = f"agent exit codes {codes}, {ended_s:.1f} s after the kill" + (
                "" if new_lines else " (no step since the kill)"
            )
        elif not new_lines:
            result.reason = "agents exited 0 but no step was completed after the kill"
        elif not finished:
            result.reason = "agents exited 0 but no post-kill attempt completed all its steps"
        else:
            result.ok = True
        if not result.ok:
            result.details = self.log_tails()

    # ------------------------------------------------------------- diagnosis

    def log_tails(self) -> list[str]:
        """What each log of the trial says: its first distinct telling lines (numbers
        aside), then its last lines."""
        out: list[str] = []
        paths = [self.log_path(name) for name in self.procs]
        paths += sorted(self.dir.glob("worker-logs-*/**/*.log"))
        for path in paths:
            lines = tail(path, 2000)
            if not lines:
                continue
            out.append(f"--- {path.relative_to(self.dir)}")
            seen: set[str] = set()
            telling: list[str] = []
            for line in lines:
                key = re.sub(r"\d+", "#", line)
                if TELLING.search(line) and key not in seen and len(telling) < 10:
                    seen.add(key)
                    telling.append(line)
            last = [line for line in lines[-6:] if line not in telling]
            out.extend(f"    {line[:300]}" for line in [*telling, "...", *last])
        return out

    def notable(self) -> list[str]:
        """Known failure signatures seen in this trial's logs (even if it recovered)."""
        signatures = {
            "connectFullMesh failed": "Gloo connectFullMesh failed",
            "Connection refused": "connection refused",
            "Connection reset by peer": "connection reset by peer",
            "RendezvousTimeoutError": "rendezvous timeout",
            "Timed out": "timed out",
        }
        text = ""
        for path in [self.log_path(name) for name in self.procs]:
            with suppress(OSError):
                text += path.read_text(encoding="utf-8", errors="replace")
        return [label for needle, label in signatures.items() if needle in text]

    # ------------------------------------------------------------- cleanup

    def cleanup(self) -> list[int]:
        """SIGKILL every process of the trial; the pids still alive after CLEANUP_S."""
        deadline = time.monotonic() + CLEANUP_S
        left: list[int] = []
        for _ in range(200):
            for proc in self.procs.values():
                if proc.poll() is None:
                    with suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
            left = tagged_pids(TAG_ENV, self.tag)
            for pid in left:
                with suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for proc in self.procs.values():
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.1)
            left = tagged_pids(TAG_ENV, self.tag)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for log in self._logs:
            log.close()
        return left


class TrialError(RuntimeError):
    def __init__(self, reason: str, details: list[str]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = details


def run_trial(system: str, index: int, args: argparse.Namespace, root: Path) -> Trial:
    result = Trial(system, index)
    trial = TrialRun(system, index, args, root)
    result.workdir = trial.dir
    try:
        trial.run(result)
    except TrialError as exc:
        result.reason = exc.reason
        result.details = exc.details
    finally:
        left = trial.cleanup()
    notes = trial.notable()
    if notes:
        result.details.insert(0, f"seen in the logs: {', '.join(notes)}")
    if left:
        raise RuntimeError(f"{system} trial {index}: processes {left} survived SIGKILL")
    return result


# --------------------------------------------------------------------------- report


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def describe(trial: Trial) -> str:
    if trial.ok:
        return (
            f"recovered in {trial.recovery_s:.3f} s (new workers after {fmt(trial.spawn_s)} s, "
            f"group up after {fmt(trial.pg_s)} s; {trial.new_workers} new worker processes), "
            f"finished; killed {trial.victim}"
        )
    recovered = (
        f"; first step after the kill at {trial.recovery_s:.3f} s"
        if trial.recovery_s is not None
        else ""
    )
    return f"FAILED: {trial.reason}{recovered}; killed {trial.victim or '-'}"


def report(trials: list[Trial], args: argparse.Namespace) -> None:
    say()
    say(
        f"{'system':9s} {'ok':>6s} {'median s':>9s} {'max s':>8s} "
        f"{'new procs s':>12s} {'group up s':>11s} {'retried':>8s}"
    )
    medians: dict[str, float | None] = {}
    for system in args.systems:
        these = [t for t in trials if t.system == system]
        good = [t for t in these if t.ok]
        times = [t.recovery_s for t in good if t.recovery_s is not None]
        medians[system] = statistics.median(times) if times else None
        retried = sum(t.new_workers > WORLD for t in these)
        say(
            f"{system:9s} {len(good):>3d}/{len(these):<2d} {fmt(medians[system]):>9s} "
            f"{fmt(max(times) if times else None):>8s} "
            f"{fmt(median_or_none([t.spawn_s for t in good])):>12s} "
            f"{fmt(median_or_none([t.pg_s for t in good])):>11s} {retried:>8d}"
        )
    say(
        "(ok: recovered and finished within the timeout; median/max: kill -> first step of "
        "a post-kill worker, successful trials only; new procs / group up: medians of kill -> "
        "first post-kill worker process started / first post-kill process group up; retried: "
        f"trials that started more than {WORLD} workers after the kill, i.e. needed more than "
        "one restart)"
    )
    failures = [t for t in trials if not t.ok]
    if failures:
        say()
        say("failed trials:")
        for t in failures:
            say(f"  {t.system} trial {t.index}: {t.reason} (logs in {t.workdir})")
            for line in t.details:
                say(f"    {line}")
    say()
    if set(SYSTEMS) - set(args.systems):
        say(f"ratio: n/a (only {', '.join(args.systems)} was run)")
        return
    dl_trials = [t for t in trials if t.system == "dlfleet"]
    dl_ok = sum(t.ok for t in dl_trials)
    dl, tr = medians["dlfleet"], medians["torchrun"]
    notes: list[str] = []
    if tr is None:
        tr = args.timeout
        notes.append(
            f"torchrun never recovered: its time counts as the {args.timeout:.0f} s timeout"
        )
    if dl is None:
        dl = args.timeout
        notes.append(
            f"dlfleet never recovered: its time counts as the {args.timeout:.0f} s timeout"
        )
    for note in notes:
        say(note)
    ratio = tr / dl
    all_ok = bool(dl_trials) and dl_ok == len(dl_trials)
    goal = "yes" if all_ok and ratio >= GOAL_RATIO else "NO"
    say(
        f"goal: every dlfleet trial recovered ({dl_ok}/{len(dl_trials)}) and torchrun / "
        f"dlfleet >= {GOAL_RATIO:.0f}x: {goal}"
    )
    say(f"ratio: {ratio:.2f}")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=None, help="trials per system (10)")
    parser.add_argument("--quick", action="store_true", help="3 trials per system")
    parser.add_argument("--steps", type=int, default=100, help="steps per attempt (100)")
    parser.add_argument("--step-ms", type=float, default=50.0, help="wall time of a step (50)")
    parser.add_argument(
        "--kill-after", type=int, default=20, help="steps every rank completes before the kill"
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds from the kill to the job's end (60)"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=90.0, help="seconds to reach the kill point (90)"
    )
    parser.add_argument(
        "--pg-timeout", type=float, default=30.0, help="the script's gloo timeout, seconds (30)"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    parser.add_argument("--keep", action="store_true", help="keep every trial's logs")
    args = parser.parse_args(argv)
    if args.trials is None:
        args.trials = 3 if args.quick else 10
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not args.systems or any(s not in SYSTEMS for s in args.systems):
        parser.error(f"--systems wants some of {', '.join(SYSTEMS)}")
    if args.trials < 1 or args.steps < 2 or args.step_ms < 0:
        parser.error("--trials and --steps must be positive, --step-ms not negative")
    if not 0 <= args.kill_after < args.steps - 1:
        parser.error("--kill-after must be below --steps - 1 (the kill lands mid-run)")
    if min(args.timeout, args.start_timeout, args.pg_timeout) <= 0:
        parser.error("the timeouts must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="dlfleet-recovery-bench-"))
    say(
        f"recovery benchmark: {args.trials} trial(s) per system ({', '.join(args.systems)}), "
        f"{len(NODES)} nodes x {NPROC} processes, gloo, {args.steps} steps of "
        f"{args.step_ms:.0f} ms per attempt, SIGKILL after step {args.kill_after}, "
        f"timeout {args.timeout:.0f} s; logs in {root}"
    )
    started = time.monotonic()
    trials: list[Trial] = []
    try:
        for index in range(args.trials):
            order = args.systems if index % 2 == 0 else args.systems[::-1]
            for system in order:
                trial = run_trial(system, index, args, root)
                trials.append(trial)
                say(f"  {system:8s} trial {index}: {describe(trial)}")
                if trial.ok and not args.keep and trial.workdir is not None:
                    shutil.rmtree(trial.workdir, ignore_errors=True)
    except KeyboardInterrupt:
        say("interrupted; reporting the trials done so far")
    say(f"(the bench took {time.monotonic() - started:.0f} s)")
    report(trials, args)
    if not any(not t.ok for t in trials) and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
