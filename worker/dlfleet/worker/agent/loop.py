"""The agent's control loop: join a round, run the local workers, react.

One state object per phase, advanced by `step()` (Ray Train's controller):

    Checking -> Joining                                   (--node-check: healthy)
             -> CheckFailed                               (found faulty: exit 6)
    Joining -> Running -> Succeeded                      (exit 0)
                       -> Restarting(failure) -> Joining (a worker failed: one
                                                          restart consumed)
                                              -> Failed   (diagnosed: exit 1, 4, 5)
                       -> Rejoining(reason)  -> Joining  (the world changed:
                                                          no restart consumed)
                       -> Failed(failure)                 (restarts exhausted:
                                                          exit 1)
                       -> Failed(None)                    (this node lost the
                                                          job: exit 3)
                       -> Preempted                       (SIGTERM: exit 143)

Every worker failure is diagnosed first (`dlfleet.api.diagnosis`: a rule
table over the exit, the error file, the stderr tail, OOM kills and the
watchdog), and the rule's action decides: restart in place, or end the node
at once, spending no restart that cannot help.

Exit 1 means the training itself failed (restarts exhausted, or a user error
diagnosed); exit 3 means the node could not take part (master unreachable,
dropped for missed heartbeats, rendezvous timed out), so a platform may
replace it; exit 4 means a hardware fault was diagnosed: replace the node,
do not retry it; exit 5 means it ran out of memory: relaunch it with more;
exit 6 means its pre-flight node check found it faulty (slow or broken,
`node_check.py`) before it trained: replace it;
exit 143 (128 + SIGTERM, as for any terminated process) means it left when
told to: preempted, or scaled down. Only exit 0 says the work is done.

What makes restarts never hang: the master pushes "re-rendezvous" on the
agent's session the moment a peer dies or a node waits, and the agent then
stops its workers (SIGTERM, then SIGKILL) whatever collective they are stuck
in. Every round gets a fresh process-group store endpoint (the leader's free
port, chosen at join), so no key of an earlier attempt is ever read again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dlfleet.api.client import AgentSession, MasterClient, RetryPolicy, join_request
from dlfleet.api.diagnosis import RESTART_LOOP_REFUSAL, Action, FailureFacts, Verdict, diagnose
from dlfleet.api.env import (
    AGENT_ENV,
    CHECKPOINT_DIR_ENV,
    CONNECT_BUDGET_ENV,
    MAX_NODES_ENV,
    NODE_ID_ENV,
    PROGRESS_ENV,
    SPARE_ENV,
    TOKEN_ENV,
)
from dlfleet.api.errors import TRAINING_DONE_REFUSAL, DlfleetError, StaleError
from dlfleet.api.v1 import checkpoint_pb2, rendezvous_pb2
from dlfleet.worker.address import interface_environment, observe_and_choose
from dlfleet.worker.agent import primed as primed_spare
from dlfleet.worker.agent.config import AgentConfig
from dlfleet.worker.agent.env import RoundAssignment, worker_environments
from dlfleet.worker.agent.keeper import ImageKeeper
from dlfleet.worker.agent.keeper_server import AgentServer, start_keeper
from dlfleet.worker.agent.metrics import NodeSampler
from dlfleet.worker.agent.node_check import CheckHelper, run_check
from dlfleet.worker.agent.orders import WorkerOrders
from dlfleet.worker.agent.phases import (
    EXIT_FOR,
    EXIT_NODE_CHECK_FAILED,
    EXIT_NODE_LOST,
    EXIT_PREEMPTED,
    EXIT_WORKERS_FAILED,
    FINAL,
    CheckFailed,
    Checking,
    Dropped,
    Failed,
    Joining,
    Phase,
    Preempted,
    Rejoining,
    Restarting,
    Running,
    Succeeded,
)
from dlfleet.worker.agent.processes import dump_stacks, free_ports, process_stopped
from dlfleet.worker.agent.store_probe import StoreProbe
from dlfleet.worker.agent.watchdog import StepPace
from dlfleet.worker.agent.workers import (
    GroupStatus,
    WorkerFailure,
    WorkerGroup,
    attempt_log_dir,
)
from dlfleet.worker.checkpoint import presence
from dlfleet.worker.elastic.channel import Abort, Run, WorkState
from dlfleet.worker.progress import read_counts

_log = logging.getLogger("dlworker")

STOP_TIMEOUT_S = 10.0
# How long the agent waits for its last word on stopped workers to go out
# (a write on the open session stream: milliseconds, unless it is down).
LAST_WORD_TIMEOUT_S = 1.0
# How often a node waiting for a round says why.
WAITING_SAY_S = 5.0
# In-process restarts: how long a worker may take to leave an aborted round
# before it is killed (and replaced), and how long after a round starts the
# agent waits before starting a new spare (its start-up costs CPU that the
# recovering ranks want).
# How long a worker gets to leave an aborted round before it is taken for
# hung and killed (its rank goes to a spare). Leaving takes milliseconds.
ABORT_TIMEOUT_S = 3.0
SPARE_DELAY_S = 3.0
# A node of a job whose workers restart in place starts them as spares and
# joins once they are warm, or after this long with those that are; once one
# is warm, the others get this much longer (a straggler is started cold).
WARM_START_TIMEOUT_S = 60.0
WARM_START_STRAGGLER_S = 10.0
# How many times a node the master dropped while its agent lived registers
# again (a link that keeps failing: after that the node is given up, exit 3).
MAX_REGISTRATIONS = 3
# Variables that name one rank: a spare has none until it takes over a rank.
_RANK_VARIABLES = ("TORCHELASTIC_ERROR_FILE", PROGRESS_ENV)
# A spare is a world of one until a run order gives it a round: a script
# that forms a process group from the environment before `elastic.run`
# (HF's TrainingArguments do, through Accelerate) gets one of its own, on a
# store of its own (port 0: any free port), instead of joining, or hosting,
# a round's store. `run` retires that group before the spare warms up.
_SPARE_WORLD = {
    "RANK": "0", "LOCAL_RANK": "0", "ROLE_RANK": "0", "GROUP_RANK": "0",
    "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
}  # fmt: skip


def spare_environment(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment made a spare's (see _SPARE_WORLD)."""
    spare = {k: v for k, v in env.items() if k not in _RANK_VARIABLES}
    spare.update(_SPARE_WORLD)
    spare[SPARE_ENV] = "1"
    return spare


def master_client(config: AgentConfig) -> MasterClient:
    """The agent's client: it rides out a master that is slow to come up for
    up to $DLFLEET_CONNECT_BUDGET seconds (60)."""
    budget = float(os.environ.get(CONNECT_BUDGET_ENV, "60"))
    return MasterClient(
        config.master,
        token=config.token,
        retry=RetryPolicy(attempts=50, max_backoff_s=2.0, total_budget_s=budget),
    )


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        *,
        host: str | None = None,
        client: MasterClient | None = None,
        worker_group: Callable[[], WorkerGroup] = WorkerGroup,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`host`: the address to publish; None (a real node) chooses it from
        --local-addr or the route to the master (`dlfleet.worker.address`).
        `client`: the master's (None: `master_client(config)`; the agent
        closes it when it ends). `worker_group` makes the group of a round's
        worker processes; `clock` reads the seconds every delay and deadline
        of the agent is kept on (monotonic)."""
        self.config = config
        self.host = host or ""
        self.bind_host = host or ""
        self._given_host = host
        # GLOO/NCCL/TP_SOCKET_IFNAME for the workers, where the user set none.
        self.interface_env: dict[str, str] = {}
        self.max_nodes = 0  # the master's --max-nodes, once registered
        self.client = client if client is not None else master_client(config)
        self._worker_group = worker_group
        self._clock = clock
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="dlworker-"))
        self.preempted = threading.Event()
        self.node_id = ""
        self.incarnation = 0
        self.session: AgentSession | None = None
        self.group: WorkerGroup | None = None
        self.rounds: list[RoundAssignment] = []
        self.progress_dir = self.log_dir / "progress"
        self._paces: dict[tuple[str, int], StepPace] = {}  # (progress file, pid)
        self._master_away_at = float("-inf")  # when the watchdog last saw it away (wall)
        self.sampler: NodeSampler | None = None
        self._sampled_at = 0.0
        # In-process restarts: the workers' order lines, served with the
        # checkpoint keeper; `opted_in` once every worker of a round attached.
        self.orders = WorkerOrders()
        self.server: AgentServer | None = None
        self.keeper: ImageKeeper | None = None
        self.opted_in = False
        self._aborted_round = 0
        self._envs: list[dict[str, str]] = []
        self._spares_due = 0.0
        # A script that may restart in place gets its spares primed with its
        # first workers (see `primed`); unused, they end after this long.
        self._primes = (
            self.config.spares > 0
            and not self.config.no_python
            and primed_spare.wants_spares(self.config.training_script, self.config.module)
        )
        self._primed_until = 0.0
        # Registrations after the first (`_register_again`), and the interval
        # the master gave for heartbeats.
        self._registrations = 0
        self._beat_interval_s = 1.0
        self._previous_exception = ""  # of this node's last failure, for `repeated` rules
        self.helper: CheckHelper | None = None
        self._warm_start_due = False
        self.store_probe: StoreProbe | None = None

    # ---------------------------------------------------------------- life

    def run(self) -> int:
        """Run until the workers succeed (0), fail for good (1), the node is
        lost to the job (3), diagnosed faulty (4) or out of memory (5), fails
        its node check (6), or the agent is preempted (143)."""
        try:
            if self._given_host is None:
                self._choose_address(None)
            config = self.config
            registered = self.client.register_node(
                job_name=config.job_name,
                node_name=config.node_name,
                local_world_size=config.nproc_per_node,
                host=self.host,
                nnodes=(config.min_nodes, config.max_nodes) if config.nnodes_given else None,
            )
            if registered.nnodes_warning:
                _log.warning("%s", registered.nnodes_warning)
            if self._given_host is None:
                self._choose_address(registered.observed_host or None)
        except DlfleetError as error:
            _log.error("cannot register with the master at %s: %s", self.config.master, error)
            return EXIT_NODE_LOST
        except (LookupError, OSError) as error:
            _log.error("%s", error)
            return EXIT_NODE_LOST
        self.node_id, self.incarnation = registered.node_id, registered.incarnation
        self._beat_interval_s = max(registered.heartbeat_interval_ms, 100) / 1000
        self.session = self.client.agent_session(
            self.node_id, self.incarnation, self._beat_interval_s
        )
        self.server, self.keeper = self._start_server()
        self.helper = self._start_helper()
        self._warm_start_due = registered.restarts_in_place and self.config.spares > 0
        self.max_nodes = registered.max_nodes  # 0: a master that does not say
        phase: Phase = Checking() if self.config.node_check else Joining(restart_count=0)
        try:
            if isinstance(phase, Joining) and self._warm_start_due:
                self._warm_start()
            while not isinstance(phase, FINAL):
                phase = self.step(phase)
        finally:
            self._stop_workers()
            self._leave(phase)
            self.helper.close()
            if self.store_probe is not None:
                self.store_probe.stop()
            self.orders.close()
            self.server.stop()
            self.keeper.close()
            self.session.close()
            self.client.close()
        if isinstance(phase, CheckFailed):
            _log.error("dlworker %s failed its node check: %s", self.node_id, phase.reason)
            return EXIT_NODE_CHECK_FAILED
        if isinstance(phase, Failed):
            _log.error("dlworker %s failed: %s", self.node_id, phase.reason)
            return phase.exit_code
        if isinstance(phase, Preempted):
            return EXIT_PREEMPTED
        return 0

    def _choose_address(self, master_saw: str | None) -> None:
        """This node's address, before registering (from the route to the
        master) and again with what the master saw; logged once, final."""
        choice = observe_and_choose(
            self.config.local_addr, os.environ, self.config.master, master_saw
        )
        if choice.bind:  # a local address: fail here, not in the workers
            free_ports(choice.bind, 1)
        self.host, self.bind_host = choice.address, choice.bind
        self.interface_env = interface_environment(choice, os.environ)
        if master_saw is None:
            return
        for warning in choice.warnings:
            _log.warning("%s", warning)
        set_for_workers = " ".join(f"{k}={v}" for k, v in self.interface_env.items())
        _log.info(
            "this node's address: %s (%s; interface %s)%s",
            choice.address,
            choice.reason,
            choice.interface or "none",
            f"; the workers get {set_for_workers}" if set_for_workers else "",
        )

    def step(self, phase: Phase) -> Phase:
        if self.preempted.is_set():
            return Preempted()
        if isinstance(phase, Checking):
            return self._check()
        if isinstance(phase, Joining):
            return self._join(phase)
        if isinstance(phase, Running):
            return self._watch(phase)
        if isinstance(phase, Restarting):
            return self._after_failure(phase)
        if isinstance(phase, Rejoining):
            _log.info("re-rendezvous: %s", phase.reason)
            return Joining(phase.restart_count)
        if isinstance(phase, Dropped):
            return self._register_again(phase)
        raise AssertionError(f"no step from {phase}")

    def _check(self) -> Phase:
        """The pre-flight node check; then, healthy, the warm start (when the
        job's workers restart in place) and the first join."""
        outcome = run_check(
            self.client,
            token=self.config.token,
            node_id=self.node_id,
            incarnation=self.incarnation,
            host=self.host,
            log_dir=self.log_dir,
            stop=self.preempted,
        )
        if outcome is None:
            return Preempted()
        if outcome.lost:
            return Failed(None, f"node check: {outcome.reason}", EXIT_NODE_LOST)
        if not outcome.healthy:
            return CheckFailed(outcome.reason)
        if self._warm_start_due:
            self._warm_start()
        return Joining(restart_count=0)

    def _after_failure(self, phase: Restarting) -> Phase:
        """Diagnose the failure, report it, and act on the verdict: end the
        node (the job fails, the node is replaced or relaunched bigger) or
        restart in place while restarts last."""
        failure = phase.failure
        steps = self.sampler.read_steps() if self.sampler is not None else None
        facts = FailureFacts(
            exit_code=failure.exit_code,
            signal=failure.signal_name or "",
            message=failure.message,
            traceback=failure.traceback or "",
            stderr_tail=failure.stderr_tail,
            oom_killed=failure.oom_killed,
            hung=failure.hung,
            previous_exception=self._previous_exception,
            steps=steps,
            ranks=self.config.nproc_per_node,
            ranks_alike=failure.ranks_alike,
        )
        verdict = diagnose(facts, self.config.diagnosis)
        self._previous_exception = facts.signature
        self._report(failure, phase.restart_count, verdict)
        described = f"{_describe(failure, self.node_id)}; diagnosed {verdict.describe()}"
        if verdict.action in EXIT_FOR:
            return Failed(failure, described, EXIT_FOR[verdict.action])
        if phase.restart_count >= self.config.max_restarts:
            # The verdict says restart, but the node ends: say that, not "restart".
            spent = (
                f"{_describe(failure, self.node_id)}; diagnosed {verdict.category.value} "
                f"(rule {verdict.rule}), not restarted: its {self.config.max_restarts} "
                "restarts (max_restarts) are spent"
            )
            return Failed(failure, spent)
        _log.warning(
            "worker failed (%s); restart %d of %d",
            described,
            phase.restart_count + 1,
            self.config.max_restarts,
        )
        return Joining(phase.restart_count + 1)

    def _start_helper(self) -> CheckHelper:
        assert self.session is not None
        helper = CheckHelper(
            self.session,
            master=self.config.master,
            token=self.config.token,
            node_id=self.node_id,
            incarnation=self.incarnation,
        )
        helper.start()
        return helper

    def _register_again(self, phase: Dropped) -> Phase:
        """The master dropped this node though its agent lives: it took the
        node for dead (its link was cut, or it was stopped, for longer than
        the heartbeat timeout). The workers are stopped (their round is
        over); the node registers a new incarnation, with the same keeper and
        its images, and joins again, at most MAX_REGISTRATIONS times."""
        assert self.session is not None
        self._stop_workers()
        if self._registrations >= MAX_REGISTRATIONS:
            return Failed(
                None,
                f"the master dropped this node ({phase.reason}); registered "
                f"{self._registrations} times already, giving the node up",
                EXIT_NODE_LOST,
            )
        try:
            registered = self.client.register_node(
                job_name=self.config.job_name,
                node_name=self.config.node_name,
                local_world_size=self.config.nproc_per_node,
                host=self.host,
                nnodes=(self.config.min_nodes, self.config.max_nodes)
                if self.config.nnodes_given
                else None,
            )
        except DlfleetError as error:
            return Failed(
                None, f"the master dropped this node ({phase.reason}) and: {error}", EXIT_NODE_LOST
            )
        self._registrations += 1
        dropped = self.node_id
        self.session.leaving()  # its end is expected: the master forgot it
        self.session.close()
        if self.helper is not None:
            self.helper.close()
        if self.store_probe is not None:
            self.store_probe.stop()
            self.store_probe = None
        self.node_id, self.incarnation = registered.node_id, registered.incarnation
        self.session = self.client.agent_session(
            self.node_id, self.incarnation, self._beat_interval_s
        )
        self.session.restarts_in_place = self.opted_in
        if self.keeper is not None:  # its images stay; it speaks for the new incarnation
            self.session.on_checkpoint_progress = self.keeper.heard_progress
            self.keeper.node_id, self.keeper.incarnation = self.node_id, self.incarnation
        self.helper = self._start_helper()
        _log.warning(
            "the master dropped %s (%s): registered again as %s, joining",
            dropped,
            phase.reason,
            self.node_id,
        )
        return Joining(phase.restart_count)

    def _start_server(self) -> tuple[AgentServer, ImageKeeper]:
        return start_keeper(
            self.orders,
            client=self.client,
            token=self.config.token,
            node_id=self.node_id,
            incarnation=self.incarnation,
            name=f"dlworker-{os.getpid()}-{secrets.token_hex(3)}",
            host=self.bind_host,
            published=self.host,
            threads=2 * (self.config.nproc_per_node + self.config.spares) + 8,
            session=self.session,
        )

    # ------------------------------------------------------------- phases

    def _join(self, phase: Joining) -> Phase:
        assert self.session is not None
        self.session.drop_pushes()  # about rounds before this one
        try:
            # On the session, not a Join call of its own: at thousands of
            # nodes the master forms a round with a message per node.
            # The spare port lets the master join this node into the next
            # round itself when this one closes (the push then says so).
            port, spare = free_ports(self.bind_host, 2)
            pending = self.session.join_future(
                join_request(
                    self.node_id,
                    self.incarnation,
                    self.config.nproc_per_node,
                    self.host,
                    port,
                    keeper_address=self.server.peer_address if self.server else "",
                    next_bootstrap_port=spare,
                )
            )
            joined = self._wait_for_round(pending)
        except DlfleetError as error:
            if str(error).startswith(TRAINING_DONE_REFUSAL):
                # The job's workers finished while this node was starting (a
                # replacement that came up too late): nothing is left to train.
                _log.info("nothing to do: %s", error)
                return Succeeded()
            if str(error).startswith(RESTART_LOOP_REFUSAL):
                # The master failed the job: its workers failed after every
                # restore. Exit as a node whose training failed, so the job
                # fails with the diagnosis, not relaunched into the same refusal.
                return Failed(None, str(error), EXIT_WORKERS_FAILED)
            if isinstance(error, StaleError) and self.session.closed_by_master.is_set():
                return Dropped(f"its join was refused: {error}", phase.restart_count)
            return Failed(None, f"rendezvous failed: {error}", EXIT_NODE_LOST)
        if joined is None:
            return Preempted()
        assignment = RoundAssignment(
            round=joined.round,
            group_rank=joined.group_rank,
            group_world_size=joined.group_world_size,
            world_size=joined.world_size,
            local_world_size=joined.local_world_size,
            rank_offset=joined.rank_offset,
            bootstrap_host=joined.bootstrap_host,
            bootstrap_port=joined.bootstrap_port,
        )
        self.session.round = assignment.round
        self.rounds.append(assignment)
        if self.keeper is not None:
            self.keeper.set_peer(joined.keeper_peer or None)
        _log.info(
            "round %d: group rank %d of %d, world size %d, store %s:%d",
            assignment.round,
            assignment.group_rank,
            assignment.group_world_size,
            assignment.world_size,
            assignment.bootstrap_host,
            assignment.bootstrap_port,
        )
        self._envs = self._environments(assignment, phase.restart_count)
        if self.store_probe is not None:
            self.store_probe.stop()
        self.store_probe = (
            StoreProbe(assignment.bootstrap_host, assignment.bootstrap_port).start()
            if assignment.group_rank != 0
            else None
        )
        self.progress_dir = attempt_log_dir(self.log_dir, assignment.round) / "progress"
        self._paces.clear()  # each round learns its own pace
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        if self.group is not None and (self.opted_in or not self.group.pids):
            # Restarting in place, or the first round of a warm start.
            self._continue_in_process(assignment, phase.restart_count)
        else:
            self._stop_workers()
            self.group = self._worker_group()
            self.group.start(self.config, self._envs, self.log_dir, assignment.round)
            for local_rank, pid in enumerate(self.group.pids):
                self.orders.expect(
                    pid, self._run_order(assignment, local_rank, phase.restart_count)
                )
            if self._primes and not self.opted_in:
                env = spare_environment(self._envs[0])
                for _ in range(self.config.spares):
                    self.group.start_spare(self.config, env, self.log_dir, primed=True)
                self._primed_until = self._clock() + WARM_START_TIMEOUT_S
        self._spares_due = self._clock() + SPARE_DELAY_S
        before = self.sampler
        self.sampler = NodeSampler(self.progress_dir, self.group.pids)
        if before is not None:  # over the node's attempts
            self.sampler.peak_rss, self.sampler.most_steps = before.peak_rss, before.most_steps
        self._sampled_at = self._clock()
        return Running(assignment, phase.restart_count)

    def _wait_for_round(
        self, pending: concurrent.futures.Future[rendezvous_pb2.JoinResponse]
    ) -> rendezvous_pb2.JoinResponse | None:
        """The join's answer; meanwhile, every WAITING_SAY_S, why no round has
        formed (the master says who waits, how many a round needs, until
        when). None when told to leave (SIGTERM, Ctrl-C) first."""
        started = self._clock()
        say_at = started + WAITING_SAY_S
        while True:
            done, _ = concurrent.futures.wait([pending], timeout=0.2)
            if done:
                return pending.result()
            if self.preempted.is_set():
                pending.cancel()
                return None
            if self._clock() >= say_at:
                say_at = self._clock() + WAITING_SAY_S
                try:
                    why = self.client.rendezvous_state(waiting_only=True).waiting
                except DlfleetError as error:
                    why = f"the master at {self.config.master} does not answer: {error}"
                _log.info(
                    "waiting %.0fs for a round: %s",
                    self._clock() - started,
                    why or "the round is forming",
                )

    def _environments(
        self, assignment: RoundAssignment, restart_count: int
    ) -> list[dict[str, str]]:
        """The workers' environments for a round, by local rank."""
        attempt_dir = attempt_log_dir(self.log_dir, assignment.round)
        assert self.server is not None
        envs = worker_environments(
            self.config,
            assignment,
            restart_count,
            attempt_dir,
            self.config.master,
            agent_environ=os.environ,
            extra={
                NODE_ID_ENV: self.node_id,
                TOKEN_ENV: self.config.token,
                AGENT_ENV: self.server.local_address,
                CHECKPOINT_DIR_ENV: str(self.keeper.own_dir) if self.keeper else "",
                **({MAX_NODES_ENV: str(self.max_nodes)} if self.max_nodes > 0 else {}),
                **self.interface_env,
            },
        )
        for local_rank, env in enumerate(envs):
            env[PROGRESS_ENV] = str(attempt_dir / "progress" / str(local_rank))
        return envs

    def _watch(self, phase: Running) -> Phase:
        """Poll the workers; wake at once for a push from the master."""
        assert self.session is not None and self.group is not None
        push = self.session.next_push(self.config.monitor_interval_s)
        if self.preempted.is_set():
            return Preempted()
        if self.store_probe is not None and self.store_probe.problem:
            _log.error("%s", self.store_probe.problem)
            self._stop_workers()
            return Failed(None, self.store_probe.problem, EXIT_NODE_LOST)
        if push is not None and push.closed_round >= phase.assignment.round:
            if self.group.poll().status is GroupStatus.SUCCEEDED:
                # Finished just before the push (a newcomer came as the job
                # ended): joining a round now would leave it waiting for a
                # leader that is gone.
                self._stop_workers()
                return Succeeded()
            if push.gone_ranks and self.keeper is not None:
                # Before the workers are stopped: persisting on their way out,
                # they wait for no part of these ranks (see `presence`).
                presence.mark_gone(self.keeper.own_dir, push.closed_round, push.gone_ranks)
            self._end_round(phase.assignment.round, push.reason)
            return Rejoining(push.reason, phase.restart_count)
        if self.session.closed_by_master.is_set():
            self._stop_workers()
            return Dropped("the master no longer knows this node", phase.restart_count)
        self._sample()
        state = self.group.poll()
        if state.status is GroupStatus.SUCCEEDED:
            self._stop_workers()
            return Succeeded()
        if state.status is GroupStatus.FAILED:
            assert state.failure is not None
            self._end_round(phase.assignment.round, "a local worker failed")
            return Restarting(state.failure, phase.restart_count)
        hung = self._hung_rank()
        if hung is not None:
            # Restarting in place, the rank that stalled may only be waiting
            # for a peer that hung: the abort sorts them out (a rank that
            # cannot leave its round is killed, see _continue_in_process).
            self._end_round(phase.assignment.round, "a local worker hung")
            return Restarting(hung, phase.restart_count)
        self._note_opt_in()
        self._keep_spares()
        return phase

    # ------------------------------------------------- in-process restarts

    def _end_round(self, round_: int, reason: str) -> None:
        """Leave the round: abort the workers in place when the script runs
        through `dlfleet.elastic.run`, else stop them (torchrun's contract)."""
        if not self.opted_in:
            self._stop_workers()
            self._last_word()
            return
        # Before the abort: a spare that takes over a dead rank starts its
        # progress file over.
        self._last_word()
        abort = Abort(round_, reason)
        assert self.group is not None
        for pid in self.group.pids:
            self.orders.send(pid, abort)
        self._aborted_round = round_

    def _warm_start(self) -> None:
        """Start this node's workers as spares and wait, up to
        WARM_START_TIMEOUT_S, until they are warm, then join.

        Joining ends the running nodes' round, and they wait for this node's
        processes in the next one: a cold start there (interpreter, imports,
        process-group set-up) is a stall of the whole job. The master says
        whether the job's workers restart in place: only a script that runs
        `dlfleet.elastic.run` can wait as a spare."""
        assert self.session is not None
        provisional = RoundAssignment(
            round=0,
            group_rank=0,
            group_world_size=1,
            world_size=self.config.nproc_per_node,
            local_world_size=self.config.nproc_per_node,
            rank_offset=0,
            bootstrap_host=self.host,
            bootstrap_port=1,
        )  # a placeholder: a spare's round, ranks and store come with its run order
        env = spare_environment(self._environments(provisional, 0)[0])
        self.group = self._worker_group()
        for _ in range(self.config.nproc_per_node):
            self.group.start_spare(self.config, env, self.log_dir)
        started = self._clock()
        deadline = started + WARM_START_TIMEOUT_S
        while self._clock() < deadline and not self.preempted.is_set():
            for failure in self.group.reap_spares():
                _log.warning("a warm-start process ended: %s", failure.message.strip()[-300:])
            warm = [pid for pid in self.orders.spares() if pid in self.group.spare_pids]
            if len(warm) >= self.config.nproc_per_node or not self.group.spare_pids:
                break
            if warm:
                deadline = min(deadline, self._clock() + WARM_START_STRAGGLER_S)
            time.sleep(0.05)
        warm = [pid for pid in self.orders.spares() if pid in self.group.spare_pids]
        late = [pid for pid in self.group.spare_pids if pid not in warm]
        for pid in late:
            _log.warning("spare process %d is not warm yet; its stacks:", pid)
            dump_stacks(pid)
        _log.info(
            "warm start: %d of %d worker(s) warm after %.2fs; joining",
            len(warm),
            self.config.nproc_per_node,
            self._clock() - started,
        )
        self._spares_due = self._clock() + SPARE_DELAY_S

    def _note_opt_in(self) -> None:
        """Every worker of the round attached: the script restarts in place."""
        if self.opted_in or self.group is None:
            return
        if all(self.orders.attached(pid) for pid in self.group.pids):
            self.opted_in = True
            if self.session is not None:
                self.session.restarts_in_place = True
            _log.info(
                "the workers restart in place (dlfleet.elastic); %d spare(s)", self.config.spares
            )

    def _keep_spares(self) -> None:
        """Keep `--spares` spare processes started (once the script opted in):
        the primed ones are told to run the script, those missing started."""
        if self.group is None:
            return
        if not self.opted_in:
            if self.group.primed_pids and self._clock() >= self._primed_until:
                dropped = self.group.drop_primed()
                _log.info(
                    "primed spare process(es) %s ended: the workers did not attach to restart "
                    "in place within %.0fs",
                    ", ".join(map(str, dropped)),
                    WARM_START_TIMEOUT_S,
                )
            return
        for pid in self.group.release_primed():
            _log.info("started spare process %d (primed at launch: it runs the script now)", pid)
        for failure in self.group.reap_spares():
            _log.warning("a spare process ended: %s", failure.message.strip().splitlines()[-1:])
        if len(self.group.spare_pids) >= self.config.spares or self._clock() < self._spares_due:
            return
        env = spare_environment(self._envs[0])
        pid = self.group.start_spare(self.config, env, self.log_dir)
        _log.info("started spare process %d", pid)
        self._spares_due = self._clock() + SPARE_DELAY_S

    def _run_order(self, assignment: RoundAssignment, local_rank: int, restart_count: int) -> Run:
        env = self._envs[local_rank]
        return Run(
            checkpoint_pb2.RunOrder(
                round=assignment.round,
                rank=assignment.rank_offset + local_rank,
                local_rank=local_rank,
                world_size=assignment.world_size,
                local_world_size=assignment.local_world_size,
                group_rank=assignment.group_rank,
                group_world_size=assignment.group_world_size,
                store_host=assignment.bootstrap_host,
                store_port=assignment.bootstrap_port,
                restart_count=restart_count,
                env=env,
            )
        )

    def _continue_in_process(self, assignment: RoundAssignment, restart_count: int) -> None:
        """The next round with the same processes: survivors get their new
        ranks, a dead or stuck rank is taken over by a spare (or, with none
        ready, by a new process). After a warm start the group has no ranks
        yet: spares take them all."""
        assert self.group is not None
        group = self.group
        # A stopped process (SIGSTOP, a tracer) cannot leave: no need to wait.
        stopped = {pid for pid in group.pids if process_stopped(pid)}
        stuck = stopped | self.orders.wait_left(
            set(group.pids) - stopped, self._aborted_round, ABORT_TIMEOUT_S
        )
        for local_rank, pid in enumerate(group.pids):
            if pid in stuck:
                _log.error(
                    "local rank %d (pid %d) did not leave its round; killing it", local_rank, pid
                )
                if pid not in stopped:  # a stopped one cannot answer
                    dump_stacks(pid)
                group.kill(local_rank)
        # A killed process takes a moment to be reaped.
        deadline = self._clock() + 1.0
        while any(pid in stuck and group.alive(lr) for lr, pid in enumerate(group.pids)):
            if self._clock() > deadline:
                break
            time.sleep(0.01)
        group.begin_round()
        spares = [pid for pid in self.orders.spares() if pid in group.spare_pids]
        # Spares still starting (importing, building the model): each is further
        # along than a process started now would be, and takes its order when
        # it attaches.
        starting = [pid for pid in group.spare_pids if not self.orders.attached(pid)]
        seated = len(group.pids)
        for local_rank in range(self.config.nproc_per_node):
            pid = group.pids[local_rank] if local_rank < seated else 0
            order = self._run_order(assignment, local_rank, restart_count)
            error_file = Path(self._envs[local_rank]["TORCHELASTIC_ERROR_FILE"])
            # A worker that finished its training as the round ended is on its
            # way out: the new round needs a process for its rank all the same
            # (it finds the data done and finishes too).
            finishing = (self.orders.state(pid) or (None, 0))[0] is WorkState.FINISHED
            if pid and pid not in stuck and group.alive(local_rank) and not finishing:
                group.set_error_file(local_rank, error_file)
                self.orders.expect(pid, order)
            elif spares:
                spare = spares.pop(0)
                group.promote(local_rank, spare, error_file)
                self.orders.send(spare, order)
                _log.info("spare process %d takes over local rank %d", spare, local_rank)
            elif starting:
                spare = starting.pop(0)
                group.promote(local_rank, spare, error_file)
                self.orders.expect(spare, order)
                _log.info(
                    "spare process %d, still starting, takes over local rank %d when it attaches",
                    spare,
                    local_rank,
                )
            else:
                self.orders.forget(pid)
                new = group.replace(
                    local_rank, self.config, self._envs[local_rank], self.log_dir, assignment.round
                )
                self.orders.expect(new, order)
                _log.warning(
                    "no spare ready: started process %d for local rank %d", new, local_rank
                )

    def _sample(self) -> None:
        """Measure the workers once per heartbeat; the next beat carries it."""
        assert self.session is not None
        if self.sampler is None or self._clock() - self._sampled_at < self.session.interval:
            return
        self._sampled_at = self._clock()
        self.session.metrics = self.sampler.sample()

    def _last_word(self) -> None:
        """Tell the master the stopped workers' final counts at once: the
        steps they made since the last heartbeat are training the job's
        goodput would otherwise lose to the failure (their progress files
        start over with the next processes)."""
        if self.sampler is None or self.session is None:
            return
        self.session.metrics = self.sampler.sample()
        if not self.session.beat_now(LAST_WORD_TIMEOUT_S):
            _log.debug("the workers' final counts were not sent (the session is down)")

    def _hung_rank(self) -> WorkerFailure | None:
        """The watchdog: a rank that stepped once, then not for its bound
        (`--step-timeout`, or learned: see `dlfleet.worker.agent.watchdog`)."""
        bounds = self.config.step_bounds()
        if bounds is None or self.group is None:
            return None
        now = time.time()
        if self.keeper is not None and self.keeper.master_away:
            self._master_away_at = now
        for local_rank, pid in enumerate(self.group.pids):
            path = self.progress_dir / str(local_rank)
            pace = self._paces.get((str(path), pid))
            if pace is None:
                pace = self._paces[(str(path), pid)] = StepPace(bounds)
            try:
                mtime: float | None = path.stat().st_mtime
            except FileNotFoundError:
                mtime = None
            pace.saw(mtime, excused_at=self._master_away_at)
            if mtime is None:
                continue
            counts = read_counts(str(path))
            if counts is None or counts[0] == 0:
                continue  # not trained yet: start-up has no step to time
            stalled = now - mtime
            limit = pace.limit(now - self._master_away_at)
            if stalled > limit:
                if bounds.factor and limit < bounds.ceiling:
                    why = (
                        f"{bounds.factor:g} x the longest gap between its steps' reports, "
                        f"{pace.longest:.2f}s, at least --step-timeout-min "
                        f"{bounds.floor:g}s, at most --step-timeout {bounds.ceiling:g}s"
                    )
                else:
                    why = f"--step-timeout {bounds.ceiling:g}s"
                message = (
                    f"hung: no training step for {stalled:.1f}s ({why}); the workers were stopped"
                )
                _log.error("local rank %d %s", local_rank, message)
                return WorkerFailure(
                    local_rank, pid, exit_code=-1, signal_name=None, message=message, hung=True
                )
        return None

    # ------------------------------------------------------------- helpers

    def _stop_workers(self) -> None:
        if self.group is not None:
            self.group.stop(STOP_TIMEOUT_S)
            self.group = None

    def _report(self, failure: WorkerFailure, restart_count: int, verdict: Verdict) -> None:
        round_ = self.rounds[-1] if self.rounds else None
        message = failure.message
        if failure.traceback:
            message = f"{message}\n{failure.traceback}"
        report = rendezvous_pb2.FailureReport(
            node_id=self.node_id,
            incarnation=self.incarnation,
            round=round_.round if round_ else 0,
            local_rank=failure.local_rank,
            global_rank=(round_.rank_offset if round_ else 0) + failure.local_rank,
            exit_code=failure.exit_code,
            signal=failure.signal_name or "",
            message=message[-8000:],
            restart_count=restart_count,
            restarting=verdict.action is Action.RESTART
            and restart_count < self.config.max_restarts,
            rule=verdict.rule,
            category=verdict.category.value,
            action=verdict.action.value,
        )
        try:
            self.client.report_worker_failure(report)
        except DlfleetError as error:  # a stale round: the report is history
            _log.warning("failure report not taken: %s", error)

    def _leave(self, phase: Phase) -> None:
        reasons = {
            Succeeded: "succeeded",
            Preempted: "preempted",
            CheckFailed: "failed its node check",
        }
        reason = reasons.get(type(phase), "failed")
        if not self.node_id:
            return
        if self.session is not None:
            self.session.leaving()
        try:
            self.client.leave_rendezvous(self.node_id, self.incarnation, reason)
        except DlfleetError as error:
            _log.warning("could not leave the rendezvous cleanly: %s", error)


def _describe(failure: WorkerFailure, node_id: str) -> str:
    how = (
        f"signal {failure.signal_name}" if failure.signal_name else f"exit code {failure.exit_code}"
    )
    last = failure.message.strip().splitlines()[-1] if failure.message.strip() else ""
    return f"local rank {failure.local_rank} on {node_id} ended with {how}: {last}"


def main(argv: list[str] | None = None) -> int:
    """`dlworker [torchrun-style flags] train.py [args]`."""
    import signal

    from dlfleet.worker.agent.config import config_or_exit

    config = config_or_exit(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s dlworker %(levelname)s %(message)s")
    agent = Agent(config)

    def preempt(signum: int, frame: object) -> None:
        agent.preempted.set()

    signal.signal(signal.SIGTERM, preempt)
    signal.signal(signal.SIGINT, preempt)
    started = time.monotonic()
    code = agent.run()
    _log.info("exiting with %d after %.1fs", code, time.monotonic() - started)
    return code


if __name__ == "__main__":
    sys.exit(main())
