"""The master's settings: one default per setting, the flags built from them,
`to_argv` read back by `dlmaster`'s own parser, and a job.yaml job's master
differing from a standalone one only where `JOB_DEFAULTS` says."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.__main__ import _parser
from dlfleet.master.core.liveness import LivenessSettings
from dlfleet.master.core.rendezvous import RendezvousSettings
from dlfleet.master.job.jobconfig import parse_job_config
from dlfleet.master.settings import FOR_JOB, JOB_DEFAULTS, STANDALONE, RunSettings


def _flags(settings: RunSettings) -> RunSettings:
    return RunSettings.from_args(_parser().parse_args(settings.to_argv()))


def test_dlmaster_reads_back_the_flags_to_argv_writes() -> None:
    odd = RunSettings(
        lease_timeout_s=12.5,
        heartbeat_interval_s=0.25,
        heartbeat_timeout_s=1.75,
        min_nodes=2,
        max_nodes=6,
        node_unit=2,
        last_call_timeout_s=0.0,
        join_timeout_s=86_400.0,
        node_check_slow_factor=1.5,
        node_check_timeout_s=7.0,
    )
    assert _flags(odd) == odd
    assert _flags(FOR_JOB) == dataclasses.replace(FOR_JOB, max_nodes=FOR_JOB.world_max)


def test_dlmaster_defaults_are_the_standalone_settings() -> None:
    assert RunSettings.from_args(_parser().parse_args([])) == STANDALONE


def test_the_cores_default_to_the_standalone_settings() -> None:
    assert LivenessSettings() == LivenessSettings(
        STANDALONE.heartbeat_interval_ms, STANDALONE.heartbeat_timeout_ms
    )
    assert RendezvousSettings().last_call_timeout_ms == STANDALONE.last_call_timeout_ms


def test_a_job_master_differs_from_a_standalone_one_only_in_job_defaults(tmp_path: Path) -> None:
    differ = {
        f.name
        for f in dataclasses.fields(RunSettings)
        if getattr(FOR_JOB, f.name) != getattr(STANDALONE, f.name)
    }
    assert differ == set(JOB_DEFAULTS)
    (tmp_path / "train.py").write_text("")
    job = parse_job_config({"name": "j", "command": "train.py"}, base_dir=tmp_path)
    assert job.master_settings == dataclasses.replace(FOR_JOB, max_nodes=1)


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"heartbeat_interval_s": 5.0, "heartbeat_timeout_s": 5.0}, "must be longer than"),
        ({"lease_timeout_s": 0.0}, "lease_timeout_s must be > 0"),
        ({"min_nodes": 0}, "min_nodes must be at least 1"),
        ({"min_nodes": 3, "max_nodes": 2}, r"max_nodes \(2\) must be at least min_nodes \(3\)"),
        ({"min_nodes": 3, "max_nodes": 3, "node_unit": 2}, "node_unit 2 leaves no world size"),
        ({"node_unit": 0}, "node_unit must be at least 1"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(values: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        RunSettings(**values)


def test_flag_help_states_the_default() -> None:
    parser = argparse.ArgumentParser()
    RunSettings.add_arguments(parser)
    assert "(default 30)" in parser.format_help()
