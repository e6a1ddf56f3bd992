"""The pre-flight node check's board: which node measures what and when, and
which nodes are too slow or broken to train (SPEC section 11).

Before a node first trains, its agent `begin`s a check here; a check process
on the node then `report`s what it measured and gets its next order:

1. Gather. A node is ready once its check process is up. A cohort forms when
   every node that began is ready and either `expected_nodes` are in (the
   healthy ones counted) or nobody began for `gather_ms`. One cohort measures
   at a time; nodes that begin meanwhile form the next one.
2. Compute: a matmul on the node's device, best of a few runs. Nodes on the
   same host take turns: they share its device, and measured together they
   would measure each other. A node whose matmul looks slow measures again
   (the faster of the two counts): a moment of noise on its host must not
   cost it its place.
3. Pairs: all-reduces between two nodes along a cycle through the cohort,
   `cycle_pairs`: round A (0,1),(2,3)...; round B (1,2),(3,4)...,(n-1,0); with
   an odd count round C (n-1,0). Every node has two partners: a slow or broken
   node spoils both its pairs while each partner keeps one good pair, so the
   bad node is isolated, not its partner. A pair starts as soon as both nodes
   are free and neither host is measuring anything else.
4. Verdicts (`node_check_verdict.judge`) for the whole cohort once its last
   pair ended; a node that failed or hung gets its verdict at once.

Late nodes (a replacement, a scale-up) form a cohort of their own. A cohort
of one or two, while nodes past their check are in the job (`helpers`: the
caller's list, known healthy ones first), pairs each of its nodes with such a
helper instead, which runs its side beside its training (a `HelperPair`
effect, pushed to it): that pair fails the late node if it fails, never for
being slow, since the helper is busy. Matmuls are also compared with the
healthy nodes' from earlier cohorts, those on other hosts only: on the late
node's own host they train now, on the device it is measured on.

Timeouts: each step a node takes (its matmul, its side of a pair) must end
within `step_timeout_ms`, its start-up (until its check process is ready:
an interpreter and torch, beside the other nodes' on a shared host) within
`startup_timeout_ms`, or the node is faulty (hung). A pair that one side
reported and the other did not blames the silent side.

Time is an argument; nothing here reads a clock. One owner (the master's
event loop) drives it. Not journaled: a master restarted mid-check starts a
fresh board under a new `check_id`, and the nodes in the middle of a check
start over on it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlfleet.api.errors import InvalidArgument, NotFound
from dlfleet.master.core.node_check_verdict import (
    CheckRule,
    PairRun,
    PairSide,
    Verdict,
    compute_suspects,
    failed_verdict,
    judge,
)
from dlfleet.master.settings import STANDALONE

VERDICTS_KEPT = 1_000


@dataclass(frozen=True)
class NodeCheckSettings:
    # Slower than this x the median of the others: faulty.
    slow_factor: float = STANDALONE.node_check_slow_factor
    step_timeout_ms: int = STANDALONE.node_check_timeout_ms
    gather_ms: int = 2_000
    expected_nodes: int = 1  # a cohort forms at once when this many nodes are in
    matmul_size: int = 512
    matmul_repeats: int = 10
    allreduce_numel: int = 1 << 20  # float32 elements: 4 MiB
    allreduce_iterations: int = 10

    def __post_init__(self) -> None:
        if not 1 < self.slow_factor <= 100:
            raise InvalidArgument(f"slow_factor must be in (1, 100], got {self.slow_factor}")
        if self.step_timeout_ms < 100 or self.gather_ms < 0 or self.expected_nodes < 1:
            raise InvalidArgument(
                "step_timeout must be >= 0.1 s, gather >= 0 and expected_nodes >= 1"
            )
        if min(self.matmul_size, self.matmul_repeats, self.allreduce_numel) < 1:
            raise InvalidArgument("matmul size and repeats, all-reduce size must be >= 1")
        if self.allreduce_iterations < 1:
            raise InvalidArgument("all-reduce iterations must be >= 1")

    @property
    def helper_timeout_ms(self) -> int:
        """A healthy node starts its side of a helper pair from nothing."""
        return 2 * self.step_timeout_ms

    @property
    def startup_timeout_ms(self) -> int:
        return 4 * self.step_timeout_ms


# ------------------------------------------------------------------ orders


@dataclass(frozen=True)
class ComputeOrder:
    size: int
    repeats: int


@dataclass(frozen=True)
class PairOrder:
    pair: int
    rank: int  # 0 hosts the pair's store
    peer: str
    store_host: str
    store_port: int
    iterations: int
    numel: int
    timeout_ms: int
    backend: str  # "gloo", or "nccl" when both sides measured on CUDA


Order = ComputeOrder | PairOrder | Verdict | None  # None: wait


@dataclass(frozen=True)
class HelperPair:
    """Effect: push `order` to `helper`, a healthy node, to run beside its training."""

    helper: str
    order: PairOrder


Effect = Verdict | HelperPair


# ----------------------------------------------------------------- reports


@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class ComputeDone:
    best_ms: float
    device: str = "cpu"


@dataclass(frozen=True)
class PairDone:
    pair: int
    ok: bool
    allreduce_ms: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class CheckFailed:
    error: str


Result = Ready | ComputeDone | PairDone | CheckFailed | None  # None: a poll


# ------------------------------------------------------------------- state


class Stage(enum.Enum):
    BEGUN = "begun"  # its check process is starting
    READY = "ready"  # waiting for its cohort
    COMPUTING = "computing"
    IDLE = "idle"  # measured its matmul; between pairs, or waiting for the others
    PAIRING = "pairing"
    DONE = "done"


@dataclass
class _Node:
    node_id: str
    host: str
    begun_ms: int
    stage: Stage = Stage.BEGUN
    seq: int = 0  # of its current order
    order: Order = None
    deadline_ms: int | None = None  # of its current step
    store_port: int = 0
    compute_ms: float | None = None
    device: str = ""


@dataclass
class _Cohort:
    id: int
    members: list[str]
    formed_ms: int
    to_compute: list[str]
    edges: list[tuple[str, str, bool]] = field(default_factory=list)  # (a, b, b is a helper)
    measured_twice: set[str] = field(default_factory=set)  # slow matmuls, measured again
    planned: bool = False
    running: dict[int, PairRun] = field(default_factory=dict)
    finished: list[PairRun] = field(default_factory=list)


def cycle_pairs(nodes: Sequence[str]) -> list[tuple[str, str]]:
    """The edges of a cycle through `nodes`, in rounds of disjoint pairs:
    (0,1),(2,3)...; then (1,2),(3,4)...,(n-1,0); with an odd count, (n-1,0)
    last (an odd cycle needs three rounds). Two nodes: their one pair."""
    n = len(nodes)
    if n < 2:
        return []
    if n == 2:
        return [(nodes[0], nodes[1])]
    first = [(nodes[i], nodes[i + 1]) for i in range(0, n - 1, 2)]
    second = [(nodes[i], nodes[(i + 1) % n]) for i in range(1, n - 1 if n % 2 else n, 2)]
    third = [(nodes[n - 1], nodes[0])] if n % 2 else []
    return first + second + third


class NodeCheckBoard:
    def __init__(self, settings: NodeCheckSettings, check_id: str) -> None:
        self.settings = settings
        self.check_id = check_id
        self.nodes: dict[str, _Node] = {}
        self.cohort: _Cohort | None = None
        self._cohorts = 0
        self._pairs = 0
        self.verdicts: dict[str, Verdict] = {}  # the latest per node, oldest first
        # Healthy nodes' matmuls, for late cohorts: node id -> (host, ms).
        self.healthy_compute: dict[str, tuple[str, float]] = {}
        self._healthy_live: set[str] = set()
        self._helper_busy: set[str] = set()

    # ------------------------------------------------------------ operations

    def begin(
        self, node_id: str, host: str, now_ms: int, helpers: Sequence[str] = ()
    ) -> list[Effect]:
        """The node's agent starts its check. Beginning again starts over."""
        if not node_id:
            raise InvalidArgument("a node check needs a node id")
        self._forget(node_id)
        deadline = now_ms + self.settings.startup_timeout_ms
        self.nodes[node_id] = _Node(node_id, host, now_ms, deadline_ms=deadline)
        return self.tick(now_ms, helpers)

    def report(
        self,
        node_id: str,
        done_seq: int,
        result: Result,
        now_ms: int,
        *,
        host: str = "",
        store_port: int = 0,
        helpers: Sequence[str] = (),
    ) -> list[Effect]:
        """What the node's check process measured for its order `done_seq`
        (`None`: a poll). A node this board does not know (its master
        restarted) starts over, ready. A result that answers no current order
        (a retry, a duplicate) changes nothing."""
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = _Node(node_id, host, now_ms, stage=Stage.READY)
            done_seq = -1  # whatever it measured was for another board
        if store_port:
            node.store_port = store_port
        if host:
            node.host = host
        effects: list[Effect] = []
        if isinstance(result, CheckFailed):
            if node.stage is not Stage.DONE:
                effects += self._conclude(node, CheckRule.CHECK_FAILED, result.error, now_ms)
        elif done_seq != node.seq:
            pass  # a retry of an answered order, or a poll
        elif isinstance(result, Ready) and node.stage is Stage.BEGUN:
            node.stage, node.deadline_ms = Stage.READY, None
        elif isinstance(result, ComputeDone) and node.stage is Stage.COMPUTING:
            measured = max(0.0, result.best_ms)  # a second measurement keeps the faster
            node.compute_ms = min(measured, node.compute_ms or measured)
            node.device = result.device
            node.stage, node.deadline_ms = Stage.IDLE, None
        elif isinstance(result, PairDone) and node.stage is Stage.PAIRING:
            self._pair_side(node_id, result)
        return effects + self.tick(now_ms, helpers)

    def helper_report(
        self, node_id: str, result: PairDone, now_ms: int, helpers: Sequence[str] = ()
    ) -> list[Effect]:
        """A healthy node's side of a helper pair; anything else is ignored."""
        cohort = self.cohort
        run = cohort.running.get(result.pair) if cohort is not None else None
        if run is None or not run.helper or run.b != node_id:
            return []
        self._pair_side(node_id, result)
        return self.tick(now_ms, helpers)

    def node_lost(self, node_id: str, now_ms: int, helpers: Sequence[str] = ()) -> list[Effect]:
        """The node died or left: it gets no verdict; its pairs blame it."""
        self._healthy_live.discard(node_id)
        self._forget(node_id)
        return self.tick(now_ms, helpers)

    def tick(self, now_ms: int, helpers: Sequence[str] = ()) -> list[Effect]:
        """Expire overdue steps, form the next cohort, hand out what can
        start, and judge a cohort whose pairs all ended."""
        effects = self._expire(now_ms)
        while True:
            if self.cohort is None and not self._form(now_ms):
                return effects
            assert self.cohort is not None
            effects += self._advance(self.cohort, now_ms, helpers)
            if self.cohort is not None:
                return effects  # still measuring; else the next may form at once

    # --------------------------------------------------------------- queries

    def order(self, node_id: str) -> tuple[int, Order]:
        """The node's current order and its sequence number."""
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id} has no check on this master")
        return node.seq, node.order

    def checking(self, node_id: str) -> bool:
        node = self.nodes.get(node_id)
        return node is not None and node.stage is not Stage.DONE

    def next_deadline(self) -> int | None:
        """When `tick` may next change something, for a timer."""
        deadlines = [n.deadline_ms for n in self.nodes.values() if n.deadline_ms is not None]
        gathering = self._gathering()
        if self.cohort is not None:
            deadlines += [run.deadline_ms for run in self.cohort.running.values()]
        elif gathering and all(n.stage is Stage.READY for n in gathering):
            # (while one is still starting, its report or its deadline comes first)
            deadlines.append(max(n.begun_ms for n in gathering) + self.settings.gather_ms)
        return min(deadlines, default=None)

    # ------------------------------------------------------------- the steps

    def _gathering(self) -> list[_Node]:
        return [n for n in self.nodes.values() if n.stage in (Stage.BEGUN, Stage.READY)]

    def _form(self, now_ms: int) -> bool:
        waiting = self._gathering()
        if not waiting or any(n.stage is Stage.BEGUN for n in waiting):
            return False
        enough = len(waiting) + len(self._healthy_live) >= self.settings.expected_nodes
        quiet = now_ms - max(n.begun_ms for n in waiting) >= self.settings.gather_ms
        if not (enough or quiet):
            return False
        self._cohorts += 1
        members = [n.node_id for n in sorted(waiting, key=lambda n: (n.begun_ms, n.node_id))]
        self.cohort = _Cohort(self._cohorts, members, now_ms, list(members))
        return True

    def _advance(self, cohort: _Cohort, now_ms: int, helpers: Sequence[str]) -> list[Effect]:
        busy = self._busy_hosts(cohort)
        for node_id in list(cohort.to_compute):
            node = self.nodes.get(node_id)
            if node is None or node.stage is Stage.DONE:
                cohort.to_compute.remove(node_id)
            elif node.host not in busy:
                cohort.to_compute.remove(node_id)
                busy.add(node.host)
                settings = self.settings
                self._give(node, ComputeOrder(settings.matmul_size, settings.matmul_repeats))
                node.stage = Stage.COMPUTING
                node.deadline_ms = now_ms + settings.step_timeout_ms
        computing = [m for m in cohort.members if self._stage(m) is Stage.COMPUTING]
        if computing or cohort.to_compute:
            return []
        suspects = [m for m in self._compute_suspects(cohort) if m not in cohort.measured_twice]
        if suspects and not cohort.planned:
            cohort.measured_twice.update(suspects)
            cohort.to_compute = suspects
            return self._advance(cohort, now_ms, helpers)
        if not cohort.planned:
            cohort.planned = True
            cohort.edges = self._plan(cohort, helpers)
        effects = self._start_pairs(cohort, now_ms, busy)
        if cohort.edges or cohort.running:
            return effects
        return effects + self._judge(cohort, now_ms)

    def _compute_suspects(self, cohort: _Cohort) -> list[str]:
        members = [self.nodes[m] for m in cohort.members if self.checking(m)]
        earlier = {k: v for k, v in self.healthy_compute.items() if k not in cohort.members}
        return compute_suspects(members, earlier, self.settings.slow_factor)

    def _plan(self, cohort: _Cohort, helpers: Sequence[str]) -> list[tuple[str, str, bool]]:
        """The cycle through the cohort; for a cohort of one or two while
        nodes past their check are there (`helpers`), a pair with one of
        them for each."""
        members = [m for m in cohort.members if self.checking(m)]
        usable = [h for h in helpers if not self.checking(h) and h not in members]
        usable.sort(key=lambda h: h not in self._healthy_live)  # known healthy first
        if len(members) < 3 and usable:
            return [(m, usable[i % len(usable)], True) for i, m in enumerate(members)]
        return [(a, b, False) for a, b in cycle_pairs(members)]

    def _start_pairs(self, cohort: _Cohort, now_ms: int, busy: set[str]) -> list[Effect]:
        effects: list[Effect] = []
        for edge in list(cohort.edges):
            a_id, b_id, helper = edge
            a, b = self.nodes.get(a_id), None if helper else self.nodes.get(b_id)
            if not self.checking(a_id) or not (helper or self.checking(b_id)):
                cohort.edges.remove(edge)  # a side is gone: nothing to measure
                continue
            assert a is not None
            if a.stage is not Stage.IDLE or a.host in busy or not a.store_port:
                continue
            if b is not None and (b.stage is not Stage.IDLE or b.host in busy):
                continue
            if helper and b_id in self._helper_busy:
                continue
            cohort.edges.remove(edge)
            effects += self._start_pair(cohort, a, b, b_id, now_ms)
            busy.add(a.host)
            if b is not None:
                busy.add(b.host)
        return effects

    def _start_pair(
        self, cohort: _Cohort, a: _Node, b: _Node | None, b_id: str, now_ms: int
    ) -> list[Effect]:
        settings = self.settings
        timeout = settings.step_timeout_ms if b is not None else settings.helper_timeout_ms
        cuda = b is not None and a.device.startswith("cuda") and b.device.startswith("cuda")
        self._pairs += 1
        order = PairOrder(
            pair=self._pairs,
            rank=0,
            peer=b_id,
            store_host=a.host,
            store_port=a.store_port,
            iterations=settings.allreduce_iterations,
            numel=settings.allreduce_numel,
            timeout_ms=timeout,
            backend="nccl" if cuda else "gloo",
        )
        a.store_port = 0  # taken: the next pair it hosts needs a fresh one
        # Both sides give up by themselves after `timeout`; the grace lets
        # their failure reports arrive before silence is assumed.
        deadline = now_ms + timeout + max(2_000, timeout // 4)
        run = PairRun(order.pair, a.node_id, b_id, b is None, now_ms, deadline)
        cohort.running[order.pair] = run
        self._give(a, order)
        a.stage = Stage.PAIRING
        peer_order = dataclasses.replace(order, rank=1, peer=a.node_id)
        if b is not None:
            self._give(b, peer_order)
            b.stage = Stage.PAIRING
            return []
        self._helper_busy.add(b_id)
        return [HelperPair(b_id, peer_order)]

    def _pair_side(self, node_id: str, result: PairDone) -> None:
        cohort = self.cohort
        run = cohort.running.get(result.pair) if cohort is not None else None
        if cohort is None or run is None or node_id not in (run.a, run.b):
            return
        run.sides[node_id] = PairSide(result.ok, max(0.0, result.allreduce_ms), result.error)
        if self._stage(node_id) is Stage.PAIRING:
            self.nodes[node_id].stage = Stage.IDLE
        if len(run.sides) == 2:
            self._end_pair(cohort, run)

    def _end_pair(self, cohort: _Cohort, run: PairRun) -> None:
        del cohort.running[run.pair]
        cohort.finished.append(run)
        self._helper_busy.discard(run.b)
        for node_id in (run.a, run.b):
            if self._stage(node_id) is Stage.PAIRING:
                self.nodes[node_id].stage = Stage.IDLE

    def _judge(self, cohort: _Cohort, now_ms: int) -> list[Effect]:
        members = [self.nodes[m] for m in cohort.members if self.checking(m)]
        earlier = {k: v for k, v in self.healthy_compute.items() if k not in cohort.members}
        factor = self.settings.slow_factor
        verdicts = judge(members, cohort.finished, earlier, factor, now_ms, cohort.formed_ms)
        self.cohort = None
        effects: list[Effect] = []
        for node in members:
            effects += self._record(node, verdicts[node.node_id])
        return effects

    def _expire(self, now_ms: int) -> list[Effect]:
        effects: list[Effect] = []
        timeout_s = f"{self.settings.step_timeout_ms / 1000:g}s"
        for node in list(self.nodes.values()):
            if node.deadline_ms is not None and now_ms >= node.deadline_ms:
                if node.stage is Stage.BEGUN:
                    startup = self.settings.startup_timeout_ms / 1000
                    why = f"did not start its check within {startup:g}s"
                else:
                    why = f"did not time its matmul within {timeout_s}"
                effects += self._conclude(node, CheckRule.HUNG, why, now_ms)
        cohort = self.cohort
        if cohort is None:
            return effects
        for run in [r for r in cohort.running.values() if now_ms >= r.deadline_ms]:
            self._end_pair(cohort, run)
            for node_id in (run.a,) if run.helper else (run.a, run.b):
                silent = self.nodes.get(node_id)
                if silent is not None and node_id not in run.sides and self.checking(node_id):
                    peer = run.peer(node_id)
                    why = f"no result for its all-reduce with {peer} within {timeout_s}"
                    effects += self._conclude(silent, CheckRule.HUNG, why, now_ms)
        return effects

    def _conclude(self, node: _Node, rule: CheckRule, why: str, now_ms: int) -> list[Effect]:
        """`node` failed or hung: faulty at once, out of its cohort's plans."""
        cohort = self.cohort
        formed = cohort.formed_ms if cohort is not None and node.node_id in cohort.members else None
        verdict = failed_verdict(node, rule, why, now_ms, self.settings.slow_factor, formed)
        self._abandon(node.node_id, "is out of the check")
        return self._record(node, verdict)

    def _record(self, node: _Node, verdict: Verdict) -> list[Effect]:
        self._give(node, verdict)
        node.stage, node.deadline_ms = Stage.DONE, None
        self.verdicts.pop(node.node_id, None)
        self.verdicts[node.node_id] = verdict
        while len(self.verdicts) > VERDICTS_KEPT:
            del self.verdicts[next(iter(self.verdicts))]
        if verdict.faulty:
            self.healthy_compute.pop(node.node_id, None)
        else:
            self._healthy_live.add(node.node_id)
            if verdict.compute_ms > 0:
                self.healthy_compute[node.node_id] = (node.host, verdict.compute_ms)
        return [verdict]

    # --------------------------------------------------------------- helpers

    def _stage(self, node_id: str) -> Stage | None:
        node = self.nodes.get(node_id)
        return node.stage if node is not None else None

    def _busy_hosts(self, cohort: _Cohort) -> set[str]:
        """Hosts measuring something now: one measurement per host at a time
        (a helper's host is training anyway)."""
        busy = {self.nodes[m].host for m in cohort.members if self._stage(m) is Stage.COMPUTING}
        for run in cohort.running.values():
            for node_id in (run.a,) if run.helper else (run.a, run.b):
                if node_id in self.nodes:
                    busy.add(self.nodes[node_id].host)
        return busy

    def _give(self, node: _Node, order: Order) -> None:
        node.seq += 1
        node.order = order

    def _forget(self, node_id: str) -> None:
        if self.nodes.pop(node_id, None) is not None:
            self._abandon(node_id, "left the job")

    def _abandon(self, node_id: str, why: str) -> None:
        """`node_id` takes no further part: its pairs under way wait for the
        other side alone, which is not held to them."""
        cohort = self.cohort
        if cohort is None:
            return
        if node_id in cohort.to_compute:
            cohort.to_compute.remove(node_id)
        for run in list(cohort.running.values()):
            if node_id in (run.a, run.b) and node_id not in run.sides:
                run.sides[node_id] = PairSide(False, 0.0, f"{node_id} {why}", gone=True)
                if len(run.sides) == 2:
                    self._end_pair(cohort, run)
