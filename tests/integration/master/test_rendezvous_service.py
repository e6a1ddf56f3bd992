"""The rendezvous through a real server and client: joins block until the round
forms, a dead agent's session closes its round at once and the survivors hear
it, late nodes trigger a re-rendezvous, rounds survive a master restart, and
stale rounds are fenced off."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from harness import TOKEN, Running

from dlfleet.api.client import AgentSession, MasterClient, ReRendezvous, join_request
from dlfleet.api.errors import InvalidArgument, StaleError, Unavailable
from dlfleet.api.status import TOKEN_METADATA_KEY
from dlfleet.api.v1 import rendezvous_pb2, rendezvous_pb2_grpc, shards_pb2
from dlfleet.master.core.liveness import LivenessSettings
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.state import MasterSettings

pytestmark = pytest.mark.integration


def settings(**rdzv: int) -> MasterSettings:
    return MasterSettings(
        job_name="job",
        rendezvous=RendezvousSettings(**{"last_call_timeout_ms": 300, **rdzv}),
        liveness=LivenessSettings(heartbeat_interval_ms=100, heartbeat_timeout_ms=1_500),
    )


class Agent:
    """A minimal agent: registered, with a session, able to join."""

    def __init__(self, address: str, name: str, lws: int = 1, host: str = "127.0.0.1") -> None:
        self.host = host
        self.client = MasterClient(address, token=TOKEN, timeout_s=5)
        reg = self.client.register_node(job_name="job", node_name=name, local_world_size=lws)
        self.node_id, self.incarnation, self.lws = reg.node_id, reg.incarnation, lws
        self.session: AgentSession = self.client.agent_session(self.node_id, self.incarnation, 0.1)

    def join_on_session(
        self, port: int = 29500, timeout_s: float = 20, spare: int = 0
    ) -> rendezvous_pb2.JoinResponse:
        """The agent's way: the join goes up the session stream (with a spare
        port, the master may join the node into the next round itself)."""
        request = join_request(
            self.node_id, self.incarnation, self.lws, self.host, port, next_bootstrap_port=spare
        )
        return self.session.join(request, timeout_s=timeout_s)

    def join(self, port: int = 29500) -> rendezvous_pb2.JoinResponse:
        return self.client.join_rendezvous(
            node_id=self.node_id,
            incarnation=self.incarnation,
            local_world_size=self.lws,
            host=self.host,
            bootstrap_port=port,
            timeout_s=20,
        )

    def next_push(self, timeout: float = 5) -> ReRendezvous:
        return self.session.events.get(timeout=timeout)

    def close(self) -> None:
        self.session.close()
        self.client.close()


def join_all(agents: list[Agent], on_session: bool = False) -> list[rendezvous_pb2.JoinResponse]:
    def join(agent: Agent) -> rendezvous_pb2.JoinResponse:
        port = 29500 + agents.index(agent)
        return agent.join_on_session(port) if on_session else agent.join(port)

    with ThreadPoolExecutor(len(agents)) as pool:
        return list(pool.map(join, agents))


@pytest.fixture
def agents() -> Any:
    made: list[Agent] = []

    def make(address: str, name: str, lws: int = 1, host: str = "127.0.0.1") -> Agent:
        made.append(Agent(address, name, lws, host))
        return made[-1]

    yield make
    for agent in made:
        agent.close()


@pytest.mark.parametrize("on_session", [False, True], ids=["join-call", "on-session"])
def test_joins_block_until_the_round_forms_and_agree_on_it(
    start_master: Callable[..., Running], agents: Callable[..., Agent], on_session: bool
) -> None:
    master = start_master(settings(min_nodes=3, max_nodes=3))
    nodes = [agents(master.address, f"n{i}", lws=i + 1) for i in range(3)]
    results = join_all(nodes, on_session)
    assert {r.round for r in results} == {1}
    assert sorted(r.group_rank for r in results) == [0, 1, 2]
    # Ranks follow the join order, which concurrent joins do not fix: each
    # node's place (its global ranks) must be where the round's order, as
    # GetState lists it, puts it.
    lws_of = {n.node_id: i + 1 for i, n in enumerate(nodes)}
    state = master.client.rendezvous_state()
    assert state.round == 1
    order = list(state.members)
    assert sorted(order) == sorted(lws_of)
    assert list(state.local_world_sizes) == [lws_of[node] for node in order]
    # The store is on the leader's port (join_all gives node i port 29500 + i).
    leader_port = 29500 + [n.node_id for n in nodes].index(order[0])
    for node, r in zip(nodes, results, strict=True):
        assert order[r.group_rank] == node.node_id
        assert r.group_world_size == 3
        assert r.world_size == 6
        assert r.local_world_size == lws_of[node.node_id]
        assert r.rank_offset == sum(lws_of[n] for n in order[: r.group_rank])
        assert r.keeper_peer == ""
        assert (r.bootstrap_host, r.bootstrap_port) == (results[0].bootstrap_host, leader_port)
        sizes = [run.size for run in r.local_world_size_runs for _ in range(run.count)]
        assert sizes == list(state.local_world_sizes)  # the same for every member


def test_a_dead_agents_session_closes_the_round_and_the_survivor_hears_at_once(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    master = start_master(settings(min_nodes=1, max_nodes=2))
    a, b = agents(master.address, "a"), agents(master.address, "b", lws=2)
    _, joined_b = join_all([a, b])
    started = time.monotonic()
    b.session.close()  # the agent process died: its stream breaks
    push = a.next_push()
    assert push.closed_round == 1
    assert "lost its session" in push.reason
    # b's ranks died with it: a persisting survivor waits for no part of theirs.
    assert push.gone_ranks == (joined_b.rank_offset, joined_b.rank_offset + 1)
    assert time.monotonic() - started < 2, "pushed at once, not after a heartbeat timeout"
    again = a.join()
    assert (again.round, again.group_world_size, again.group_rank) == (2, 1, 0)
    with pytest.raises(StaleError):
        b.join()  # that incarnation is gone


def test_a_late_node_makes_the_members_re_rendezvous_into_a_bigger_round(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    master = start_master(settings(min_nodes=1, max_nodes=2))
    a = agents(master.address, "a")
    assert a.join().group_world_size == 1
    b = agents(master.address, "b")
    late: queue.Queue[rendezvous_pb2.JoinResponse] = queue.Queue()
    threading.Thread(target=lambda: late.put(b.join()), daemon=True).start()
    assert a.next_push().closed_round == 1
    mine = a.join()
    theirs = late.get(timeout=10)
    assert (mine.round, mine.group_world_size) == (2, 2)
    assert (mine.group_rank, theirs.group_rank) == (0, 1), "the survivor keeps rank 0"


def test_a_node_whose_workers_succeeded_leaves_without_disturbing_the_others(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    master = start_master(settings(min_nodes=2, max_nodes=2))
    a, b = agents(master.address, "a"), agents(master.address, "b")
    join_all([a, b])
    b.client.leave_rendezvous(b.node_id, b.incarnation, "succeeded")
    b.session.close()
    time.sleep(0.3)
    assert a.session.events.empty()
    assert master.client.rendezvous_state().round == 1


def test_a_node_that_leaves_closes_the_round_naming_no_rank_gone(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    """A preempted node stops its workers itself (they persist their parts
    on the way out) before it leaves: none of its ranks is said to be gone."""
    master = start_master(settings(min_nodes=1, max_nodes=2))
    a, b = agents(master.address, "a"), agents(master.address, "b")
    join_all([a, b])
    b.client.leave_rendezvous(b.node_id, b.incarnation, "preempted")
    push = a.next_push()
    assert "preempted" in push.reason and push.gone_ranks == ()


def test_a_new_round_releases_the_old_rounds_shard_leases(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    master = start_master(settings(min_nodes=1, max_nodes=2))
    a = agents(master.address, "a")
    first = a.join()
    client = master.client
    client.register_dataset(shards_pb2.DatasetSpec(name="d", size=40, batch_size=5, epochs=1))
    lease = client.lease_for_round("d", round=first.round, position=0).shard
    b = agents(master.address, "b")
    threading.Thread(target=b.join, daemon=True).start()
    a.next_push()
    second = a.join()
    with pytest.raises(StaleError):
        client.report_done("d", lease.lease_id, round=first.round)
    with pytest.raises(StaleError):
        client.lease_for_round("d", round=first.round, position=1)
    again = client.lease_for_round("d", round=second.round, position=0).shard
    assert (again.start, again.end) == (lease.start, lease.end), "the released shard comes back"


def test_failure_reports_of_a_stale_round_are_rejected(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    master = start_master(settings(min_nodes=1, max_nodes=1))
    a = agents(master.address, "a")
    first = a.join()
    report = rendezvous_pb2.FailureReport(
        node_id=a.node_id, incarnation=a.incarnation, round=first.round, exit_code=1
    )
    a.client.report_worker_failure(report)
    second = a.join()
    assert second.round == first.round + 1
    with pytest.raises(StaleError, match="stale"):
        a.client.report_worker_failure(report)


def test_a_silent_agent_is_dropped_after_the_heartbeat_timeout(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    master = start_master(settings(min_nodes=1, max_nodes=2))
    a = agents(master.address, "a")
    client = MasterClient(master.address, token=TOKEN)
    reg = client.register_node(job_name="job", node_name="hung", local_world_size=1)
    # A node that joined but never heartbeats (no session): a hang or a partition.
    outcome: queue.Queue[BaseException | None] = queue.Queue()

    def hung_join() -> None:
        try:
            client.join_rendezvous(
                node_id=reg.node_id, incarnation=reg.incarnation, local_world_size=1,
                host="127.0.0.1", bootstrap_port=1, timeout_s=20,
            )  # fmt: skip
            outcome.put(None)
        except StaleError as error:
            outcome.put(error)

    threading.Thread(target=hung_join, daemon=True).start()
    joined = a.join()
    assert joined.group_world_size == 2
    push = a.next_push(timeout=5)
    assert "missed its heartbeats" in push.reason
    assert push.gone_ranks == (1 - joined.rank_offset,)  # the silent node's rank
    assert a.join().group_world_size == 1
    assert outcome.get(timeout=5) is None, "the hung node's join had succeeded"
    client.close()


def test_the_round_and_node_table_survive_a_master_restart(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    master = start_master(settings(min_nodes=2, max_nodes=2))
    a, b = agents(master.address, "a"), agents(master.address, "b")
    join_all([a, b])
    order = list(master.client.rendezvous_state().members)  # concurrent joins: either
    assert sorted(order) == sorted([a.node_id, b.node_id])
    port = master.server.port
    start_master.stop(master)  # type: ignore[attr-defined]
    again = start_master(settings(min_nodes=2, max_nodes=2), port=port)
    state = again.client.rendezvous_state()
    assert state.round == 1 and list(state.members) == order
    # The agents' sessions reconnect; a failure report for round 1 is current.
    a.client.report_worker_failure(
        rendezvous_pb2.FailureReport(node_id=a.node_id, incarnation=a.incarnation, round=1)
    )


def test_network_failures_naming_one_node_in_two_rounds_make_it_a_suspect(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    """c's link is bad: a's and b's workers lose their connections to c
    (gloo names c's address), c's worker names a. Once two closed rounds
    blamed c, the master's status names it as a network suspect."""
    master = start_master(settings(min_nodes=3, max_nodes=3))
    a, b, c = (agents(master.address, n, host=f"10.9.0.{i + 1}") for i, n in enumerate("abc"))

    def fail(agent: Agent, round_: int, peer: Agent) -> None:
        agent.client.report_worker_failure(
            rendezvous_pb2.FailureReport(
                node_id=agent.node_id,
                incarnation=agent.incarnation,
                round=round_,
                exit_code=1,
                message="RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                f"Connection closed by peer [{peer.host}]:40213",
                category="network",
                rule="network",
                action="restart",
            )
        )

    seen = []
    for _ in range(3):
        round_ = join_all([a, b, c])[0].round
        seen.append([s.node_id for s in master.client.master_status().network_suspects])
        fail(a, round_, c)
        fail(b, round_, c)
        fail(c, round_, a)
    assert seen == [[], [], [c.node_id]]
    suspect = master.client.master_status().network_suspects[0]
    assert list(suspect.rounds) == [1, 2]
    assert "named it in rounds 1, 2" in suspect.reason


def join_in_background(
    agent: Agent, timeout_s: float = 20
) -> queue.Queue[BaseException | rendezvous_pb2.JoinResponse]:
    """`agent` joins on its session in a thread: its answer, or its error."""
    outcome: queue.Queue[BaseException | rendezvous_pb2.JoinResponse] = queue.Queue()

    def join() -> None:
        try:
            outcome.put(agent.join_on_session(timeout_s=timeout_s))
        except Exception as error:  # noqa: BLE001 - the test reads it
            outcome.put(error)

    threading.Thread(target=join, daemon=True).start()
    return outcome


def test_a_join_on_the_session_fails_as_the_call_would(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    """Errors come down the session with their codes; the session lives on."""
    master = start_master(settings(min_nodes=2, max_nodes=2))
    a, b = agents(master.address, "a"), agents(master.address, "b")
    with pytest.raises(InvalidArgument, match=r"local_world_size must be in 1\.\.1024"):
        a.session.join(join_request(a.node_id, a.incarnation, 0, "127.0.0.1", 1), timeout_s=5)
    with pytest.raises(InvalidArgument, match=f"names {b.node_id}"):
        a.session.join(join_request(b.node_id, b.incarnation, 1, "127.0.0.1", 1), timeout_s=5)
    results = join_all([a, b], on_session=True)
    assert sorted(r.group_rank for r in results) == [0, 1]


def test_a_silent_node_waiting_on_its_session_is_told_it_was_dropped(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    master = start_master(settings(min_nodes=2, max_nodes=2))
    a = agents(master.address, "a")
    outcome = join_in_background(a)
    time.sleep(0.3)
    a.session._io.loop.call_soon_threadsafe(a.session.silence)  # a partition
    error = outcome.get(timeout=10)
    assert isinstance(error, StaleError) and "missed its heartbeats" in str(error)


def test_a_join_on_the_session_rides_out_a_master_restart(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    """The join is sent again on the reopened stream; the new master, on the
    same store, forms the round with it."""
    master = start_master(settings(min_nodes=2, max_nodes=2))
    a, b = agents(master.address, "a"), agents(master.address, "b")
    outcome = join_in_background(a, timeout_s=30)
    deadline = time.monotonic() + 5
    while master.client.rendezvous_state().num_nodes_waiting < 1:
        assert time.monotonic() < deadline, "a's join never reached the master"
        time.sleep(0.05)
    port = master.server.port
    start_master.stop(master)  # type: ignore[attr-defined]
    again = start_master(settings(min_nodes=2, max_nodes=2), port=port)
    mine = b.join_on_session()
    theirs = outcome.get(timeout=20)
    assert isinstance(theirs, rendezvous_pb2.JoinResponse), theirs
    assert theirs.round == mine.round and theirs.group_world_size == 2
    assert again.client.rendezvous_state().round == mine.round


def open_raw_session(
    address: str, node_id: str, incarnation: int, round_: int, timeout_s: float = 10
) -> tuple[Any, threading.Event]:
    """A session opened by hand (the first message says `round_`), kept
    open until the event is set or `timeout_s`: the master's answers, as
    they come."""
    channel = grpc.insecure_channel(address)
    done = threading.Event()

    def messages() -> Any:
        yield rendezvous_pb2.SessionMessage(node_id=node_id, incarnation=incarnation, round=round_)
        done.wait(timeout_s)

    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    events = stub.Session(messages(), metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=timeout_s)
    return events, done


def test_a_round_that_closed_while_a_nodes_session_was_down_is_told_when_it_opens(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    """The master restarts; "b" re-joins before "a"'s session is back, so
    round 1 closes with no session of "a" to tell. When "a"'s session opens
    saying round 1, the master tells it at once (else its workers would wait
    on peers that left until something failed); one saying the active round
    hears nothing."""
    master = start_master(settings(min_nodes=1, max_nodes=2))
    a, b = agents(master.address, "a"), agents(master.address, "b")
    join_all([a, b], on_session=True)
    port = master.server.port
    start_master.stop(master)  # type: ignore[attr-defined]
    a.session.close()  # its link is down across the restart
    again = start_master(settings(min_nodes=1, max_nodes=2), port=port)
    assert b.join_on_session().round == 2
    events, done = open_raw_session(again.address, a.node_id, a.incarnation, 1)
    try:
        event = next(events)
        assert event.re_rendezvous.closed_round == 1
        assert "closed while this node's session was down" in event.re_rendezvous.reason
    finally:
        done.set()
    events, done = open_raw_session(again.address, b.node_id, b.incarnation, 2, timeout_s=1.5)
    try:
        with pytest.raises(grpc.RpcError) as silence:
            next(iter(events))  # nothing until the call's deadline (or its end)
        assert silence.value.code() in (
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.UNAVAILABLE,
        )
    finally:
        done.set()


def test_a_closed_session_fails_its_join(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    master = start_master(settings(min_nodes=2, max_nodes=2))
    a = agents(master.address, "a")
    outcome = join_in_background(a)
    time.sleep(0.3)
    a.session.close()
    assert isinstance(outcome.get(timeout=5), Unavailable)


def test_the_master_joins_the_survivors_of_a_closed_round_into_the_next_itself(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    """With a spare port on record, a survivor's push carries a join the
    master made for it: the next round forms when the old one closes, and
    the survivor's next join takes that answer without sending anything. A
    spare port serves once: until the node tells a new one (its next join
    does), it joins itself."""
    master = start_master(settings(min_nodes=1, max_nodes=3))
    a, b, c = (agents(master.address, name) for name in "abc")
    with ThreadPoolExecutor(3) as pool:
        spares = {a: 31001, b: 31002, c: 31003}
        list(
            pool.map(
                lambda n: n.join_on_session(30000 + ord(n.node_id[0]), spare=spares[n]), [a, b, c]
            )
        )
    c.session.close()  # c's agent died
    pushes = {agent: agent.next_push() for agent in (a, b)}
    assert all(p.closed_round == 1 for p in pushes.values())
    assert all(p.join_id < 0 for p in pushes.values()), pushes
    # Every survivor joined: round 2 formed at once, and each push carries
    # its answer.
    assert {p.answer.round if p.answer else 0 for p in pushes.values()} == {2}
    # Round 2 formed with a and b before either asked.
    deadline = time.monotonic() + 5
    while (state := master.client.rendezvous_state()).round != 2:
        assert time.monotonic() < deadline, state
        time.sleep(0.02)
    assert sorted(state.members) == sorted([a.node_id, b.node_id])
    joined = {agent: agent.join_on_session(32000, spare=33000) for agent in (a, b)}
    assert {r.round for r in joined.values()} == {2}
    leader = next(agent for agent, r in joined.items() if r.group_rank == 0)
    # The store of round 2 is on the leader's spare port, not the one it just sent.
    assert joined[a].bootstrap_port == spares[leader]
    # Round 2 closes before a or b told a new spare (their beats carry it,
    # every 0.1 s here, so stop b's agent at once): a must join itself.
    b.session.close()
    push = a.next_push()
    assert push.closed_round == 2
    if push.join_id:
        # a's beat had told its new spare (33000) in time: the master used it.
        assert a.join_on_session(34000, spare=35000).bootstrap_port == 33000
    else:
        assert a.join_on_session(34000, spare=35000).bootstrap_port == 34000


def test_without_a_spare_port_every_survivor_joins_itself(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    master = start_master(settings(min_nodes=1, max_nodes=2))
    a, b = agents(master.address, "a"), agents(master.address, "b")
    join_all([a, b], on_session=True)
    b.session.close()
    push = a.next_push()
    assert push.closed_round == 1 and push.join_id == 0
    time.sleep(0.3)
    assert master.client.rendezvous_state().round == 0  # nobody joined a yet
    assert a.join_on_session().round == 2


def test_a_push_that_comes_after_the_agents_own_join_was_answered_is_not_taken_later(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    """Both nodes' workers fail at once: b's join closes round 1 and the
    master joins a into round 2 itself, pushing it that answer; a's own
    join, sent meanwhile, may be answered first (round 2), the push coming
    after it. That push is no join to keep: a's workers fail again in round
    2 and its next join must close round 2, not take round 2 once more (a
    chaos run: the spare waited in a round its peer had left, until the
    watchdog's 5 s ceiling called it hung)."""
    master = start_master(settings(min_nodes=2, max_nodes=2))
    a, b = agents(master.address, "a"), agents(master.address, "b")
    with ThreadPoolExecutor(2) as pool:
        firsts = list(
            pool.map(lambda n: n[0].join_on_session(n[1], spare=n[1] + 1), [(a, 31000), (b, 32000)])
        )
    assert {r.round for r in firsts} == {1}
    assert b.join_on_session(32010, spare=32011).round == 2
    push = a.next_push()
    assert push.closed_round == 1 and push.join_id < 0 and push.answer is not None
    assert a.join_on_session(31010, spare=31011).round == 2  # the master's join, taken
    # The same push once more, as if it came after a's own join was answered.
    late = rendezvous_pb2.ReRendezvous(
        closed_round=push.closed_round, reason=push.reason, join_id=push.join_id, answer=push.answer
    )
    session = a.session

    async def deliver() -> None:
        call = session._call
        assert call is not None, "the session's stream is down"
        session._master_joined(late, call)

    asyncio.run_coroutine_threadsafe(deliver(), session._io.loop).result(5)
    assert a.join_on_session(31020, spare=31021).round == 3


def test_a_member_joining_again_is_not_joined_a_second_time_by_the_master(
    start_master: Callable[..., Running], agents: Callable[..., Agent]
) -> None:
    """Alone in its round, a node whose workers failed joins again: its join
    closes round 1 and forms round 2 at once; the push for round 1 must not
    join it again (that would close round 2)."""
    master = start_master(settings(min_nodes=1, max_nodes=1))
    a = agents(master.address, "a")
    assert a.join_on_session(spare=31001).round == 1
    assert a.join_on_session(32000, spare=32001).round == 2
    push = a.next_push()
    assert push.closed_round == 1 and push.join_id == 0
    time.sleep(0.3)
    assert master.client.rendezvous_state().round == 2
