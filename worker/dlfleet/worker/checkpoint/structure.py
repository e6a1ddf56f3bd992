"""The shape of a state dict, kept beside it so a restore without a template
gives back what was saved.

torch.distributed.checkpoint flattens a nested state dict with string keys
and drops empty containers: an optimizer's `state` keyed by parameter index
comes back keyed "0", "1", ... (which `Optimizer.load_state_dict` rejects),
and a fresh optimizer's empty `state` does not come back at all. So every
save also stores a *skeleton* of the state dict (containers and keys, each
leaf a 0) under `SKELETON_KEY`, as one small JSON string, and a restore
without a template reshapes what DCP rebuilt by it. It is an ordinary value
of the state dict: images and persisted folders carry it alike, and a
template (which does not name it) ignores it.

Skeleton JSON: a leaf is 0; a dict is {"d": [[key, child], ...]} (keys that
are JSON strings or integers keep their type; others become strings); a list
is {"l": [child, ...]}, a tuple {"t": [...]}.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from dlfleet.worker.checkpoint.errors import RestoreError

SKELETON_KEY = "__dlfleet_skeleton__"


def skeleton(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {"d": [[_key(k), skeleton(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return {"l": [skeleton(v) for v in value]}
    if isinstance(value, tuple):
        return {"t": [skeleton(v) for v in value]}
    return 0


def with_skeleton(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """`state_dict` plus its skeleton, ready to save."""
    if SKELETON_KEY in state_dict:
        raise ValueError(f"{SKELETON_KEY!r} is a reserved key of dlfleet's checkpoints")
    return {**state_dict, SKELETON_KEY: json.dumps(skeleton(state_dict), separators=(",", ":"))}


def reshape(restored: dict[str, Any]) -> dict[str, Any]:
    """What DCP rebuilt (string keys, no empty containers), in the saved
    shape; a state dict saved without a skeleton is returned as it is."""
    raw = restored.pop(SKELETON_KEY, None)
    if raw is None:
        return restored
    try:
        shape = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise RestoreError(f"a checkpoint's {SKELETON_KEY} is not JSON: {exc}") from exc
    result = _rebuild(restored, shape, ())
    if not isinstance(result, dict):
        raise RestoreError("a checkpoint's skeleton is not a dict")
    return result


def _key(key: Any) -> str | int:
    if isinstance(key, bool) or not isinstance(key, str | int):
        return str(key)
    return key


def _rebuild(node: Any, shape: Any, path: tuple[Any, ...]) -> Any:
    if shape == 0:
        if node is _MISSING:
            raise RestoreError(f"the checkpoint has no value at {'.'.join(map(str, path))}")
        return node
    if not isinstance(shape, dict) or len(shape) != 1:
        raise RestoreError(f"a malformed skeleton at {'.'.join(map(str, path))}")
    ((kind, children),) = shape.items()
    if kind == "d":
        return {key: _rebuild(_child(node, key), child, (*path, key)) for key, child in children}
    items = [_rebuild(_child(node, i), child, (*path, i)) for i, child in enumerate(children)]
    return tuple(items) if kind == "t" else items


_MISSING = object()


def _child(node: Any, key: str | int) -> Any:
    """DCP's rebuilt child: dict keys became strings, list items keep indices;
    an empty container was dropped (its skeleton rebuilds it)."""
    if isinstance(node, Mapping):
        for candidate in (key, str(key)):
            if candidate in node:
                return node[candidate]
        return _MISSING
    if isinstance(node, list | tuple) and isinstance(key, int) and key < len(node):
        return node[key]
    return _MISSING
