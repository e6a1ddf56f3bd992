"""Run import-linter over the whole `dlfleet` namespace.

`dlfleet` is spread over the component folders (SPEC section 1) and grimp only walks one
package directory, so this builds a merged view of the namespace out of
symlinks in a temporary folder, puts it first on PYTHONPATH, and runs
`lint-imports` with the contracts in pyproject.toml.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = {
    "__init__.py": ROOT / "proto/dlfleet/__init__.py",
    "api": ROOT / "proto/dlfleet/api",
    "master": ROOT / "master/dlfleet/master",
    "worker": ROOT / "worker/dlfleet/worker",
    "brain": ROOT / "brain/dlfleet/brain",
    "integrations": ROOT / "worker/dlfleet/integrations",
}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="dlfleet-imports-") as tmp:
        package = Path(tmp) / "dlfleet"
        package.mkdir()
        for name, target in PARTS.items():
            (package / name).symlink_to(target)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")])}
        lint = Path(sys.executable).parent / "lint-imports"
        done = subprocess.run(
            [str(lint), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
            check=False,
            env=env,
            cwd=ROOT,
        )
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
