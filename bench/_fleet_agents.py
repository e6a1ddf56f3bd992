"""One process of bench/fleet.py's simulated agents: many nodes, each what a
real `dlworker` is to the master, driven by the orchestrator over stdin/stdout.

Each simulated node is built from the real client (dlfleet.api.client): its
own `MasterClient` with a TCP connection of its own, `Nodes.Register`, a real
`AgentSession` (the agent's session stream: heartbeats at the interval the
master gave at registration, carrying `NodeMetrics` like an agent's sampler
does; re-rendezvous pushes coming down), and the join on that session
(`AgentSession.join_async`, the agent's `join`) -- again after every push, as
the agent does. What it does not do is train: no worker
processes, no leases. All nodes of a process share one asyncio loop (the
client's), which is what lets a few processes carry thousands of nodes.

Protocol (one line each; replies on stdout, everything else on stderr):
    -> READY                      every node registered, its session open
    <- GO <t0>                    every node joins at t0 (time.monotonic())
    -> JOINED <json>              when every node's join returned
    <- STATE                      -> STATE <json>: each node's last round, world, times
    <- SUMMARY <round> <world>    -> SUMMARY <json>: its nodes in a later round of that world
    <- PROBES                     -> PROBES <json>: heartbeat RTTs (ms) since the last PROBES
    <- SILENCE <k>                the process's k-th node stops heartbeating
    -> SILENCED <t>               its last heartbeat went out at t
    <- QUIT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import sys
import threading
import time
from typing import Any

from dlfleet.api.client import AgentSession, MasterClient, ReRendezvous, join_request
from dlfleet.api.v1 import rendezvous_pb2
from dlfleet.master.service.app import tune_gc

JOB_NAME = "job"
SETUP_BATCH = 200


class _Pushes(queue.Queue[ReRendezvous]):
    """The session's event queue, handing each push straight to its node on
    the loop (the real agent's thread polls the queue; thousands of threads
    would not fit in one process)."""

    def __init__(self, node: SimNode) -> None:
        super().__init__()
        self._node = node

    def put(self, item: ReRendezvous, block: bool = True, timeout: float | None = None) -> None:
        self._node.pushed(item)


class SimNode:
    def __init__(self, index: int, target: str, token: str, run_id: str) -> None:
        self.index = index
        self.name = f"{run_id}-node-{index}"
        self.client = MasterClient(target, token=token, timeout_s=60.0, own_connection=True)
        self.node_id = ""
        self.incarnation = 0
        self.session: AgentSession | None = None
        self.interval_s = 5.0
        # The latest join's outcome and when things happened (monotonic s).
        self.round = 0
        self.rank = -1
        self.world = 0
        self.joined_t = 0.0
        self.pushed_t = 0.0
        self.pushes = 0
        self.joins = 0
        self.error = ""
        self.silent = False  # partitioned: no heartbeat of any kind goes out
        self.probed_t = 0.0  # when its last heartbeat probe went out
        self._joining: asyncio.Task[None] | None = None

    async def register(self) -> None:
        reg = await self.client.register_node_async(
            job_name=JOB_NAME, node_name=self.name, local_world_size=1, host="127.0.0.1"
        )
        self.node_id, self.incarnation = reg.node_id, reg.incarnation
        self.interval_s = reg.heartbeat_interval_ms / 1000
        # At once, as the agent does: a node registered but silent for a
        # heartbeat timeout is dropped.
        self.open_session()

    def open_session(self) -> None:
        self.session = self.client.agent_session(self.node_id, self.incarnation, self.interval_s)
        self.session.events = _Pushes(self)
        # What an agent's sampler reports of a node training steadily.
        self.session.metrics = rendezvous_pb2.NodeMetrics(
            cpu_percent=95.0 + self.index % 5,
            rss_bytes=3_000_000_000 + self.index,
            peak_rss_bytes=3_200_000_000,
            steps_per_second=2.0,
            samples_per_second=64.0,
            step_time_ms=500.0,
            steps=1000,
        )

    async def join(self) -> None:
        assert self.session is not None
        # Two ports as an agent picks them: new ones each join (never bound
        # here: a simulated node starts no store).
        port = 20_000 + 2 * (self.joins % 20_000)
        self.joins += 1
        request = join_request(
            self.node_id, self.incarnation, 1, "127.0.0.1", port, next_bootstrap_port=port + 1
        )
        try:
            result = await self.session.join_async(request, timeout_s=600.0)
        except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.round = int(result.round)
        self.rank = int(result.group_rank)
        self.world = int(result.group_world_size)
        self.joined_t = time.monotonic()
        if self.session is not None:
            self.session.round = self.round

    def pushed(self, push: ReRendezvous) -> None:
        """A re-rendezvous: join again, as the agent does (on the loop)."""
        self.pushed_t = time.monotonic()
        self.pushes += 1
        if self.session is not None:
            self.session.round = 0
        self._joining = asyncio.get_running_loop().create_task(self.join())

    def state(self) -> list[Any]:
        return [self.round, self.world, self.joined_t, self.pushed_t, self.pushes, self.error]


async def probe(nodes: list[SimNode], every_s: float, rtts: list[float]) -> None:
    """A heartbeat RPC from each probe node every `every_s`: its round trip
    through the master's loop, which carries every node's session beats."""
    while True:
        started = time.monotonic()
        for node in nodes:
            if node.silent:
                continue
            t = node.probed_t = time.monotonic()
            try:
                await node.client.heartbeat_async(node.node_id, node.incarnation)
            except Exception:  # noqa: BLE001 - a failed probe counts as no sample
                continue
            rtts.append((time.monotonic() - t) * 1000)
        await asyncio.sleep(max(0.0, every_s - (time.monotonic() - started)))


class Simulator:
    """This process's nodes, and the orchestrator's commands carried out."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)  # what the libraries print goes to stderr
        self._lock = threading.Lock()
        self.nodes = [
            SimNode(i, args.target, args.token, args.run_id)
            for i in range(args.first, args.first + args.count)
        ]
        self.loop = self.nodes[0].client.io_loop
        for node in self.nodes[1:]:
            node.client.io_loop  # noqa: B018 - opens its channel, outside the loop
        self.rtts: list[float] = []
        self._probing: asyncio.Task[None] | None = None

    def emit(self, line: str) -> None:
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()

    def on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(600.0)

    async def register_all(self) -> None:
        nodes = self.nodes
        for start in range(0, len(nodes), SETUP_BATCH):
            await asyncio.gather(*(n.register() for n in nodes[start : start + SETUP_BATCH]))

    async def join_all(self, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        await asyncio.gather(*(n.join() for n in self.nodes))
        self.emit("JOINED " + json.dumps([[n.rank, *n.state()] for n in self.nodes]))
        if self.args.probes:
            probes = self.nodes[: self.args.probes]
            self._probing = self.loop.create_task(probe(probes, self.args.probe_every, self.rtts))

    async def take_rtts(self) -> list[float]:
        out = list(self.rtts)
        self.rtts.clear()
        return out

    def summary(self, after_round: int, world: int) -> dict[str, Any]:
        """What the orchestrator polls while a fleet re-forms, in a few bytes
        (all nodes' states, polled 5 times a second, would take CPU from the
        master being measured): this process's nodes in a round after
        `after_round` of `world` nodes, and when they were pushed and joined."""
        members = [n for n in self.nodes if n.round > after_round and n.world == world]
        errors = [n.error for n in self.nodes if n.error]
        return {
            "members": len(members),
            "rounds": sorted({n.round for n in members}),
            "first_push": min((n.pushed_t for n in members), default=None),
            "last_push": max((n.pushed_t for n in members), default=None),
            "last_join": max((n.joined_t for n in members), default=None),
            "errors": len(errors),
            "error": errors[0] if errors else "",
        }

    def silence(self, index: int) -> None:
        node = self.nodes[index]
        session = node.session
        assert session is not None
        node.silent = True
        self.loop.call_soon_threadsafe(session.silence)
        time.sleep(0.5)
        # Its last heartbeat of either kind (a probe in flight has landed).
        self.emit(f"SILENCED {max(session.last_beat_s, node.probed_t)!r} {node.node_id}")

    def serve(self) -> None:
        self.on_loop(self.register_all())
        # One process carries thousands of agents (a real one carries its
        # own): their sessions, channels and loops, set up now, are moved out
        # of the collector's sight, as the master does with its state, so
        # that full collections over all of them do not bill the
        # simulation's CPU to the fleet.
        tune_gc()
        self.emit("READY")
        for line in sys.stdin:
            words = line.split() or [""]
            if words[0] == "GO":
                asyncio.run_coroutine_threadsafe(self.join_all(float(words[1])), self.loop)
            elif words[0] == "STATE":
                self.emit("STATE " + json.dumps([n.state() for n in self.nodes]))
            elif words[0] == "SUMMARY":
                self.emit("SUMMARY " + json.dumps(self.summary(int(words[1]), int(words[2]))))
            elif words[0] == "PROBES":
                self.emit("PROBES " + json.dumps(self.on_loop(self.take_rtts())))
            elif words[0] == "SILENCE":
                self.silence(int(words[1]))
            elif words[0] == "QUIT":
                break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="bench/fleet.py's simulated agents")
    parser.add_argument("--target", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--probes", type=int, default=0, help="nodes that also probe")
    parser.add_argument("--probe-every", type=float, default=1.0)
    Simulator(parser.parse_args(argv)).serve()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
