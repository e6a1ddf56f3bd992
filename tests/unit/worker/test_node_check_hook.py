"""The node check's test hook ($DLFLEET_NODE_CHECK_SLOWDOWN): which node it
slows, and by how much; a value that does not parse is an error, not a
silent no-op."""

from __future__ import annotations

import pytest

from dlfleet.api.env import NODE_CHECK_SLOWDOWN_ENV
from dlfleet.worker.nodecheck import slowdown_for


@pytest.mark.parametrize(
    ("value", "node", "factor"),
    [
        ("", "node-2#1", 1.0),
        ("3", "node-2#1", 3.0),
        ("node-2#1:4", "node-2#1", 4.0),
        ("node-2#1:4", "node-2#2", 1.0),  # a later incarnation is not slowed
        ("node-2:2.5", "node-2#7", 2.5),  # by name: every incarnation
        ("node-1#1:2, node-5:3", "node-5#1", 3.0),
        ("node-1#1:2,node-5:3", "node-3#1", 1.0),
    ],
)
def test_the_hook_slows_the_nodes_it_names(value: str, node: str, factor: float) -> None:
    assert slowdown_for(node, {NODE_CHECK_SLOWDOWN_ENV: value}) == factor


@pytest.mark.parametrize("value", ["fast", "node-2#1:x", "0.5", "node-2#1:5000"])
def test_a_hook_that_does_not_parse_is_an_error(value: str) -> None:
    with pytest.raises(ValueError, match=NODE_CHECK_SLOWDOWN_ENV):
        slowdown_for("node-2#1", {NODE_CHECK_SLOWDOWN_ENV: value})
