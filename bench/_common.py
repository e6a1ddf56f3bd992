"""What every benchmark here needs: messages, free ports, server processes in
their own process groups, drivers and their options. Standard library only."""

from __future__ import annotations

import importlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from dlfleet.api.env import TOKEN_ENV


class BenchError(RuntimeError):
    """The benchmark could not produce an honest figure; it says why."""


def say(message: str = "") -> None:
    print(message, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def kill_group(proc: subprocess.Popen[Any], grace: float = 5.0) -> None:
    """Stop a process started with start_new_session=True, and whatever it
    left behind in its process group."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, all its threads."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise BenchError(f"no VmRSS for pid {pid}")


def load_driver(prefix: str, name: str) -> Any:
    """A bench driver module `bench/<prefix><name>.py`."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(f"{prefix}{name}")


def parse_options(items: list[str]) -> dict[str, str]:
    """`--option KEY=VALUE` items as a dict."""
    options: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option wants KEY=VALUE, got {item!r}")
        options[key] = value
    return options


class ServerProcess:
    """A server in its own process group, its output copied to a log file;
    ready once it printed `ready_text` (if any) and its port accepts."""

    def __init__(
        self,
        label: str,
        argv: list[str],
        log_path: Path,
        ready_text: str | None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.label = label
        self.log_path = log_path
        self._ready_text = ready_text
        self._seen_ready = threading.Event()
        self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            argv,
            cwd=log_path.parent,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        self._pump = threading.Thread(target=self._copy_output, daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if self._ready_text is not None and self._ready_text in line:
                self._seen_ready.set()

    def wait_ready(self, port: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._pump.join(timeout=5)
                raise BenchError(f"{self.label} exited with {self.proc.returncode}; {self.tail()}")
            if (self._ready_text is None or self._seen_ready.is_set()) and port_open(port):
                return
            time.sleep(0.05)
        raise BenchError(f"{self.label} not ready after {timeout:.0f} s; {self.tail()}")

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        return f"log {self.log_path}, last lines:\n" + "\n".join(text[-lines:])

    def stop(self) -> None:
        kill_group(self.proc)
        self._pump.join(timeout=5)
        self._log.close()


def become_subreaper() -> None:
    """Adopt this process's orphaned descendants (Linux PR_SET_CHILD_SUBREAPER),
    so that their CPU time reaches this process's RUSAGE_CHILDREN once
    `reap_orphans` has waited for them: a forkserver, and the DataLoader
    workers it forked, outlive the rank that started them."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def reap_orphans() -> None:
    """Wait for every child that has exited (adopted orphans included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def tagged_pids(tag_env: str, tag: str) -> list[int]:
    """Live, non-zombie processes (of this user) whose environment carries
    `tag_env=tag`: what a bench started, however deep, to clean up after it."""
    marker = f"{tag_env}={tag}".encode()
    found: list[int] = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and marker in environ.split(b"\0"):
            found.append(int(entry))
    return found


class TrialError(BenchError):
    """A trial that did not give its figure: why, and what the logs said."""

    def __init__(self, reason: str, details: list[str]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = details


def spawn_logged(
    argv: list[str], *, cwd: Path, env: dict[str, str], log_path: Path
) -> tuple[subprocess.Popen[bytes], Any]:
    """Start `argv` in its own session, stdout and stderr into `log_path`;
    the process and the log file (the caller closes it)."""
    log = open(log_path, "wb")  # noqa: SIM115 - the caller closes it
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, log


def listening_port(log_path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """The port a dlfleet master prints ("listening on 127.0.0.1:P") into
    its log; BenchError if it exits or stays silent for `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pattern = re.compile(rb"listening on 127\.0\.0\.1:(\d+)")
    while time.monotonic() < deadline:
        found = pattern.search(log_path.read_bytes())
        if found:
            return int(found.group(1))
        if proc.poll() is not None:
            raise BenchError(f"the master exited with {proc.returncode}")
        time.sleep(0.05)
    raise BenchError(f"the master did not listen within {timeout_s:.0f} s")


def exit_on_sigterm() -> None:
    """A SIGTERM to the bench ends it like Ctrl-C does: the `finally`s run,
    so the processes of the trial under way are killed, not orphaned."""

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def kill_tagged(
    procs: list[subprocess.Popen[bytes]], tag_env: str, tag: str, timeout_s: float
) -> list[int]:
    """SIGKILL `procs`' process groups and every process carrying the tag,
    until none is left or `timeout_s`; the pids still alive then."""
    deadline = time.monotonic() + timeout_s
    left: list[int] = []
    while True:
        for proc in procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for pid in tagged_pids(tag_env, tag):
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for proc in procs:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
        left = tagged_pids(tag_env, tag)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def trial_env(tag_env: str, tag: str, **extra: str) -> dict[str, str]:
    """The environment of a trial's processes: this one's without a
    launcher's variables (torchrun's, a rank's), tagged `tag_env=tag` so that
    every process of the trial can be found and killed (`kill_tagged`), with
    a fresh job token, gloo on loopback, one OpenMP thread, unbuffered output,
    and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(
        {
            tag_env: tag,
            TOKEN_ENV: secrets.token_hex(16),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **extra,
        }
    )
    return env


def log_tails(root: Path, paths: list[Path], lines: int, width: int = 300) -> list[str]:
    """The last `lines` lines of each non-empty log in `paths` (named relative
    to `root`), for a failed trial's report."""
    out: list[str] = []
    for path in paths:
        with suppress(OSError):
            text = path.read_text(encoding="utf-8", errors="replace").rstrip().splitlines()
            if text:
                out.append(f"--- {path.relative_to(root)}")
                out.extend(f"    {line[:width]}" for line in text[-lines:])
    return out
