"""After a master restart, on SQLite and PostgreSQL, the nodes its store
remembers count only once they are heard from: a node that was waiting for a
round when its master stopped (dead, for all the new master knows) is formed
into no round until it joins again, and a live node is not left outside a
round formed with it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from harness import TOKEN, Running

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.errors import Unavailable
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.state import MasterSettings

pytestmark = pytest.mark.integration

ONCE = RetryPolicy(attempts=1)


def test_a_node_waiting_when_its_master_stopped_is_formed_into_no_round_until_it_joins_again(
    start_master: Callable[..., Running],
) -> None:
    """The issue's new master: it formed round 1 with a node of an earlier run
    at once, and the live node sat outside it as a spare."""
    pair = MasterSettings(job_name="job", rendezvous=RendezvousSettings(min_nodes=2, max_nodes=2))
    earlier = start_master(pair)
    with MasterClient(earlier.address, token=TOKEN, timeout_s=5, retry=ONCE) as client:
        old = client.register_node(job_name="job", node_name="old", local_world_size=1)
        with pytest.raises(Unavailable, match="DEADLINE_EXCEEDED"):  # alone: no round of 2
            client.join_rendezvous(
                node_id=old.node_id, incarnation=old.incarnation, local_world_size=1,
                host="127.0.0.1", bootstrap_port=29500, timeout_s=0.3,
            )  # fmt: skip
        # Written after the join (the store keeps the order), and durable when it returns.
        client.register_node(job_name="job", node_name="other", local_world_size=1)
    start_master.stop(earlier)  # type: ignore[attr-defined]

    single = MasterSettings(job_name="job", rendezvous=RendezvousSettings(min_nodes=1, max_nodes=1))
    running = start_master(single)
    assert set(running.state.nodes.nodes) == {"old", "other"}  # recovered, not yet heard from
    assert running.state.rendezvous.state.waiting == {}
    assert running.state.rendezvous.state.active is None
    with MasterClient(running.address, token=TOKEN, timeout_s=5, retry=ONCE) as client:
        new = client.register_node(job_name="job", node_name="new", local_world_size=1)
        answer = client.join_rendezvous(
            node_id=new.node_id, incarnation=new.incarnation, local_world_size=1,
            host="127.0.0.1", bootstrap_port=29501, timeout_s=5,
        )  # fmt: skip
    assert (answer.round, answer.group_world_size, answer.group_rank) == (1, 1, 0)
    active = running.state.rendezvous.state.active
    assert active is not None and [m.node_id for m in active.members] == ["new#1"]
