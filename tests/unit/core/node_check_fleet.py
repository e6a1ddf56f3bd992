"""A simulated fleet for the node check's board: each node has a matmul time
and a link speed, and does what the board orders, in simulated time.

A pair's all-reduce takes the slower of its two sides' link times (times a
jitter); a `broken` node's pairs fail on both sides; a `silent` node never
answers its pairs; a `mute` node never gets ready. Helpers (nodes past their
check) run the pairs pushed to them. Every step checks that a host measures
one thing at a time and that no node is in two pairs at once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from dlfleet.master.core.node_check import (
    CheckFailed,
    ComputeDone,
    ComputeOrder,
    Effect,
    HelperPair,
    NodeCheckBoard,
    NodeCheckSettings,
    PairDone,
    PairOrder,
    Ready,
)
from dlfleet.master.core.node_check_verdict import Verdict


@dataclass
class SimNode:
    name: str
    host: str
    compute_ms: float = 10.0
    link_ms: float = 5.0
    behaviour: str = "ok"  # ok | broken | silent | mute | crash
    noise_ms: float = 0.0  # added to its first matmul only (a moment of load on its host)
    computes: int = 0


@dataclass
class Fleet:
    settings: NodeCheckSettings
    seed: int = 0
    now: int = 1_000_000
    board: NodeCheckBoard = field(init=False)
    nodes: dict[str, SimNode] = field(default_factory=dict)
    helpers: dict[str, SimNode] = field(default_factory=dict)
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    pushed: list[HelperPair] = field(default_factory=list)  # not yet run by their helper
    all_pushed: list[HelperPair] = field(default_factory=list)
    done: dict[str, int] = field(default_factory=dict)  # the last order each node answered
    port: int = 40_000
    ready: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.board = NodeCheckBoard(self.settings, "check-1")
        self.rng = random.Random(self.seed)

    def helper_ids(self) -> list[str]:
        return sorted(self.helpers)

    def take(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Verdict):
                assert effect.node_id not in self.verdicts, f"second verdict for {effect.node_id}"
                self.verdicts[effect.node_id] = effect
            else:
                self.pushed.append(effect)
                self.all_pushed.append(effect)
        self.check_invariants()

    def begin(self, node: SimNode) -> None:
        self.nodes[node.name] = node
        self.done[node.name] = 0
        self.take(self.board.begin(node.name, node.host, self.now, self.helper_ids()))

    def report(self, name: str, done: int, result: object) -> None:
        self.port += 1
        self.take(
            self.board.report(
                name,
                done,
                result,  # type: ignore[arg-type]
                self.now,
                host=self.nodes[name].host,
                store_port=self.port,
                helpers=self.helper_ids(),
            )
        )

    def step(self) -> bool:
        """Every node with a new order carries it out; True if any did."""
        acted = False
        for name in list(self.nodes):
            node = self.nodes[name]
            if name in self.verdicts:
                continue
            seq, order = self.board.order(name)
            if name not in self.ready:
                if node.behaviour != "mute":
                    self.ready.add(name)
                    self.report(name, 0, Ready())
                    acted = True
                continue
            if seq <= self.done[name] or order is None:
                continue
            self.done[name] = seq
            acted = True
            if isinstance(order, ComputeOrder):
                if node.behaviour == "crash":
                    self.report(name, seq, CheckFailed("CUDA error: device-side assert"))
                else:
                    noise = node.noise_ms if node.computes == 0 else 0.0
                    node.computes += 1
                    self.report(name, seq, ComputeDone(node.compute_ms + noise, "cpu"))
            elif isinstance(order, PairOrder):
                self.pair_side(name, seq, order)
        for push in list(self.pushed):
            helper = self.helpers.get(push.helper)
            if helper is not None:
                self.pushed.remove(push)
                ms = max(helper.link_ms, self.peer_link(push.order.peer)) * self.jitter()
                result = PairDone(push.order.pair, True, ms)
                self.take(self.board.helper_report(helper.name, result, self.now))
                acted = True
        return acted

    def peer_link(self, name: str) -> float:
        node = self.nodes.get(name) or self.helpers.get(name)
        return node.link_ms if node is not None else 0.0

    def jitter(self) -> float:
        return self.rng.uniform(1.0, 1.15)

    def pair_side(self, name: str, seq: int, order: PairOrder) -> None:
        me = self.nodes[name]
        peer = self.nodes.get(order.peer) or self.helpers.get(order.peer)
        if me.behaviour == "silent":
            return
        if peer is None or peer.behaviour == "silent":
            self.report(name, seq, PairDone(order.pair, False, 0, "timed out waiting for peer"))
            return
        if "broken" in (me.behaviour, peer.behaviour):
            self.report(name, seq, PairDone(order.pair, False, 0, "Connection reset by peer"))
            return
        ms = max(me.link_ms, peer.link_ms) * self.jitter()
        self.report(name, seq, PairDone(order.pair, True, ms))

    def run(self, limit_ms: int = 600_000) -> dict[str, Verdict]:
        """Until every node has its verdict, time moving on when nobody acts."""
        deadline = self.now + limit_ms
        while len(self.verdicts) < len(self.nodes) and self.now < deadline:
            if not self.step():
                self.now = max(self.now + 100, min(self.board.next_deadline() or 0, deadline))
                self.take(self.board.tick(self.now, self.helper_ids()))
        return self.verdicts

    def check_invariants(self) -> None:
        cohort = self.board.cohort
        if cohort is None:
            return
        in_pairs = [n for run in cohort.running.values() for n in (run.a, run.b)]
        assert len(in_pairs) == len(set(in_pairs)), f"a node in two pairs: {in_pairs}"
        hosts: list[str] = []
        for entry in self.board.nodes.values():
            if entry.stage.value == "computing":
                hosts.append(entry.host)
        for run in cohort.running.values():
            assert run.a != run.b
            sides = (run.a,) if run.helper else (run.a, run.b)
            hosts += {self.board.nodes[n].host for n in sides if n in self.board.nodes}
        assert len(hosts) == len(set(hosts)), f"a host measures two things at once: {hosts}"
