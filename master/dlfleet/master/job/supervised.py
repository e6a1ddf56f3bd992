"""The job's master as a child process of its supervisor (`dlmaster
--job-config`), on every platform.

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO

from dlfleet.api.env import TOKEN_ENV
from dlfleet.api.processes import die_with_parent
from dlfleet.master.job.jobconfig import JobConfig

HTTP_LINE = "dlmaster: http on "  # what the master prints before `listening on`


class SupervisedMaster:
    """The job's master as a child process (`dlmaster` in serve mode on the
    job's store), so that a master that crashes can be started again while
    the nodes keep training: the agents reconnect to the same address, and
    the new master continues from the store. Its output goes to `on_line`."""

    def __init__(
        self,
        config: JobConfig,
        *,
        port: int,
        token: str,
        on_line: Callable[[str, str], None],
        python: str = sys.executable,
        http_port: int = 0,
    ) -> None:
        """`http_port`: of the HTTP endpoint when job.yaml has `http` (0 would
        give a restarted master another one)."""
        self.config = config
        self.port = port
        self.http_port = http_port
        self.http_url = ""  # what the master printed
        self.token = token
        self.on_line = on_line
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = -1  # the first start is not a restart
        self.listening = threading.Event()
        # Set once this start's master listens or its output ends (it exited).
        self._settled = threading.Event()
        self.last_line = ""  # of its output: why it exited, when it did
        self.log_dir = config.work_dir / "logs"

    @property
    def address(self) -> str:
        return f"{self.config.master.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def command(self, forget_nodes: bool) -> list[str]:
        """Always with --resume: the job's store is this job's, on purpose (a
        restarted master continues it; a job that failed or was stopped
        resumes from it; one that succeeded got a fresh workdir, see
        `JobRunner`), and a store of another job's name is still refused."""
        config = self.config
        command = [
            self.python, "-u", "-m", "dlfleet.master",
            "--host", config.master.host,
            "--port", str(self.port),
            "--state-store", config.store_url,
            "--resume",
            "--job-name", config.name,
            *config.master_settings.to_argv(),
        ]  # fmt: skip
        if config.tls is not None:
            command += ["--tls-cert", str(config.path(config.tls.cert_file))]
            command += ["--tls-key", str(config.path(config.tls.key_file))]
        if config.http is not None:
            command += ["--http-host", config.http.host, "--http-port", str(self.http_port)]
            if config.http.open_metrics:
                command.append("--http-open-metrics")
        if forget_nodes:
            command.append("--forget-nodes")
        return command

    def start(self, forget_nodes: bool = False) -> None:
        """Start (or start again) the master; `forget_nodes` on a job's first
        start, when the nodes in the store are an earlier run's, all dead."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.restarts += 1
        self.listening.clear()
        self._settled = settled = threading.Event()
        env = {**os.environ, TOKEN_ENV: self.token, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            die_with_parent(self.command(forget_nodes)),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        threading.Thread(
            target=self._pump, args=(self.proc.stdout, settled), name="output-master", daemon=True
        ).start()

    def wait_listening(self, timeout_s: float) -> bool:
        """Whether the master listens within `timeout_s`; False at once when
        it exits first (then `last_line` says why)."""
        self._settled.wait(timeout_s)
        return self.listening.is_set()

    def wait_exit(self, timeout_s: float) -> int | None:
        """Its exit code, once it exits within `timeout_s`; None if it runs."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _pump(self, stream: IO[bytes], settled: threading.Event) -> None:
        try:
            with stream, (self.log_dir / "master.log").open("ab") as log:
                for raw in stream:
                    log.write(raw)
                    log.flush()
                    line = raw.decode(errors="replace").rstrip("\n")
                    if line.startswith(HTTP_LINE):
                        self.http_url = line.removeprefix(HTTP_LINE).strip()
                    if line.startswith("dlmaster: listening on"):
                        self.listening.set()
                        settled.set()
                    if line.strip():
                        self.last_line = line
                    self.on_line("master", line)
        finally:
            settled.set()  # its output ended: it exited
