"""Recovery benchmark: one rank of a 2-node gloo DDP job is SIGKILLed mid-run
(or a whole node); how long until the job trains again and how many steps the
failure cost, under dlfleet's `dlworker` and under `torchrun --max-restarts`,
side by side, with a cold start of the same script as the reference.

    python bench/recovery.py              # 10 rank kills per system, 5 node kills, 10 cold starts
    python bench/recovery.py --quick      # 3, 2 and 3
    python bench/recovery.py --trials 5 --node-trials 0 --keep

The job (every system, same script bench/_recovery_train.py, the Python that
runs this bench): 2 nodes x 2 processes, all on this machine over 127.0.0.1
(GLOO_SOCKET_IFNAME=lo), DDP over gloo on a 3-layer MLP (~0.5 M parameters,
~6 MB with AdamW's state), trained through `dlfleet.elastic.run` and
checkpointed with `dlfleet.Checkpointer` after every step (in memory;
persisted to disk every 20 saves), each step padded to `--step-ms`; every
rank appends `<wall time> <round> <rank> <step> <pid>` to the trial's step log
after each step (and step -1 once its process group is up) and one line per
attempt to the restore log (which step it restored, from where, how long).

* dlfleet: `python -m dlfleet.master --port 0 --store sqlite:///<trial>/m.db
  --min-nodes 1|2 --max-nodes 2 --last-call-timeout 0.3`, then two agents
  `python -m dlfleet.worker.agent.loop --nnodes 1:2|2:2 --nproc-per-node 2
  --max-restarts 3 --monitor-interval 0.1 --master 127.0.0.1:P --node-name
  nodeA|nodeB ...` (one spare process each, the default). The healthy ranks
  restart in place and restore from memory; a spare takes over a killed rank.
* torchrun: two `torchrun --nnodes 2 --nproc-per-node 2 --max-restarts 3
  --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P --rdzv-id <fresh>
  --rdzv-conf is_host=1|0 --local-addr 127.0.0.1 --monitor-interval 0.1
  train.py ...`. Both nodes resolve to this machine, so torch's heuristic
  (`_matches_machine_hostname`) would make both try to host the c10d store;
  `is_host` says explicitly that node A hosts it, as on two real hosts.
* cold start (the reference): the four processes of the same script started
  bare, with torchrun's environment, on a copy of the folder the preceding
  dlfleet trial persisted to: interpreter, imports, process group, model
  build, the read of the newest disk checkpoint, the first step. Its time is
  from the launch to the first completed step: what every restart of a job
  costs when nothing survives the failure.

A rank trial: start the system, wait until every rank of the first attempt has
completed `--kill-after` steps (and, under dlfleet, both spares are ready),
then SIGKILL one worker of node B (local rank 0 in even-numbered trials, 1 in
odd ones, the same for both systems; found by its pid file and its ancestry)
and note the wall time. A node trial (dlfleet only): SIGKILL node B's agent,
whose workers die with it, and start a replacement agent (nodeC) after
`--relaunch-delay` seconds, as a platform would; the master runs with
--min-nodes 1, so node A goes on alone first.

Recovery time = the completion time of the first step logged after the kill
by a process started after it or in a round newer than the kill's, minus the
kill time. Steps lost = the newest step completed before the kill minus the
step the next attempt restored. The trial succeeds when training recovered,
the agents still running exited 0 and a post-kill attempt reached the last
step, within `--timeout` seconds of the kill; otherwise every process of the
trial is killed and the failure is recorded with what the logs said. dlfleet
and torchrun alternate trial by trial (dlfleet first in even trials, torchrun
first in odd ones) so machine drift hits both.

Every trial gets fresh ports, a fresh temporary folder, a fresh rendezvous /
job, and an environment marker; at its end every process carrying the marker
(agents, workers, spares, orphans, the master) is SIGKILLed and the bench
checks none is left before the next trial.

Printed per system and kind: successes, median and max recovery time, the
medians of kill -> first post-kill worker process started and kill -> first
post-kill process group up, where the restores came from, steps lost; then
the cold start's median, torchrun's ratio to dlfleet, and, last,
`ratio: X` with X = the cold start's median / dlfleet's median recovery time
(all dlfleet trials; higher is better). Goal: X >= 4 with every dlfleet trial
recovered and at most one step lost per failure.

Expect a full run to take about 15 minutes on a 2-core machine (a torchrun
trial that hangs costs the whole `--timeout`); `--quick` about 5.
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

from _common import (
    BenchError,
    TrialError,
    exit_on_sigterm,
    free_port,
    kill_tagged,
    listening_port,
    say,
    spawn_logged,
    trial_env,
)

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TRAIN = BENCH / "_recovery_train.py"
PYTHON = Path(sys.executable)
TORCHRUN = Path(sys.executable).parent / "torchrun"
SYSTEMS = ("dlfleet", "torchrun")
COLD = "cold"
NODES = ("nodeA", "nodeB")
REPLACEMENT = "nodeC"
NPROC = 2
WORLD = len(NODES) * NPROC
MAX_RESTARTS = 3
TAG_ENV = "RECOVERY_BENCH_TAG"
POLL_S = 0.02
MASTER_READY_S = 30.0
CLEANUP_S = 15.0
GOAL_RATIO = 4.0
GOAL_LOST = 1
PERSIST_EVERY = 20
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
    kind: str = "rank"  # rank | node | start (the cold start)
    ok: bool = False
    recovery_s: float | None = None  # kill (or launch) -> first step after it
    spawn_s: float | None = None  # kill -> first post-kill worker started
    pg_s: float | None = None  # kill -> first post-kill process group up
    restored: int | None = None  # the step the first post-kill attempt restored (-1: none)
    source: str = ""  # where it came from: memory | peer | disk | none
    lost: int | None = None  # steps completed before the kill and not restored
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


@dataclass(frozen=True)
class RestoreLine:
    wall: float
    attempt: str
    rank: int
    step: int
    source: str
    seconds: float
    pid: int


def read_restores(path: Path) -> list[RestoreLine]:
    out: list[RestoreLine] = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for raw in text.splitlines():
        parts = raw.split()
        if len(parts) != 7:
            continue
        with suppress(ValueError):
            out.append(
                RestoreLine(
                    float(parts[0]),
                    parts[1],
                    int(parts[2]),
                    int(parts[3]),
                    parts[4],
                    float(parts[5]),
                    int(parts[6]),
                )
            )
    return out


def _int_or(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:
        return default


def read_pid_files(folder: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for path in folder.glob("*.json"):
        with suppress(OSError, ValueError):
            info = json.loads(path.read_text(encoding="utf-8"))
            out[int(info["pid"])] = info
    return out


class TrialRun:
    """The processes of one trial of one system, and its bookkeeping."""

    def __init__(
        self, system: str, index: int, args: argparse.Namespace, root: Path, kind: str = "rank"
    ) -> None:
        self.system = system
        self.index = index
        self.kind = kind
        self.args = args
        self.dir = root / f"{index:02d}-{system}-{kind}"
        self.dir.mkdir(parents=True)
        self.pids_dir = self.dir / "pids"
        self.pids_dir.mkdir()
        self.ckpt_dir = self.dir / "ckpt"
        self.restore_log = self.dir / "restores.log"
        self.step_log = StepLog(self.dir / "steps.log")
        self.tag = secrets.token_hex(8)
        self.env = trial_env(TAG_ENV, self.tag)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    # ------------------------------------------------------------- starting

    def log_path(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    def spawn(self, name: str, argv: list[str]) -> None:
        proc, log = spawn_logged(argv, cwd=self.dir, env=self.env, log_path=self.log_path(name))
        self._logs.append(log)  # closed in cleanup()
        self.procs[name] = proc

    def train_args(self) -> list[str]:
        return [
            str(TRAIN),
            # Not `--log`: torchrun's argparse would take it for `--log-dir`.
            "--step-log",
            str(self.step_log.path),
            "--pids-dir",
            str(self.pids_dir),
            "--restore-log",
            str(self.restore_log),
            "--ckpt-dir",
            str(self.ckpt_dir),
            "--persist-every",
            str(PERSIST_EVERY),
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
                "1" if self.kind == "node" else "2",
                "--max-nodes",
                "2",
                "--last-call-timeout",
                "0.3",
            ],
        )
        self.port = self._master_port()
        for node in NODES:
            self.spawn_agent(node)

    def spawn_agent(self, node: str) -> None:
        self.spawn(
            node,
            [
                str(PYTHON),
                "-m",
                "dlfleet.worker.agent.loop",
                "--nnodes",
                f"{1 if self.kind == 'node' else len(NODES)}:{len(NODES)}",
                "--nproc-per-node",
                str(NPROC),
                "--max-restarts",
                str(MAX_RESTARTS),
                "--monitor-interval",
                "0.1",
                "--master",
                f"127.0.0.1:{self.port}",
                "--node-name",
                node,
                "--log-dir",
                str(self.dir / f"worker-logs-{node}"),
                *self.train_args(),
            ],
        )

    def _master_port(self) -> int:
        try:
            return listening_port(self.log_path("master"), self.procs["master"], MASTER_READY_S)
        except BenchError as exc:
            raise TrialError(str(exc), self.log_tails()) from None

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
            if (
                len(best) == WORLD
                and min(best.values()) >= self.args.kill_after
                and self.spares_ready()
            ):
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

    def spares_ready(self) -> bool:
        """Under dlfleet, each agent's spare has attached (warmed up): the
        steady state a failure meets."""
        if self.system != "dlfleet":
            return True
        return all(b"attached as a spare" in self.log_path(node).read_bytes() for node in NODES)

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
        killed_at, kill_mono, old_pids, survivors = self._kill(result)
        self.step_log.read()
        done = [line.step for line in self.step_log.lines if line.wall <= killed_at]
        last_done = max(done, default=-1)
        replacement_due = kill_mono + self.args.relaunch_delay if self.kind == "node" else None
        deadline = kill_mono + self.args.timeout
        while time.monotonic() < deadline:
            if replacement_due is not None and time.monotonic() >= replacement_due:
                self.spawn_agent(REPLACEMENT)
                replacement_due = None
            if replacement_due is None and all(self.procs[n].poll() is not None for n in survivors):
                break
            time.sleep(POLL_S)
        self._measure(result, killed_at, time.monotonic() - kill_mono, old_pids, survivors)
        restores = sorted(
            (r for r in read_restores(self.restore_log) if r.wall > killed_at),
            key=lambda r: r.wall,
        )
        if restores:
            result.restored, result.source = restores[0].step, restores[0].source
            result.lost = last_done - restores[0].step

    def _kill(self, result: Trial) -> tuple[float, float, set[int], tuple[str, ...]]:
        """The fault: (wall time, monotonic time, the worker pids before it, the
        agents expected to finish)."""
        if self.kind == "node":
            agent = self.procs[NODES[1]]
            old_pids = set(read_pid_files(self.pids_dir))
            result.victim = f"{NODES[1]}'s agent and its workers"
            killed_at, kill_mono = time.time(), time.monotonic()
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
            return killed_at, kill_mono, old_pids, (NODES[0], REPLACEMENT)
        victim, info, old_pids = self.pick_victim()
        result.victim = f"rank {info['rank']} (local rank {info['local_rank']} of {NODES[1]})"
        killed_at, kill_mono = time.time(), time.monotonic()
        os.kill(victim, signal.SIGKILL)
        return killed_at, kill_mono, old_pids, NODES

    def _measure(
        self,
        result: Trial,
        killed_at: float,
        ended_s: float,
        old_pids: set[int],
        survivors: tuple[str, ...],
    ) -> None:
        kill_round = max(
            (_int_or(line.attempt, 0) for line in self.step_log.lines if line.wall <= killed_at),
            default=0,
        )

        def after_kill(line: StepLine) -> bool:
            return line.wall > killed_at and (
                line.pid not in old_pids or _int_or(line.attempt, 0) > kill_round
            )

        self.step_log.read()
        new_lines = [line for line in self.step_log.lines if after_kill(line) and line.step >= 0]
        if new_lines:
            result.recovery_s = min(line.wall for line in new_lines) - killed_at
        pg_up = [line.wall for line in self.step_log.lines if after_kill(line) and line.step < 0]
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
        codes = {node: self.procs[node].poll() for node in survivors if node in self.procs}
        if None in codes.values() or len(codes) < len(survivors):
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
            result.reason = "agents exited 0 but no post-kill attempt reached the last step"
        else:
            result.ok = True
        if not result.ok:
            result.details = self.log_tails()

    def run_cold(self, result: Trial, persisted: Path) -> None:
        """The same script started bare on a copy of `persisted` (a folder
        of persisted steps): launch -> the first completed step."""
        shutil.copytree(persisted, self.ckpt_dir)
        newest = max(int(p.parent.name.split("-")[1]) for p in persisted.glob("step-*/.metadata"))
        self.args = argparse.Namespace(**{**vars(self.args), "steps": newest + 6})
        port = free_port()
        launched_at = time.time()
        for rank in range(WORLD):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank % NPROC),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_WORLD_SIZE": str(NPROC),
                "GROUP_RANK": str(rank // NPROC),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            self.env.update(env)
            self.spawn(f"rank{rank}", [str(PYTHON), *self.train_args()])
        deadline = time.monotonic() + self.args.timeout
        while time.monotonic() < deadline:
            if all(proc.poll() is not None for proc in self.procs.values()):
                break
            time.sleep(POLL_S)
        self.step_log.read()
        steps = [line for line in self.step_log.lines if line.step >= 0]
        restores = read_restores(self.restore_log)
        if steps:
            result.recovery_s = min(line.wall for line in steps) - launched_at
        if restores:
            result.restored, result.source = restores[0].step, restores[0].source
        codes = {name: proc.poll() for name, proc in self.procs.items()}
        if None in codes.values() or any(codes.values()):
            result.reason = f"exit codes {codes}"
        elif not steps:
            result.reason = "no step was completed"
        elif {r.source for r in restores} != {"disk"}:
            result.reason = f"restored from {sorted({r.source for r in restores})}, not disk"
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
        left = kill_tagged(list(self.procs.values()), TAG_ENV, self.tag, CLEANUP_S)
        for log in self._logs:
            log.close()
        return left


def run_trial(
    system: str,
    index: int,
    args: argparse.Namespace,
    root: Path,
    kind: str = "rank",
    persisted: Path | None = None,
) -> Trial:
    result = Trial(system, index, kind)
    trial = TrialRun(system, index, args, root, kind)
    result.workdir = trial.dir
    try:
        if persisted is not None:
            trial.run_cold(result, persisted)
        else:
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
    restored = (
        f"restored step {trial.restored} from {trial.source} ({trial.lost} lost)"
        if trial.restored is not None
        else "no restore seen"
    )
    if trial.kind == "start" and trial.ok:
        return f"first step {trial.recovery_s:.3f} s after the launch; {restored}"
    if trial.ok:
        return (
            f"recovered in {trial.recovery_s:.3f} s (new workers after {fmt(trial.spawn_s)} s, "
            f"group up after {fmt(trial.pg_s)} s; {trial.new_workers} new worker processes), "
            f"{restored}, finished; killed {trial.victim}"
        )
    recovered = (
        f"; first step after the kill at {trial.recovery_s:.3f} s"
        if trial.recovery_s is not None
        else ""
    )
    return f"FAILED: {trial.reason}{recovered}; killed {trial.victim or '-'}"


def _label(trial: Trial) -> str:
    return COLD if trial.kind == "start" else f"{trial.system}/{trial.kind}"


def report(trials: list[Trial], args: argparse.Namespace) -> None:
    say()
    say(
        f"{'system':14s} {'ok':>6s} {'median s':>9s} {'max s':>8s} "
        f"{'new procs s':>12s} {'group up s':>11s} {'restored from':>16s} {'lost med/max':>13s}"
    )
    labels = [label for label in dict.fromkeys(_label(t) for t in trials)]
    medians: dict[str, float | None] = {}
    for label in labels:
        these = [t for t in trials if _label(t) == label]
        good = [t for t in these if t.ok]
        times = [t.recovery_s for t in good if t.recovery_s is not None]
        medians[label] = statistics.median(times) if times else None
        sources = ",".join(sorted({t.source for t in good if t.source})) or "-"
        lost = [t.lost for t in good if t.lost is not None]
        lost_text = f"{statistics.median(lost):g}/{max(lost)}" if lost else "-"
        say(
            f"{label:14s} {len(good):>3d}/{len(these):<2d} {fmt(medians[label]):>9s} "
            f"{fmt(max(times) if times else None):>8s} "
            f"{fmt(median_or_none([t.spawn_s for t in good])):>12s} "
            f"{fmt(median_or_none([t.pg_s for t in good])):>11s} {sources:>16s} {lost_text:>13s}"
        )
    say(
        "(ok: recovered and finished within the timeout; median/max: kill -> first step "
        "after it, successful trials only (cold: launch -> first step); new procs / group "
        "up: medians of kill -> first post-kill worker process started / first post-kill "
        "process group up; lost: steps completed before the kill and not restored)"
    )
    failures = [t for t in trials if not t.ok]
    if failures:
        say()
        say("failed trials:")
        for t in failures:
            say(f"  {_label(t)} trial {t.index}: {t.reason} (logs in {t.workdir})")
            for line in t.details:
                say(f"    {line}")
    say()
    dl_trials = [t for t in trials if t.system == "dlfleet" and t.kind != "start"]
    dl_ok = [t for t in dl_trials if t.ok]
    dl_times = [t.recovery_s for t in dl_ok if t.recovery_s is not None]
    dl = statistics.median(dl_times) if dl_times else None
    if "torchrun/rank" in medians and medians.get("dlfleet/rank") is not None:
        tr = medians["torchrun/rank"]
        note = ""
        if tr is None:
            tr = args.timeout
            note = f" (torchrun never recovered: counted as the {args.timeout:.0f} s timeout)"
        dl_rank = medians["dlfleet/rank"]
        assert dl_rank is not None
        say(f"torchrun / dlfleet (rank kills): {tr / dl_rank:.2f}x{note}")
    cold = medians.get(COLD)
    if cold is not None:
        restored = sorted(
            {t.restored for t in trials if t.kind == "start" and t.restored is not None}
        )
        say(
            f"cold start: {cold:.3f} s median from launch to the first step ({WORLD} processes "
            f"started, state read from disk at step(s) {restored})"
        )
    lost = [t.lost for t in dl_ok if t.lost is not None]
    if lost:
        say(
            f"steps lost per failure (dlfleet): median {statistics.median(lost):g}, max {max(lost)}"
        )
    if cold is None or dl is None:
        say("ratio: n/a (needs dlfleet trials and cold starts that succeeded)")
        return
    ratio = cold / dl
    all_ok = len(dl_ok) == len(dl_trials)
    goal = "yes" if all_ok and ratio >= GOAL_RATIO and lost and max(lost) <= GOAL_LOST else "NO"
    say(
        f"goal: every dlfleet trial recovered ({len(dl_ok)}/{len(dl_trials)}), at most "
        f"{GOAL_LOST} step lost, cold start / dlfleet >= {GOAL_RATIO:.0f}x: {goal}"
    )
    say(f"ratio: {ratio:.2f}")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=None, help="rank kills per system (10)")
    parser.add_argument("--node-trials", type=int, default=None, help="node kills, dlfleet (5)")
    parser.add_argument("--quick", action="store_true", help="3 rank kills, 2 node kills")
    parser.add_argument("--steps", type=int, default=500, help="the step to reach (500)")
    parser.add_argument("--step-ms", type=float, default=50.0, help="wall time of a step (50)")
    parser.add_argument(
        "--kill-after", type=int, default=30, help="steps every rank completes before the kill"
    )
    parser.add_argument(
        "--relaunch-delay", type=float, default=1.0, help="node kills: seconds to the new node"
    )
    parser.add_argument(
        "--timeout", type=float, default=90.0, help="seconds from the kill to the job's end (90)"
    )
    parser.add_argument(
        "--torchrun-trials",
        type=int,
        default=None,
        help="rank kills under torchrun (default: --trials; each that hangs costs --timeout)",
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
    if args.node_trials is None:
        args.node_trials = 2 if args.quick else 5
    if args.torchrun_trials is None:
        args.torchrun_trials = args.trials
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not args.systems or any(s not in SYSTEMS for s in args.systems):
        parser.error(f"--systems wants some of {', '.join(SYSTEMS)}")
    if args.trials < 1 or args.node_trials < 0 or args.steps < 2 or args.step_ms < 0:
        parser.error("--trials and --steps must be positive, --step-ms not negative")
    if not PERSIST_EVERY <= args.kill_after < args.steps - 1:
        parser.error(
            f"--kill-after must be in {PERSIST_EVERY}..--steps - 2 (a step is persisted "
            "before the kill, which lands mid-run)"
        )
    if min(args.timeout, args.start_timeout, args.pg_timeout) <= 0:
        parser.error("the timeouts must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    root = Path(tempfile.mkdtemp(prefix="dlfleet-recovery-bench-"))
    say(
        f"recovery benchmark: {args.trials} rank kill(s) per system ({', '.join(args.systems)}), "
        f"{args.node_trials if 'dlfleet' in args.systems else 0} node kill(s) (dlfleet), cold "
        f"starts; {len(NODES)} nodes x {NPROC} processes, gloo, to step {args.steps}, "
        f"{args.step_ms:.0f} ms steps, kill after step {args.kill_after}, timeout "
        f"{args.timeout:.0f} s; logs in {root}"
    )
    started = time.monotonic()
    trials: list[Trial] = []

    def record(trial: Trial) -> None:
        trials.append(trial)
        say(f"  {_label(trial):14s} trial {trial.index}: {describe(trial)}")

    try:
        for index in range(max(args.trials, args.node_trials)):
            order = args.systems if index % 2 == 0 else args.systems[::-1]
            runs = [
                (system, "rank")
                for system in order
                if index < (args.torchrun_trials if system == "torchrun" else args.trials)
            ]
            if "dlfleet" in args.systems and index < args.node_trials:
                runs.append(("dlfleet", "node"))
            for system, kind in runs:
                trial = run_trial(system, index, args, root, kind)
                record(trial)
                if system == "dlfleet" and kind == "rank" and trial.workdir is not None:
                    persisted = trial.workdir / "ckpt"
                    if any(persisted.glob("step-*/.metadata")):
                        record(run_trial(COLD, index, args, root, "start", persisted))
            for trial in trials:
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
