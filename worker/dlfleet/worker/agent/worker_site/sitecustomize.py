"""Imported by every worker's Python at startup (its folder is first on the
PYTHONPATH the agent sets): an uncaught exception that ends the worker is
written to TORCHELASTIC_ERROR_FILE as torch's `@record` writes it, so that
the agent's diagnosis reads the exception of scripts that never use
`@record` (Lightning, Hugging Face Trainer) as it reads theirs, whatever is
printed after the traceback and whether or not the agent keeps the
worker's stderr (`--redirects`/`--tee`).

Invariants:
- Only the standard library, imported lazily: every worker pays for two
  hooks, not for imports.
- Only the worker process itself writes (the agent starts it as the leader
  of its own session): a subprocess of the script that fails does not speak
  for the rank.
- An existing error file is never replaced: `@record` wrote it first, with
  the same exception.
- The sitecustomize this one hides on sys.path (a distribution's, a
  virtualenv's) still runs, after the hooks are installed.
"""

from __future__ import annotations

import atexit
import os
import sys
from types import TracebackType

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def record(exc: BaseException) -> None:
    """Writes `exc` to the rank's error file, unless it is not this rank's to
    write or the file already exists. Never raises: the exception itself is
    what the worker must show."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or os.getpid() != os.getsid(0):
        return
    import json
    import time
    import traceback

    try:
        report = {
            "message": {
                "message": f"{type(exc).__name__}: {exc}",
                "extraInfo": {
                    "py_callstack": "".join(
                        traceback.format_exception(type(exc), exc, exc.__traceback__)
                    ),
                    "timestamp": str(int(time.time())),
                },
            }
        }
        with open(path, "x") as f:  # "x": never over @record's file
            json.dump(report, f)
    # An exception's own __str__ may fail, the folder may be gone: the
    # worker's traceback must print all the same.
    except Exception:  # noqa: BLE001
        pass


_previous_excepthook = sys.excepthook


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    record(value)
    _previous_excepthook(kind, value, tb)


def _at_exit() -> None:
    # A script may replace sys.excepthook (rich's tracebacks do); Python
    # still keeps the exception it printed for an uncaught one.
    last = getattr(sys, "last_value", None)
    if isinstance(last, BaseException):
        record(last)


def _run_hidden_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


sys.excepthook = _excepthook
atexit.register(_at_exit)
_run_hidden_sitecustomize()
