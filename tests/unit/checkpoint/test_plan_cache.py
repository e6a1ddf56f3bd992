"""The save's layout is reused while a state keeps its structure
(image.PlanCache): whatever sequence of states is saved, each plan equals
DCP's own planning of that state, record for record and byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlfleet.worker.checkpoint import image
from dlfleet.worker.checkpoint.files import ItemKind
from dlfleet.worker.checkpoint.image import BlobCache, ImageWriter, LocalImage, PlanCache, Stripe

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
    }
)


def build(choice: dict[str, Any], seed: int) -> dict[str, Any]:
    weight = torch.full((choice["rows"], 1), float(seed), dtype=choice["dtype"])
    weight.requires_grad_(choice["grad"])
    state: dict[str, Any] = {
        "model": {"w": weight, "b": torch.arange(3.0) + seed},
        "optim": {"param_groups": [{"lr": choice["lr"], "params": [0, 1]}], "ids": choice["ids"]},
    }
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
            data.contiguous().view(torch.uint8).numpy().tobytes()
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
        got, got_paths = image._plan(state, rank, stripe, blobs, cache)
        want, want_paths = image._plan(state, rank, stripe)
        assert plain(got) == plain(want)
        assert got_paths == want_paths


def test_a_sharded_value_is_planned_anew_every_time() -> None:
    class Checkpointable(torch.Tensor):
        """Stands in for a tensor that plans its own writes (DTensor's hook)."""

        def __create_write_items__(self, fqn: str, obj: Any) -> Any:  # pragma: no cover
            raise AssertionError("not planned in this test")

    flat = {"w": torch.ones(2).as_subclass(Checkpointable)}
    assert image._structure(flat, {"w": ("w",)}, 0, None) is None
    assert image._structure({"w": torch.ones(2)}, {"w": ("w",)}, 0, None) is not None


def test_images_written_with_a_reused_layout_restore_each_step(tmp_path: Path) -> None:
    with ImageWriter(tmp_path, rank=0, slots=2) as writer:
        for step in range(4):
            state = {"w": torch.full((4,), float(step)), "step": step, "ids": list(range(step))}
            saved = writer.write(step, state, round=0, world_size=1, protect=None)
            source = LocalImage(saved.header_path)
            items = {i.fqn: i for i in source.header.items}
            assert source.tensor(items["w"]).tolist() == [float(step)] * 4
            assert items["ids"].kind is ItemKind.BYTES
