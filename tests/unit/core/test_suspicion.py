"""NetworkSuspicion: a network failure names the members whose host its text
mentions; a closed round blames the member named by the most other nodes,
unless that is a tie or the member failed for a reason of its own; a member
blamed in `suspect_after` closed rounds is a suspect. Checked on examples and,
with hypothesis, against a brute-force reading of the rule."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.core.suspicion import NetworkSuspicion, Suspect, names

HOSTS = {"a#1": "10.0.0.1", "b#1": "10.0.0.2", "c#1": "10.0.0.3"}
RESET = "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [{}]:41022"


def reset_by(host: str) -> str:
    return RESET.format(host)


def test_a_failure_names_the_members_whose_address_it_mentions_as_a_whole() -> None:
    assert names(reset_by("10.0.0.3"), "a#1", HOSTS) == ("c#1",)
    assert names("Read error [10.0.0.2]:5 and [10.0.0.3]:6", "a#1", HOSTS) == ("b#1", "c#1")
    # Not a part of another address, not the reporter itself, not its own host.
    assert names(reset_by("10.0.0.31"), "a#1", HOSTS) == ()
    assert names(reset_by("110.0.0.3"), "a#1", HOSTS) == ()
    assert names(reset_by("10.0.0.1"), "a#1", HOSTS) == ()
    same_host = {**HOSTS, "d#1": "10.0.0.1"}
    assert names(reset_by("10.0.0.1"), "a#1", same_host) == ()
    assert names("Timed out waiting 30000ms for recv operation", "a#1", HOSTS) == ()


def test_the_member_the_others_name_is_blamed_and_a_suspect_after_two_closed_rounds() -> None:
    suspicion = NetworkSuspicion(suspect_after=2)
    for round_ in (3, 5):
        # c's link is bad: a and b name c; c names one of them.
        assert suspicion.failed(round_, "a#1", "network", reset_by("10.0.0.3"), HOSTS) == ("c#1",)
        suspicion.failed(round_, "b#1", "network", reset_by("10.0.0.3"), HOSTS)
        suspicion.failed(round_, "c#1", "network", reset_by("10.0.0.1"), HOSTS)
        assert suspicion.blamed(round_) == "c#1"
    assert suspicion.suspects(current_round=5) == []  # round 5 is not closed yet
    assert suspicion.suspects(current_round=6) == [Suspect("c#1", (3, 5))]
    assert "rounds 3, 5" in suspicion.suspects(6)[0].describe()


def test_two_nodes_naming_each_other_blame_nobody() -> None:
    two = {"a#1": "10.0.0.1", "b#1": "10.0.0.2"}
    suspicion = NetworkSuspicion(suspect_after=1)
    suspicion.failed(1, "a#1", "network", reset_by("10.0.0.2"), two)
    assert suspicion.blamed(1) == "b#1"  # so far only a has reported
    suspicion.failed(1, "b#1", "network", reset_by("10.0.0.1"), two)
    assert suspicion.blamed(1) is None
    assert suspicion.suspects(2) == []


def test_a_member_that_failed_for_its_own_reason_is_not_blamed_for_its_peers_errors() -> None:
    suspicion = NetworkSuspicion(suspect_after=1)
    suspicion.failed(1, "a#1", "network", reset_by("10.0.0.3"), HOSTS)
    suspicion.failed(1, "b#1", "network", reset_by("10.0.0.3"), HOSTS)
    suspicion.failed(1, "c#1", "killed", "Signal 9 (SIGKILL)", HOSTS)
    assert suspicion.blamed(1) is None
    assert suspicion.suspects(2) == []


def test_failures_of_other_categories_name_nobody() -> None:
    suspicion = NetworkSuspicion(suspect_after=1)
    assert suspicion.failed(1, "a#1", "user_error", reset_by("10.0.0.3"), HOSTS) == ()
    assert suspicion.blamed(1) is None


def test_a_forgotten_node_is_neither_blamed_nor_counted_as_a_reporter() -> None:
    suspicion = NetworkSuspicion(suspect_after=1)
    suspicion.failed(1, "a#1", "network", reset_by("10.0.0.3"), HOSTS)
    suspicion.failed(1, "b#1", "network", reset_by("10.0.0.3"), HOSTS)
    suspicion.forget(["c#1"])
    assert suspicion.blamed(1) is None
    suspicion.failed(2, "a#1", "network", reset_by("10.0.0.2"), HOSTS)
    suspicion.failed(2, "c#1", "network", reset_by("10.0.0.2"), HOSTS)
    suspicion.forget(["c#1"])
    assert suspicion.blamed(2) == "b#1"  # named by a alone now


def test_only_the_last_keep_rounds_rounds_are_kept() -> None:
    suspicion = NetworkSuspicion(suspect_after=2, keep_rounds=2)
    for round_ in (1, 2, 3):
        suspicion.failed(round_, "a#1", "network", reset_by("10.0.0.3"), HOSTS)
    assert suspicion.blamed(1) is None and suspicion.blamed(3) == "c#1"
    assert suspicion.suspects(10) == [Suspect("c#1", (2, 3))]


def test_bad_settings_and_reports_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="suspect_after"):
        NetworkSuspicion(suspect_after=0)
    with pytest.raises(InvalidArgument, match="keep_rounds"):
        NetworkSuspicion(suspect_after=3, keep_rounds=2)
    suspicion = NetworkSuspicion()
    with pytest.raises(InvalidArgument, match="round"):
        suspicion.failed(0, "a#1", "network", "", HOSTS)
    with pytest.raises(InvalidArgument, match="not a member"):
        suspicion.failed(1, "z#1", "network", "", HOSTS)
    assert suspicion.blamed(1) is None  # nothing was recorded


NODES = ("a#1", "b#1", "c#1", "d#1")
FOUR = {node: f"10.0.0.{i + 1}" for i, node in enumerate(NODES)}


@given(
    st.lists(
        st.tuples(
            st.sampled_from(NODES),
            st.sampled_from(("network", "network", "killed")),
            st.sets(st.sampled_from(NODES), max_size=3),
        ),
        max_size=12,
    )
)
def test_a_round_blames_the_unique_most_named_member_that_did_not_fail_itself(
    reports: list[tuple[str, str, set[str]]],
) -> None:
    suspicion = NetworkSuspicion(suspect_after=1)
    named: dict[str, set[str]] = {}
    failed_otherwise: set[str] = set()
    for reporter, category, peers in reports:
        text = " ".join(reset_by(FOUR[p]) for p in sorted(peers))
        found = suspicion.failed(1, reporter, category, text, FOUR)
        if category != "network":
            failed_otherwise.add(reporter)
            assert found == ()
            continue
        assert set(found) == peers - {reporter}
        for peer in found:
            named.setdefault(peer, set()).add(reporter)
    # The rule read plainly: the member named by the most reporters, alone at
    # the top, and not failed for a reason of its own.
    counts = {node: len(reporters) for node, reporters in named.items()}
    most = max(counts.values(), default=0)
    top = [node for node, count in counts.items() if count == most]
    expected = top[0] if most and len(top) == 1 and top[0] not in failed_otherwise else None
    assert suspicion.blamed(1) == expected
    assert suspicion.suspects(2) == ([Suspect(expected, (1,))] if expected else [])
