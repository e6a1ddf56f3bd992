"""`dlfleet.api.env` is the one place a dlfleet environment variable's name is
written: each name once, none spelled again in the components' code, and the
module loads nothing (the agent and every worker import it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from dlfleet.api import env

ROOT = Path(__file__).resolve().parents[3]
COMPONENTS = ("proto", "master", "worker", "brain", "tools")
ENV_MODULE = ROOT / "proto/dlfleet/api/env.py"


def _names() -> dict[str, str]:
    return {key: value for key, value in vars(env).items() if key.endswith("_ENV")}


def test_each_variable_has_one_constant() -> None:
    names = _names()
    assert len(set(names.values())) == len(names), names
    assert all(re.fullmatch(r"(DLFLEET|PET)_[A-Z_]+", value) for value in names.values())


def test_no_component_spells_a_dlfleet_variable_outside_env_py() -> None:
    literal = re.compile(r"""["']DLFLEET_[A-Z_]+["']""")
    spelled = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in COMPONENTS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != ENV_MODULE
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert spelled == []


def test_importing_env_loads_no_library() -> None:
    probe = (
        "import sys, dlfleet.api.env\n"
        "heavy = {'grpc', 'torch', 'google.protobuf', 'sqlalchemy', 'kubernetes'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
