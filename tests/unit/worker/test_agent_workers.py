"""The pure parts of the worker group: torchrun's command lines and reading
error files in every format torch writes, and in broken ones."""

from __future__ import annotations

import json
from pathlib import Path

from dlfleet.worker.agent.config import AgentConfig
from dlfleet.worker.agent.workers import (
    ErrorFileReport,
    attempt_log_dir,
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
