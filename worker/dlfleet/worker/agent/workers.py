"""The local training processes of one rendezvous round: start, watch, stop.

Built on `subprocess.Popen` rather than torch's `start_processes` because the
agent needs three things that function does not give directly: logs laid out
by round (`<log_dir>/<round>/<local_rank>/stdout.log|stderr.log`, torch picks
its own `<run_id>_<random>/attempt_<n>` folders), a stop that kills each
worker's whole process group (DataLoader workers and other grandchildren
included) and escalates from SIGTERM to SIGKILL on our own deadline, and no
dependence on torch's private, version-to-version `LogsSpecs` signatures. The
agent therefore imports no torch to launch workers.

Invariants:
- Each worker leads its own session (`start_new_session=True`), so its process
  group id is its pid; signals go to the group, never to the agent's group.
- The first failure is latched: `poll()` keeps reporting the same one while
  later ranks die of its consequences. "First" is the failure seen in the
  earliest poll; among ranks seen failing in the same poll, the earliest error
  file timestamp (torch's root-cause rule), then the lowest local rank.
- `stop()` always ends every process group it started and reaps every worker,
  is idempotent, and freezes the state: exits it causes are never failures.
  It is also how a finished group is closed: log files and tee threads are
  complete once it returned.
- Stale error files of an earlier attempt are removed before a worker starts,
  so an error file is always this attempt's.

Matching torchrun: command lines (`python -u script`, `-m`, `--no-python`,
`PYTHON_EXEC`), `--redirects` and `--tee` (tee'd lines are echoed to the
agent's console prefixed `[<role><local_rank>]:`), and reading `@record`
error files. Different: stdin is /dev/null (many processes never share a
terminal usefully), log files are appended to, not replaced, and a worker
with no error file but a stderr log gets the tail of that log as its message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

from dlfleet.api.diagnosis import exception_signature
from dlfleet.api.errors import DlfleetError
from dlfleet.api.processes import die_with_parent
from dlfleet.worker.agent import primed as primed_spare
from dlfleet.worker.agent.config import AgentConfig, Std

logger = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# An error file or log tail larger than this is read only up to it.
MAX_REPORT_BYTES = 1 << 20
CGROUP_ROOT = Path("/sys/fs/cgroup")
STDERR_TAIL_LINES = 20
_STOP_POLL_S = 0.05
# How long a rank's exception waits for the other ranks to fail alike (see poll).
ALIKE_GRACE_S = 0.3


class WorkerStartError(DlfleetError):
    """A worker process could not be started at all (e.g. no such executable)."""


class GroupStatus(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # every worker exited 0
    FAILED = "failed"  # some worker exited non-zero or was killed
    STOPPED = "stopped"  # stop() ended a group that was still running


@dataclass(frozen=True)
class ErrorFileReport:
    """What a worker's `@record` error file says."""

    message: str
    traceback: str | None = None
    timestamp: int | None = None


@dataclass(frozen=True)
class WorkerFailure:
    local_rank: int
    pid: int
    exit_code: int  # Popen's returncode: -N when killed by signal N
    signal_name: str | None  # "SIGKILL" when killed by a signal
    message: str  # the error file's message, else the stderr tail, else a summary
    traceback: str | None = None
    timestamp: int | None = None  # seconds since the epoch, from the error file
    error_file: str | None = None  # the error file, when the worker wrote one
    stderr_tail: str = ""  # the end of its stderr log, when it has one
    oom_killed: bool = False  # the kernel's OOM killer struck on this node meanwhile
    hung: bool = False  # found by the step watchdog, not by its exit
    ranks_alike: int = 1  # local ranks that failed with this same exception (itself included)


@dataclass(frozen=True)
class GroupState:
    status: GroupStatus
    exit_codes: tuple[int | None, ...]  # by local rank; None while running
    failure: WorkerFailure | None = None


def worker_command(config: AgentConfig, python: str) -> list[str]:
    """The command line of every worker, as torchrun builds it."""
    if config.no_python:
        return [config.training_script, *config.training_script_args]
    module = ["-m"] if config.module else []
    return [python, "-u", *module, config.training_script, *config.training_script_args]


def attempt_log_dir(log_dir: Path, round_id: int) -> Path:
    """The folder of one round's logs; the agent passes it to
    `worker_environments` as the error file folder too."""
    return log_dir / str(round_id)


def oom_kill_count(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT
) -> int | None:
    """How many processes the kernel's OOM killer has killed in this
    process's memory cgroup (v2 `memory.events`, v1 `memory.oom_control`),
    or None where that is not readable. Workers share the agent's cgroup, so
    a rise while a worker died of SIGKILL means the kernel killed it for
    memory."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if hierarchy == "0" and not controllers:
            candidates.append(root / relative / "memory.events")
        elif "memory" in controllers.split(","):
            candidates.append(root / "memory" / relative / "memory.oom_control")
            candidates.append(root / "memory" / "memory.oom_control")  # a namespaced view
    for candidate in candidates:
        try:
            text = candidate.read_text()
        except OSError:
            continue
        for entry in text.splitlines():
            key, _, value = entry.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def _signal_name(exit_code: int) -> str | None:
    if exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def _read_capped(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - MAX_REPORT_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def read_error_file(path: Path) -> ErrorFileReport | None:
    """Reads an error file written by torch's `@record` (`ErrorHandler`),
    tolerant of its formats: `{"message": {"message", "extraInfo":
    {"py_callstack", "timestamp"}}}`, `{"message": str, "timestamp"}`, or
    anything else (then its text is the message). None if there is no file."""
    text = _read_capped(path)
    if text is None or not text.strip():
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return ErrorFileReport(message=text.strip())
    if not isinstance(data, dict):
        return ErrorFileReport(message=text.strip())
    body = data.get("message")
    if isinstance(body, str):
        return ErrorFileReport(message=body, timestamp=_int_or_none(data.get("timestamp")))
    if isinstance(body, dict):
        extra = body.get("extraInfo")
        extra = extra if isinstance(extra, dict) else {}
        callstack = extra.get("py_callstack")
        message = body.get("message")
        return ErrorFileReport(
            message=str(message) if message is not None else json.dumps(body),
            traceback=callstack if isinstance(callstack, str) else None,
            timestamp=_int_or_none(extra.get("timestamp", data.get("timestamp"))),
        )
    return ErrorFileReport(message=text.strip())


def _tail(path: Path, lines: int) -> str | None:
    text = _read_capped(path)
    if not text or not text.strip():
        return None
    return "\n".join(text.rstrip().splitlines()[-lines:])


class _Pump:
    """Copies one tee'd stream of a worker into its log file and, each line
    prefixed, to the agent's console."""

    def __init__(
        self,
        source: IO[bytes],
        log: BinaryIO,
        console: BinaryIO,
        prefix: bytes,
        lock: threading.Lock,
    ) -> None:
        self._source, self._log, self._console = source, log, console
        self._prefix, self._lock = prefix, lock
        self.thread = threading.Thread(target=self._run, name=f"tee {prefix!r}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # Always drain to EOF, whatever fails: a worker blocked on a full pipe
        # would look like a hang.
        log: BinaryIO | None = self._log
        echo = True
        for line in iter(self._source.readline, b""):
            if log is not None:
                try:
                    log.write(line)
                    log.flush()
                except (OSError, ValueError) as exc:
                    logger.warning("%s log stopped: %s", self._prefix.decode(), exc)
                    log = None
            if echo:
                try:
                    with self._lock:
                        self._console.write(self._prefix + line)
                        self._console.flush()
                except (OSError, ValueError) as exc:
                    logger.warning("%s console echo stopped: %s", self._prefix.decode(), exc)
                    echo = False
        self._source.close()
        self._log.close()


@dataclass
class _Worker:
    local_rank: int
    proc: subprocess.Popen[bytes]
    error_file: Path | None
    stderr_log: Path | None
    pumps: list[_Pump]


class WorkerGroup:
    """The workers of one round on this node. Start it once, `poll()` it every
    monitor interval, and `stop()` it when the round ends, whatever the state."""

    def __init__(
        self, console_stdout: BinaryIO | None = None, console_stderr: BinaryIO | None = None
    ) -> None:
        self._console_stdout = console_stdout
        self._console_stderr = console_stderr
        self._console_lock = threading.Lock()
        self._workers: list[_Worker] = []  # by local rank
        self._spares: list[_Worker] = []  # started ahead, no rank yet (in-process restarts)
        self._retired: list[_Worker] = []  # replaced by a spare; reaped at stop()
        self._started = False
        self._failure: WorkerFailure | None = None
        self._first_failed_at: float | None = None  # monotonic: when a rank was first seen failed
        self._described: dict[int, WorkerFailure] = {}  # by pid: an exit is final
        self._final: GroupState | None = None
        self._oom_kills_at_start = oom_kill_count()

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(w.proc.pid for w in self._workers)

    @property
    def spare_pids(self) -> tuple[int, ...]:
        return tuple(w.proc.pid for w in self._spares)

    # ----------------------------------------------- in-process restarts

    def alive(self, local_rank: int) -> bool:
        return self._workers[local_rank].proc.poll() is None

    def start_spare(
        self, config: AgentConfig, env: Mapping[str, str], log_dir: Path, primed: bool = False
    ) -> int:
        """Start a spare process (waits in `dlfleet.elastic.run` for a rank).
        A primed one imports what the script imports and waits for
        `release_primed` before it runs the script (see `primed`)."""
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        command = worker_command(config, python)
        if primed:
            command = [python, "-u", "-m", primed_spare.MODULE, *command[2:]]
        index = len(self._spares) + len(self._retired) + len(self._workers)
        spare = self._start_one(
            config, die_with_parent(command), env, log_dir / "spares" / str(index), 0, primed
        )
        self._spares.append(spare)
        return spare.proc.pid

    @property
    def primed_pids(self) -> tuple[int, ...]:
        """Primed spares still waiting for the word to run the script."""
        return tuple(w.proc.pid for w in self._spares if w.proc.stdin is not None)

    def release_primed(self) -> list[int]:
        """Tell every waiting primed spare to run the script; their pids."""
        released = []
        for worker in self._spares:
            stdin = worker.proc.stdin
            if stdin is None:
                continue
            worker.proc.stdin = None
            with contextlib.suppress(OSError):  # it died: reap_spares tells
                stdin.write(primed_spare.RUN)
                stdin.flush()
            with contextlib.suppress(OSError):
                stdin.close()
            released.append(worker.proc.pid)
        return released

    def drop_primed(self) -> list[int]:
        """End the primed spares still waiting (the script never restarted in
        place): a closed stdin and they exit 0. Their pids."""
        dropped = [w for w in self._spares if w.proc.stdin is not None]
        for worker in dropped:
            assert worker.proc.stdin is not None
            with contextlib.suppress(OSError):
                worker.proc.stdin.close()
            worker.proc.stdin = None
        self._spares = [w for w in self._spares if w not in dropped]
        self._retired.extend(dropped)  # reaped at stop()
        return [w.proc.pid for w in dropped]

    def reap_spares(self) -> list[WorkerFailure]:
        """Spares that died (never trained): dropped, and described."""
        dead = [w for w in self._spares if w.proc.poll() is not None]
        self._spares = [w for w in self._spares if w not in dead]
        self._retired.extend(dead)
        return [self._describe(w) for w in dead]

    def promote(self, local_rank: int, pid: int, error_file: Path | None) -> None:
        """Spare `pid` takes over `local_rank`: the process it replaces (dead,
        or killed as hung) is retired, or, in a group started from spares
        alone (a warm start), it is the rank's first process."""
        spare = next(w for w in self._spares if w.proc.pid == pid)
        self._spares.remove(spare)
        spare.local_rank = local_rank
        spare.error_file = error_file
        if error_file is not None:
            error_file.parent.mkdir(parents=True, exist_ok=True)
            error_file.unlink(missing_ok=True)
        self._seat(local_rank, spare)

    def replace(
        self,
        local_rank: int,
        config: AgentConfig,
        env: Mapping[str, str],
        log_dir: Path,
        round_id: int,
    ) -> int:
        """A new process for `local_rank` (no spare was ready): a cold start."""
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        command = die_with_parent(worker_command(config, python))
        rank_dir = attempt_log_dir(log_dir, round_id) / str(local_rank)
        worker = self._start_one(config, command, env, rank_dir, local_rank)
        self._seat(local_rank, worker)
        return worker.proc.pid

    def _seat(self, local_rank: int, worker: _Worker) -> None:
        if local_rank < len(self._workers):
            self._retired.append(self._workers[local_rank])
            self._workers[local_rank] = worker
        elif local_rank == len(self._workers):  # filling a group seated rank by rank
            self._workers.append(worker)
        else:
            raise IndexError(f"local rank {local_rank} seated before {len(self._workers)}")
        self._started = True

    def set_error_file(self, local_rank: int, error_file: Path | None) -> None:
        """A surviving process's error file for its next round."""
        worker = self._workers[local_rank]
        worker.error_file = error_file
        if error_file is not None:
            error_file.parent.mkdir(parents=True, exist_ok=True)
            error_file.unlink(missing_ok=True)

    def kill(self, local_rank: int) -> None:
        """SIGKILL one worker's process group (hung, or not leaving its round)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._workers[local_rank].proc.pid, signal.SIGKILL)

    def begin_round(self) -> None:
        """The group goes on in a new round: earlier failures are history."""
        self._failure = None
        self._first_failed_at = None
        self._described = {}

    def start(
        self,
        config: AgentConfig,
        envs: Sequence[Mapping[str, str]],
        log_dir: Path,
        round_id: int,
    ) -> None:
        """Starts one process per local rank, `envs[local_rank]` over the
        agent's environment. Raises WorkerStartError (after stopping the ones
        already started) if a process cannot be started."""
        if self._started:
            raise RuntimeError("a WorkerGroup is started once; make a new one per round")
        if len(envs) != config.nproc_per_node:
            raise ValueError(f"{len(envs)} environments for {config.nproc_per_node} processes")
        self._started = True
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        command = die_with_parent(worker_command(config, python))
        attempt = attempt_log_dir(log_dir, round_id)
        for local_rank, env in enumerate(envs):
            try:
                self._workers.append(
                    self._start_one(config, command, env, attempt / str(local_rank), local_rank)
                )
            except OSError as exc:
                self._stop(timeout_s=5.0, status=GroupStatus.STOPPED)
                raise WorkerStartError(
                    f"cannot start local rank {local_rank} ({' '.join(command)}): {exc}"
                ) from exc

    def _start_one(
        self,
        config: AgentConfig,
        command: list[str],
        env: Mapping[str, str],
        rank_dir: Path,
        local_rank: int,
        primed: bool = False,
    ) -> _Worker:
        error_file = Path(env[ERROR_FILE_ENV]) if env.get(ERROR_FILE_ENV) else None
        if error_file is not None:
            error_file.parent.mkdir(parents=True, exist_ok=True)
            error_file.unlink(missing_ok=True)
        redirect, tee = config.redirects.for_rank(local_rank), config.tee.for_rank(local_rank)
        to_file = redirect | tee
        if to_file:
            rank_dir.mkdir(parents=True, exist_ok=True)
        logs: dict[str, BinaryIO] = {}
        try:
            for name, bit in (("stdout", Std.OUT), ("stderr", Std.ERR)):
                if to_file & bit:
                    logs[name] = (rank_dir / f"{name}.log").open("ab")
            proc = subprocess.Popen(
                command,
                env={**os.environ, **env},
                stdin=subprocess.PIPE if primed else subprocess.DEVNULL,
                stdout=subprocess.PIPE if tee & Std.OUT else logs.get("stdout"),
                stderr=subprocess.PIPE if tee & Std.ERR else logs.get("stderr"),
                start_new_session=True,
            )
        except BaseException:
            for log in logs.values():
                log.close()
            raise
        pumps = []
        prefix = f"[{config.role}{local_rank}]:".encode()
        for name, source in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            if source is not None:  # tee'd: a pump owns the log file now
                pumps.append(
                    _Pump(source, logs[name], self._console(name), prefix, self._console_lock)
                )
            elif name in logs:
                logs[name].close()  # redirected: the child holds its own copy
        return _Worker(
            local_rank=local_rank,
            proc=proc,
            error_file=error_file,
            stderr_log=rank_dir / "stderr.log" if to_file & Std.ERR else None,
            pumps=pumps,
        )

    def _console(self, name: str) -> BinaryIO:
        chosen = self._console_stdout if name == "stdout" else self._console_stderr
        if chosen is not None:
            return chosen
        stream = sys.stdout if name == "stdout" else sys.stderr
        buffer: BinaryIO | None = getattr(stream, "buffer", None)
        if buffer is not None:
            return buffer
        # sys.stdout was replaced by a text-only object: write to the fd itself.
        return os.fdopen(1 if name == "stdout" else 2, "wb", closefd=False)

    def poll(self, *, wait_alike: bool = True) -> GroupState:
        """The group's state now; after `stop()`, the state it froze.

        A rank that failed with an exception while others still run is held
        back for up to `ALIKE_GRACE_S` (`wait_alike`): ranks that raise the
        same exception in the same step leave within moments of each other,
        and every rank failing alike says the code is at fault, not the node."""
        if self._final is not None:
            return self._final
        if not self._started:
            raise RuntimeError("poll() before start()")
        codes = tuple(w.proc.poll() for w in self._workers)
        if self._failure is None:
            failed = [w for w, code in zip(self._workers, codes, strict=True) if code]
            if failed:
                failure = self._first_failure(failed)
                if self._first_failed_at is None:
                    self._first_failed_at = time.monotonic()
                waiting = (
                    wait_alike
                    and failure.signal_name is None
                    and bool(_said(failure))
                    and any(code is None for code in codes)
                    and time.monotonic() - self._first_failed_at < ALIKE_GRACE_S
                )
                if waiting:
                    return GroupState(GroupStatus.RUNNING, codes)
                self._failure = failure
        if self._failure is not None:
            return GroupState(GroupStatus.FAILED, codes, self._failure)
        if all(code == 0 for code in codes):
            return GroupState(GroupStatus.SUCCEEDED, codes)
        return GroupState(GroupStatus.RUNNING, codes)

    def _first_failure(self, failed: Iterable[_Worker]) -> WorkerFailure:
        failures = [self._description(w) for w in failed]
        first = min(
            failures,
            key=lambda f: (f.timestamp if f.timestamp is not None else float("inf"), f.local_rank),
        )
        said = _said(first)
        alike = sum(1 for f in failures if said and _said(f) == said)
        return dataclasses.replace(first, ranks_alike=max(1, alike))

    def _description(self, worker: _Worker) -> WorkerFailure:
        """`_describe`, once per exit: polls repeat while the other ranks are waited for."""
        known = self._described.get(worker.proc.pid)
        if known is None:
            known = self._described[worker.proc.pid] = self._describe(worker)
        return known

    def _describe(self, worker: _Worker) -> WorkerFailure:
        code = worker.proc.returncode
        signal_name = _signal_name(code)
        report = read_error_file(worker.error_file) if worker.error_file else None
        for pump in worker.pumps:  # a tee'd stderr may still be draining
            pump.thread.join(timeout=1.0)
        tail = _tail(worker.stderr_log, STDERR_TAIL_LINES) if worker.stderr_log else None
        oom_killed = signal_name == "SIGKILL" and self._oom_killed()
        if report is not None:
            message, traceback, timestamp = report.message, report.traceback, report.timestamp
        else:
            traceback, timestamp = None, None
            summary = f"killed by {signal_name}" if signal_name else f"exited with code {code}"
            if oom_killed:
                summary += " (out of memory: the kernel's OOM killer)"
            message = f"{summary}; stderr ends with:\n{tail}" if tail else summary
        return WorkerFailure(
            local_rank=worker.local_rank,
            pid=worker.proc.pid,
            exit_code=code,
            signal_name=signal_name,
            message=message,
            traceback=traceback,
            timestamp=timestamp,
            error_file=str(worker.error_file) if report is not None else None,
            stderr_tail=tail or "",
            oom_killed=oom_killed,
        )

    def _oom_killed(self) -> bool:
        now = oom_kill_count()
        before = self._oom_kills_at_start
        return now is not None and before is not None and now > before

    def stop(self, timeout_s: float) -> GroupState:
        """SIGTERM every worker's process group, SIGKILL what is left after
        `timeout_s`, reap everything, and freeze the state. Idempotent."""
        return self._stop(timeout_s, status=None)

    def _stop(self, timeout_s: float, status: GroupStatus | None) -> GroupState:
        if self._final is not None:
            return self._final
        before = (
            self.poll(wait_alike=False) if self._started else GroupState(GroupStatus.STOPPED, ())
        )
        self._signal_all(signal.SIGTERM)
        # A stopped (SIGSTOP, a debugger) worker would only see SIGTERM once
        # continued: continue it, or a hang costs the whole grace period.
        self._signal_all(signal.SIGCONT)
        deadline = time.monotonic() + max(0.0, timeout_s)
        while self._any_alive() and time.monotonic() < deadline:
            time.sleep(_STOP_POLL_S)
        if self._any_alive():
            logger.warning("workers still running %.1fs after SIGTERM; sending SIGKILL", timeout_s)
            self._signal_all(signal.SIGKILL)
        for worker in self._everyone():
            try:
                worker.proc.wait(timeout=max(1.0, timeout_s))
            except subprocess.TimeoutExpired:
                logger.error("worker pid %d survived SIGKILL; giving up on it", worker.proc.pid)
            for pump in worker.pumps:
                pump.thread.join(timeout=1.0)
        codes = tuple(w.proc.returncode for w in self._workers)
        if status is None:
            running = before.status is GroupStatus.RUNNING
            status = GroupStatus.STOPPED if running else before.status
        self._final = GroupState(status, codes, before.failure)
        return self._final

    def _everyone(self) -> list[_Worker]:
        return [*self._workers, *self._spares, *self._retired]

    def _signal_all(self, sig: signal.Signals) -> None:
        for worker in self._everyone():
            # The group outlives its leader while grandchildren live; after the
            # group is empty the call fails harmlessly.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.proc.pid, sig)

    def _any_alive(self) -> bool:
        orphaned: set[int] = set()  # groups whose leader is gone but which are not empty
        for worker in self._everyone():
            if worker.proc.poll() is None:  # reaps a dead leader so its group can empty
                return True
            try:
                os.killpg(worker.proc.pid, 0)
                orphaned.add(worker.proc.pid)
            except (ProcessLookupError, PermissionError):
                pass
        own = {w.proc.pid for w in self._everyone()}
        return bool(orphaned) and _have_live_members(orphaned, own)


def _have_live_members(groups: set[int], own_children: set[int]) -> bool:
    """Whether any process of `groups` is still running, zombies not counted:
    an orphaned grandchild stays a zombie until init reaps it, and when the
    agent is PID 1 (a container's entry point) the agent is init. Such zombies
    that are ours to reap (not Popen's) are reaped here. Without /proc, any
    member counts."""
    if not os.path.isdir("/proc"):
        return True
    me, alive = os.getpid(), False
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "stat"), "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        state, ppid, pgrp = fields[0], int(fields[1]), int(fields[2])
        if pgrp not in groups:
            continue
        if state not in (b"Z", b"X"):
            alive = True
        elif ppid == me and int(entry.name) not in own_children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry.name), os.WNOHANG)
    return alive


def _said(failure: WorkerFailure) -> str:
    """The exception a failed worker raised, as Python printed it ("" if none)."""
    return exception_signature(failure.traceback or "", failure.message, failure.stderr_tail)
