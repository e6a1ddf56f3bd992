"""A node's --nnodes reaches the master at registration, through a real server:
a range other than the master's is registered with a warning on both sides
(the master's range decides), one that cannot overlap it is refused, and a
node that gave none registers as before."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from harness import Running

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.service.state import MasterSettings

pytestmark = pytest.mark.integration

TWO = MasterSettings(job_name="job", rendezvous=RendezvousSettings(min_nodes=2, max_nodes=2))


def test_a_node_asking_for_more_nodes_than_the_master_forms_is_refused_on_both_sides(
    start_master: Callable[..., Running], caplog: pytest.LogCaptureFixture
) -> None:
    running = start_master(TWO)
    with pytest.raises(InvalidArgument, match=r"--nnodes 3 cannot be met.*--max-nodes 2"):
        running.client.register_node(
            job_name="job", node_name="a", local_world_size=1, nnodes=(3, 3)
        )
    assert "node a refused: --nnodes 3 cannot be met" in caplog.text
    assert running.state.nodes.nodes == {}


def test_a_node_range_that_differs_is_registered_with_a_warning_on_both_sides(
    start_master: Callable[..., Running], caplog: pytest.LogCaptureFixture
) -> None:
    running = start_master(TWO)
    with caplog.at_level(logging.WARNING):
        registered = running.client.register_node(
            job_name="job", node_name="a", local_world_size=1, nnodes=(1, 3)
        )
    assert registered.node_id == "a#1"
    assert registered.nnodes_warning.startswith("--nnodes 1:3 is not the master's node range")
    assert "--min-nodes 2 --max-nodes 2 decide the world size" in registered.nnodes_warning
    assert f"node a: {registered.nnodes_warning}" in caplog.text
    assert registered.max_nodes == 2  # the master's: the largest world is 2 nodes' worth


def test_a_node_that_gave_no_range_or_the_masters_registers_without_a_word(
    start_master: Callable[..., Running], caplog: pytest.LogCaptureFixture
) -> None:
    running = start_master(TWO)
    with caplog.at_level(logging.WARNING):
        silent = running.client.register_node(job_name="job", node_name="a", local_world_size=1)
        same = running.client.register_node(
            job_name="job", node_name="b", local_world_size=1, nnodes=(2, 2)
        )
    assert silent.nnodes_warning == same.nnodes_warning == ""
    assert silent.max_nodes == same.max_nodes == 2
    assert "--nnodes" not in caplog.text
