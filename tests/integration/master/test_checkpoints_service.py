"""The Checkpoints service through a real gRPC server on 127.0.0.1:0, the real
client and a real store: reports make a step committed and restorable, a lost
node takes its copies along, a stale round is ignored, the records survive a
master restart and a compacted journal, and bad or unauthenticated calls are
refused without changing anything."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
import torch
from harness import TOKEN, Running

from dlfleet.api.client import MasterClient, join_request
from dlfleet.api.env import CHECKPOINT_DIR_ENV, MASTER_ENV, TOKEN_ENV
from dlfleet.api.errors import InvalidArgument, StaleError, Unauthenticated
from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.api.v1 import checkpoint_pb2
from dlfleet.master.core.checkpoint_events import ImageCopy
from dlfleet.master.core.checkpoints import CheckpointReport, PersistedStep
from dlfleet.master.core.liveness import LivenessSettings
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.journal import CHECKPOINTS_STREAM
from dlfleet.master.service.state import MasterSettings, MasterState
from dlfleet.master.store.sql import open_store
from dlfleet.worker.checkpoint.checkpointer import Checkpointer

pytestmark = pytest.mark.integration

# One node forms a round at once; a member joining again forms the next one.
SETTINGS = MasterSettings(
    job_name="job",
    rendezvous=RendezvousSettings(min_nodes=1, max_nodes=1, last_call_timeout_ms=0),
)
Node = tuple[str, int]  # (node id, incarnation)


def register(client: MasterClient, *names: str) -> list[Node]:
    nodes = []
    for name in names:
        reply = client.register_node(job_name="job", node_name=name, local_world_size=1)
        nodes.append((reply.node_id, reply.incarnation))
    return nodes


def form_rounds(client: MasterClient, node: Node, count: int, keeper: str = "") -> int:
    """Rounds 1..count (one node each); the last one's number."""
    round_ = 0
    for _ in range(count):
        round_ = client.join_rendezvous(
            node_id=node[0],
            incarnation=node[1],
            local_world_size=1,
            host="127.0.0.1",
            bootstrap_port=29500,
            timeout_s=10,
            keeper_address=keeper,
        ).round
    return round_


def copy(rank: int, node: Node, *, replica: bool = False) -> checkpoint_pb2.ImageCopy:
    return checkpoint_pb2.ImageCopy(
        rank=rank, node_id=node[0], address=f"{node[0]}:7000", replica=replica, bytes=1 << 20
    )


def report(
    node: Node,
    step: int,
    copies: Sequence[checkpoint_pb2.ImageCopy],
    *,
    round_: int = 1,
    world: int = 2,
) -> checkpoint_pb2.CheckpointReport:
    return checkpoint_pb2.CheckpointReport(
        node_id=node[0],
        incarnation=node[1],
        step=step,
        round=round_,
        world_size=world,
        copies=copies,
    )


def save_step(client: MasterClient, nodes: Sequence[Node], step: int, round_: int = 1) -> int:
    """Rank r on nodes[r], replicated to the next node; the committed step."""
    committed = -1
    world = len(nodes)
    for rank, node in enumerate(nodes):
        copies = [copy(rank, node), copy((rank - 1) % world, node, replica=True)]
        answer = client.report_checkpoint(report(node, step, copies, round_=round_, world=world))
        committed = answer.committed_step
    return committed


def placement(record: checkpoint_pb2.CheckpointRecord) -> list[tuple[int, str, bool]]:
    return [(c.rank, c.node_id, c.replica) for c in record.copies]


@pytest.fixture
def master(start_master: Callable[..., Running]) -> Running:
    return start_master(SETTINGS)


def test_reports_of_every_rank_make_the_step_latest_with_its_copies(master: Running) -> None:
    client = master.client
    a, b = register(client, "a", "b")
    form_rounds(client, a, 1)
    assert save_step(client, [a, b], step=10) == 10
    latest = client.latest_checkpoint()
    assert (latest.found, latest.step, latest.round, latest.world_size) == (True, 10, 1, 2)
    assert placement(latest) == [
        (0, a[0], False),
        (0, b[0], True),
        (1, b[0], False),
        (1, a[0], True),
    ]
    assert latest.copies[0].address == f"{a[0]}:7000"
    status = client.checkpoint_status()
    assert (status.committed_step, status.restorable_step, status.bytes_held) == (10, 10, 4 << 20)
    assert client.master_status().checkpoints == status


def test_a_step_is_not_committed_until_every_rank_reported_its_image(master: Running) -> None:
    client = master.client
    a, b = register(client, "a", "b")
    form_rounds(client, a, 1)
    answer = client.report_checkpoint(report(a, 10, [copy(0, a)]))
    assert answer.committed_step == -1
    assert not client.latest_checkpoint().found
    assert client.report_checkpoint(report(b, 10, [copy(1, b)])).committed_step == 10
    assert client.latest_checkpoint().step == 10
    assert client.latest_checkpoint(before_step=10).found is False


def test_a_survivors_replica_of_a_lost_nodes_image_commits_the_step_it_holds_whole(
    master: Running,
) -> None:
    """The double fault as the master sees it once back: b saved step 10 and
    copied it to a, then left before reporting it; a reports its own image
    and its replica of b's, and step 10 is restored from a alone."""
    client = master.client
    a, b = register(client, "a", "b")
    form_rounds(client, a, 1)
    assert save_step(client, [a, b], step=5) == 5
    assert client.report_checkpoint(report(a, 10, [copy(0, a)])).committed_step == 5
    client.deregister_node(*b)
    answer = client.report_checkpoint(report(a, 10, [copy(0, a), copy(1, a, replica=True)]))
    assert answer.committed_step == 10
    latest = client.latest_checkpoint()
    assert latest.step == 10 and placement(latest) == [(0, a[0], False), (1, a[0], True)]


def test_a_node_that_leaves_takes_its_copies_and_the_replicas_still_restore(
    master: Running,
) -> None:
    client = master.client
    a, b = register(client, "a", "b")
    form_rounds(client, a, 1)
    save_step(client, [a, b], step=10)
    client.deregister_node(*a)
    latest = client.latest_checkpoint()
    assert latest.found and placement(latest) == [(0, b[0], True), (1, b[0], False)]
    client.leave_rendezvous(b[0], b[1], "preempted")
    assert not client.latest_checkpoint().found
    status = client.checkpoint_status()
    assert (status.committed_step, status.restorable_step, status.bytes_held) == (10, -1, 0)


def test_a_node_dropped_by_liveness_loses_its_copies(start_master: Callable[..., Running]) -> None:
    settings = MasterSettings(
        job_name="job",
        liveness=LivenessSettings(heartbeat_interval_ms=50, heartbeat_timeout_ms=300),
        rendezvous=SETTINGS.rendezvous,
    )
    client = start_master(settings).client
    a, b = register(client, "a", "b")
    form_rounds(client, a, 1)
    save_step(client, [a, b], step=10)
    stop = threading.Event()

    def beat() -> None:  # b stays alive, a goes silent
        while not stop.is_set():
            client.heartbeat(*b)
            time.sleep(0.05)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if {c.node_id for c in client.latest_checkpoint().copies} == {b[0]}:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the silent node's copies were not dropped")
    finally:
        stop.set()
        beater.join()


def test_a_report_of_a_stale_round_is_ignored_and_answers_the_committed_step(
    master: Running,
) -> None:
    client = master.client
    a, b = register(client, "a", "b")
    assert form_rounds(client, a, 2) == 2
    save_step(client, [a, b], step=10, round_=1)
    save_step(client, [a, b], step=20, round_=2)
    before = client.latest_checkpoint()
    answer = client.report_checkpoint(report(a, 20, [copy(0, a)], round_=1))
    assert answer.committed_step == 20
    answer = client.report_checkpoint(report(a, 30, [copy(0, a)], round_=1))
    assert answer.committed_step == 20
    assert client.latest_checkpoint() == before
    assert client.checkpoint_status().bytes_held == 8 << 20


def test_a_newer_round_abandons_the_steps_an_older_round_saved_after_its_restore(
    master: Running,
) -> None:
    client = master.client
    a, b = register(client, "a", "b")
    form_rounds(client, a, 2)
    for step in (10, 20, 30):
        save_step(client, [a, b], step=step, round_=1)
    save_step(client, [a, b], step=25, round_=2)
    # Step 30 of round 1 is gone (else it would be the latest); 10 and 20 stay.
    assert (client.latest_checkpoint().step, client.latest_checkpoint().round) == (25, 2)
    assert client.latest_checkpoint(before_step=25).step == 20


def test_the_records_survive_a_master_restart_on_the_same_store(
    start_master: Callable[..., Running],
) -> None:
    first = start_master(SETTINGS)
    client = first.client
    a, b = register(client, "a", "b")
    form_rounds(client, a, 1)
    save_step(client, [a, b], step=10)
    save_step(client, [a, b], step=20)
    client.report_persisted(
        checkpoint_pb2.PersistedReport(step=10, path="/ckpt/10", round=1, world_size=2)
    )
    latest, status = client.latest_checkpoint(), client.checkpoint_status()
    start_master.stop(first)  # type: ignore[attr-defined]
    again = start_master(SETTINGS).client
    assert again.latest_checkpoint() == latest
    assert again.checkpoint_status() == status
    assert status.persisted_path == "/ckpt/10"
    # The restarted master still knows the nodes: their losses still count.
    again.deregister_node(*a)
    assert {c.node_id for c in again.latest_checkpoint().copies} == {b[0]}


def test_a_committed_step_lost_with_every_node_that_held_it_is_told_unless_persisted(
    master: Running,
) -> None:
    client = master.client
    a, b = register(client, "a", "b")
    form_rounds(client, a, 1)
    save_step(client, [a, b], step=10)
    save_step(client, [a, b], step=20)
    assert client.latest_checkpoint().lost_step == 0  # found: nothing lost
    client.report_persisted(
        checkpoint_pb2.PersistedReport(step=10, path="/ckpt/10", round=1, world_size=2)
    )
    client.deregister_node(*a)
    client.deregister_node(*b)
    latest = client.latest_checkpoint()
    assert not latest.found and latest.lost_step == 20  # step 10 is on disk, 20 nowhere
    assert client.latest_checkpoint(before_step=20).lost_step == 0  # the ladder's later asks
    client.report_persisted(
        checkpoint_pb2.PersistedReport(step=20, path="/ckpt/20", round=1, world_size=2)
    )
    assert client.latest_checkpoint().lost_step == 0


def test_a_rank_that_finds_nothing_after_a_lost_step_says_it_starts_afresh(
    master: Running,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every node that held step 20 is gone and nothing was persisted: the
    Checkpointer of the next round restores nothing, and says why that
    loses the job's training so far instead of starting over in silence."""
    client = master.client
    a, b = register(client, "a", "b")
    form_rounds(client, a, 1)
    save_step(client, [a, b], step=20)
    client.deregister_node(*a)
    client.deregister_node(*b)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(MASTER_ENV, master.address)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setenv(CHECKPOINT_DIR_ENV, str(tmp_path / "shm"))
    with Checkpointer(persist_every=100, persist_dir=tmp_path / "disk") as checkpointer:
        assert checkpointer.load({"w": torch.zeros(2)}) is None
    said = [r.getMessage() for r in caplog.records if "starting afresh" in r.getMessage()]
    assert len(said) == 1 and "committed step 20" in said[0], caplog.text


def test_persisted_steps_show_in_the_status_newest_first(master: Running) -> None:
    client = master.client
    a, _ = register(client, "a", "b")
    form_rounds(client, a, 1)
    for step in (20, 10):
        client.report_persisted(
            checkpoint_pb2.PersistedReport(step=step, path=f"/ckpt/{step}", round=1, world_size=2)
        )
    status = client.checkpoint_status()
    assert (status.persisted_step, status.persisted_path) == (20, "/ckpt/20")
    assert status.restorable_step == -1


def test_join_tells_each_member_the_next_keeper_by_group_rank(master: Running) -> None:
    client = master.client
    (a,) = register(client, "a")
    reply = client.join_rendezvous(
        node_id=a[0],
        incarnation=a[1],
        local_world_size=1,
        host="127.0.0.1",
        bootstrap_port=29500,
        timeout_s=10,
        keeper_address="127.0.0.1:7123",
    )
    assert reply.keeper_peer == ""  # its own Keeper is no peer
    state = client.rendezvous_state()
    assert list(state.keeper_addresses) == ["127.0.0.1:7123"]
    assert list(state.members) == [a[0]]


def test_a_step_committed_by_another_nodes_report_is_pushed_to_the_waiting_members(
    start_master: Callable[..., Running],
) -> None:
    """A save's answer waits for its step's commit: the node whose report
    came first hears of the commit on its session when the other node's
    report makes it, not with its own next report."""
    running = start_master(
        MasterSettings(
            job_name="job",
            rendezvous=RendezvousSettings(min_nodes=2, max_nodes=2, last_call_timeout_ms=0),
        )
    )
    client = running.client
    a, b = register(client, "a", "b")
    heard: dict[str, list[tuple[int, int, int]]] = {a[0]: [], b[0]: []}
    told = threading.Event()
    sessions = []
    for node in (a, b):
        session = client.agent_session(node[0], node[1], 1.0)

        def tell(committed: int, replicated: int, replica: int, name: str = node[0]) -> None:
            heard[name].append((committed, replicated, replica))
            told.set()

        session.on_checkpoint_progress = tell
        sessions.append(session)
    try:
        joins = [
            s.join_future(join_request(n[0], n[1], 1, "127.0.0.1", 29500 + i))
            for i, (s, n) in enumerate(zip(sessions, (a, b), strict=True))
        ]
        round_ = {f.result(timeout=10).round for f in joins}
        assert round_ == {1}
        for session in sessions:
            session.round = 1  # as the agent sets it on joining
        assert client.report_checkpoint(report(a, 10, [copy(0, a)])).committed_step == -1
        assert client.report_checkpoint(report(b, 10, [copy(1, b)])).committed_step == 10
        assert told.wait(5), "no progress pushed"
        # b has it in its answer; step 10 is the one to copy to the peers.
        assert heard == {a[0]: [(10, -1, 10)], b[0]: []}
        # Nothing moved: nothing is pushed again.
        client.report_checkpoint(report(b, 10, [copy(1, b)]))
        time.sleep(0.2)
        assert heard[a[0]] == [(10, -1, 10)]
    finally:
        for session in sessions:
            session.close()


# ----------------------------------------------------------------- refusals


def test_every_checkpoint_method_needs_the_job_token(master: Running) -> None:
    client = master.client
    (a,) = register(client, "a")
    form_rounds(client, a, 1)
    with MasterClient(master.address, token="wrong") as bad:
        calls: list[Callable[[], object]] = [
            lambda: bad.report_checkpoint(report(a, 1, [copy(0, a)])),
            bad.latest_checkpoint,
            lambda: bad.report_persisted(
                checkpoint_pb2.PersistedReport(step=1, path="/p", round=1, world_size=1)
            ),
            bad.checkpoint_status,
        ]
        for call in calls:
            with pytest.raises(Unauthenticated):
                call()
    status = client.checkpoint_status()
    assert (status.committed_step, status.bytes_held, status.persisted_step) == (-1, 0, -1)


@pytest.fixture
def formed(master: Running) -> Iterator[tuple[MasterClient, Node, Node]]:
    client = master.client
    a, b = register(client, "a", "b")
    form_rounds(client, a, 1)
    save_step(client, [a, b], step=5)
    yield client, a, b


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("step", -1, "step must be >= 0"),
        ("world_size", 0, "world_size must be in"),
        ("world_size", 1, "rank 1 is outside 0..0"),
        ("round", 0, "round must be >= 1"),
        ("round", 9, "round 9 has not formed"),
        ("dropped_below", 7, "dropped_below must be in 0..6"),
        ("node_id", "", "node_id must not be empty"),
    ],
)
def test_bad_report_fields_are_invalid_argument_and_change_nothing(
    formed: tuple[MasterClient, Node, Node], field: str, value: int | str, message: str
) -> None:
    client, a, _ = formed
    before = client.checkpoint_status(), client.latest_checkpoint()
    request = report(a, 6, [copy(0, a), copy(1, a, replica=True)])
    setattr(request, field, value)
    with pytest.raises(InvalidArgument, match=message):
        client.report_checkpoint(request)
    assert (client.checkpoint_status(), client.latest_checkpoint()) == before


def test_other_bad_fields_are_invalid_argument_on_the_wire(
    formed: tuple[MasterClient, Node, Node], master: Running
) -> None:
    client = formed[0]
    with pytest.raises(InvalidArgument, match="before_step"):
        client.latest_checkpoint(before_step=-1)
    with pytest.raises(InvalidArgument, match="path must not be empty"):
        client.report_persisted(checkpoint_pb2.PersistedReport(step=1, round=1, world_size=1))
    with grpc.insecure_channel(master.address) as channel:
        latest = channel.unary_unary(
            "/dlfleet.api.v1.Checkpoints/Latest",
            request_serializer=lambda raw: raw,
            response_deserializer=lambda raw: raw,
        )
        with pytest.raises(grpc.RpcError) as refused:
            latest(b"\xff\xff\xff", metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=5)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_a_report_from_a_stale_incarnation_is_failed_precondition(
    formed: tuple[MasterClient, Node, Node],
) -> None:
    client, a, b = formed
    register(client, "a")  # a new incarnation replaces a#1, whose copies go
    with pytest.raises(StaleError, match="not registered"):
        client.report_checkpoint(report(a, 6, [copy(0, a)]))
    assert {c.node_id for c in client.latest_checkpoint().copies} == {b[0]}


# ------------------------------------------------------------- durability


def test_the_checkpoint_stream_is_compacted_and_recovers_the_same_table(store_url: str) -> None:
    settings = MasterSettings(checkpoints_compact_every=10)
    live = MasterState(open_store(store_url), settings)
    table = live.checkpoints
    for step in range(30):
        for rank in range(2):
            node = f"n{rank}#1"
            own = ImageCopy(rank, node, f"{node}:1", False, 10)
            copies = (own, ImageCopy((rank + 1) % 2, node, f"{node}:1", True, 10))
            events = table.report(CheckpointReport(node, step, 1, 2, copies, max(0, step - 3)))[1]
            live.journal.append(events).result()
    live.journal.append(table.report_persisted(PersistedStep(20, "/p/20", 1, 2))).result()
    live.journal.append([]).result()
    expected = table.to_dict()
    live.close()

    store = open_store(store_url)
    stream = store.load()[CHECKPOINTS_STREAM]
    assert stream.checkpoint is not None, "no compaction happened"
    assert len(stream.entries) <= 20
    # The nodes were never registered with this state: recovery drops their copies.
    recovered = MasterState.recover(store, settings, now_ms=0)
    assert recovered.checkpoints.to_dict()["persisted"] == expected["persisted"]
    assert recovered.checkpoints.latest() is None
    assert {r["step"] for r in recovered.checkpoints.to_dict()["records"]} == {
        r["step"] for r in expected["records"]
    }
    recovered.close()


def test_replay_from_a_compacted_stream_gives_the_same_table_when_nodes_are_live(
    store_url: str,
) -> None:
    settings = MasterSettings(checkpoints_compact_every=7)
    live = MasterState(open_store(store_url), settings)
    for name in ("n0", "n1"):
        live.journal.append(live.nodes.register(name, 1, "h", now_ms=0)[1]).result()
    for step in range(12):
        for rank in range(2):
            node = f"n{rank}#1"
            copies = (ImageCopy(rank, node, f"{node}:1", False, 10),)
            events = live.checkpoints.report(CheckpointReport(node, step, 1, 2, copies))[1]
            live.journal.append(events).result()
    expected = live.checkpoints.to_dict()
    live.close()
    recovered = MasterState.recover(open_store(store_url), settings, now_ms=0)
    assert recovered.checkpoints.to_dict() == expected
    recovered.close()
