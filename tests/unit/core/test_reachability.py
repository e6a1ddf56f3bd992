"""No round publishes a loopback address to nodes on other machines."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dlfleet.master.core.reachability import Published, Publishers, unreachable


def test_two_machines_publishing_loopback_are_both_refused_naming_the_flag() -> None:
    refused = unreachable(
        {"a#1": Published("127.0.0.1", "10.0.0.2"), "b#1": Published("127.0.0.1", "10.0.0.3")}
    )
    assert set(refused) == {"a#1", "b#1"}
    assert "--local-addr" in refused["a#1"] and "10.0.0.3" in refused["a#1"]


def test_nodes_on_one_machine_may_use_its_loopback() -> None:
    assert not unreachable(
        {"a#1": Published("127.0.0.1", "127.0.0.1"), "b#1": Published("127.0.0.1", "127.0.0.1")}
    )


def test_only_the_loopback_publisher_is_refused_beside_a_reachable_node() -> None:
    refused = unreachable(
        {"m#1": Published("127.0.0.1", "127.0.0.1"), "a#1": Published("10.0.0.2", "10.0.0.2")}
    )
    assert set(refused) == {"m#1"}


def test_a_node_not_seen_yet_counts_as_no_machine() -> None:
    assert not unreachable(
        {"a#1": Published("127.0.0.1", ""), "b#1": Published("10.0.0.3", "10.0.0.3")}
    )


@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c", "d"]),
        st.tuples(
            st.sampled_from(["127.0.0.1", "::1", "10.0.0.2", "10.0.0.3"]),
            st.sampled_from(["", "127.0.0.1", "10.0.0.2", "10.0.0.3"]),
        ),
    )
)
def test_refused_exactly_the_loopback_publishers_of_a_multi_machine_job(
    nodes: dict[str, tuple[str, str]],
) -> None:
    refused = unreachable({n: Published(h, s) for n, (h, s) in nodes.items()})
    machines = {s for _, s in nodes.values() if s}
    expected = {n for n, (h, _) in nodes.items() if h in ("127.0.0.1", "::1")}
    assert set(refused) == (expected if len(machines) > 1 else set())


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["join", "leave"]),
            st.sampled_from(["a", "b", "c", "d", "e"]),
            st.sampled_from(["127.0.0.1", "::1", "10.0.0.2", "10.0.0.3"]),
            st.sampled_from(["", "127.0.0.1", "10.0.0.2", "10.0.0.3"]),
        ),
        max_size=40,
    )
)
def test_the_index_asks_for_the_check_exactly_when_it_would_refuse(
    steps: list[tuple[str, str, str, str]],
) -> None:
    """`Publishers.may_refuse` over the nodes still present says what
    `unreachable` over them says, while nodes join (again) and leave."""
    publishers = Publishers()
    present: dict[str, Published] = {}
    for op, node, host, seen in steps:
        if op == "join":
            present[node] = Published(host, seen)
            publishers.joined(node, present[node])
        else:
            present.pop(node, None)
        assert publishers.may_refuse(lambda n: n in present) == bool(unreachable(present))


def test_a_fleet_of_one_machine_on_loopback_is_asked_about_in_constant_time() -> None:
    """The single-machine case (every node on 127.0.0.1, every node
    publishing it): the index looks at one node per question."""
    publishers = Publishers()
    asked: list[str] = []

    def present(node_id: str) -> bool:
        asked.append(node_id)
        return True

    for index in range(2_000):
        publishers.joined(f"n{index}", Published("127.0.0.1", "127.0.0.1"))
        assert not publishers.may_refuse(present)
    assert len(asked) <= 2 * 2_000
