"""The `dlfleet` namespace spans the component folders, and the master side
never loads torch (SPEC section 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import dlfleet

ROOT = Path(__file__).resolve().parents[3]


def test_each_component_comes_from_its_own_folder() -> None:
    import dlfleet.api
    import dlfleet.brain
    import dlfleet.master
    import dlfleet.worker

    for module, folder in (
        (dlfleet.api, "proto"),
        (dlfleet.master, "master"),
        (dlfleet.worker, "worker"),
        (dlfleet.brain, "brain"),
    ):
        assert module.__file__ is not None
        assert Path(module.__file__).resolve().is_relative_to(ROOT / folder), module.__file__


def test_importing_the_master_and_the_client_never_loads_torch() -> None:
    code = (
        "import sys, dlfleet, dlfleet.master.service.server, dlfleet.master.__main__, "
        "dlfleet.api.client, dlfleet.master.store.sql; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_unknown_top_level_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = dlfleet.Nope
