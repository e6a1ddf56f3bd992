"""The pure parts of the worker group: torchrun's command lines and reading
error files in every format torch writes, and in broken ones."""

from __future__ import annotations

import json
from pathlib import Path

from dlfleet.worker.agent.config import AgentConfig
from dlfleet.worker.agent.workers import (
    ErrorFileReport,
    attempt_log_dir,
    oom_kill_count,
    read_error_file,
    worker_command,
)


def config(**kw: object) -> AgentConfig:
    return AgentConfig(
        training_script="train.py",
        training_script_args=("--lr", "0.1"),
        master="m:1",
        token="t",
        **kw,  # type: ignore[arg-type]
    )


def test_a_script_runs_unbuffered_under_python() -> None:
    assert worker_command(config(), "/py") == ["/py", "-u", "train.py", "--lr", "0.1"]


def test_a_module_runs_with_dash_m() -> None:
    assert worker_command(config(module=True), "/py") == [
        "/py",
        "-u",
        "-m",
        "train.py",
        "--lr",
        "0.1",
    ]


def test_no_python_runs_the_script_itself() -> None:
    assert worker_command(config(no_python=True), "/py") == ["train.py", "--lr", "0.1"]


def test_a_rounds_logs_live_in_a_folder_named_by_the_round() -> None:
    assert attempt_log_dir(Path("/logs"), 12) == Path("/logs/12")


def test_torchs_record_format_gives_message_traceback_and_time(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": "ValueError: bad",
                    "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"},
                }
            }
        )
    )
    assert read_error_file(path) == ErrorFileReport("ValueError: bad", "Traceback ...", 1700000000)


def test_the_string_message_format_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": "Segfault", "timestamp": 12}))
    assert read_error_file(path) == ErrorFileReport("Segfault", None, 12)


def test_missing_fields_and_odd_types_do_not_break_reading(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text(
        json.dumps({"message": {"extraInfo": {"timestamp": "soon", "py_callstack": 3}}})
    )
    report = read_error_file(path)
    assert report is not None
    assert (report.traceback, report.timestamp) == (None, None)
    assert "extraInfo" in report.message


def test_a_file_that_is_not_json_is_its_own_message(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text("killed by the OOM reaper\n")
    assert read_error_file(path) == ErrorFileReport("killed by the OOM reaper")
    path.write_text("[1, 2]")
    assert read_error_file(path) == ErrorFileReport("[1, 2]")


def test_no_file_or_an_empty_file_is_no_report(tmp_path: Path) -> None:
    assert read_error_file(tmp_path / "absent.json") is None
    (tmp_path / "empty.json").write_text("  \n")
    assert read_error_file(tmp_path / "empty.json") is None


def test_oom_kills_are_read_from_cgroup_v2_memory_events(tmp_path: Path) -> None:
    (tmp_path / "cg").write_text("0::/jobs/a\n")
    events = tmp_path / "root" / "jobs" / "a" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    assert oom_kill_count(tmp_path / "cg", tmp_path / "root") == 2


def test_oom_kills_are_read_from_cgroup_v1_oom_control(tmp_path: Path) -> None:
    (tmp_path / "cg").write_text("5:cpu:/\n4:memory:/jobs/b\n0::/\n")
    control = tmp_path / "root" / "memory" / "memory.oom_control"  # a namespaced view
    control.parent.mkdir(parents=True)
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    assert oom_kill_count(tmp_path / "cg", tmp_path / "root") == 7


def test_no_cgroup_means_no_oom_count(tmp_path: Path) -> None:
    assert oom_kill_count(tmp_path / "absent", tmp_path) is None
    (tmp_path / "cg").write_text("0::/\n")
    assert oom_kill_count(tmp_path / "cg", tmp_path / "root") is None
