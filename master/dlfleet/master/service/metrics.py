"""The master's Prometheus metrics, in a registry of its own (several masters
in one test process must not share the global one).

Three kinds, to keep the request path cheap:
- facts the state already holds (the round, nodes by state, dataset progress,
  the live nodes' latest heartbeat metrics) are read by `StateCollector` only
  when `/metrics` is scraped, and cost the RPCs nothing; a node's series go
  when it leaves;
- events (RPCs and their latency, leases, acks and renewals, store commits,
  lost nodes, worker failures and restarts, finished shards) are counted as
  they happen, through label children cached per label value so that a count
  is one dict look-up and one locked add;
- the job's goodput ledger (`core/goodput.py`): its ratio, productive
  seconds and lost seconds by cause, read at scrape time (`GoodputCollector`);
- what only the job's supervisor sees (the brain's plans, node exits as the
  platform reports them, master restarts) arrives as running totals with its
  status requests (`job_pb2.SupervisorTotals`), and the latest are exported
  as they are (`SupervisorCollector`).

Units are in the names (`_seconds`, `_bytes`), counters end in `_total`.

Lives in the master service process.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dlfleet.api.serving.tokens import AsyncContinuation
from dlfleet.api.v1 import job_pb2, rendezvous_pb2
from dlfleet.master.core.events import (
    EpochCompleted,
    Event,
    LeaseDone,
    LeaseGranted,
    LeaseReleased,
    ShardFailed,
)
from dlfleet.master.core.goodput import Cause, Goodput
from dlfleet.master.service.state import MasterState

NodeMetricsView = Mapping[str, tuple[rendezvous_pb2.NodeMetrics, int]]

# gRPC latencies on one loop: a lease answers in well under a millisecond, a
# join waits for its round (seconds, up to the join timeout).
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60)
_COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# What `Membership.node_lost` is told, as a bounded label (a Leave's reason is
# the client's free text: anything else is "left").
_LOST_REASONS = {
    "missed its heartbeats": "heartbeat_missed",
    "lost its session": "session_lost",
    "deregistered": "deregistered",
    "was replaced by a new incarnation": "replaced",
    "its master was restarted": "master_restarted",
}


def lost_reason_label(reason: str) -> str:
    return _LOST_REASONS.get(reason, "left")


def failure_reason_label(report: rendezvous_pb2.FailureReport) -> str:
    """A worker failure as a bounded label: `hang` (the agent's watchdog
    stopped it), its signal, else `exit`."""
    if report.message.lstrip().startswith("hung:"):
        return "hang"
    signal = report.signal.strip()
    if signal.startswith("SIG") and signal[3:].isalnum() and len(signal) <= 12:
        return signal
    return "exit"


class MasterMetrics:
    """The event metrics, and the registry `/metrics` exposes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self._rpcs = Counter(
            "dlfleet_rpc_requests", "RPCs answered, by method and status code",
            ["method", "code"], registry=reg,
        )  # fmt: skip
        self._rpc_seconds = Histogram(
            "dlfleet_rpc_duration_seconds",
            "Time to answer a unary RPC (Lease, Report = ack, Renew, Join, ...), by status code",
            ["method", "code"], buckets=_RPC_BUCKETS, registry=reg,
        )  # fmt: skip
        self._lease_seconds = Histogram(
            "dlfleet_shard_lease_duration_seconds",
            "Time from a lease request to its durable answer, unary or streamed (acks ride on it)",
            buckets=_RPC_BUCKETS, registry=reg,
        )  # fmt: skip
        self._ack_seconds = Histogram(
            "dlfleet_shard_ack_duration_seconds",
            "Time from an ack (a Report of done, or the done list of a lease request) "
            "to its durable answer",
            buckets=_RPC_BUCKETS, registry=reg,
        )  # fmt: skip
        self._renew_seconds = Histogram(
            "dlfleet_shard_renew_duration_seconds",
            "Time from a lease renewal to its durable answer",
            buckets=_RPC_BUCKETS, registry=reg,
        )  # fmt: skip
        self._commit_seconds = Histogram(
            "dlfleet_store_commit_duration_seconds",
            "Time of one group commit to the durable store",
            buckets=_COMMIT_BUCKETS, registry=reg,
        )  # fmt: skip
        self._committed = Counter(
            "dlfleet_store_committed_entries", "Journal entries made durable", registry=reg
        )
        self._nodes_lost = Counter(
            "dlfleet_node_failures", "Nodes dropped from the job, by reason",
            ["reason"], registry=reg,
        )  # fmt: skip
        self._heartbeats_missed = Counter(
            "dlfleet_heartbeats_missed",
            "Nodes dropped because their heartbeats stopped", registry=reg,
        )  # fmt: skip
        self._worker_failures = Counter(
            "dlfleet_worker_failures", "Worker failures the agents reported, by reason",
            ["reason"], registry=reg,
        )  # fmt: skip
        self._worker_restarts = Counter(
            "dlfleet_worker_restarts",
            "Worker-group restarts after a failure, by the failure's reason "
            "(a new round restarts workers too: see rendezvous_rounds_formed)",
            ["reason"], registry=reg,
        )  # fmt: skip
        self._node_checks = Counter(
            "dlfleet_node_checks", "Pre-flight node check verdicts, by verdict and rule",
            ["verdict", "rule"], registry=reg,
        )  # fmt: skip
        self._node_check_seconds = Histogram(
            "dlfleet_node_check_duration_seconds",
            "From a node's check beginning to its verdict",
            buckets=(0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300), registry=reg,
        )  # fmt: skip
        # A shard event's type -> the counter of its kind, by dataset.
        self._shard_counters: dict[type[Event], Counter] = {
            LeaseGranted: Counter(
                "dlfleet_shards_leased", "Shard leases granted", ["dataset"], registry=reg
            ),
            LeaseDone: Counter(
                "dlfleet_shards_done", "Shard leases acknowledged done", ["dataset"], registry=reg
            ),
            LeaseReleased: Counter(
                "dlfleet_shards_released",
                "Shard leases released unfinished (expiry, a lost holder, a closed round)",
                ["dataset"], registry=reg,
            ),
            ShardFailed: Counter(
                "dlfleet_shard_failures", "Shard leases reported failed", ["dataset"], registry=reg
            ),
            EpochCompleted: Counter(
                "dlfleet_epochs_completed", "Epochs every record of which is done",
                ["dataset"], registry=reg,
            ),
        }  # fmt: skip
        self._children: dict[tuple[Any, ...], Any] = {}
        self.supervisor = SupervisorCollector()
        reg.register(self.supervisor)

    def watch(self, collector: Collector) -> None:
        self.registry.register(collector)

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def rpc_done(self, method: str, code: str, seconds: float | None) -> None:
        self._child(self._rpcs, method, code).inc()
        if seconds is not None:
            self._child(self._rpc_seconds, method, code).observe(seconds)

    def leased(self, seconds: float, acked: bool) -> None:
        """A lease answered; `acked` when the request also acknowledged shards."""
        self._lease_seconds.observe(seconds)
        if acked:
            self._ack_seconds.observe(seconds)

    def acked(self, seconds: float) -> None:
        self._ack_seconds.observe(seconds)

    def renewed(self, seconds: float) -> None:
        self._renew_seconds.observe(seconds)

    def committed(self, seconds: float, entries: int) -> None:
        """Called on the group committer's writer thread (the metrics lock)."""
        self._commit_seconds.observe(seconds)
        self._committed.inc(entries)

    def node_lost(self, reason: str) -> None:
        label = lost_reason_label(reason)
        self._child(self._nodes_lost, label).inc()
        if label == "heartbeat_missed":
            self._heartbeats_missed.inc()

    def worker_failed(self, report: rendezvous_pb2.FailureReport) -> None:
        label = failure_reason_label(report)
        self._child(self._worker_failures, label).inc()
        if report.restarting:
            self._child(self._worker_restarts, label).inc()

    def node_checked(self, rule: str, faulty: bool, seconds: float) -> None:
        self._child(self._node_checks, "faulty" if faulty else "healthy", rule).inc()
        self._node_check_seconds.observe(seconds)

    def shard_events(self, events: Sequence[Event]) -> None:
        for event in events:
            counter = self._shard_counters.get(type(event))
            if counter is not None:
                self._child(counter, event.dataset).inc()


class StateCollector(Collector):
    """Gauges read from the master's state at scrape time (on the loop thread
    that serves the scrape, the one that owns the state)."""

    def __init__(
        self, state: MasterState, node_metrics: NodeMetricsView, clock: Callable[[], int]
    ) -> None:
        self.state = state
        self.node_metrics = node_metrics
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        yield from self._rendezvous()
        yield from self._datasets()
        yield from self._node_metrics()

    def _rendezvous(self) -> Iterator[Metric]:
        rdzv = self.state.rendezvous.state
        active = rdzv.active
        formed = CounterMetricFamily(
            "dlfleet_rendezvous_rounds_formed", "Rendezvous rounds formed in the job so far"
        )
        formed.add_metric([], rdzv.last_round)
        yield formed
        members = {m.node_id for m in active.members} if active is not None else set()
        world = sum(active.local_world_sizes()) if active is not None else 0
        for name, doc, value in (
            (
                "dlfleet_rendezvous_round",
                "The active round, 0 if none",
                active.round if active else 0,
            ),
            ("dlfleet_world_size", "Processes in the active round", world),
            ("dlfleet_round_nodes", "Nodes in the active round", len(members)),
        ):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], value)
            yield gauge
        live = [record.node_id for record in self.state.nodes.nodes.values()]
        in_round = sum(1 for node_id in live if node_id in members)
        waiting = sum(1 for node_id in live if node_id in rdzv.waiting and node_id not in members)
        nodes = GaugeMetricFamily(
            "dlfleet_nodes", "Live nodes by state: in_round, waiting, idle", labels=["state"]
        )
        nodes.add_metric(["in_round"], in_round)
        nodes.add_metric(["waiting"], waiting)
        nodes.add_metric(["idle"], len(live) - in_round - waiting)
        yield nodes

    def _datasets(self) -> Iterator[Metric]:
        book = self.state.book
        epoch = GaugeMetricFamily("dlfleet_dataset_epoch", "Epoch in progress", labels=["dataset"])
        epochs = GaugeMetricFamily("dlfleet_dataset_epochs", "Epochs to run", labels=["dataset"])
        records = GaugeMetricFamily(
            "dlfleet_dataset_records",
            "Records of the epoch in progress by state (todo, doing, done)",
            labels=["dataset", "epoch", "state"],
        )
        done = GaugeMetricFamily(
            "dlfleet_dataset_records_done",
            "Records trained in all epochs so far (acked, and within live leases)",
            labels=["dataset"],
        )
        expected = GaugeMetricFamily(
            "dlfleet_dataset_records_expected",
            "Records of all epochs (records per epoch x epochs)",
            labels=["dataset"],
        )
        leases = GaugeMetricFamily(
            "dlfleet_dataset_leases_active", "Shard leases held now", labels=["dataset"]
        )
        failed = GaugeMetricFamily(
            "dlfleet_dataset_failed_shards", "Shards given up on", labels=["dataset"]
        )
        shards_done = GaugeMetricFamily(
            "dlfleet_dataset_shards_done",
            "Shards of the epoch in progress every record of which is done",
            labels=["dataset", "epoch"],
        )
        shards = GaugeMetricFamily(
            "dlfleet_dataset_epoch_shards", "Shards per epoch", labels=["dataset"]
        )
        for name in sorted(book.datasets):
            view = book.status(name)
            per_epoch, total_epochs = view.records_per_epoch, view.config.epochs
            epoch.add_metric([name], view.epoch)
            epochs.add_metric([name], total_epochs)
            label = str(view.epoch)
            records.add_metric([name, label, "todo"], view.records_todo)
            records.add_metric([name, label, "doing"], view.records_doing)
            records.add_metric([name, label, "done"], view.records_done)
            done.add_metric([name], view.records_trained)
            expected.add_metric([name], per_epoch * total_epochs)
            leases.add_metric([name], view.leases_active)
            failed.add_metric([name], len(view.failed))
            shards_done.add_metric([name, label], view.shards_done)
            shards.add_metric([name], view.config.shards_per_epoch)
        yield from (epoch, epochs, records, done, expected, leases, failed, shards_done, shards)

    def _node_metrics(self) -> Iterator[Metric]:
        labels = ["node"]
        families = {
            "samples": GaugeMetricFamily(
                "dlfleet_node_samples_per_second", "Samples/s over the last interval", labels=labels
            ),
            "steps": GaugeMetricFamily(
                "dlfleet_node_steps_per_second", "Steps/s over the last interval", labels=labels
            ),
            "step_time": GaugeMetricFamily(
                "dlfleet_node_step_time_seconds", "Mean time per step", labels=labels
            ),
            "cpu": GaugeMetricFamily(
                "dlfleet_node_cpu_cores", "CPU used by training processes, in cores", labels=labels
            ),
            "rss": GaugeMetricFamily(
                "dlfleet_node_resident_memory_bytes", "RSS of training processes", labels=labels
            ),
            "limit": GaugeMetricFamily(
                "dlfleet_node_memory_limit_bytes", "cgroup memory limit, 0 if none", labels=labels
            ),
            "age": GaugeMetricFamily(
                "dlfleet_node_metrics_age_seconds", "Since the node's last metrics", labels=labels
            ),
        }
        now = self.clock()
        # A node that left (or was dropped) takes its series with it, even
        # while its session's last metrics are still held.
        live = {record.node_id for record in self.state.nodes.nodes.values()}
        for node_id, (sample, at) in sorted(self.node_metrics.items()):
            if node_id not in live:
                continue
            node = [node_id]
            families["samples"].add_metric(node, sample.samples_per_second)
            families["steps"].add_metric(node, sample.steps_per_second)
            families["step_time"].add_metric(node, sample.step_time_ms / 1000)
            families["cpu"].add_metric(node, sample.cpu_percent / 100)
            families["rss"].add_metric(node, sample.rss_bytes)
            families["limit"].add_metric(node, sample.memory_limit_bytes)
            families["age"].add_metric(node, max(0, now - at) / 1000)
        yield from families.values()


class SupervisorCollector(Collector):
    """What the job's supervisor counted (`job_pb2.SupervisorTotals`, sent
    with its status requests), exported as it last said: the totals are its
    own since it started, so a restarted master repeats them at once, and a
    request lost or repeated changes nothing. Zero until it reports (a
    master without a supervisor has none to report)."""

    def __init__(self) -> None:
        self.totals = job_pb2.SupervisorTotals()

    def reported(self, totals: job_pb2.SupervisorTotals) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        totals = self.totals
        plans = CounterMetricFamily(
            "dlfleet_brain_plans",
            "The brain's plans, by action (scale, replace_node, memory, initial, none) "
            "and whether they were carried out",
            labels=["action", "applied"],
        )
        for plan in totals.brain_plans:
            plans.add_metric([plan.action, "true" if plan.applied else "false"], plan.count)
        exits = CounterMetricFamily(
            "dlfleet_node_exits",
            "Nodes that ended, as the platform saw them, by reason "
            "(succeeded, left, workers_failed, lost, killed, preempted, oom_killed, evicted, ...)",
            labels=["reason"],
        )
        for ended in totals.node_exits:
            exits.add_metric([ended.reason], ended.count)
        relaunches = CounterMetricFamily(
            "dlfleet_node_relaunches", "Lost nodes the supervisor relaunched or replaced"
        )
        relaunches.add_metric([], totals.node_relaunches)
        restarts = CounterMetricFamily(
            "dlfleet_master_restarts", "Times the supervisor started the master again"
        )
        restarts.add_metric([], totals.master_restarts)
        yield from (plans, exits, relaunches, restarts)


class GoodputCollector(Collector):
    """The job's goodput ledger as it stands (`report`): the ratio and the
    productive seconds are gauges (a roll-back moves time out of productive);
    the lost seconds by cause are a counter, which only grows, so that
    `rate()` and `increase()` over it read as "seconds lost per second"."""

    def __init__(self, report: Callable[[], Goodput]) -> None:
        self.report = report

    def collect(self) -> Iterator[Metric]:
        report = self.report()
        ratio = GaugeMetricFamily(
            "dlfleet_goodput_ratio",
            "Share of the wall time since the first training step spent in steps (0 before it)",
        )
        ratio.add_metric([], report.ratio)
        productive = GaugeMetricFamily(
            "dlfleet_productive_seconds", "Time spent in training steps since the first step"
        )
        productive.add_metric([], report.productive_ms / 1000)
        badput = CounterMetricFamily(
            "dlfleet_badput_seconds",
            "Time lost since the first training step, by cause",
            labels=["cause"],
        )
        for cause in Cause:
            badput.add_metric([cause.value], report.lost_ms[cause] / 1000)
        yield from (ratio, productive, badput)


def _code_name(context: Any, raised: bool) -> str:
    """The status code an RPC ended with, by name."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for known in grpc.StatusCode:
            if known.value[0] == code:
                return known.name
    return "UNKNOWN" if raised else "OK"


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Counts every RPC by method and status code and times the unary ones
    (a stream lives as long as its client; only its end is counted). First in
    the chain, so that refused tokens and malformed requests count too. Each
    handler the chain gives (a method's, or a denial) is wrapped once, not per
    call."""

    def __init__(self, metrics: MasterMetrics) -> None:
        self._metrics = metrics
        # (method, id of the handler) -> (that handler, it counted); the
        # handler is kept, so its id is not reused while the entry lives.
        self._counted: dict[tuple[str, int], tuple[Any, grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self,
        continuation: AsyncContinuation,
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        key = (handler_call_details.method, id(handler))
        known = self._counted.get(key)
        if known is not None and known[0] is handler:
            return known[1]
        counted = self._counting(key[0].rpartition("/")[2], handler)
        self._counted[key] = (handler, counted)
        return counted

    def _counting(
        self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        metrics = self._metrics
        unary: Any = handler.unary_unary
        streams: Any = handler.stream_stream
        if unary is not None:

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                start = time.perf_counter()
                raised = True
                try:
                    response = await unary(request, context)
                    raised = False
                    return response
                finally:
                    seconds = time.perf_counter() - start
                    metrics.rpc_done(method, _code_name(context, raised), seconds)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if streams is not None:

            async def stream_stream(
                requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                raised = True
                try:
                    produced = streams(requests, context)
                    if inspect.isasyncgen(produced):
                        async for response in produced:
                            yield response
                    else:  # a denial: a coroutine that aborts
                        await produced
                    raised = False
                finally:
                    metrics.rpc_done(method, _code_name(context, raised), None)

            return grpc.stream_stream_rpc_method_handler(
                stream_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler  # no other kind among the master's services
