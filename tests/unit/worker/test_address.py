"""The node's address as a pure function of what the host shows (interfaces,
its route to the master), what the master saw and what the user named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfleet.api.addresses import is_loopback, peer_host, split_host_port, with_port
from dlfleet.worker.address import (
    AddressChoice,
    Interface,
    choose_address,
    given_address,
    interface_environment,
    interfaces,
    route_source,
)

HOST = [
    Interface("lo", ("127.0.0.1", "::1")),
    Interface("eth0", ("10.0.0.2", "fd00::2")),
    Interface("eth1", ("192.168.9.2",)),  # a network the others cannot reach
]


def test_the_route_to_the_master_picks_the_address_and_its_interface() -> None:
    choice = choose_address(given=None, interfaces=HOST, route_source="10.0.0.2")
    assert (choice.address, choice.bind, choice.interface) == ("10.0.0.2", "10.0.0.2", "eth0")
    assert "route" in choice.reason and not choice.warnings


def test_a_hostname_resolving_elsewhere_plays_no_part() -> None:
    # What torchrun would publish (getfqdn -> 127.0.1.1 or eth1) is not an input.
    choice = choose_address(given=None, interfaces=HOST, route_source="10.0.0.2",
                            master_saw="10.0.0.2")  # fmt: skip
    assert choice.address == "10.0.0.2"


def test_the_flag_wins_over_the_route_and_what_the_master_saw() -> None:
    choice = choose_address(
        given=("192.168.9.2", "--local-addr"),
        interfaces=HOST,
        route_source="10.0.0.2",
        master_saw="10.0.0.2",
    )
    assert (choice.address, choice.interface, choice.reason) == (
        "192.168.9.2", "eth1", "--local-addr",
    )  # fmt: skip
    assert any("10.0.0.2" in w for w in choice.warnings)


def test_a_named_address_on_no_interface_is_published_but_bound_everywhere() -> None:
    choice = choose_address(given=("203.0.113.7", "$PET_LOCAL_ADDR"), interfaces=HOST,
                            route_source="10.0.0.2")  # fmt: skip
    assert (choice.address, choice.bind, choice.interface) == ("203.0.113.7", "", None)
    assert "not an address of any interface" in choice.warnings[0]


def test_behind_nat_the_address_the_master_saw_is_published_and_said() -> None:
    choice = choose_address(given=None, interfaces=HOST, route_source="10.0.0.2",
                            master_saw="198.51.100.4")  # fmt: skip
    assert (choice.address, choice.bind, choice.interface) == ("198.51.100.4", "10.0.0.2", "eth0")
    assert "198.51.100.4" in choice.warnings[0] and "10.0.0.2" in choice.warnings[0]


def test_a_master_on_this_machine_keeps_the_loopback_choice() -> None:
    choice = choose_address(given=None, interfaces=HOST, route_source="127.0.0.1",
                            master_saw="127.0.0.1")  # fmt: skip
    assert (choice.address, choice.interface) == ("127.0.0.1", "lo")


def test_no_route_to_the_master_names_the_flag() -> None:
    with pytest.raises(LookupError, match="--local-addr"):
        choose_address(given=None, interfaces=HOST, route_source=None)


def test_ipv6_is_chosen_like_ipv4() -> None:
    choice = choose_address(given=None, interfaces=HOST, route_source="fd00::2")
    assert (choice.address, choice.interface) == ("fd00::2", "eth0")
    assert with_port(choice.address, 29500) == "[fd00::2]:29500"


def test_the_flag_comes_before_torchruns_variable_and_the_old_one() -> None:
    environ = {"PET_LOCAL_ADDR": "10.0.0.9", "DLFLEET_NODE_HOST": "10.0.0.8"}
    assert given_address("10.0.0.7", environ) == ("10.0.0.7", "--local-addr")
    assert given_address(None, environ) == ("10.0.0.9", "$PET_LOCAL_ADDR")
    assert given_address(None, {"DLFLEET_NODE_HOST": "10.0.0.8"}) == (
        "10.0.0.8", "$DLFLEET_NODE_HOST",
    )  # fmt: skip
    assert given_address(None, {}) is None


def test_workers_get_the_interface_only_where_the_user_set_none() -> None:
    choice = AddressChoice("10.0.0.2", "10.0.0.2", "eth0", "route")
    assert interface_environment(choice, {"NCCL_SOCKET_IFNAME": "ib0"}) == {
        "GLOO_SOCKET_IFNAME": "eth0",
        "TP_SOCKET_IFNAME": "eth0",
    }
    assert interface_environment(AddressChoice("x", "", None, "flag"), {}) == {}


@given(
    route=st.sampled_from(["10.0.0.2", "192.168.9.2", "127.0.0.1", "fd00::2"]),
    saw=st.none() | st.sampled_from(["10.0.0.2", "198.51.100.4", "127.0.0.1"]),
    flag=st.none() | st.sampled_from(["10.0.0.2", "192.168.9.2", "203.0.113.7"]),
)
def test_the_choice_is_published_and_bound_consistently(
    route: str, saw: str | None, flag: str | None
) -> None:
    given_ = (flag, "--local-addr") if flag else None
    choice = choose_address(given=given_, interfaces=HOST, route_source=route, master_saw=saw)
    if flag:
        assert choice.address == flag
    elif saw is None or saw == route or is_loopback(route):
        assert choice.address == route
    else:
        assert choice.address == saw and choice.warnings
    # Whatever is bound is an address of this host, and its interface holds it.
    if choice.bind:
        assert choice.interface is not None
        assert choice.bind in next(i for i in HOST if i.name == choice.interface).addresses


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.0.0.2:51000", "10.0.0.2"),
        ("ipv6:[fd00::2]:51000", "fd00::2"),
        ("ipv6:%5Bfe80::1%25eth0%5D:51000", "fe80::1"),
        ("unix:/tmp/x.sock", None),
        ("", None),
    ],
)
def test_the_master_reads_the_ip_of_a_grpc_peer(peer: str, host: str | None) -> None:
    assert peer_host(peer.replace("%25", "%")) == host


def test_host_port_round_trips_with_ipv6_bracketed() -> None:
    for host in ("10.0.0.2", "fd00::2", "hosta"):
        assert split_host_port(with_port(host, 50051)) == (host, 50051)


def test_this_host_shows_its_loopback_and_routes_to_it() -> None:
    found = interfaces()
    assert any("127.0.0.1" in i.addresses for i in found)
    assert route_source("127.0.0.1", 50051) == "127.0.0.1"
    assert route_source("no-such-host.invalid", 1) is None
