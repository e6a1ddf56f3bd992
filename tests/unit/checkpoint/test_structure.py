"""A state dict restored without a template has the saved shape: integer keys
stay integers (an optimizer's state), empty containers come back, tuples stay
tuples."""

from __future__ import annotations

import json

import pytest

from dlfleet.worker.checkpoint.errors import RestoreError
from dlfleet.worker.checkpoint.structure import SKELETON_KEY, reshape, skeleton, with_skeleton


def test_integer_keys_and_empty_containers_are_rebuilt_from_the_skeleton() -> None:
    saved = {"optim": {"state": {0: {"step": 1}, 1: {}}, "groups": [{"lr": 0.1}]}, "e": {}}
    # What DCP gives back: string keys, empty containers dropped.
    rebuilt = {"optim": {"state": {"0": {"step": 1}}, "groups": [{"lr": 0.1}]}}
    rebuilt[SKELETON_KEY] = with_skeleton(saved)[SKELETON_KEY]
    assert reshape(rebuilt) == saved


def test_a_tuple_comes_back_a_tuple() -> None:
    saved = {"t": (1, [2, {}])}
    restored = {"t": [1, [2]], SKELETON_KEY: json.dumps(skeleton(saved))}
    assert reshape(restored) == saved


def test_a_state_dict_saved_without_a_skeleton_is_left_as_it_is() -> None:
    assert reshape({"a": 1}) == {"a": 1}


def test_a_value_the_skeleton_names_but_the_checkpoint_lacks_is_an_error() -> None:
    restored = {SKELETON_KEY: json.dumps(skeleton({"a": 1, "b": 2})), "a": 1}
    with pytest.raises(RestoreError, match="no value at b"):
        reshape(restored)


def test_the_skeleton_key_is_reserved() -> None:
    with pytest.raises(ValueError, match="reserved"):
        with_skeleton({SKELETON_KEY: 1})
