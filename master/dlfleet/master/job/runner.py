"""`dlmaster --job-config job.yaml`: run a whole job to its end.

The runner is the job's supervisor: it starts the master as a child process
(`dlmaster` serve mode on the job's store, on a port fixed for the run) and
starts it again at once if it dies, so that the nodes keep training through a
master crash and reconnect to the same address; it starts the nodes (the
platform), serves the Job service (status, scale) on a port of its own, and
asks the master how the job stands. Killed itself, it takes the master and
the nodes with it (parent-death signal); run again, the job resumes from the
store. Every `POLL_S` it looks at the nodes that exited and decides:

- exit 0: the node's workers finished (or it left when asked to);
- exit 1: its training failed beyond `max_restarts`: the job fails, and the
  reason names the node, the rank and the worker's traceback (the agent's
  failure report);
- killed by a signal, exit 3 (the node lost the job: master unreachable,
  dropped for silence, rendezvous timed out) or exit 143 (preempted: SIGTERM
  from outside, unless the runner itself asked it to leave): the node is lost. It is replaced
  after `relaunch_delay_s` while the job's `max_node_relaunches` last and the
  job wants it (target nodes); with none left, the job goes on with the nodes
  it has while they are at least `nodes.min`, and fails otherwise. A node lost
  `FAULTY_AFTER_LOSSES` times is marked faulty and replaced by a fresh node
  (a new name: on a cluster, another host) instead of relaunched again;
- exit 4 (its agent diagnosed a hardware fault: dlfleet.api.diagnosis) or 6
  (its pre-flight node check found it slow or broken, before it trained):
  marked faulty and replaced by a fresh node at once, while the job's
  relaunches last, the reason (the rule, the numbers) logged; exit 5 (a worker
  killed for memory): relaunched as an out-of-memory node is, with more memory
  where the platform sets limits;
- anything else (2: dlworker refused its flags): the job fails.

The job succeeds when no node is active any more and at least one succeeded.
`Scale` (the Job RPC, `dlmaster scale`) changes the target: new nodes are
started, or the newest ones are asked to leave (SIGTERM: they stop their
workers and leave the round, and the rest re-form at once).

What an exit, a suspect, a new target or an empty job means is the policy's
call (`dlfleet.master.job.policy`, pure); the runner gathers the facts,
asks, and carries the answer out. What it holds about the job is one
`JobState` (`dlfleet.master.job.states`). The master, its client, the
platform and the brain link are built by a `Wiring` (production by
default), so a test can hand the runner fakes.

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import time
from typing import Any

import grpc

from dlfleet.api.errors import DlfleetError, InvalidArgument
from dlfleet.api.serving.answers import rpc
from dlfleet.api.serving.ports import Endpoint, check_port_free
from dlfleet.api.serving.tls import TlsPair, load_tls_pair, server_credentials
from dlfleet.api.serving.tokens import AsyncTokenCheck
from dlfleet.api.status_document import samples_per_second
from dlfleet.api.v1 import job_pb2, job_pb2_grpc, rendezvous_pb2
from dlfleet.api.v1.nodecheck_pb2 import NodeCheckVerdict
from dlfleet.brain import PlanKind
from dlfleet.master.job.brain_link import BrainLink
from dlfleet.master.job.crd import KIND
from dlfleet.master.job.display import Display
from dlfleet.master.job.jobconfig import JobConfig
from dlfleet.master.job.platform import Node, NodeState, Platform, describe_exit
from dlfleet.master.job.platform.resource_link import ResourceLink, fields
from dlfleet.master.job.policy import (
    ActiveNode,
    DlworkerFailed,
    ExitAction,
    FailJob,
    Fault,
    Faulty,
    Finished,
    GoOnWithout,
    IgnoreSuspect,
    KeepSuspect,
    LeftAsAsked,
    Loss,
    Lost,
    NodeEnd,
    Relaunch,
    ReplaceFresh,
    Retired,
    RetireSuspect,
    ScaleRefused,
    TrainingFailed,
    decide_end,
    decide_exit,
    decide_suspect,
    failed_node_check,
    is_loss,
    node_state_after,
    plan_scale,
)
from dlfleet.master.job.states import JobResult, JobState
from dlfleet.master.job.tally import SupervisorTally, exit_reason
from dlfleet.master.job.wiring import PRODUCTION, MasterProcess, MasterStatusClient, Wiring

_log = logging.getLogger(__name__)

POLL_S = 0.2
LINK_S = 2.0  # how often a DLFleetJob's status is written and its spec read
MASTER_FILE = "master.json"
STOP_GRACE_S = 15.0
MASTER_START_S = 60.0
EXIT_SEEN_S = 5.0  # from a master's output ending to its exit code
MAX_MASTER_RESTARTS = 10
RESULT_FILE = "result.json"
PREVIOUS_RUN = ".previous"


def token_source(config: JobConfig) -> str:
    """Where the job token is, in words (never the token itself)."""
    if config.token is not None:
        return "the token in job.yaml"
    if config.token_file is not None:
        return f"the token in {config.path(config.token_file)}"
    return f"the token in {config.work_dir / 'token'}"


def job_token(config: JobConfig) -> str:
    """The token from the config, or the job's own: generated once, kept in
    the workdir (mode 0600) so a restarted master and `dlmaster scale` agree."""
    if config.token is not None:
        return config.token
    if config.token_file is not None:
        return config.path(config.token_file).read_text().strip()
    path = config.work_dir / "token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token


def _free_port(host: str) -> int:
    """A port for the master, fixed for the job's run: a restarted master must
    come back on the address the nodes know."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class JobRunner:
    def __init__(
        self,
        config: JobConfig,
        display: Display,
        wiring: Wiring = PRODUCTION,
        poll_s: float = POLL_S,
    ) -> None:
        self.config = config
        self.display = display
        self.wiring = wiring
        self.poll_s = poll_s
        self.state = JobState(config.nodes.start, config.max_node_relaunches)
        self.master: MasterProcess | None = None
        self.client: MasterStatusClient | None = None
        self.view = job_pb2.MasterStatus()  # the master's last answer
        self.master_up = False
        self.control: grpc.aio.Server | None = None
        self.platform: Platform[Any] | None = None
        self.brain: BrainLink | None = None
        self.tally = SupervisorTally()  # for the master's /metrics
        # The latest node check verdict of each node (by name), as the master
        # gave it: kept here, where a master restart does not forget it.
        self.checks: dict[str, NodeCheckVerdict] = {}
        self._suspects_seen: set[str] = set()
        self._interrupted = asyncio.Event()
        # The DLFleetJob this run is for (None: run from a job.yaml), when its
        # status was last written, and the nodes its spec last asked for.
        self.link: ResourceLink | None = None
        self._linked_at = float("-inf")
        self._linked_phase: str | None = None
        self._last_round = 0
        self._spec_nodes: int | None = None
        # Events for that resource, not sent yet: (warning, reason, message);
        # and the worker failures already told.
        self._events: list[tuple[bool, str, str]] = []
        self._failures_seen: set[tuple[str, int, int, int]] = set()

    # ------------------------------------------------------------------ run

    async def run(self) -> JobResult:
        """The job, to its end. `PortInUse` before anything starts when a port
        job.yaml fixes is taken."""
        config = self.config
        check_port_free(Endpoint.GRPC, config.master.host, config.master.port)
        if config.http is not None:
            check_port_free(Endpoint.HTTP, config.http.host, config.http.port)
        self._set_aside_finished_run()
        config.work_dir.mkdir(parents=True, exist_ok=True)
        token = job_token(config)
        port = config.master.port or _free_port(config.master.host)
        http = config.http
        http_port = (http.port or _free_port(http.host)) if http is not None else 0
        self.master = self.wiring.master(config, port, token, self.display.line, http_port)
        tls_ca = config.tls_ca_file.read_bytes() if config.tls_ca_file else None
        self.client = self.wiring.client(self.master.address, token, tls_ca)
        try:
            # Local nodes died with the last runner: the nodes in the store are
            # all dead. Pods outlive it, and the new runner adopts them.
            self.master.start(forget_nodes=self.config.platform == "local")
            if not await asyncio.to_thread(self.master.wait_listening, MASTER_START_S):
                log = self.master.log_dir / "master.log"
                code = await asyncio.to_thread(self.master.wait_exit, EXIT_SEEN_S)
                if code is None:
                    raise DlfleetError(
                        f"the master did not start within {MASTER_START_S:g}s; see {log}"
                    )
                raise DlfleetError(
                    f"the master exited ({describe_exit(code)}) before it listened: "
                    f"{self.master.last_line}; see {log}"
                )
            control = await self._serve_control(token)
            self._write_master_file(control)
            _log.info("job %s: master on %s, control on %s, workdir %s", config.name,
                      self.master.address, control, config.work_dir)  # fmt: skip
            if self.master.http_url:
                # The token itself is never printed: the link names its file.
                _log.info("job %s: dashboard, metrics and status on %s; "
                          "log in at %s/login?token=<%s>",
                          config.name, self.master.http_url, self.master.http_url,
                          token_source(config))  # fmt: skip
            self.platform = self.wiring.platform(config, self.master, token, self.display.line)
            self.link = self.wiring.resource(config, self.platform)
            self.brain = self.wiring.brain(config, token, self.tally)
            await asyncio.to_thread(self.brain.open)
            target = await asyncio.to_thread(self.brain.initial_nodes, self.state.target)
            self.state = self.state.scaled(target)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._interrupted.set)
            self.platform.start(self.state.target)
            await self._supervise()
            return await self._conclude()
        finally:
            await self._teardown()

    async def _supervise(self) -> None:
        """Watch the master and the nodes until the job ends."""
        while not self.state.ended:
            await self._refresh()
            self._watch_master()
            self._step()
            self._consult_brain()
            await self._mirror()
            await self._record_events()
            self.display.update(self.status())
            if self.state.ended:
                break
            try:
                await asyncio.wait_for(self._interrupted.wait(), self.poll_s)
                self._finish(130, "interrupted: stopping the job's nodes")
            except asyncio.TimeoutError:
                pass

    async def _conclude(self) -> JobResult:
        result = self.state.result
        assert result is not None and self.platform is not None
        self.state = self.state.conclude()
        if result.code != 130 or not self.platform.outlives_runner:
            await asyncio.to_thread(self.platform.shutdown, STOP_GRACE_S)
        await self._refresh()
        self.display.update(self.status())
        if result.code == 0:
            self._say("Succeeded", f"job {self.config.name} succeeded: {result.reason}", False)
        elif result.code != 130:
            self._say("Failed", f"job {self.config.name} failed: {result.reason}")
        await self._mirror(final=True)
        await self._record_events()
        if result.code != 130:
            ended = {"code": result.code, "reason": result.reason}
            (self.config.work_dir / RESULT_FILE).write_text(json.dumps(ended))
        return result

    async def _teardown(self) -> None:
        """Stop what the run started. Nodes that outlive the runner (Pods)
        stay when it was interrupted: its successor adopts them."""
        result = self.state.result
        if self.brain is not None:
            code = result.code if result is not None else None
            await asyncio.to_thread(self.brain.close, None if code == 130 else code)
        interrupted = result is None or result.code == 130
        if self.platform is not None and not (interrupted and self.platform.outlives_runner):
            self.platform.shutdown(grace_s=1.0)
        if self.master is not None:
            await asyncio.to_thread(self.master.stop)
        if self.client is not None:
            self.client.close()
        if self.control is not None:
            await self.control.stop(0)
        (self.config.work_dir / MASTER_FILE).unlink(missing_ok=True)

    async def _refresh(self) -> None:
        """Ask the master how the job stands; while it is down, the last
        answer stands."""
        assert self.client is not None
        if self.master is not None:
            self.tally.master_restarts = max(0, self.master.restarts)
        try:
            self.view = await asyncio.to_thread(
                self.client.master_status, self.tally.to_wire(), self.status()
            )
            self.master_up = True
        except DlfleetError:
            self.master_up = False
        self._note_checks()
        self._note_suspects()
        self._note_failures()

    async def _mirror(self, final: bool = False) -> None:
        """Every LINK_S, and at once when the phase changes (Running,
        Restarting), write the job's figures into its DLFleetJob's status;
        every LINK_S, scale to what its spec.nodes asks for, if that changed.
        `final`: the figures as the job ended, at once."""
        link, now = self.link, time.monotonic()
        if link is None:
            return
        config = self.config
        job = self.status()
        self._last_round = max(self._last_round, job.round)
        status = fields(job, config.nodes.min, config.nodes.maximum, self._last_round)
        due = now - self._linked_at >= LINK_S
        if not (due or final or status.get("phase") != self._linked_phase):
            return
        self._linked_phase = status.get("phase")
        await asyncio.to_thread(link.publish, status)
        if final or not due:
            return
        self._linked_at = now
        wanted = await asyncio.to_thread(link.wanted_nodes)
        if wanted is None or wanted == self._spec_nodes:
            return
        first, self._spec_nodes = self._spec_nodes is None, wanted
        if first or wanted == self.state.target:
            return
        try:
            previous = self.scale(wanted)
            self._say("Scaled", f"{KIND} {config.name}: spec.nodes asks for {wanted} nodes "
                      f"(was {previous})", warning=False)  # fmt: skip
        except InvalidArgument as exc:
            _log.warning("%s %s: spec.nodes asks for %d nodes: %s", KIND, config.name,
                         wanted, exc)  # fmt: skip

    def _note_checks(self) -> None:
        for verdict in self.view.node_checks:
            name = verdict.node_id.rpartition("#")[0]
            known = self.checks.get(name)
            if known is None or known.at_ms < verdict.at_ms:
                self.checks[name] = verdict
                if self.brain is not None:
                    self.brain.node_checked(name, verdict)

    def _note_suspects(self) -> None:
        """A node the network failures of the others keep pointing at
        (dlfleet.master.core.suspicion) is retired and replaced by a fresh one,
        while relaunches last; without one it stays (a flaky node is better
        than none)."""
        if self.platform is None or self.state.ended:
            return
        for suspect in self.view.network_suspects:
            if suspect.node_id in self._suspects_seen:
                continue
            self._suspects_seen.add(suspect.node_id)
            name = suspect.node_id.rpartition("#")[0]
            running = [n for n in self.platform.active if n.name == name]
            is_running = bool(running) and running[0].state is NodeState.RUNNING
            match decide_suspect(suspect.reason, is_running, self.state):
                case IgnoreSuspect():
                    continue
                case KeepSuspect():
                    _log.warning(
                        "%s is suspect (%s), but no relaunch is left to replace it",
                        name, suspect.reason,
                    )  # fmt: skip
                case RetireSuspect(why=why, relaunches_left=left):
                    fresh = self._retire_suspect(running[0], why, left)
                    self._say(
                        "NodeReplaced",
                        f"{name}: {suspect.reason}: retiring it, replaced by {fresh.name} "
                        f"({left} relaunches left)",
                    )

    def _retire_suspect(self, node: Node, why: str, relaunches_left: int) -> Node:
        """Stop it (marked faulty when it exits); the fresh node in its place."""
        assert self.platform is not None
        self.state = self.state.spent(relaunches_left).retire(node.name, why)
        self.platform.stop_node(node)
        if node.state is NodeState.STOPPED:  # it had no process: retired at once
            self.state = self.state.retired(node.name)
            node.state, node.detail = NodeState.FAULTY, why
        fresh: Node = self.platform.add_node()
        return fresh

    def _watch_master(self) -> None:
        """A master that died is started again at once, on the same address
        and store: the nodes keep training and reconnect to it."""
        assert self.master is not None
        code = self.master.poll()
        if code is None:
            return
        if self.master.restarts >= MAX_MASTER_RESTARTS:
            why = f"the master died ({describe_exit(code)}) after {self.master.restarts} restarts"
            self._finish(1, f"{why}; see {self.master.log_dir / 'master.log'}")
            return
        _log.warning("the master died (%s): starting it again", describe_exit(code))
        self.master.start()

    async def _serve_control(self, token: str) -> str:
        """The Job service (status, scale) on a port of its own: it must stay
        up while the master restarts."""
        server = grpc.aio.server(interceptors=[AsyncTokenCheck(token)])
        job_pb2_grpc.add_JobServicer_to_server(JobService(self), server)
        host = self.config.master.host
        address = f"{host}:0"
        tls = self._tls_pair()
        if tls is not None:
            port = server.add_secure_port(address, server_credentials(tls))
        else:
            port = server.add_insecure_port(address)
        await server.start()
        self.control = server
        return f"{host}:{port}"

    def _set_aside_finished_run(self) -> None:
        """A job that succeeded is done: running it again starts it afresh,
        with the last run's workdir kept as `<workdir>.previous`. A job that
        failed or was interrupted resumes from its store and checkpoints."""
        config = self.config
        try:
            ended = json.loads((config.work_dir / RESULT_FILE).read_text())
        except (OSError, ValueError):
            return
        if ended.get("code") != 0:
            (config.work_dir / RESULT_FILE).unlink()
            return
        if config.state_store is not None:
            raise InvalidArgument(
                f"job {config.name} already succeeded, and its state store {config.state_store} "
                f"holds the finished job: give the new run a new store, or remove "
                f"{config.work_dir / RESULT_FILE} to resume the finished job"
            )
        previous = config.work_dir.with_name(config.work_dir.name + PREVIOUS_RUN)
        if previous.exists():
            shutil.rmtree(previous)
        config.work_dir.rename(previous)
        _log.info("job %s succeeded before; starting afresh (last run kept in %s)",
                  config.name, previous)  # fmt: skip

    def _tls_pair(self) -> TlsPair | None:
        tls = self.config.tls
        if tls is None:
            return None
        return load_tls_pair(self.config.path(tls.cert_file), self.config.path(tls.key_file))

    def _step(self) -> None:
        assert self.platform is not None
        for exited in self.platform.poll():
            self._on_exit(exited.node, exited.exit_code, exited.reason)
            if self.state.ended:
                return
        problem = self.platform.problem()
        if problem is not None:
            self._finish(1, problem)
            return
        succeeded = any(n.state is NodeState.SUCCEEDED for n in self.platform.nodes)
        ended = decide_end(len(self.platform.active), succeeded)
        if ended is not None:
            self._finish(ended.code, ended.reason)

    def _consult_brain(self) -> None:
        """Report what the master sees; carry out a plan that came back (in
        `auto` mode; in `advise` mode it is only shown)."""
        assert self.platform is not None
        if self.brain is None or self.state.ended:
            return
        self.brain.observe(self.view, self.platform.nodes)
        memory = next((n.memory_bytes for n in self.platform.active if n.memory_bytes), None)
        plan = self.brain.poll_plan(self.state.target, memory)
        if plan is None:
            return
        if self.brain.mode != "auto":
            self.brain.applied(plan, False)
            return
        if plan.kind is PlanKind.SCALE:
            try:
                self.scale(plan.target_nodes)
            except InvalidArgument as error:
                self.brain.applied(plan, False, f"not done: {error}")
                return
            self.brain.applied(plan, True)
        elif plan.kind is PlanKind.REPLACE_NODE:
            slow = [n for n in self.platform.active if n.name == plan.node]
            if not slow or slow[0].state is not NodeState.RUNNING:
                self.brain.applied(plan, False, f"not done: {plan.node} is not running")
                return
            self.platform.stop_node(slow[0])
            fresh = self.platform.add_node()
            self._say("NodeReplaced", f"brain: replacing straggler {plan.node} by {fresh.name}")
            self.brain.applied(plan, True)
        else:
            self.brain.applied(plan, False, "kept for the next relaunch")

    def _on_exit(self, node: Node, code: int, reason: str = "") -> None:
        """Tell the tally and the brain, ask the policy, and do what it says."""
        assert self.platform is not None
        asked_to_leave = node.state is NodeState.STOPPING
        self.tally.node_exit(exit_reason(code, reason, asked_to_leave))
        checked = failed_node_check(code, reason)
        check_failure = self._check_failure(node) if checked else ""
        if self.brain is not None and not asked_to_leave and code != 0:
            if checked:
                self.brain.node_check_failed(node, check_failure)
            else:
                self.brain.node_ended(node, code, reason, is_loss(code, reason))
        end = NodeEnd(node.name, code, reason, asked_to_leave, node.relaunches)
        others = sum(1 for other in self.platform.active if other is not node)
        action = decide_exit(
            end,
            self.state,
            active=others,
            nodes_min=self.config.nodes.min,
            relaunch_delay_s=self.config.relaunch_delay_s,
        )
        node.state = node_state_after(action)
        self._carry_out(node, action, check_failure)

    def _carry_out(self, node: Node, action: ExitAction, check_failure: str) -> None:
        """The policy's answer to `node`'s exit, done: the words are the
        ones users and tests read (and, for a DLFleetJob, its events')."""
        assert self.platform is not None
        match action:
            case Finished():
                _log.info("%s finished", node.name)
            case LeftAsAsked(how=how):
                _log.info("%s left as asked (%s)", node.name, how)
            case Retired(how=how, why=why):
                self.state = self.state.retired(node.name)
                node.detail = why
                self._say("NodeRetired", f"{node.name} retired ({how}): {why}")
            case TrainingFailed(how=how):
                self._finish(1, self._root_cause(node, how))
            case DlworkerFailed(how=how):
                hint = self.platform.log_hint(node)
                self._finish(1, f"{node.name}: dlworker ended with {how}; {hint}")
            case Relaunch(lost=lost, delay_s=delay, grow_memory=grow, relaunches_left=left):
                self.state = self.state.spent(left)
                self.tally.node_relaunches += 1
                self._say(
                    "NodeLost",
                    f"{node.name} was lost ({lost.how}): relaunching it in {delay:.1f}s "
                    f"({left} relaunches left)",
                )
                memory = self._memory_after(node) if grow else None
                self.platform.relaunch(node, delay, memory_bytes=memory)
            case ReplaceFresh(loss=Lost() as lost, delay_s=delay, relaunches_left=left):
                self.state = self.state.spent(left)
                self.tally.node_relaunches += 1
                fresh = self.platform.add_node(delay_s=delay)
                self._say(
                    "NodeReplaced",
                    f"{node.name} was lost {lost.times} times (last: {lost.how}): marked "
                    f"faulty, replaced by {fresh.name} ({left} relaunches left)",
                )
            case ReplaceFresh(loss=Faulty(fault=fault), relaunches_left=left):
                why = self._fault_words(node, fault, check_failure)
                self.state = self.state.spent(left)
                fresh = self.platform.add_node()
                self._say(
                    "NodeReplaced",
                    f"{node.name}: {why}: marked faulty, replaced at once by {fresh.name} "
                    f"({left} relaunches left)",
                )
            case GoOnWithout(loss=Lost(how=how), active=active):
                self._say("NodeLost", f"{node.name} was lost ({how}); going on with {active} nodes")
            case GoOnWithout(loss=Faulty(fault=fault), active=active):
                why = self._fault_words(node, fault, check_failure)
                self._say(
                    "NodeFaulty", f"{node.name}: {why}: marked faulty; going on with {active} nodes"
                )
            case FailJob(loss=loss, active=active):
                self._finish(1, self._too_few(node, loss, active, check_failure))

    def _say(self, reason: str, message: str, warning: bool = True) -> None:
        """Log `message`, and record it as an event on the job's DLFleetJob."""
        (_log.warning if warning else _log.info)("%s", message)
        if self.link is not None:
            self._events.append((warning, reason, message))

    async def _record_events(self) -> None:
        """Send the events `_say` queued (off the loop: they are API calls)."""
        link, events = self.link, self._events
        if link is None or not events:
            return
        self._events = []
        for warning, reason, message in events:
            await asyncio.to_thread(link.event, warning, reason, message)

    def _note_failures(self) -> None:
        """A worker failure the master heard of, as an event on the DLFleetJob."""
        if self.link is None:
            return
        for report in self.view.failures:
            key = (report.node_id, report.round, report.local_rank, report.restart_count)
            if key in self._failures_seen:
                continue
            self._failures_seen.add(key)
            how = f"signal {report.signal}" if report.signal else f"exit code {report.exit_code}"
            then = "restarting" if report.restarting else "not restarted"
            rule = f", rule {report.rule}" if report.rule else ""
            first = report.message.strip().splitlines()[0] if report.message.strip() else ""
            self._events.append(
                (
                    True,
                    "WorkerFailed",
                    f"{report.node_id.rpartition('#')[0]} local rank {report.local_rank} "
                    f"failed ({how}) in round {report.round}: {then} "
                    f"({report.category or 'unknown'}{rule}){': ' + first if first else ''}",
                )
            )

    def _too_few(self, node: Node, loss: Loss, active: int, check_failure: str) -> str:
        """Why the job fails when a node is out with no relaunch to replace it."""
        max_relaunches = self.config.max_node_relaunches
        remain = f"{active} nodes remain, fewer than nodes.min={self.config.nodes.min}"
        if isinstance(loss, Lost):
            return (
                f"{node.name} was lost ({loss.how}) and no relaunch is left "
                f"(max_node_relaunches={max_relaunches}); {remain}"
            )
        why = self._fault_words(node, loss.fault, check_failure)
        return (
            f"{node.name}: {why}, and no relaunch is left to replace it "
            f"(max_node_relaunches={max_relaunches}); {remain}"
        )

    def _fault_words(self, node: Node, fault: Fault, check_failure: str) -> str:
        """Why `node` was marked faulty, in words: the node check's verdict,
        or the rule its agent's diagnosis named."""
        if fault is Fault.NODE_CHECK:
            return check_failure
        report = self._last_failure(node.name, refresh=True)  # it came before its exit
        rule = f" (rule {report.rule})" if report is not None and report.rule else ""
        return f"its agent diagnosed a hardware fault{rule}"

    def _check_failure(self, node: Node) -> str:
        """Why `node` failed its node check, in words, with the numbers."""
        self._refresh_now()  # its verdict came before its exit
        verdict = self.checks.get(node.name)
        if verdict is None or not verdict.faulty:
            return "failed its pre-flight node check"
        return f"failed its pre-flight node check (rule {verdict.rule}): {verdict.reason}"

    def _refresh_now(self) -> None:
        """The master's view, at once (from the event loop: a short call)."""
        if self.client is not None:
            with contextlib.suppress(DlfleetError):
                self.view = self.client.master_status()
            self._note_checks()

    def _memory_after(self, node: Node) -> int | None:
        """The memory limit for a node relaunched after running out of it:
        the current limit times the job's factor, capped. None where the
        platform sets no limit."""
        if node.memory_bytes is None or self.config.kubernetes is None:
            return None
        policy = self.config.kubernetes.oom
        planned = self.brain.memory_after_oom(node, self.state.target) if self.brain else None
        grown = planned or int(node.memory_bytes * policy.memory_factor)
        grown = min(grown, policy.memory_cap_bytes)
        _log.warning(
            "%s ran out of memory at %d MiB: relaunching it with %d MiB",
            node.name, node.memory_bytes >> 20, grown >> 20,
        )  # fmt: skip
        return max(grown, node.memory_bytes)

    def _root_cause(self, node: Node, how: str) -> str:
        """The last failure its agent reported: rank, exit, traceback."""
        assert self.platform is not None
        report = self._last_failure(node.name, refresh=True)  # it came before its exit
        hint = self.platform.log_hint(node)
        if report is None:
            return f"{node.name}: its workers failed ({how}); {hint}"
        what = report.signal or f"exit code {report.exit_code}"
        if report.action == "fail_job":
            why = (
                f"diagnosed {report.category} (rule {report.rule}): not restarted, "
                f"restarting cannot help"
            )
        else:
            why = f"after {report.restart_count} restarts (max_restarts={self.config.max_restarts})"
        return (
            f"{node.name}: rank {report.global_rank} (local rank {report.local_rank}) failed "
            f"with {what} in round {report.round}, {why}:\n{report.message.rstrip()}\n"
            f"({hint})"
        )

    def _last_failure(
        self, node_name: str | None = None, refresh: bool = False
    ) -> rendezvous_pb2.FailureReport | None:
        if refresh:
            self._refresh_now()
        for report in reversed(self.view.failures):
            if node_name is None or report.node_id.rpartition("#")[0] == node_name:
                return report
        return None

    def _finish(self, code: int, reason: str) -> None:
        self.state = self.state.finish(code, reason)

    # ---------------------------------------------------------------- scale

    def scale(self, nodes: int) -> int:
        """Set the target number of nodes; returns the previous target."""
        assert self.platform is not None
        active = self.platform.active
        seen = [ActiveNode(n.name, n.index, n.state is NodeState.STOPPING) for n in active]
        config = self.config
        plan = plan_scale(nodes, self.state, seen, config.nodes.min, config.nodes.maximum)
        if isinstance(plan, ScaleRefused):
            raise InvalidArgument(plan.message)
        previous, self.state = self.state.target, self.state.scaled(plan.target)
        for _ in range(plan.start):
            node = self.platform.add_node()
            _log.info("scale to %d: started %s", nodes, node.name)
        by_name = {node.name: node for node in active}
        for name in plan.leave:
            _log.info("scale to %d: asking %s to leave", nodes, name)
            self.platform.stop_node(by_name[name])
        return previous

    # --------------------------------------------------------------- status

    def status(self) -> job_pb2.JobStatus:
        view = self.view
        status = job_pb2.JobStatus(
            job_name=self.config.name,
            phase=self.state.phase.value,
            target_nodes=self.state.target,
            reason=self.state.reason,
            eta_seconds=-1,
            round=view.round,
            world_size=view.world_size,
            datasets=view.datasets,
            master_up=self.master_up,
            last_plan=self.brain.last_plan if self.brain is not None else "",
        )
        if self.master is not None:
            status.http_url = self.master.http_url
            status.master_pid = self.master.pid
            status.master_restarts = max(0, self.master.restarts)
        if self.platform is not None:
            reports = {r.node_id.rpartition("#")[0]: r for r in view.nodes}
            for node in self.platform.nodes:
                entry = job_pb2.NodeStatus(
                    name=node.name,
                    state=node.state.value,
                    pid=node.pid,
                    relaunches=node.relaunches,
                    detail=node.detail,
                    memory_bytes=node.memory_bytes or 0,
                )
                report = reports.get(node.name)
                if report is not None and node.active:
                    entry.node_id = report.node_id
                    entry.metrics.CopyFrom(report.metrics)
                if node.name in self.checks:
                    entry.check.CopyFrom(self.checks[node.name])
                status.nodes.append(entry)
        # What the nodes train now, as the master's status sums it too: a rate
        # taken from records done over a window would count the start-up in
        # it (the job's first seconds train nothing) and lag every change.
        status.samples_per_second = samples_per_second(status.nodes)
        remaining = sum(ds.records_total - ds.records_done for ds in view.datasets)
        if view.datasets and remaining == 0:
            status.eta_seconds = 0
        elif status.samples_per_second > 0:
            status.eta_seconds = remaining / status.samples_per_second
        last = self._last_failure()
        if last is not None:
            status.last_failure.CopyFrom(last)
        if view.HasField("checkpoints"):
            status.checkpoints.CopyFrom(view.checkpoints)
        if view.HasField("goodput"):
            status.goodput.CopyFrom(view.goodput)
        return status

    # ---------------------------------------------------------------- wiring

    def _write_master_file(self, address: str) -> None:
        path = self.config.work_dir / MASTER_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
        tmp.replace(path)


class JobService(job_pb2_grpc.JobServicer):
    def __init__(self, runner: JobRunner) -> None:
        self.runner = runner

    @rpc
    async def GetStatus(self, request: job_pb2.JobStatusRequest, context: Any) -> job_pb2.JobStatus:
        return self.runner.status()

    @rpc
    async def Scale(self, request: job_pb2.ScaleRequest, context: Any) -> job_pb2.ScaleResponse:
        previous = self.runner.scale(request.nodes)
        return job_pb2.ScaleResponse(previous=previous, nodes=request.nodes)


def read_master_file(config: JobConfig) -> str:
    """The address of the job's running master, from its workdir."""
    path = config.work_dir / MASTER_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        raise InvalidArgument(
            f"no running master for job {config.name} ({path} not found)"
        ) from None
    return str(data["address"])
