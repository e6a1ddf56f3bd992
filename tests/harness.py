"""Test support: real masters (in-process on an asyncio loop thread, or as a
`dlmaster` subprocess that tests can SIGKILL) and access to the PostgreSQL on
127.0.0.1:5432."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest

from dlfleet.api.env import TOKEN_ENV

T = TypeVar("T")

POSTGRES_URL = os.environ.get(
    "DLFLEET_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def postgres_available() -> bool:
    try:
        import psycopg

        with psycopg.connect(
            POSTGRES_URL.replace("postgresql+psycopg", "postgresql"), connect_timeout=3
        ):
            return True
    except Exception:  # noqa: BLE001 - any failure means "not reachable"
        return False


def missing(reason: str) -> NoReturn:
    """What the test needs is not here (`reason`): skip it, but never in CI
    (CI=true), whose set-up installs everything: there the test fails."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run this test", pytrace=False)
    pytest.skip(reason)


def require_postgres() -> None:
    """Skip where PostgreSQL is absent, but never in CI: there it must run."""
    if not postgres_available():
        missing(f"PostgreSQL unreachable at {POSTGRES_URL}")


@dataclass
class MasterProcess:
    """`dlmaster` as a real subprocess, so that tests can SIGKILL it."""

    store: str
    token: str
    extra: tuple[str, ...] = ()
    port: int = 0
    proc: subprocess.Popen[str] | None = None

    def start(self, timeout_s: float = 30) -> MasterProcess:
        args = [sys.executable, "-m", "dlfleet.master", "--port", str(self.port)]
        args += ["--store", self.store, "--log-level", "WARNING", *self.extra]
        env = {**os.environ, TOKEN_ENV: self.token}
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            match = re.search(r"listening on [\d.]+:(\d+)", line)
            if match:
                self.port = int(match.group(1))
                threading.Thread(target=self._drain, daemon=True).start()
                return self
        self.kill()
        raise RuntimeError(f"dlmaster did not start: {self.proc.stdout.read()}")

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        return self.proc.wait(10)


class LoopThread:
    """An asyncio loop on a thread, for running a MasterServer in-process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


TOKEN = "test-token"


@dataclass
class Running:
    """An in-process master on a LoopThread, and a client to it."""

    server: Any  # dlfleet.master.service.server.MasterServer
    state: Any  # dlfleet.master.service.state.MasterState
    client: Any  # dlfleet.api.client.MasterClient
    stopped: bool = field(default=False)

    @property
    def address(self) -> str:
        return str(self.client.target)


def start_in_process(
    loop_thread: LoopThread, store_url: str, settings: Any, port: int = 0, **options: Any
) -> Running:
    """`options` go to MasterServer (`http=HttpSettings()`, `tls=...`)."""
    from dlfleet.api.client import MasterClient
    from dlfleet.master.service.rpc import system_clock
    from dlfleet.master.service.server import MasterServer
    from dlfleet.master.service.state import MasterState
    from dlfleet.master.store.sql import open_store

    state = MasterState.recover(open_store(store_url), settings, system_clock())
    server = MasterServer(state, token=TOKEN, port=port, tick_ms=50, **options)
    bound = loop_thread.run(server.start())
    client = MasterClient(f"127.0.0.1:{bound}", token=TOKEN, timeout_s=5)
    return Running(server, state, client)


def stop_in_process(loop_thread: LoopThread, running: Running) -> None:
    if running.stopped:
        return
    running.stopped = True
    running.client.close()
    loop_thread.run(running.server.stop(0))
    running.state.close()


StartMaster = Callable[..., Running]


class JobProcess:
    """`dlmaster --job-config` as a subprocess (its own process group, so a
    test can SIGKILL the master), with `dlmaster status/scale` beside it."""

    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        self.root = root
        self.config = root / "job.yaml"
        self.config.write_text(json.dumps(config))  # JSON is YAML
        self.proc: subprocess.Popen[str] | None = None

    def start(self, env: dict[str, str] | None = None) -> JobProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dlfleet.master", "--job-config", str(self.config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        return self

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        assert self.proc is not None
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def control(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dlfleet.master", *args, "--job-config", str(self.config)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def status(self) -> dict[str, Any]:
        done = self.control("status", "--json")
        assert done.returncode == 0, done.stderr
        data: dict[str, Any] = json.loads(done.stdout)
        return data

    def node_pid(self, name: str) -> int:
        return int(next(n for n in self.status()["nodes"] if n["name"] == name)["pid"])

    def wait_for(self, predicate: Callable[[], Any], what: str, timeout: float = 60) -> None:
        """Until `predicate()` is true; fails at once if the job ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"the job ended while waiting for {what}: {self.finish()}")
            try:
                if predicate():
                    return
            except (OSError, ValueError, AssertionError, KeyError, StopIteration):
                pass
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def kill(self) -> None:
        """SIGKILL the master (its nodes die with it)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


def make_cert(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    request = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
    subject = ["-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
    subprocess.run(
        [*request, *subject, "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


def run_ranks(world: int, rank_main: Callable[[int], None]) -> None:
    """Each rank of a world on a thread of this process (loader tests); a
    rank's exception fails the test."""
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            rank_main(rank)
        except BaseException as error:
            errors.append(error)
            raise

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def worker_of(agent_pid: int) -> int:
    """A training process under the agent `agent_pid` (not a spare: it has a rank)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == agent_pid and any(v.startswith(b"RANK=") for v in environ):
            return int(entry)
    raise AssertionError(f"no worker under agent {agent_pid}")
