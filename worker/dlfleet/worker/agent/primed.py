"""A primed spare: started with a node's first workers, it imports what the
training script imports at its top level, then waits for the agent's word
on stdin before it runs the script.

    python -u -m dlfleet.worker.agent.primed script.py [args...]
    python -u -m dlfleet.worker.agent.primed -m package.module [args...]

Why: a spare's start is mostly imports (torch, Lightning, transformers:
seconds of CPU). Started once the ranks train, it takes that CPU from them
(on a 2-core machine the ranks of a Lightning job trained ~45% slower for
~10 s); started with them, its imports overlap theirs, before the first
step. No line of the script runs before the agent knows the script restarts
in place (every worker attached through `dlfleet.elastic.run`): then it
writes `run`, and the script runs as `python -u script.py` would run it,
as a spare. Anything else, or a closed stdin, and the process exits 0.

Invariants:
- Only the standard library (and `dlfleet.api`) at module level: the
  agent imports `wants_spares` from here.
- An import that fails is skipped: the script meets it itself, where its
  traceback belongs.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import runpy
import sys
from pathlib import Path

from dlfleet.api.processes import SPARE_NAME, name_process

MODULE = "dlfleet.worker.agent.primed"
RUN = b"run\n"
# What a script that restarts in place imports (any one of them).
_IN_PLACE = ("dlfleet.elastic", "dlfleet.integrations")


def _source_of(target: str, module: bool) -> Path | None:
    if not module:
        return Path(target)
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def top_level_imports(source: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) of the absolute imports in the module's body, in
    order, including those inside top-level `try` and `if` blocks; names is
    empty for `import module`. An unreadable file has none."""
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[tuple[str, tuple[str, ...]]] = []
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module != "__future__":
                found.append((node.module, tuple(a.name for a in node.names if a.name != "*")))
        elif isinstance(node, (ast.Try, ast.If)):
            body[:0] = [*node.body, *node.orelse]
    return found


def wants_spares(target: str, module: bool) -> bool:
    """Whether the script imports what a script that restarts in place
    imports (`dlfleet.elastic`, an integration), so that a primed spare may
    be of use."""
    source = _source_of(target, module)
    if source is None:
        return False
    for name, names in top_level_imports(source):
        if name.startswith(_IN_PLACE):
            return True
        if name == "dlfleet" and ("elastic" in names or "integrations" in names):
            return True
    return False


def _prime(source: Path) -> None:
    for name, names in top_level_imports(source):
        try:
            imported = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the script meets the failure itself
            continue
        for attribute in names:
            # A lazy module (transformers) loads on first access.
            with contextlib.suppress(Exception):
                if getattr(imported, attribute, None) is None:
                    importlib.import_module(f"{name}.{attribute}")


def main(argv: list[str]) -> int:
    module = bool(argv) and argv[0] == "-m"
    if module:
        argv = argv[1:]
    if not argv:
        print(f"usage: python -m {MODULE} [-m] script [args...]", file=sys.stderr)
        return 2
    target, args = argv[0], argv[1:]
    name_process(SPARE_NAME)
    if not module:
        # As `python script.py` sets it: the script's folder first.
        sys.path[0] = str(Path(target).resolve().parent)
    source = _source_of(target, module)
    if source is not None:
        _prime(source)
    if sys.stdin.buffer.readline() != RUN:
        return 0
    with open(os.devnull, "rb") as devnull:
        os.dup2(devnull.fileno(), 0)  # as a worker's: nothing to read
    if module:
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
