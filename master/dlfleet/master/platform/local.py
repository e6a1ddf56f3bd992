"""The `local` platform: the job's nodes are `dlworker` processes on this machine.

The platform only starts, stops and watches processes; what an exit means for
the job is the runner's call (job.py). Every node's output (the agent's log
and its training processes' output) goes to `<workdir>/logs/<node>.log` and,
line by line, to the `on_line` callback. Nodes die with the master (parent-
death signal): a master killed and started again resumes the job from its store
with fresh nodes, and never finds a stray one still training.

Not thread-safe; one owner (the runner's event loop) calls it. Reading output
happens on one thread per node, which only calls `on_line`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from dlfleet.api.client import TLS_CA_ENV
from dlfleet.api.processes import die_with_parent
from dlfleet.master.jobconfig import JobConfig

_log = logging.getLogger(__name__)

STOP_GRACE_S = 15.0


class NodeState(enum.Enum):
    STARTING = "starting"  # launched or waiting out its relaunch delay
    RUNNING = "running"
    STOPPING = "stopping"  # asked to leave (scale down or job end)
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # its training failed beyond its restarts
    LOST = "lost"  # it died or lost the job; may be replaced
    STOPPED = "stopped"  # left when asked
    FAULTY = "faulty"  # lost too often: retired and replaced


@dataclass
class LocalNode:
    name: str
    index: int
    relaunches: int = 0
    state: NodeState = NodeState.STARTING
    proc: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    start_at: float = 0.0  # monotonic time at which a pending launch happens
    reader: threading.Thread | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    @property
    def active(self) -> bool:
        return self.state in (NodeState.STARTING, NodeState.RUNNING, NodeState.STOPPING)


@dataclass(frozen=True)
class NodeExit:
    node: LocalNode
    exit_code: int  # Popen's returncode: -N for signal N


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class LocalPlatform:
    def __init__(
        self,
        config: JobConfig,
        *,
        master: str,
        token: str,
        on_line: Callable[[str, str], None] | None = None,
        python: str = sys.executable,
    ) -> None:
        self.config = config
        self.master = master
        self.token = token
        self.on_line = on_line or (lambda node, line: None)
        self.python = python
        self.nodes: list[LocalNode] = []
        self.log_dir = config.work_dir / "logs"

    # ---------------------------------------------------------------- intent

    def start(self, count: int) -> None:
        for _ in range(count):
            self.add_node()

    def add_node(self, delay_s: float = 0.0) -> LocalNode:
        node = LocalNode(name=f"node-{len(self.nodes)}", index=len(self.nodes))
        self.nodes.append(node)
        if delay_s > 0:
            node.start_at = time.monotonic() + delay_s  # poll() launches it
        else:
            self._launch(node)
        return node

    def relaunch(self, node: LocalNode, delay_s: float) -> None:
        """Replace a lost node under the same name (a new incarnation to the
        master) after `delay_s`."""
        node.relaunches += 1
        node.state = NodeState.STARTING
        node.proc = None
        node.exit_code = None
        node.start_at = time.monotonic() + delay_s

    def stop_node(self, node: LocalNode) -> None:
        """Ask a node to leave: its agent stops its workers and leaves the
        round, and the others re-form without it."""
        if node.proc is None:  # not launched yet
            node.state = NodeState.STOPPED
            return
        node.state = NodeState.STOPPING
        self._signal(node, signal.SIGTERM)

    @property
    def active(self) -> list[LocalNode]:
        return [node for node in self.nodes if node.active]

    # ---------------------------------------------------------------- watch

    def poll(self) -> list[NodeExit]:
        """Launch nodes whose relaunch delay is over; report nodes that exited
        since the last poll."""
        exits: list[NodeExit] = []
        now = time.monotonic()
        for node in self.nodes:
            if node.state is NodeState.STARTING and node.proc is None and now >= node.start_at:
                self._launch(node)
            if node.proc is None or node.exit_code is not None:
                continue
            code = node.proc.poll()
            if code is None:
                if node.state is NodeState.STARTING:
                    node.state = NodeState.RUNNING
                continue
            node.exit_code = code
            if node.reader is not None:
                node.reader.join(timeout=2.0)  # its last lines come first
            exits.append(NodeExit(node, code))
        return exits

    def shutdown(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every node still running: SIGTERM, then SIGKILL after `grace_s`."""
        running = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        for node in running:
            self._signal(node, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for node in running:
            assert node.proc is not None
            try:
                node.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(node, signal.SIGKILL)
                node.proc.wait()
        for node in self.nodes:
            if node.reader is not None:
                node.reader.join(timeout=2.0)

    # ------------------------------------------------------------- helpers

    def command(self, node: LocalNode) -> list[str]:
        config = self.config
        nodes = f"{config.nodes.min}:{config.nodes.maximum}"
        command = [
            self.python, "-u", "-m", "dlfleet.worker.agent.loop",
            "--master", self.master,
            "--job-name", config.name,
            "--node-name", node.name,
            "--nnodes", nodes,
            "--nproc-per-node", str(config.nproc_per_node),
            "--max-restarts", str(config.max_restarts),
            "--log-dir", str(self.log_dir / node.name),
            # Copies of the workers' output in files: a failed rank's report
            # then carries the end of its stderr (the traceback).
            "--tee", "3",
        ]  # fmt: skip
        if config.step_timeout_s is not None:
            command += ["--step-timeout", str(config.step_timeout_s)]
        if config.module:
            command.append("--module")
        return [*command, config.script, *config.args]

    def _launch(self, node: LocalNode) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            **self.config.env,
            "DLFLEET_TOKEN": self.token,
            "DLFLEET_WORKDIR": str(self.config.work_dir),
            "PYTHONUNBUFFERED": "1",
        }
        if self.config.tls_ca_file is not None:
            env[TLS_CA_ENV] = str(self.config.tls_ca_file)
        if "OMP_NUM_THREADS" not in env:
            # All nodes share this machine's cores: without a cap, each
            # process's intra-op threads would use every core, and the nodes
            # would slow each other down (three times slower, measured).
            processes = self.config.nodes.maximum * self.config.nproc_per_node
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
        node.state = NodeState.STARTING
        node.exit_code = None
        node.proc = subprocess.Popen(
            die_with_parent(self.command(node)),
            cwd=self.config.base_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a ^C at the terminal reaches the master only
        )
        assert node.proc.stdout is not None
        log_path = self.log_dir / f"{node.name}.log"
        node.reader = threading.Thread(
            target=self._pump,
            args=(node.name, node.proc.stdout, log_path),
            name=f"output-{node.name}",
            daemon=True,
        )
        node.reader.start()
        _log.info("started %s (pid %d)", node.name, node.proc.pid)

    def _pump(self, name: str, stream: IO[bytes], log_path: Path) -> None:
        with stream, log_path.open("ab") as log:
            for raw in stream:
                log.write(raw)
                log.flush()
                self.on_line(name, raw.decode(errors="replace").rstrip("\n"))

    def _signal(self, node: LocalNode, sig: signal.Signals) -> None:
        if node.proc is None or node.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.proc.pid, sig)


class LocalMaster:
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
    ) -> None:
        self.config = config
        self.port = port
        self.token = token
        self.on_line = on_line
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = -1  # the first start is not a restart
        self.listening = threading.Event()
        self.log_dir = config.work_dir / "logs"

    @property
    def address(self) -> str:
        return f"{self.config.master.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def command(self, forget_nodes: bool) -> list[str]:
        config = self.config
        command = [
            self.python, "-u", "-m", "dlfleet.master",
            "--host", config.master.host,
            "--port", str(self.port),
            "--state-store", config.store_url,
            "--job-name", config.name,
            "--lease-timeout", str(config.lease_timeout_s),
            "--heartbeat-interval", str(config.heartbeat.interval_s),
            "--heartbeat-timeout", str(config.heartbeat.timeout_s),
            "--min-nodes", str(config.nodes.min),
            "--max-nodes", str(config.nodes.maximum),
            "--node-unit", str(config.rendezvous.node_unit),
            "--last-call-timeout", str(config.rendezvous.last_call_timeout_s),
            "--join-timeout", str(config.rendezvous.join_timeout_s),
        ]  # fmt: skip
        if config.tls is not None:
            command += ["--tls-cert", str(config.path(config.tls.cert_file))]
            command += ["--tls-key", str(config.path(config.tls.key_file))]
        if forget_nodes:
            command.append("--forget-nodes")
        return command

    def start(self, forget_nodes: bool = False) -> None:
        """Start (or start again) the master; `forget_nodes` on a job's first
        start, when the nodes in the store are an earlier run's, all dead."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.restarts += 1
        self.listening.clear()
        env = {**os.environ, "DLFLEET_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
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
            target=self._pump, args=(self.proc.stdout,), name="output-master", daemon=True
        ).start()

    def wait_listening(self, timeout_s: float) -> bool:
        return self.listening.wait(timeout_s)

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

    def _pump(self, stream: IO[bytes]) -> None:
        with stream, (self.log_dir / "master.log").open("ab") as log:
            for raw in stream:
                log.write(raw)
                log.flush()
                line = raw.decode(errors="replace").rstrip("\n")
                if line.startswith("dlmaster: listening on"):
                    self.listening.set()
                self.on_line("master", line)
