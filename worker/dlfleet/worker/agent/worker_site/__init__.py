"""The folder the agent puts first on every worker's PYTHONPATH, so that
the worker's Python imports `sitecustomize.py` from here at startup (see
that module: it writes the rank's error file for scripts that never use
torch's `@record`).

Invariant: the folder holds nothing else a worker could import by mistake
(this file is a package marker only; it is never imported by a worker).
"""

from __future__ import annotations

import os
from pathlib import Path

FOLDER = Path(__file__).resolve().parent


def worker_pythonpath(inherited: str | None) -> str:
    """The workers' PYTHONPATH: this folder, then what the agent inherited."""
    return os.pathsep.join([str(FOLDER), *([inherited] if inherited else [])])
