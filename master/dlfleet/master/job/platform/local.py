"""The `local` platform: the job's nodes are `dlworker` processes on this machine.

The platform only starts, stops and watches processes; what an exit means for
the job is the runner's call (`dlfleet.master.job.runner`). Every node's
output (the agent's log and its training processes' output) goes to
`<workdir>/logs/<node>.log` and, line by line, to the `on_line` callback.
Nodes die with the master (parent-death signal): a master killed and started
again resumes the job from its store with fresh nodes, and never finds a stray
one still training.

Not thread-safe; one owner (the runner's event loop) calls it. Reading output
happens on one thread per node, which only calls `on_line`.

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

import contextlib
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

from dlfleet.api.env import TOKEN_ENV, WORKDIR_ENV
from dlfleet.api.processes import die_with_parent
from dlfleet.master.job.jobconfig import JobConfig
from dlfleet.master.job.platform import Node, NodeExit, NodeState, Platform
from dlfleet.master.job.platform.launch import NodeLaunch, node_launch

_log = logging.getLogger(__name__)

STOP_GRACE_S = 15.0


@dataclass
class LocalNode(Node):
    proc: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0


class LocalPlatform(Platform[LocalNode]):
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

    def add_node(self, delay_s: float = 0.0) -> LocalNode:
        node = LocalNode(name=f"node-{len(self.nodes)}", index=len(self.nodes))
        self.nodes.append(node)
        if delay_s > 0:
            node.start_at = time.monotonic() + delay_s  # poll() launches it
        else:
            self._launch(node)
        return node

    def relaunch(self, node: LocalNode, delay_s: float, memory_bytes: int | None = None) -> None:
        """Replace a lost node under the same name (a new incarnation to the
        master) after `delay_s`. Local nodes have no memory limit."""
        node.relaunches += 1
        node.state = NodeState.STARTING
        node.proc = None
        node.exit_code = None
        node.start_at = time.monotonic() + delay_s

    def stop_node(self, node: LocalNode) -> None:
        if node.proc is None:  # not launched yet
            node.state = NodeState.STOPPED
            return
        node.state = NodeState.STOPPING
        self._signal(node, signal.SIGTERM)

    # ---------------------------------------------------------------- watch

    def poll(self) -> list[NodeExit]:
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
        """SIGTERM every node still running, then SIGKILL after `grace_s`."""
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

    def launch(self, node: LocalNode) -> NodeLaunch:
        ca_file = self.config.tls_ca_file
        return node_launch(
            self.config,
            node.name,
            program=[self.python, "-u", "-m", "dlfleet.worker.agent.loop"],
            master=self.master,
            ca_file=None if ca_file is None else str(ca_file),
            # Copies of the workers' output in files: a failed rank's report
            # then carries the end of its stderr (the traceback).
            flags=["--log-dir", str(self.log_dir / node.name), "--tee", "3"],
        )

    def log_hint(self, node: LocalNode) -> str:
        return f"see {self.log_dir / (node.name + '.log')}"

    def _launch(self, node: LocalNode) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        launch = self.launch(node)
        env = {
            **os.environ,
            **self.config.env,
            **launch.env,
            TOKEN_ENV: self.token,
            WORKDIR_ENV: str(self.config.work_dir),
        }
        if "OMP_NUM_THREADS" not in env:
            # All nodes share this machine's cores: without a cap, each
            # process's intra-op threads would use every core, and the nodes
            # would slow each other down (three times slower, measured).
            processes = self.config.nodes.maximum * self.config.nproc_per_node
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
        node.state = NodeState.STARTING
        node.exit_code = None
        node.proc = subprocess.Popen(
            die_with_parent(launch.argv),
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
