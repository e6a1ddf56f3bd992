"""Build glue: the namespace layout of SPEC section 1, and generated wire code.

`dlfleet` is one import namespace spread over the component folders; each
folder maps to its subpackage here. The wire protocol's Python modules are
generated from `proto/` on every build (see tools/protogen.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))

import protogen  # noqa: E402

COMPONENT_DIRS = {
    "dlfleet": "proto/dlfleet",
    "dlfleet.master": "master/dlfleet/master",
    "dlfleet.worker": "worker/dlfleet/worker",
    # Adapters for training frameworks; they run in the training processes.
    "dlfleet.integrations": "worker/dlfleet/integrations",
    "dlfleet.brain": "brain/dlfleet/brain",
}


def _packages() -> list[str]:
    found: list[str] = []
    for name, folder in COMPONENT_DIRS.items():
        base = ROOT / folder
        for init in sorted(base.rglob("__init__.py")):
            rel = init.parent.relative_to(base)
            if any(part in {"__pycache__", "build"} for part in rel.parts):
                continue
            found.append(".".join([name, *rel.parts]) if rel.parts else name)
    return found


class GenerateThenBuild(build_py):
    def run(self) -> None:
        protogen.generate(protogen.PROTO_ROOT)
        super().run()


setup(
    packages=_packages(),
    package_dir=COMPONENT_DIRS,
    cmdclass={"build_py": GenerateThenBuild},
)
