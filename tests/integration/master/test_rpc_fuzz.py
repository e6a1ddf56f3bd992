"""Bad input at every RPC of a real in-process master: hypothesis builds
requests field by field (empty, huge and non-ASCII strings, int64 extremes,
unknown datasets, stale rounds, incarnations and lease ids, missing oneofs,
checkpoint reports of bad ranks, steps and world sizes) and
sends raw random bytes as malformed protobuf. For every call:

- the answer is OK or a status code documented for that RPC (never UNKNOWN or
  INTERNAL: those are unhandled exceptions in the master);
- a rejected call changes nothing: the master's state (shard book, node table,
  rendezvous, failure reports, sessions, journal submissions) is identical
  before and after it;
- the master still answers a valid request afterwards.

A wrong or missing job token is UNAUTHENTICATED for every method, streaming
ones included; the LeaseStream answers refused requests in the stream and ends
on a malformed one; the agent Session refuses a stale or malformed first
message. One master per test function (SQLite store), not per example."""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import queue
import string
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import hypothesis.strategies as st
import pytest
from google.protobuf.message import Message
from harness import TOKEN, LoopThread, Running
from hypothesis import HealthCheck, event, given, settings

from dlfleet.api.errors import DlfleetError
from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.api.v1 import checkpoint_pb2, nodes_pb2, rendezvous_pb2, shards_pb2
from dlfleet.master.core.codec import dump_dataset
from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.liveness import LivenessSettings
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.core.shards import ShardSettings
from dlfleet.master.service.state import MasterSettings

pytestmark = pytest.mark.integration

Code = grpc.StatusCode
OK = Code.OK
IA, NF, FP = Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION
AUTH = ((TOKEN_METADATA_KEY, TOKEN),)
Metadata = tuple[tuple[str, str | bytes], ...]
M = TypeVar("M", bound=Message)

HOUR_MS = 3_600_000
SETTINGS = MasterSettings(
    job_name="job",
    # Nothing expires during a test: a state change between the two dumps
    # around a rejected call is the call's doing.
    shard=ShardSettings(lease_timeout_ms=HOUR_MS),
    liveness=LivenessSettings(heartbeat_interval_ms=1_000, heartbeat_timeout_ms=HOUR_MS),
    # One node forms a round at once: a valid Join never blocks.
    rendezvous=RendezvousSettings(min_nodes=1, max_nodes=1, last_call_timeout_ms=0),
)
DATASET = "data"
SPEC = shards_pb2.DatasetSpec(
    name=DATASET, size=1_000, batch_size=5, shard_size=10, epochs=3, shuffle=True, seed=7
)
DIGEST = DatasetConfig.create(
    name=DATASET, size=1_000, batch_size=5, shard_size=10, epochs=3, shuffle=True, seed=7
).digest()
NODE = "n"

FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[
        # One master per test function, on purpose: it outlives the examples.
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


# ----------------------------------------------------------------- strategies

INT64_EDGES = [-(2**63), -(2**31) - 1, -(2**31), -1, 0, 1, 2**31 - 1, 2**31, 2**63 - 1]
INT32_EDGES = [-(2**31), -1, 0, 1, 2, 1024, 1025, 65535, 65536, 2**31 - 1]


T = TypeVar("T")


def mostly(good: st.SearchStrategy[T], bad: st.SearchStrategy[T]) -> st.SearchStrategy[T]:
    """`good` two times in three: refusals come easily, while the deeper
    checks need most fields of a request right."""
    return st.integers(0, 2).flatmap(lambda i: bad if i == 2 else good)


def int64s(*good: int) -> st.SearchStrategy[int]:
    """Small values (or `good` ones), edges of int32 and int64, anything."""
    small = st.sampled_from(good) if good else st.integers(-3, 40)
    return mostly(small, st.one_of(st.sampled_from(INT64_EDGES), st.integers(-(2**63), 2**63 - 1)))


def int32s(*good: int) -> st.SearchStrategy[int]:
    small = st.sampled_from(good) if good else st.integers(-3, 40)
    return mostly(small, st.one_of(st.sampled_from(INT32_EDGES), st.integers(-(2**31), 2**31 - 1)))


def texts(*known: str) -> st.SearchStrategy[str]:
    """Known good values (mostly), empty, short random unicode, and huge
    strings (around the 200-character name limit, and up to ~1 MiB)."""
    huge = st.builds(
        operator.mul,
        st.sampled_from(["x", "\u20ac", "\x00", "'", "#", "\U0001f600"]),
        st.one_of(st.integers(195, 205), st.integers(1_000, 250_000)),
    )
    small = st.text(st.characters(exclude_categories=["Cs"]), max_size=30)
    fuzzed = st.one_of(st.just(""), small, huge)
    return mostly(st.sampled_from(known), fuzzed) if known else fuzzed


def node_ids() -> st.SearchStrategy[str]:
    """Live, stale and never-registered node ids."""
    named = st.builds("{}#{}".format, st.sampled_from([NODE, "m", "", "n#1"]), st.integers(-1, 4))
    return st.one_of(named, texts(f"{NODE}#1", NODE))


def of_node(kind: type[M], **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[M]:
    """A message of `kind` naming a node: often a matching (node_id,
    incarnation) pair of node `n`'s first incarnations (one of them is live),
    otherwise each drawn on its own."""
    pairs = st.one_of(
        st.integers(1, 4).map(lambda k: (f"{NODE}#{k}", k)),
        st.tuples(node_ids(), int64s()),
    )

    def build(pair: tuple[str, int], **values: Any) -> M:
        return kind(node_id=pair[0], incarnation=pair[1], **values)

    return st.builds(build, pairs, **fields)


def lease_ids() -> st.SearchStrategy[int]:
    """Small ids are the live, done and stale leases."""
    return st.one_of(st.integers(-1, 12), int64s())


def rounds() -> st.SearchStrategy[int]:
    """Round 1 is current after setup; 0 is no round, 2+ future ones."""
    return int64s(-1, 0, 1, 1, 2, 3)


def specs() -> st.SearchStrategy[shards_pb2.DatasetSpec]:
    return st.builds(
        shards_pb2.DatasetSpec,
        name=texts(DATASET, "other"),
        size=int64s(),
        batch_size=int64s(),
        shard_size=int64s(),
        epochs=int32s(1, 3, 0, -1, 1_000_001),
        shuffle=st.booleans(),
        seed=st.one_of(st.integers(0, 9), st.integers(0, 2**64 - 1)),
        drop_last=st.booleans(),
        max_shard_failures=int32s(),
    )


def lease_requests() -> st.SearchStrategy[shards_pb2.LeaseRequest]:
    common = {
        "dataset": texts(DATASET, "other"),
        "request_id": texts("r1"),
        "done": st.lists(lease_ids(), max_size=4),
    }
    rank = st.builds(shards_pb2.RankConsumer, node_id=node_ids(), rank=int32s(0, 1, -1))
    round_ = st.builds(shards_pb2.RoundConsumer, round=rounds(), position=int64s(0, 1, 2, 5, -1))
    return st.one_of(
        st.builds(shards_pb2.LeaseRequest, rank=rank, **common),
        st.builds(shards_pb2.LeaseRequest, round=round_, **common),
        st.builds(shards_pb2.LeaseRequest, **common),  # names no consumer
    )


def report_requests() -> st.SearchStrategy[shards_pb2.ReportRequest]:
    common = {"dataset": texts(DATASET), "lease_id": lease_ids(), "round": rounds()}
    failure = st.builds(
        shards_pb2.ShardFailure, reason=texts("boom"), consumed=int64s(0, 3, 10, 11, -1)
    )
    return st.one_of(
        st.builds(shards_pb2.ReportRequest, done=st.just(shards_pb2.ShardDone()), **common),
        st.builds(shards_pb2.ReportRequest, failure=failure, **common),
        st.builds(shards_pb2.ReportRequest, **common),  # names no result
    )


def ranges() -> st.SearchStrategy[shards_pb2.Range]:
    small = st.integers(-2, 1_002)
    return st.one_of(
        st.builds(shards_pb2.Range, start=small, end=small),
        st.builds(shards_pb2.Range, start=int64s(), end=int64s()),
    )


@st.composite
def plausible_snapshots(draw: st.DrawFn) -> shards_pb2.DatasetSnapshot:
    """Snapshots that a restore should accept (or nearly: one field off)."""
    epoch = draw(st.integers(0, SPEC.epochs))
    cuts = sorted(draw(st.sets(st.integers(0, SPEC.size), max_size=6)))
    done = [shards_pb2.Range(start=a, end=b) for a, b in zip(cuts[::2], cuts[1::2], strict=False)]
    failed = []
    if cuts and cuts[-1] < SPEC.size and draw(st.booleans()):
        failed.append(
            shards_pb2.FailedShard(
                epoch=epoch,
                range=shards_pb2.Range(start=cuts[-1], end=SPEC.size),
                failures=3,
                last_reason=draw(texts("boom")),
            )
        )
    return shards_pb2.DatasetSnapshot(
        dataset=DATASET,
        spec_digest=DIGEST,
        epoch=epoch,
        done=done,
        failed=failed,
        finished=epoch >= SPEC.epochs,
    )


def snapshots() -> st.SearchStrategy[shards_pb2.DatasetSnapshot]:
    failed = st.builds(
        shards_pb2.FailedShard,
        epoch=int32s(),
        range=ranges(),
        failures=int32s(),
        last_reason=texts("boom"),
    )
    fuzzed = st.builds(
        shards_pb2.DatasetSnapshot,
        dataset=texts(DATASET),
        spec_digest=texts(DIGEST, DIGEST[:8]),
        epoch=int32s(0, 1, 3, 4, -1),
        done=st.lists(ranges(), max_size=4),
        failed=st.lists(failed, max_size=2),
        finished=st.booleans(),
    )
    return st.one_of(plausible_snapshots(), fuzzed)


def messages() -> dict[str, st.SearchStrategy[Message]]:
    """Well-formed requests of every unary RPC, by method path."""
    return {
        "/dlfleet.api.v1.Shards/RegisterDataset": st.builds(
            shards_pb2.RegisterDatasetRequest, spec=specs()
        )
        | st.just(shards_pb2.RegisterDatasetRequest()),
        "/dlfleet.api.v1.Shards/Lease": lease_requests(),
        "/dlfleet.api.v1.Shards/Renew": st.builds(
            shards_pb2.RenewRequest,
            dataset=texts(DATASET),
            lease_id=lease_ids(),
            round=rounds(),
            consumed=int64s(0, 3, 10, 11, -1),
        ),
        "/dlfleet.api.v1.Shards/Report": report_requests(),
        "/dlfleet.api.v1.Shards/Snapshot": st.builds(
            shards_pb2.SnapshotRequest,
            dataset=texts(DATASET),
            round=rounds(),
            progress=st.lists(
                st.builds(
                    shards_pb2.LeaseProgress,
                    lease_id=lease_ids(),
                    consumed=int64s(0, 3, 10, 11, -1),
                ),
                max_size=4,
            ),
        ),
        "/dlfleet.api.v1.Shards/Restore": st.builds(
            shards_pb2.RestoreRequest, snapshot=snapshots(), round=rounds()
        ),
        "/dlfleet.api.v1.Shards/GetDatasetStatus": st.builds(
            shards_pb2.DatasetStatusRequest, dataset=texts(DATASET, "other")
        ),
        "/dlfleet.api.v1.Nodes/Register": st.builds(
            nodes_pb2.RegisterNodeRequest,
            job_name=texts("job"),
            node_name=texts(NODE, "m", "a#b"),
            local_world_size=int32s(1, 2, 1024, 1025, 0),
            host=texts("127.0.0.1"),
        ),
        "/dlfleet.api.v1.Nodes/Heartbeat": of_node(nodes_pb2.HeartbeatRequest),
        "/dlfleet.api.v1.Nodes/Deregister": of_node(nodes_pb2.DeregisterNodeRequest),
        "/dlfleet.api.v1.Rendezvous/Join": of_node(
            rendezvous_pb2.JoinRequest,
            local_world_size=int32s(1, 2, 1024, 1025, 0),
            host=texts("127.0.0.1"),
            bootstrap_port=int32s(0, 29500, 65535, 65536, -1),
            keeper_address=texts("127.0.0.1:7000", ""),
        ),
        "/dlfleet.api.v1.Rendezvous/Leave": of_node(
            rendezvous_pb2.LeaveRequest,
            reason=texts("succeeded", "left"),
        ),
        "/dlfleet.api.v1.Rendezvous/ReportFailure": of_node(
            rendezvous_pb2.FailureReport,
            round=rounds(),
            local_rank=int32s(0, 1, -1),
            global_rank=int32s(),
            exit_code=int32s(),
            signal=texts("SIGKILL"),
            message=texts("Traceback\nboom"),
            restart_count=int32s(),
        ),
        "/dlfleet.api.v1.Rendezvous/GetState": st.just(rendezvous_pb2.RendezvousStateRequest()),
        "/dlfleet.api.v1.Checkpoints/Report": st.one_of(
            plausible_checkpoint_reports(),
            of_node(
                checkpoint_pb2.CheckpointReport,
                step=int64s(0, 1, 5, -1),
                round=rounds(),
                world_size=int32s(1, 1, 2, 0, -1),
                copies=st.lists(image_copies(), max_size=3),
                dropped_below=int64s(0, 0, 1, -1),
            ),
        ),
        "/dlfleet.api.v1.Checkpoints/Latest": st.builds(
            checkpoint_pb2.LatestCheckpointRequest, before_step=int64s(0, 1, 6, -1)
        ),
        "/dlfleet.api.v1.Checkpoints/Persisted": st.builds(
            checkpoint_pb2.PersistedReport,
            step=int64s(0, 5, -1),
            path=texts("/ckpt/5"),
            round=rounds(),
            world_size=int32s(1, 2, 0, -1),
        ),
        "/dlfleet.api.v1.Checkpoints/Status": st.just(checkpoint_pb2.CheckpointStatusRequest()),
    }


@st.composite
def plausible_checkpoint_reports(draw: st.DrawFn) -> checkpoint_pb2.CheckpointReport:
    """Reports the master should accept (when `n`'s incarnation is live):
    round 1, ranks within the world, sensible steps."""
    incarnation = draw(st.integers(1, 3))
    node_id = f"{NODE}#{incarnation}"
    world = draw(st.integers(1, 2))
    step = draw(st.integers(0, 6))
    copies = [
        checkpoint_pb2.ImageCopy(
            rank=rank, node_id=node_id, address="127.0.0.1:7000", replica=replica, bytes=100
        )
        for rank, replica in draw(
            st.sets(st.tuples(st.integers(0, world - 1), st.booleans()), max_size=3)
        )
    ]
    return checkpoint_pb2.CheckpointReport(
        node_id=node_id,
        incarnation=incarnation,
        step=step,
        round=1,
        world_size=world,
        copies=copies,
        dropped_below=draw(st.integers(0, step)),
    )


def image_copies() -> st.SearchStrategy[checkpoint_pb2.ImageCopy]:
    """Copies of rank 0 or 1 (or out of range) on the reporter (no node id),
    on live, stale and unknown nodes."""
    return st.builds(
        checkpoint_pb2.ImageCopy,
        rank=int32s(0, 0, 1, -1),
        node_id=st.one_of(st.just(""), node_ids()),
        address=texts("127.0.0.1:7000", ""),
        replica=st.booleans(),
        bytes=int64s(0, 100, -1),
    )


MESSAGES = messages()

# The codes each RPC may refuse a well-formed request with (dlfleet.api.status):
# INVALID_ARGUMENT a bad field, NOT_FOUND an unknown dataset, FAILED_PRECONDITION
# a stale lease, round or incarnation. Any request may also be malformed bytes:
# INVALID_ARGUMENT.
REFUSALS: dict[str, frozenset[Code]] = {
    "/dlfleet.api.v1.Shards/RegisterDataset": frozenset({IA}),
    "/dlfleet.api.v1.Shards/Lease": frozenset({IA, NF, FP}),
    "/dlfleet.api.v1.Shards/Renew": frozenset({IA, NF, FP}),
    "/dlfleet.api.v1.Shards/Report": frozenset({IA, NF, FP}),
    "/dlfleet.api.v1.Shards/Snapshot": frozenset({IA, NF, FP}),
    "/dlfleet.api.v1.Shards/Restore": frozenset({IA, NF, FP}),
    "/dlfleet.api.v1.Shards/GetDatasetStatus": frozenset({NF}),
    "/dlfleet.api.v1.Nodes/Register": frozenset({IA}),
    "/dlfleet.api.v1.Nodes/Heartbeat": frozenset({FP}),
    "/dlfleet.api.v1.Nodes/Deregister": frozenset({FP}),
    "/dlfleet.api.v1.Rendezvous/Join": frozenset({IA, FP}),
    "/dlfleet.api.v1.Rendezvous/Leave": frozenset({FP}),
    "/dlfleet.api.v1.Rendezvous/ReportFailure": frozenset({IA, FP}),
    "/dlfleet.api.v1.Rendezvous/GetState": frozenset(),
    "/dlfleet.api.v1.Checkpoints/Report": frozenset({IA, FP}),
    "/dlfleet.api.v1.Checkpoints/Latest": frozenset({IA}),
    "/dlfleet.api.v1.Checkpoints/Persisted": frozenset({IA}),
    "/dlfleet.api.v1.Checkpoints/Status": frozenset(),
}
STREAMS = ("/dlfleet.api.v1.Shards/LeaseStream", "/dlfleet.api.v1.Rendezvous/Session")
assert set(REFUSALS) == set(MESSAGES)


# ------------------------------------------------------------------- harness


def _identity(data: bytes) -> bytes:
    return data


class Master:
    """Raw access to a running master: calls with serialized requests (so
    malformed ones can be sent), and a canonical dump of its whole state."""

    def __init__(self, running: Running, loop_thread: LoopThread) -> None:
        self.running = running
        self.loop_thread = loop_thread
        self.channel = grpc.insecure_channel(running.address)

    def close(self) -> None:
        self.channel.close()

    def call(
        self, method: str, request: bytes, metadata: Metadata = AUTH
    ) -> tuple[Code, str, bytes]:
        stub = self.channel.unary_unary(
            method, request_serializer=_identity, response_deserializer=_identity
        )
        try:
            response: bytes = stub(request, metadata=metadata, timeout=15)
        except grpc.RpcError as error:
            return error.code(), error.details() or "", b""
        return OK, "", response

    def stream(
        self, method: str, requests: Sequence[bytes], metadata: Metadata = AUTH
    ) -> tuple[Code, str, list[bytes]]:
        stub = self.channel.stream_stream(
            method, request_serializer=_identity, response_deserializer=_identity
        )
        call = stub(iter(requests), metadata=metadata, timeout=15)
        responses: list[bytes] = []
        try:
            responses.extend(call)
        except grpc.RpcError as error:
            return error.code(), error.details() or "", responses
        return OK, "", responses

    def dump(self) -> dict[str, Any]:
        """Everything a call could change, read on the master's loop thread."""

        async def read() -> dict[str, Any]:
            state, server = self.running.state, self.running.server
            return {
                "datasets": {n: dump_dataset(d) for n, d in sorted(state.book.datasets.items())},
                "next_lease_id": state.book._next_lease_id,
                "nodes": {n: dataclasses.asdict(r) for n, r in sorted(state.nodes.nodes.items())},
                "incarnations": dict(state.nodes._incarnations),
                "rendezvous": dataclasses.asdict(state.rendezvous.state),
                "checkpoints": state.checkpoints.to_dict(),
                "failures": [f.SerializeToString() for f in server.rendezvous.failures],
                "sessions": sorted(server.membership.sessions),
                "journal_submissions": state.committer.submissions,
            }

        return self.loop_thread.run(read())

    def settle(self, timeout_s: float = 5) -> None:
        """Wait until the state stops changing: what follows an ended session
        (dropping its node, closing its round) runs after the client saw the
        end, and must not land between the dumps around the next call."""
        deadline = time.monotonic() + timeout_s
        last = self.dump()
        while time.monotonic() < deadline:
            time.sleep(0.03)
            now = self.dump()
            if now == last:
                return
            last = now
        raise AssertionError("the master's state did not settle")

    def read(self, what: Callable[[Any], Any]) -> Any:
        async def run() -> Any:
            return what(self.running.state)

        return self.loop_thread.run(run())

    def check(self, method: str, request: bytes, refusals: frozenset[Code]) -> Code:
        """Send one request; assert the answer's code and that a refusal
        changed nothing and left the master serving."""
        before = self.dump()
        code, details, _ = self.call(method, request)
        event(code.name)
        assert code is OK or code in refusals, f"{method} answered {code.name}: {details[:300]}"
        if code is not OK:
            assert_unchanged(
                before, self.dump(), f"{method} refused ({code.name}: {details[:200]})"
            )
        self.assert_serving()
        return code

    def assert_serving(self) -> None:
        code, details, _ = self.call(
            "/dlfleet.api.v1.Rendezvous/GetState",
            rendezvous_pb2.RendezvousStateRequest().SerializeToString(),
        )
        assert code is OK, f"the master stopped serving: {code.name} {details}"

    def node(self) -> tuple[str, int] | None:
        def live(state: Any) -> tuple[str, int] | None:
            record = state.nodes.nodes.get(NODE)
            return None if record is None else (record.node_id, record.incarnation)

        found: tuple[str, int] | None = self.read(live)
        return found

    def ensure_world(self, *, join: bool = True, lease: bool = True) -> None:
        """Between examples (accepted calls, outside any comparison): node `n`
        registered and a member of the active round; a live lease on the
        dataset. Keeps the valid paths reachable after examples that were
        accepted and dropped the node, closed the round or finished leases."""
        client = self.running.client
        # An accepted Leave("succeeded") of the round's only member ends the
        # training for good (joins are refused after it): the fuzzing goes on
        # in a job whose training is not done. (Set on the master's loop, as
        # a restarted master with a fresh journal would have it.)
        self.read(lambda s: setattr(s.rendezvous.state, "done_reason", ""))
        node = self.node()
        if node is None:
            reply = client.register_node(job_name="job", node_name=NODE, local_world_size=1)
            node = (reply.node_id, reply.incarnation)
        if join and self.read(lambda s: s.rendezvous.assignment(node[0]) is None):
            client.join_rendezvous(
                node_id=node[0],
                incarnation=node[1],
                local_world_size=1,
                host="127.0.0.1",
                bootstrap_port=29500,
                timeout_s=10,
            )
        if lease and not self.read(lambda s: s.book.datasets[DATASET].doing):
            # A restore may have finished the dataset: the fuzzing goes on.
            with contextlib.suppress(DlfleetError):
                client.lease(DATASET, node_id=node[0], rank=0)


def assert_unchanged(before: dict[str, Any], after: dict[str, Any], what: str) -> None:
    changed = {k: (before[k], after[k]) for k in sorted(before) if before[k] != after[k]}
    assert not changed, f"{what}, yet changed (before, after): {str(changed)[:5_000]}"


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    """SQLite only (overrides the conftest's sqlite/postgres parameter): the
    store plays no part in input validation."""
    return f"sqlite:///{tmp_path / 'master.db'}"


@pytest.fixture
def master(start_master: Callable[..., Running], loop_thread: LoopThread) -> Iterator[Master]:
    """A master with a dataset, node `n` in round 1, a rank lease and a round
    lease, so that live, stale and unknown ids all exist."""
    running = start_master(SETTINGS)
    client = running.client
    client.register_dataset(SPEC)
    wire = Master(running, loop_thread)
    wire.ensure_world(lease=False)
    node = wire.node()
    assert node is not None
    client.lease(DATASET, node_id=node[0], rank=0)
    assert client.lease_for_round(DATASET, round=1, position=0).WhichOneof("outcome") == "shard"
    yield wire
    wire.close()


# --------------------------------------------------------------------- tests


@pytest.mark.parametrize("method", sorted(MESSAGES))
@FUZZ
@given(data=st.data())
def test_every_rpc_answers_bad_input_with_a_documented_code_and_changes_nothing(
    master: Master, method: str, data: st.DataObject
) -> None:
    master.ensure_world()
    refusals = REFUSALS[method]
    if data.draw(st.integers(0, 4), label="malformed?") == 0:
        # Raw bytes: sometimes a valid message, mostly not.
        request = data.draw(st.binary(max_size=64), label="raw request")
        master.check(method, request, refusals | {IA})
    else:
        message = data.draw(MESSAGES[method], label="request")
        master.check(method, message.SerializeToString(), refusals)


def tokens() -> st.SearchStrategy[Metadata]:
    """Metadata without the right job token."""
    wrong = st.one_of(
        st.sampled_from(["", TOKEN + "x", TOKEN[:-1], TOKEN.upper(), "x" * 4_000]),
        st.text(string.ascii_letters + string.digits + "-_.", max_size=40),
    ).filter(lambda token: token != TOKEN)
    return st.one_of(
        st.just(()),
        wrong.map(lambda token: ((TOKEN_METADATA_KEY, token),)),
        st.just((("x-dlfleet-tokens", TOKEN),)),
        st.just((("authorization", f"Bearer {TOKEN}"),)),
        st.just(((TOKEN_METADATA_KEY + "-bin", TOKEN.encode()),)),
        # The first token counts: a right one after a wrong one does not help.
        wrong.map(lambda token: ((TOKEN_METADATA_KEY, token), (TOKEN_METADATA_KEY, TOKEN))),
    )


def requests_of(method: str) -> st.SearchStrategy[bytes]:
    if method in MESSAGES:
        return st.one_of(MESSAGES[method].map(lambda m: m.SerializeToString()), st.binary())
    return st.binary()


@FUZZ
@given(method=st.sampled_from(sorted([*MESSAGES, *STREAMS])), metadata=tokens(), data=st.data())
def test_a_wrong_or_missing_token_is_unauthenticated_for_every_method(
    master: Master, method: str, metadata: Metadata, data: st.DataObject
) -> None:
    before = master.dump()
    if method in STREAMS:
        requests = data.draw(st.lists(requests_of(method), max_size=3))
        code, details, responses = master.stream(method, requests, metadata)
        assert responses == []
    else:
        code, details, _ = master.call(method, data.draw(requests_of(method)), metadata)
    assert code is Code.UNAUTHENTICATED, f"{method}: {code.name} {details}"
    assert_unchanged(before, master.dump(), f"{method} without the token")
    master.assert_serving()


def test_every_method_needs_the_token_even_a_stream_that_sends_nothing(master: Master) -> None:
    """Explicitly every method, and streams that never send a request: the
    denial must not wait for a request the client never sends."""
    for method in [*MESSAGES, *STREAMS, "/dlfleet.api.v1.Shards/NoSuchMethod"]:
        for metadata in [(), ((TOKEN_METADATA_KEY, "wrong"),)]:
            started = time.monotonic()
            if method in STREAMS:
                code, details, _ = master.stream(method, [], metadata)
            else:
                code, details, _ = master.call(method, b"", metadata)
            assert code is Code.UNAUTHENTICATED, f"{method}: {code.name} {details}"
            assert time.monotonic() - started < 5


class LeaseStream:
    """One LeaseStream driven request by request, so the state can be dumped
    between a request and its answer."""

    def __init__(self, wire: Master) -> None:
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        stub = wire.channel.stream_stream(
            "/dlfleet.api.v1.Shards/LeaseStream",
            request_serializer=_identity,
            response_deserializer=_identity,
        )
        self._call = stub(self._feed(), metadata=AUTH, timeout=60)

    def _feed(self) -> Iterator[bytes]:
        while (request := self._requests.get()) is not None:
            yield request

    def send(self, request: bytes) -> shards_pb2.LeaseResponse:
        self._requests.put(request)
        return shards_pb2.LeaseResponse.FromString(next(self._call))

    def send_last(self, request: bytes) -> grpc.RpcError | None:
        """A request that ends the stream (malformed): the status it ends with."""
        self._requests.put(request)
        try:
            extra = list(self._call)
        except grpc.RpcError as error:
            return error
        finally:
            self._requests.put(None)
        raise AssertionError(f"the stream answered a malformed request: {extra}")

    def close(self) -> None:
        self._requests.put(None)
        assert list(self._call) == []


@FUZZ
@given(
    requests=st.lists(lease_requests(), min_size=1, max_size=4),
    garbage=st.one_of(st.none(), st.binary(min_size=1, max_size=32)),
)
def test_lease_stream_answers_refusals_in_the_stream_and_ends_on_malformed_requests(
    master: Master, requests: list[shards_pb2.LeaseRequest], garbage: bytes | None
) -> None:
    master.ensure_world()
    stream = LeaseStream(master)
    for request in requests:
        before = master.dump()
        response = stream.send(request.SerializeToString())
        outcome = response.WhichOneof("outcome")
        assert outcome is not None
        event(outcome)
        if outcome == "error":
            code = response.error.code
            assert code in {c.value[0] for c in (IA, NF, FP)}, response
            assert_unchanged(before, master.dump(), f"LeaseStream refused ({response.error})")
    if garbage is not None and not _parses(garbage, shards_pb2.LeaseRequest):
        before = master.dump()
        error = stream.send_last(garbage)
        assert error is not None and error.code() is IA, error
        assert_unchanged(before, master.dump(), "a malformed LeaseStream request")
    else:
        stream.close()
    master.assert_serving()


def _parses(data: bytes, kind: type[Message]) -> bool:
    try:
        kind.FromString(data)
    except Exception:  # noqa: BLE001 - any parse failure
        return False
    return True


@FUZZ
@given(
    first=st.one_of(
        of_node(rendezvous_pb2.SessionMessage, round=rounds()).map(lambda m: m.SerializeToString()),
        st.binary(min_size=1, max_size=32),
    ),
    rest=st.lists(st.binary(max_size=16), max_size=2),
)
def test_agent_session_refuses_a_stale_or_malformed_first_message(
    master: Master, first: bytes, rest: list[bytes]
) -> None:
    master.ensure_world(join=False, lease=False)
    before = master.dump()
    code, details, responses = master.stream("/dlfleet.api.v1.Rendezvous/Session", [first, *rest])
    assert code in {OK, IA, FP}, f"Session: {code.name} {details}"
    event(code.name)
    # At most one event: the close of the round the first message says the
    # node is in, if that round closed while it had no session.
    said = rendezvous_pb2.SessionMessage.FromString(first).round if responses else 0
    assert [rendezvous_pb2.SessionEvent.FromString(r) for r in responses] in (
        [],
        [
            rendezvous_pb2.SessionEvent(
                re_rendezvous=rendezvous_pb2.ReRendezvous(
                    closed_round=said,
                    reason=f"round {said} closed while this node's session was down",
                )
            )
        ],
    )
    if not _parses(first, rendezvous_pb2.SessionMessage):
        assert code is IA
    opened = code is OK or (code is IA and _parses(first, rendezvous_pb2.SessionMessage))
    if not opened:
        assert_unchanged(before, master.dump(), f"Session refused ({code.name}: {details})")
    else:
        # An accepted session that ends (here: the client closed it, or broke
        # it with a malformed heartbeat) is a dead agent: its node is dropped.
        deadline = time.monotonic() + 5
        while master.node() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert master.node() is None, "an ended session left its node live"
        master.settle()
    master.assert_serving()


# ------------------------------------------------------ regression examples


def test_malformed_protobuf_is_invalid_argument_not_unknown(master: Master) -> None:
    """Found by fuzzing: a request that does not parse used to be answered
    UNKNOWN (a DecodeError escaping into gRPC), on unary calls and streams."""
    corrupt, bad_utf8 = b"\xff\xff\xff", b"\x0a\x02\xff\xfe"  # field 1 (string) = b"\xff\xfe"
    before = master.dump()
    for request in (corrupt, bad_utf8):
        code, details, _ = master.call("/dlfleet.api.v1.Shards/GetDatasetStatus", request)
        assert (code, details.split(":")[0]) == (IA, "malformed request")
        for method in STREAMS:
            code, details, _ = master.stream(method, [request])
            assert (code, details.split(":")[0]) == (IA, "malformed request")
    assert_unchanged(before, master.dump(), "malformed requests")
    master.assert_serving()


def test_refusals_of_huge_inputs_keep_their_code(master: Master) -> None:
    """Found by fuzzing: status details echo the request (here a 100 KB
    dataset name); past the client's 16 KiB metadata limit the client saw
    RESOURCE_EXHAUSTED instead of NOT_FOUND. Details are now bounded."""
    for name in ("x" * 100_000, "\u20ac" * 100_000, "\x00" * 100_000):
        request = shards_pb2.DatasetStatusRequest(dataset=name)
        code, details, _ = master.call(
            "/dlfleet.api.v1.Shards/GetDatasetStatus", request.SerializeToString()
        )
        assert code is NF, details[:200]
        assert len(details.encode()) < 4_000
    stream = LeaseStream(master)
    huge = shards_pb2.LeaseRequest(
        dataset="\x00" * 1_000_000, rank=shards_pb2.RankConsumer(node_id="a")
    )
    answer = stream.send(huge.SerializeToString())
    assert answer.error.code == NF.value[0]
    assert len(answer.error.message) < 4_000
    stream.close()


def test_a_request_over_the_message_limit_is_resource_exhausted(master: Master) -> None:
    before = master.dump()
    request = shards_pb2.DatasetStatusRequest(dataset="x" * (5 << 20)).SerializeToString()
    code, _, _ = master.call("/dlfleet.api.v1.Shards/GetDatasetStatus", request)
    assert code is Code.RESOURCE_EXHAUSTED
    assert_unchanged(before, master.dump(), "an oversized request")
    master.assert_serving()


def test_a_concurrent_storm_of_bad_requests_leaves_the_master_serving(master: Master) -> None:
    """Bad requests from many threads at once, interleaved on the loop."""
    errors: list[str] = []
    bad = [
        ("/dlfleet.api.v1.Shards/Lease", shards_pb2.LeaseRequest(dataset="nope")),
        ("/dlfleet.api.v1.Shards/Renew", shards_pb2.RenewRequest(dataset=DATASET, lease_id=-1)),
        ("/dlfleet.api.v1.Nodes/Heartbeat", nodes_pb2.HeartbeatRequest(node_id="x#1")),
        ("/dlfleet.api.v1.Rendezvous/Join", rendezvous_pb2.JoinRequest(node_id="")),
    ]
    before = master.dump()

    def hammer() -> None:
        for _ in range(25):
            for method, message in bad:
                code, details, _ = master.call(method, message.SerializeToString())
                if code not in REFUSALS[method]:
                    errors.append(f"{method}: {code.name} {details}")
            code, details, _ = master.call(bad[0][0], b"\xff")
            if code is not IA:
                errors.append(f"malformed: {code.name} {details}")

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert_unchanged(before, master.dump(), "a storm of refused requests")
    master.assert_serving()
