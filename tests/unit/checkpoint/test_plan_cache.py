"""The save's layout is reused while a state keeps its structure
(plan.PlanCache): whatever sequence of states is saved, each plan equals
DCP's own planning of that state, record for record and byte for byte,
whether the cached plan is taken by the nested state's shape (a save that
skips DCP's flattening) or by the flattened one's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dlfleet.worker.checkpoint import plan
from dlfleet.worker.checkpoint.plan import BlobCache, PlanCache, Stripe

# A state is drawn as a few choices that change its structure or only its values.
states = st.fixed_dictionaries(
    {
        "rows": st.sampled_from([3, 300_000]),  # 300_000 rows of f32: cut when striped
        "dtype": st.sampled_from([torch.float32, torch.float64]),
        "extra": st.booleans(),  # a key that comes and goes
        "lr": st.sampled_from([0.1, 0.2, 1, True]),
        "ids": st.lists(st.integers(0, 9), max_size=4),  # a blob of changing length
        "nested": st.booleans(),  # "a.b" as one key or as a nested dict
        "grad": st.booleans(),
        # an optimizer's state keyed by parameter index, or by its string
        # (the same flat keys from DCP: only the nested shape tells them apart)
        "index": st.sampled_from([0, "0"]),
        "pair": st.sampled_from(["list", "tuple", "ints"]),  # a container of tensors, or not
    }
)


def build(choice: dict[str, Any], seed: int) -> dict[str, Any]:
    weight = torch.full((choice["rows"], 1), float(seed), dtype=choice["dtype"])
    weight.requires_grad_(choice["grad"])
    state: dict[str, Any] = {
        "model": {"w": weight, "b": torch.arange(3.0) + seed},
        "optim": {"param_groups": [{"lr": choice["lr"], "params": [0, 1]}], "ids": choice["ids"]},
    }
    state["optim"]["state"] = {choice["index"]: {"step": torch.tensor(float(seed))}}
    pair = [torch.ones(2) * seed, torch.zeros(3)] if choice["pair"] != "ints" else [seed, 1]
    state["pair"] = tuple(pair) if choice["pair"] == "tuple" else pair
    if choice["extra"]:
        state["model"]["extra"] = torch.ones(2, 2)
    if choice["nested"]:
        state["a"] = {"b": torch.zeros(1) + seed}
    else:
        state["a.b"] = torch.zeros(1) + seed
    return state


def plain(planned: list[Any]) -> list[tuple[Any, bytes]]:
    out = []
    for p in planned:
        data = p.data
        raw = (
            data.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if isinstance(data, torch.Tensor)
            else bytes(data)
        )
        out.append((p.record, raw))
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(states, min_size=1, max_size=6),
    st.sampled_from([None, Stripe(0, 2), Stripe(1, 2)]),
    st.integers(0, 1),
)
def test_a_cached_layout_plans_as_dcp_does(
    choices: list[dict[str, Any]], stripe: Stripe | None, rank: int
) -> None:
    cache, blobs = PlanCache(), BlobCache()
    for seed, choice in enumerate(choices):
        state = build(choice, seed)
        got, got_paths = plan.plan_state(state, rank, stripe, blobs, cache)
        want, want_paths = plan.plan_state(state, rank, stripe)
        assert plain(got) == plain(want)
        assert got_paths == want_paths


def test_a_sharded_value_is_planned_anew_every_time() -> None:
    class Checkpointable(torch.Tensor):
        """Stands in for a tensor that plans its own writes (DTensor's hook)."""

        def __create_write_items__(self, fqn: str, obj: Any) -> Any:  # pragma: no cover
            raise AssertionError("not planned in this test")

    flat = {"w": torch.ones(2).as_subclass(Checkpointable)}
    assert plan._structure(flat, {"w": ("w",)}, 0, None) is None
    assert plan._structure({"w": torch.ones(2)}, {"w": ("w",)}, 0, None) is not None
    assert plan._nested_key({"m": {"w": flat["w"]}}, 0, None) is None
    assert plan._nested_key({"m": {"w": torch.ones(2)}}, 0, None) is not None


def test_a_saved_structure_skips_dcp_flattening(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second save of a structure takes the nested path: DCP's flattening
    is not called (it is most of a small state's save)."""
    cache, blobs = PlanCache(), BlobCache()
    state: dict[str, Any] = {"model": {"w": torch.ones(2)}, "optim": {"state": {0: {"step": 1}}}}
    plan.plan_state(state, 0, None, blobs, cache)
    assert cache.nested is not None
    calls = []
    original = DefaultSavePlanner.set_up_planner

    def counted(self: DefaultSavePlanner, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(DefaultSavePlanner, "set_up_planner", counted)
    state["optim"]["state"][0]["step"] = 2
    got, _ = plan.plan_state(state, 0, None, blobs, cache)
    assert calls == []
    state["model"]["w2"] = torch.ones(1)  # a new key: planned by DCP again
    plan.plan_state(state, 0, None, blobs, cache)
    assert calls == [1]
    monkeypatch.undo()
    want, _ = plan.plan_state({**state, "model": {"w": torch.ones(2)}}, 0, None)
    assert plain(got) == plain(want)
