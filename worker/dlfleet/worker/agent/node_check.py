"""The agent's side of the pre-flight node check (SPEC section 11).

Before the node first joins, `run_check` begins its check with the master and
runs the check process (`python -m dlfleet.worker.nodecheck`; the agent never
imports torch), which measures what the master orders until its verdict. A
check process that crashes, or outlives `CHECK_TIMEOUT_STEPS` x the master's
step timeout, is killed and reported to the master as this node's failed
check: the node is faulty either way.

On every node, `CheckHelper` runs the pairs the master pushes on the session
for late nodes' checks (a replacement pairs with a node past its check), one
at a time, on a thread of its own, whatever the node is doing meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dlfleet.api.client import AgentSession, MasterClient
from dlfleet.api.env import TOKEN_ENV
from dlfleet.api.errors import DlfleetError, StaleError, Unavailable
from dlfleet.api.processes import die_with_parent
from dlfleet.api.v1 import nodecheck_pb2
from dlfleet.worker.nodecheck import EXIT_FAULTY, EXIT_HEALTHY, EXIT_LOST, MODULE

_log = logging.getLogger("dlworker")

# The master ends every step of a check within its step timeout, so its
# verdict comes long before this; this only bounds a check process stuck
# where the master cannot see (or a master that went away for good).
CHECK_TIMEOUT_STEPS = 10
HELPER_GRACE_S = 30.0  # a helper's start-up and report, beyond its pair's timeout


@dataclass(frozen=True)
class CheckOutcome:
    healthy: bool
    reason: str
    lost: bool = False  # the master could not be reached: the node lost the job


def run_check(
    client: MasterClient,
    *,
    token: str,
    node_id: str,
    incarnation: int,
    host: str,
    log_dir: Path,
    stop: threading.Event,
) -> CheckOutcome | None:
    """This node's check, to its verdict; None when `stop` was set first."""
    try:
        begun = client.node_check_begin(node_id, incarnation, host)
    except (Unavailable, StaleError) as error:
        return CheckOutcome(False, f"could not begin its node check: {error}", lost=True)
    except DlfleetError as error:  # a master without the NodeCheck service
        _log.warning("node check skipped: the master does not run it (%s)", error)
        return CheckOutcome(True, "skipped: the master does not run node checks")
    started = time.monotonic()
    log_dir.mkdir(parents=True, exist_ok=True)
    result = log_dir / "node-check.json"
    result.unlink(missing_ok=True)
    command = [
        sys.executable, "-u", "-m", MODULE,
        "--master", client.target,
        "--node-id", node_id,
        "--incarnation", str(incarnation),
        "--host", host,
        "--check-id", begun.check_id,
        "--result", str(result),
    ]  # fmt: skip
    proc = subprocess.Popen(die_with_parent(command), env={**os.environ, TOKEN_ENV: token})
    _log.info("node check: begun (check %s), its process is %d", begun.check_id, proc.pid)
    limit_s = CHECK_TIMEOUT_STEPS * begun.step_timeout_ms / 1000
    code = _wait(proc, limit_s, stop)
    took = time.monotonic() - started
    if code is None and stop.is_set():
        return None
    if code == EXIT_LOST:
        return CheckOutcome(False, "its check process lost the master", lost=True)
    if code in (EXIT_HEALTHY, EXIT_FAULTY):
        reason = _verdict_reason(result)
        _log.info("node check: %s after %.1fs: %s",
                  "healthy" if code == EXIT_HEALTHY else "faulty", took, reason)  # fmt: skip
        return CheckOutcome(code == EXIT_HEALTHY, reason)
    why = (
        f"its check process did not finish within {limit_s:g}s"
        if code is None
        else f"its check process ended with exit code {code}"
    )
    _report_failed(client, node_id, incarnation, begun.check_id, why)
    return CheckOutcome(False, why)


def _wait(proc: subprocess.Popen[bytes], limit_s: float, stop: threading.Event) -> int | None:
    """The exit code, or None (the process killed) past `limit_s` or on `stop`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not stop.is_set():
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    proc.wait()
    return None


def _verdict_reason(path: Path) -> str:
    try:
        return str(json.loads(path.read_text())["reason"])
    except (OSError, ValueError, KeyError):
        return "(no verdict file)"


def _report_failed(
    client: MasterClient, node_id: str, incarnation: int, check_id: str, why: str
) -> None:
    report = nodecheck_pb2.NodeCheckReport(
        node_id=node_id, incarnation=incarnation, check_id=check_id, failed=why
    )
    try:
        client.node_check_next(report, timeout_s=10.0)
    except DlfleetError as error:
        _log.warning("could not report the failed node check: %s", error)


class CheckHelper:
    """Runs the pairs pushed on `session.check_pairs`, one at a time."""

    def __init__(
        self, session: AgentSession, *, master: str, token: str, node_id: str, incarnation: int
    ) -> None:
        self.session = session
        self.master = master
        self.token = token
        self.node_id = node_id
        self.incarnation = incarnation
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="node-check-helper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5.0)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                order = self.session.check_pairs.get(timeout=0.2)
            except queue.Empty:
                continue
            _log.info("node check: running pair %d with late node %s", order.pair, order.peer)
            command = [
                sys.executable, "-u", "-m", MODULE,
                "--master", self.master,
                "--node-id", self.node_id,
                "--incarnation", str(self.incarnation),
                "--helper-pair", order.SerializeToString().hex(),
            ]  # fmt: skip
            env = {**os.environ, TOKEN_ENV: self.token}
            proc = subprocess.Popen(die_with_parent(command), env=env)
            code = _wait(proc, order.timeout_ms / 1000 + HELPER_GRACE_S, self._closed)
            if code != EXIT_HEALTHY:
                _log.warning("node check: the helper pair %d ended with %s", order.pair, code)
