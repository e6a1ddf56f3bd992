"""The agent's image keeper against a real master and real Keeper servers on
127.0.0.1: an announced image is reported and committed, copied to the peer
node (which reports its replica), fetched back byte for byte from either
node, and a call without the job token is refused. Images are written with
the real ImageWriter, into the keeper's folder, as a worker does."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from harness import TOKEN, Running

from dlfleet.api.client import MasterClient
from dlfleet.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.state import MasterSettings
from dlfleet.worker.agent.keeper import ImageKeeper, remove_stale_folders
from dlfleet.worker.agent.keeper_server import AgentServer, KeeperService
from dlfleet.worker.agent.orders import WorkerOrders
from dlfleet.worker.checkpoint import files
from dlfleet.worker.checkpoint.image import ImageWriter
from dlfleet.worker.checkpoint.remote import fetch_image

pytestmark = pytest.mark.integration

SETTINGS = MasterSettings(
    job_name="job",
    rendezvous=RendezvousSettings(min_nodes=2, max_nodes=2, last_call_timeout_ms=0),
)


class Node:
    def __init__(self, master: Running, name: str, root: Path) -> None:
        reply = master.client.register_node(job_name="job", node_name=name, local_world_size=1)
        self.node_id, self.incarnation = reply.node_id, reply.incarnation
        self.client = MasterClient(master.address, token=TOKEN, timeout_s=5)
        self.service = KeeperService(WorkerOrders())
        self.server = AgentServer(
            self.service,
            token=TOKEN,
            local_address=f"unix:{root / f'{name}.sock'}",
            host="127.0.0.1",
            threads=8,
        )
        self.keeper = ImageKeeper(
            root / name,
            client=self.client,
            token=TOKEN,
            node_id=self.node_id,
            incarnation=self.incarnation,
            address=self.server.peer_address,
        )
        self.service.images = self.keeper
        self.server.start()

    def close(self) -> None:
        self.server.stop()
        self.keeper.close()
        self.client.close()


@pytest.fixture
def nodes(
    start_master: Callable[..., Running], tmp_path: Path
) -> Iterator[tuple[Running, Node, Node]]:
    master = start_master(SETTINGS)
    a, b = Node(master, "a", tmp_path), Node(master, "b", tmp_path)
    form_round(master, a, b)
    yield master, a, b
    a.close()
    b.close()


def form_round(master: Running, a: Node, b: Node) -> int:
    """Both nodes join a round (the next one), each copying to the other."""
    import threading

    rounds: dict[str, int] = {}

    def join(node: Node) -> None:
        reply = master.client.join_rendezvous(
            node_id=node.node_id,
            incarnation=node.incarnation,
            local_world_size=1,
            host="127.0.0.1",
            bootstrap_port=29500,
            timeout_s=10,
            keeper_address=node.server.peer_address,
        )
        rounds[node.node_id] = reply.round

    threads = [threading.Thread(target=join, args=(n,)) for n in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert len(rounds) == 2 and len(set(rounds.values())) == 1, rounds
    a.keeper.set_peer(b.server.peer_address)
    b.keeper.set_peer(a.server.peer_address)
    return rounds[a.node_id]


def write(node: Node, rank: int, step: int, round_: int = 1) -> Any:
    """An image written into the node's folder, as a worker does, unannounced."""
    writer = ImageWriter(node.keeper.own_dir, rank)
    state = {"w": torch.full((256, 256), float(step)), "step": step}
    image = writer.write(step, state, round=round_, world_size=2, protect=None)
    writer.close()
    return image


def save(node: Node, rank: int, step: int, round_: int = 1) -> checkpoint_pb2.SavedAck:
    image = write(node, rank, step, round_)
    notice = checkpoint_pb2.SavedNotice(
        rank=rank,
        step=step,
        round=round_,
        world_size=2,
        path=str(image.header_path),
        bytes=image.nbytes,
    )
    return node.keeper.saved(notice)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_an_image_of_every_rank_commits_the_step_and_is_replicated_to_the_peer(
    nodes: tuple[Running, Node, Node],
) -> None:
    master, a, b = nodes
    first = save(a, 0, 3)
    assert first.committed_step < 3  # rank 1 has not saved step 3 yet
    second = save(b, 1, 3)
    assert second.committed_step == 3

    def replicated() -> bool:
        record = master.client.latest_checkpoint()
        return record.found and len(record.copies) == 4

    wait_for(replicated, "both images replicated")
    record = master.client.latest_checkpoint()
    assert record.step == 3 and record.world_size == 2
    holders = {(c.rank, c.node_id, c.replica) for c in record.copies}
    assert holders == {
        (0, a.node_id, False),
        (0, b.node_id, True),
        (1, b.node_id, False),
        (1, a.node_id, True),
    }
    assert b.keeper.find(3, 0) is not None and a.keeper.find(3, 1) is not None


def test_a_save_is_answered_once_every_ranks_image_of_its_step_is_on_two_nodes(
    nodes: tuple[Running, Node, Node],
) -> None:
    """Each node's answer waits for the other node's copy too, which this
    node learns only from the master: once a save is answered, losing any one
    node loses no image of its step."""
    import threading

    master, a, b = nodes
    seen: dict[tuple[str, int], bool] = {}

    def saving(node: Node, rank: int, other_rank: int, name: str, step: int) -> None:
        save(node, rank, step)
        seen[(name, step)] = node.keeper.find(step, other_rank) is not None  # the peer's copy

    for step in (4, 5, 6):
        threads = [
            threading.Thread(target=saving, args=(a, 0, 1, "a", step)),
            threading.Thread(target=saving, args=(b, 1, 0, "b", step)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
        answers = {name: seen.get((name, step)) for name in "ab"}
        assert answers == {"a": True, "b": True}, f"step {step}: a replica was missing"
        status = master.client.checkpoint_status()
        assert (status.committed_step, status.replicated_step) == (step, step)


def saving_both(a: Node, b: Node, step: int, round_: int = 1) -> float:
    """Rank 0 on a and rank 1 on b save `step` at once; the slower answer's
    time in seconds."""
    import threading

    took: list[float] = []

    def one(node: Node, rank: int) -> None:
        started = time.monotonic()
        save(node, rank, step, round_)
        took.append(time.monotonic() - started)

    threads = [threading.Thread(target=one, args=(a, 0)), threading.Thread(target=one, args=(b, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(40)
    assert len(took) == 2, "a save was not answered"
    return max(took)


def test_while_the_master_is_away_saves_do_not_wait_and_commit_once_it_is_back(
    nodes: tuple[Running, Node, Node], start_master: Any
) -> None:
    """Only the master can commit a step, so a save waiting for it while it
    restarts gains nothing: the first save notices within MASTER_SLOW_S, the
    next ones answer at once, and the steps commit when it is back."""
    master, a, b = nodes
    saving_both(a, b, 3)
    assert master.client.checkpoint_status().replicated_step == 3
    port = int(master.address.rsplit(":", 1)[1])
    start_master.stop(master)

    first = saving_both(a, b, 4)
    assert first < 1.0, f"the first save without a master took {first:.2f}s"
    later = [saving_both(a, b, step) for step in (5, 6)]
    assert max(later) < 0.3, f"saves without a master took {later}"
    assert a.keeper.master_away and b.keeper.master_away

    back = start_master(SETTINGS, port=port)  # the same address and store: a restart
    wait_for(lambda: back.client.checkpoint_status().committed_step == 6, "step 6 committed", 40)
    # Committed again as before the outage: no save waits out its bound.
    after = [saving_both(a, b, step) for step in (7, 8)]
    assert max(after) < 1.0, f"saves after the master came back took {after}"
    assert back.client.checkpoint_status().committed_step == 8
    assert not a.keeper.master_away and not b.keeper.master_away


def test_a_step_saved_again_after_a_restore_is_copied_to_the_peer_again(
    nodes: tuple[Running, Node, Node], start_master: Any
) -> None:
    """Round 1 committed step 3; b also saved step 4, copied to a while the
    master was away (the newest goes then), which a never saved: a's worker
    had died. Round 2 restores step 3 and saves step 4 again. a holds round
    1's image of b's step 4, not this one: it is sent too, so a hears of the
    commit and the copy, and the save is answered as fast as any, not after
    the answer's bound."""
    master, a, b = nodes
    saving_both(a, b, 3)
    port = int(master.address.rsplit(":", 1)[1])
    start_master.stop(master)
    save(b, 1, 4)
    wait_for(lambda: a.keeper.find(4, 1) is not None, "b's round-1 step 4 on a")
    master = start_master(SETTINGS, port=port)
    assert a.keeper.wait_reconciled(20) and b.keeper.wait_reconciled(20)
    round_ = form_round(master, a, b)
    assert round_ == 2
    started = time.monotonic()
    saving_both(a, b, 4, round_)

    def both() -> bool:
        status = master.client.checkpoint_status()
        return (status.committed_step, status.replicated_step) == (4, 4)

    wait_for(both, "step 4 committed and replicated", 5)
    took = time.monotonic() - started
    assert took < 1.0, f"step 4 saved again took {took:.2f}s to commit and replicate"
    copies = [
        image.header.round
        for folder in a.keeper.replica_dir.iterdir()
        for image in files.list_images(folder, 1)
        if image.header.step == 4
    ]
    assert 2 in copies, f"b's round-2 image of step 4 is not on a (rounds held: {copies})"


def saved_by_both(a: Node, b: Node, step: int) -> dict[str, int]:
    """Rank 0 on a and rank 1 on b save `step` at once; each node's answer."""
    import threading

    answers: dict[str, int] = {}

    def one(node: Node, rank: int, name: str) -> None:
        answers[name] = save(node, rank, step).committed_step

    threads = [
        threading.Thread(target=one, args=(a, 0, "a")),
        threading.Thread(target=one, args=(b, 1, "b")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(40)
    assert len(answers) == 2, "a save was not answered"
    return answers


def test_a_node_lost_while_the_master_is_away_leaves_its_peer_holding_the_step_whole(
    nodes: tuple[Running, Node, Node], start_master: Any
) -> None:
    """With the master away, a save is answered once its node holds every
    rank's image of the step (own and replica): that step is told committed.
    b is then lost; the master, back, hears from a every image it held and
    restores the step told committed from a alone, not the step committed
    before the outage."""
    master, a, b = nodes
    saved_by_both(a, b, 3)
    assert master.client.checkpoint_status().replicated_step == 3
    port = int(master.address.rsplit(":", 1)[1])
    start_master.stop(master)

    for step in (4, 5):
        assert saved_by_both(a, b, step) == {"a": step, "b": step}
    assert a.keeper.find(5, 1) is not None  # b's image of step 5, as a replica
    b.close()  # lost: its memory with it, and it never reports again

    back = start_master(SETTINGS, port=port)  # the same address and store: a restart
    back.client.deregister_node(b.node_id, b.incarnation)
    assert a.keeper.wait_reconciled(20)
    latest = back.client.latest_checkpoint()
    assert latest.step == 5
    assert {(c.rank, c.node_id, c.replica) for c in latest.copies} == {
        (0, a.node_id, False),
        (1, a.node_id, True),
    }


def test_the_replica_of_the_step_told_committed_outlives_newer_replicas(
    nodes: tuple[Running, Node, Node], start_master: Any
) -> None:
    """A replica slot is reused oldest first, but never the one holding the
    step this node's workers were told is committed: with the master away,
    a holds step 4 whole and answered so; b's images of steps 5 and 6 come
    (a saves neither), and a still holds b's image of step 4."""
    master, a, b = nodes
    saved_by_both(a, b, 3)
    start_master.stop(master)
    assert saved_by_both(a, b, 4) == {"a": 4, "b": 4}
    for step in (5, 6):
        assert save(b, 1, step).committed_step == 4  # b never holds 5 or 6 whole
    wait_for(lambda: a.keeper.find(6, 1) is not None, "b's step 6 on a")
    assert a.keeper.find(4, 1) is not None


def test_a_new_round_first_tells_the_master_the_images_it_had_not_reported(
    nodes: tuple[Running, Node, Node],
) -> None:
    """Reports trail the saves, and a killed worker never announces its
    last: each node's images of step 4 were written but never reported. The
    next round's start reports them before its restore asks for the newest
    step, which is then step 4, not the step committed before."""
    master, a, b = nodes
    saving_both(a, b, 3)
    wait_for(lambda: master.client.latest_checkpoint().step == 3, "step 3 restorable")
    write(a, 0, 4)
    write(b, 1, 4)
    time.sleep(0.2)  # nothing reports them meanwhile
    assert master.client.latest_checkpoint().step == 3
    form_round(master, a, b)  # each node's set_peer waits for its reports
    latest = master.client.latest_checkpoint()
    assert latest.step == 4
    # Step 3 stays restorable: the reports of step 4 say the nodes hold it.
    assert master.client.latest_checkpoint(before_step=4).step == 3
    assert {(c.rank, c.node_id) for c in latest.copies if not c.replica} == {
        (0, a.node_id),
        (1, b.node_id),
    }


def test_an_image_fetched_from_the_peer_is_the_saved_image_byte_for_byte(
    nodes: tuple[Running, Node, Node],
) -> None:
    _, a, b = nodes
    save(a, 0, 5)
    save(b, 1, 5)
    wait_for(lambda: b.keeper.find(5, 0) is not None, "rank 0's replica on b")
    own = a.keeper.find(5, 0)
    assert own is not None
    expected = files.read_image_bytes(own)
    header, body = fetch_image(b.server.peer_address, TOKEN, 5, 0)
    assert body == expected[1]
    assert files.decode_header(header).step == 5
    from_origin = fetch_image(a.server.peer_address, TOKEN, 5, 0)
    assert from_origin[1] == expected[1]


def test_a_fetch_of_an_image_nobody_holds_is_not_found(nodes: tuple[Running, Node, Node]) -> None:
    _, a, _ = nodes
    with grpc.insecure_channel(a.server.peer_address) as channel:
        stub = checkpoint_pb2_grpc.KeeperStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(
                stub.Fetch(
                    checkpoint_pb2.FetchRequest(step=99, rank=0),
                    metadata=(("x-dlfleet-token", TOKEN),),
                    timeout=5,
                )
            )
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND


def test_a_keeper_call_without_the_job_token_is_refused(nodes: tuple[Running, Node, Node]) -> None:
    _, a, _ = nodes
    with grpc.insecure_channel(a.server.peer_address) as channel:
        stub = checkpoint_pb2_grpc.KeeperStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Saved(checkpoint_pb2.SavedNotice(), metadata=(("x-dlfleet-token", "no"),))
    assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_an_announced_file_outside_the_keepers_folder_is_refused(
    nodes: tuple[Running, Node, Node], tmp_path: Path
) -> None:
    _, a, _ = nodes
    with grpc.insecure_channel(a.server.peer_address) as channel:
        stub = checkpoint_pb2_grpc.KeeperStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Saved(
                checkpoint_pb2.SavedNotice(path=str(tmp_path / "elsewhere.header")),
                metadata=(("x-dlfleet-token", TOKEN),),
            )
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_the_folders_of_dead_agents_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    dead = tmp_path / "dlworker-999999999-abcdef"
    alive = tmp_path / f"dlworker-{os.getpid()}-abcdef"
    other = tmp_path / "not-ours"
    for folder in (dead, alive, other):
        folder.mkdir()
    assert remove_stale_folders(tmp_path) == [dead]
    assert alive.exists() and other.exists() and not dead.exists()


def test_a_keeper_without_in_place_restarts_refuses_to_attach_a_worker(tmp_path: Path) -> None:
    """The torchrun handler's keeper (no orders: torchrun restarts its
    workers cold) says so to a process that tries to attach, at once."""
    server = AgentServer(
        KeeperService(None),
        token=TOKEN,
        local_address=f"unix:{tmp_path / 'k.sock'}",
        host="127.0.0.1",
        threads=2,
    )
    server.start()
    try:
        with grpc.insecure_channel(server.local_address) as channel:
            stub = checkpoint_pb2_grpc.KeeperStub(channel)
            request = checkpoint_pb2.AttachRequest(pid=os.getpid())
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Attach(request, metadata=(("x-dlfleet-token", TOKEN),), timeout=5))
            stub.Report(
                checkpoint_pb2.WorkerState(pid=os.getpid(), round=1),
                metadata=(("x-dlfleet-token", TOKEN),),
                timeout=5,
            )  # ignored: nothing to tell
    finally:
        server.stop()
    assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "torchrun" in str(caught.value.details())


def test_copies_to_a_peer_that_is_down_are_tried_again_with_growing_waits(
    nodes: tuple[Running, Node, Node], caplog: pytest.LogCaptureFixture
) -> None:
    """The peer's machine is gone (its keeper answers nothing) before the
    master says so: the node keeps saving, and its copies fail. They are
    tried again after 0.05 s, 0.1 s, 0.2 s... not at every save or wake
    (seen: a try every 2 ms, a warning each, for as long as the round
    lasted)."""
    import threading

    _, a, b = nodes
    b.server.stop()
    caplog.set_level("WARNING", logger="dlfleet.worker.agent.keeper")
    stop = threading.Event()

    answers: list[threading.Thread] = []

    def saving() -> None:
        # A save's answer waits (up to 2 s) for a commit that cannot come:
        # each announced from a thread of its own, as the worker's notices
        # run off its training.
        step = 1
        while not stop.is_set():
            answers.append(threading.Thread(target=save, args=(a, 0, step), daemon=True))
            answers[-1].start()
            step += 1
            time.sleep(0.02)

    saver = threading.Thread(target=saving)
    saver.start()
    time.sleep(1.0)
    stop.set()
    saver.join()
    tries = [r for r in caplog.records if "replica of rank 0" in r.getMessage()]
    for answer in answers:
        answer.join(5)
    # 0.05 + 0.1 + 0.2 + 0.4 s of waits fit in a second: at most 5 tries.
    assert 1 <= len(tries) <= 6, len(tries)
