"""The master's CPU per RPC on its hot paths, in CPU seconds per 1,000 calls:
a number that does not depend on how loaded the machine is (wall time does).

    python bench/master_cpu.py                  # 1,000 nodes
    python bench/master_cpu.py --nodes 2000 --repeat 3
    python bench/master_cpu.py --nodes 2000 --profile /tmp/prof

One real `dlmaster` (SQLite store) in its own process; this process is every
client, with a connection per node as agents have (`--channels` for fewer) and
their keepalive pings. Per phase, the master's user + system CPU time (all its
threads, /proc/PID/stat) from before the phase's first call to after its last
answer:

* idle: every node registered, its session open, nothing sent for `--idle` s
  (keepalive pings only): cores per 1,000 nodes.
* join: every node (registered, its session stream open: not counted) joins
  at once on its session (`SessionMessage.join`, as the agent joins); the
  round forms when the last arrives (min = max = N); every answer is read.
* heartbeat: `Nodes.Heartbeat` unary calls, 64 in flight.
* session beat: one `SessionMessage` with node metrics per node on its open
  session stream (how real agents beat), a few times over.
* paced beat: the same beats, every node's every `--interval` s spread
  evenly over `--paced` s, as a fleet's arrive (each wakes the master alone).
* lease stream: 64 `LeaseStream`s (as loaders lease), one message each way
  per pair: the request reports the previous shard done and leases the next.
* lease+ack unary: async-mode (rank consumer) `Lease` then `Report(done)`,
  64 in flight: two calls per pair, for reference.

`--profile DIR`: the master runs under cProfile, one profile per phase
(bench/_profiled.py); the CPU numbers then include the profiler's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from _common import ServerProcess, free_port, say

from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.api.v1 import (
    nodes_pb2,
    nodes_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    shards_pb2,
    shards_pb2_grpc,
)

PROFILED = Path(__file__).resolve().parent / "_profiled.py"
IN_FLIGHT = 64
# As the agents' client (dlfleet.api.client) pings an idle master.
KEEPALIVE = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


class Master:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.profile = args.profile
        argv = [
            "-m", "dlfleet.master", "--port", str(self.port),
            "--store", f"sqlite:///{workdir / 'master.db'}", "--token", self.token,
            "--job-name", "job", "--min-nodes", str(args.nodes), "--max-nodes", str(args.nodes),
            "--heartbeat-interval", "60", "--heartbeat-timeout", "600",
            "--last-call-timeout", "30", "--lease-timeout", "600", "--log-level", "WARNING",
        ]  # fmt: skip
        if args.profile:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            argv = [str(PROFILED), str(Path(args.profile).resolve() / "master"), *argv[2:]]
        self.server = ServerProcess(
            "dlmaster", [sys.executable, *argv], workdir / "master.log", None
        )
        self.server.wait_ready(self.port, 60.0)

    def cpu(self) -> float:
        seconds: float = self.server.cpu_seconds()
        return seconds

    def cut_profile(self) -> None:
        if self.profile:
            os.kill(self.server.proc.pid, signal.SIGUSR1)
            time.sleep(0.5)


async def bounded(call: Callable[[int], Awaitable[Any]], count: int, in_flight: int) -> None:
    """`call(0)` .. `call(count - 1)`, `in_flight` at a time."""
    queue = iter(range(count))

    async def worker() -> None:
        for k in queue:
            await call(k)

    await asyncio.gather(*(worker() for _ in range(in_flight)))


class Session:
    """A node's open session stream: messages are put, nothing is awaited;
    the answers to joins sent on it are read into `joined`."""

    def __init__(self, stub: Any, meta: Any) -> None:
        self.outbox: asyncio.Queue[rendezvous_pb2.SessionMessage | None] = asyncio.Queue()
        self.call = stub.Session(self._messages(), metadata=meta)
        self.joined: asyncio.Future[rendezvous_pb2.SessionJoined] = (
            asyncio.get_running_loop().create_future()
        )
        self.reader = asyncio.ensure_future(self._read())

    async def _messages(self) -> AsyncIterator[rendezvous_pb2.SessionMessage]:
        while (message := await self.outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            async for event in self.call:
                if event.HasField("joined") and not self.joined.done():
                    self.joined.set_result(event.joined)


class Fleet:
    """Every node's client side: its connection, registration and session."""

    def __init__(self, master: Master, args: argparse.Namespace) -> None:
        self.master = master
        self.meta = ((TOKEN_METADATA_KEY, master.token),)
        self.channels = [
            grpc.aio.insecure_channel(f"127.0.0.1:{master.port}", options=KEEPALIVE)
            for _ in range(args.channels)
        ]
        self.n: int = args.nodes
        self.ids: list[tuple[str, int]] = []
        self.sessions: list[Session] = []
        self.round = 0

    # The generated stubs are typed for the blocking channel: Any for aio's.
    def nodes(self, k: int) -> Any:
        return nodes_pb2_grpc.NodesStub(self.channels[k % len(self.channels)])

    def rendezvous(self, k: int) -> Any:
        return rendezvous_pb2_grpc.RendezvousStub(self.channels[k % len(self.channels)])

    def shards(self, k: int) -> Any:
        return shards_pb2_grpc.ShardsStub(self.channels[k % len(self.channels)])

    async def settled(self) -> None:
        """No answer to wait for: until the master's CPU stops moving."""
        last = self.master.cpu()
        while True:
            await asyncio.sleep(1.0)
            now = self.master.cpu()
            if now - last < 0.02:
                return
            last = now

    async def register(self) -> float:
        """Every node registers and opens its session: CPU s per 1,000."""
        cpu0 = self.master.cpu()
        ids: dict[int, tuple[str, int]] = {}

        async def one(i: int) -> None:
            reply = await self.nodes(i).Register(
                nodes_pb2.RegisterNodeRequest(
                    job_name="job", node_name=f"node-{i}", local_world_size=8, host=f"h{i}"
                ),
                metadata=self.meta,
            )
            ids[i] = (reply.node_id, reply.incarnation)

        await bounded(one, self.n, IN_FLIGHT)
        self.ids = [ids[i] for i in range(self.n)]
        for k, (node_id, inc) in enumerate(self.ids):
            session = Session(self.rendezvous(k), self.meta)
            first = rendezvous_pb2.SessionMessage(node_id=node_id, incarnation=inc)
            session.outbox.put_nowait(first)
            self.sessions.append(session)
        await self.settled()
        return (self.master.cpu() - cpu0) / self.n * 1000

    async def idle(self, seconds: float) -> float:
        """Cores per 1,000 nodes while they only hold their sessions open."""
        cpu0, t0 = self.master.cpu(), time.monotonic()
        await asyncio.sleep(seconds)
        return (self.master.cpu() - cpu0) / (time.monotonic() - t0) / self.n * 1000

    async def join(self) -> float:
        cpu0 = self.master.cpu()
        for k, (node_id, inc) in enumerate(self.ids):
            request = rendezvous_pb2.JoinRequest(
                node_id=node_id, incarnation=inc, local_world_size=8, host=f"h{k}",
                bootstrap_port=1234,
            )  # fmt: skip
            self.sessions[k].outbox.put_nowait(
                rendezvous_pb2.SessionMessage(
                    node_id=node_id, incarnation=inc, join=request, join_id=1
                )
            )
        events = await asyncio.gather(*(session.joined for session in self.sessions))
        cpu = self.master.cpu() - cpu0
        assert not any(e.HasField("error") for e in events), [e.error for e in events][:3]
        joined = [e.answer for e in events]
        assert sorted(j.group_rank for j in joined) == list(range(self.n)), "bad world"
        self.round = joined[0].round
        return cpu / self.n * 1000

    async def heartbeat(self, calls: int) -> float:
        async def one(k: int) -> None:
            node_id, inc = self.ids[k % self.n]
            request = nodes_pb2.HeartbeatRequest(node_id=node_id, incarnation=inc)
            await self.nodes(k).Heartbeat(request, metadata=self.meta)

        cpu0 = self.master.cpu()
        await bounded(one, calls, IN_FLIGHT)
        return (self.master.cpu() - cpu0) / calls * 1000

    def beat(self, k: int, r: int) -> None:
        """Node `k`'s beat with its metrics, as an agent sends it."""
        node_id, inc = self.ids[k]
        metrics = rendezvous_pb2.NodeMetrics(
            cpu_percent=700.0 + r, rss_bytes=1 << 33, peak_rss_bytes=1 << 34,
            steps_per_second=2.5, samples_per_second=80.0, step_time_ms=400.0, steps=r + k,
        )  # fmt: skip
        beat = rendezvous_pb2.SessionMessage(
            node_id=node_id, incarnation=inc, round=self.round, metrics=metrics
        )
        self.sessions[k].outbox.put_nowait(beat)

    async def session_beats(self, calls: int) -> float:
        """Every node beats at once, `calls // N` times: the cost of a beat
        read in a burst."""
        rounds = max(1, calls // self.n)
        cpu0 = self.master.cpu()
        for r in range(rounds):
            for k in range(self.n):
                self.beat(k, r)
            await asyncio.sleep(0)
        await self.settled()
        return (self.master.cpu() - cpu0) / (rounds * self.n) * 1000

    async def paced_beats(self, interval_s: float, seconds: float) -> float:
        """Every node beats every `interval_s`, spread evenly (as a fleet's
        beats arrive) for `seconds`: the cost of a beat in steady state."""
        beats = 0
        cpu0, t0 = self.master.cpu(), time.monotonic()
        while (now := time.monotonic() - t0) < seconds:
            due = int(now / interval_s * self.n)
            while beats < due:
                self.beat(beats % self.n, beats // self.n)
                beats += 1
            await asyncio.sleep(0.005)
        await self.settled()
        return (self.master.cpu() - cpu0) / max(1, beats) * 1000

    async def dataset(self, name: str) -> None:
        spec = shards_pb2.DatasetSpec(name=name, size=10**8, batch_size=32, shard_size=64, epochs=1)
        request = shards_pb2.RegisterDatasetRequest(spec=spec)
        await self.shards(0).RegisterDataset(request, metadata=self.meta)

    async def lease_stream(self, pairs: int) -> float:
        await self.dataset("s")
        per_stream = max(1, pairs // IN_FLIGHT)

        async def one(k: int) -> None:
            call = self.shards(k).LeaseStream(metadata=self.meta)
            consumer = shards_pb2.RankConsumer(node_id=self.ids[k % self.n][0], rank=0)
            done: list[int] = []
            for i in range(per_stream):
                request = shards_pb2.LeaseRequest(
                    dataset="s", rank=consumer, request_id=f"{k}-{i}", done=done
                )
                await call.write(request)
                reply = await call.read()
                assert reply.WhichOneof("outcome") == "shard", reply
                done = [reply.shard.lease_id]
            last = shards_pb2.ReportRequest(
                dataset="s", lease_id=done[0], done=shards_pb2.ShardDone()
            )
            await self.shards(k).Report(last, metadata=self.meta)
            await call.done_writing()

        cpu0 = self.master.cpu()
        await asyncio.gather(*(one(k) for k in range(IN_FLIGHT)))
        return (self.master.cpu() - cpu0) / (per_stream * IN_FLIGHT) * 1000

    async def lease_ack(self, pairs: int) -> float:
        await self.dataset("d")

        async def one(k: int) -> None:
            stub = self.shards(k)
            consumer = shards_pb2.RankConsumer(node_id=self.ids[k % self.n][0], rank=0)
            lease = shards_pb2.LeaseRequest(dataset="d", rank=consumer)
            reply = await stub.Lease(lease, metadata=self.meta)
            assert reply.WhichOneof("outcome") == "shard", reply
            done = shards_pb2.ReportRequest(
                dataset="d", lease_id=reply.shard.lease_id, done=shards_pb2.ShardDone()
            )
            await stub.Report(done, metadata=self.meta)

        cpu0 = self.master.cpu()
        await bounded(one, pairs, IN_FLIGHT)
        return (self.master.cpu() - cpu0) / pairs * 1000

    async def close(self) -> None:
        for session in self.sessions:
            session.outbox.put_nowait(None)
            session.call.cancel()
            session.reader.cancel()
        for channel in self.channels:
            await channel.close()


async def measure(master: Master, args: argparse.Namespace) -> dict[str, float]:
    """Each phase's master CPU: s per 1,000 calls (idle: cores per 1,000 nodes)."""
    fleet = Fleet(master, args)
    results: dict[str, float] = {}
    try:
        phases: list[tuple[str, Callable[[], Awaitable[float]]]] = [
            ("register+session", fleet.register),
            ("idle, cores", lambda: fleet.idle(args.idle)),
            ("join", fleet.join),
            ("heartbeat", lambda: fleet.heartbeat(args.calls)),
            ("session beat", lambda: fleet.session_beats(args.calls)),
            ("paced beat", lambda: fleet.paced_beats(args.interval, args.paced)),
            ("lease stream", lambda: fleet.lease_stream(args.calls)),
            ("lease+ack unary", lambda: fleet.lease_ack(args.calls)),
        ]
        for name, phase in phases:
            results[name] = await phase()
            master.cut_profile()
    finally:
        await fleet.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=1000, help="nodes that join (1000)")
    parser.add_argument("--calls", type=int, default=5000, help="heartbeats, lease+acks (5000)")
    parser.add_argument(
        "--channels", type=int, default=0, help="connections (0: one per node, like agents)"
    )
    parser.add_argument("--idle", type=float, default=20.0, help="s of the idle window (20)")
    parser.add_argument("--interval", type=float, default=5.0, help="s between paced beats (5)")
    parser.add_argument("--paced", type=float, default=10.0, help="s of paced beats (10)")
    parser.add_argument("--repeat", type=int, default=1, help="runs, a fresh master each (1)")
    parser.add_argument("--profile", help="a folder: the master under cProfile, a file a phase")
    args = parser.parse_args(argv)
    args.channels = args.channels or args.nodes
    runs: list[dict[str, float]] = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="dlfleet-mcpu-") as tmp:
            master = Master(args, Path(tmp))
            try:
                runs.append(asyncio.run(measure(master, args)))
            except BaseException:
                say(master.server.tail())
                raise
            finally:
                master.server.stop()
        say("  " + ", ".join(f"{name} {value:.3f}" for name, value in runs[-1].items()))
    say(
        f"master CPU s per 1,000 calls at {args.nodes} nodes, {args.calls} calls, "
        f"median of {len(runs)} (min-max):"
    )
    for name in runs[0]:
        values = sorted(run[name] for run in runs)
        say(f"  {name:<16} {statistics.median(values):.3f} ({values[0]:.3f}-{values[-1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
