"""`dlworker`'s command line: torchrun's flags and PET_* variables, dlfleet's
own flags, pass-through of the script's arguments, and errors that name the
flag at fault."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from dlfleet.api.addresses import split_host_port
from dlfleet.api.diagnosis import default_table, restart_only_table
from dlfleet.api.errors import InvalidArgument
from dlfleet.worker.agent.config import (
    MAX_AUTO_CPU_PROCESSES,
    AgentConfig,
    ConfigError,
    HostProbe,
    Std,
    StreamSpec,
    config_or_exit,
    parse_args,
)
from dlfleet.worker.agent.watchdog import Bounds

BASE_ENV = {"DLFLEET_MASTER": "master.local:50051", "DLFLEET_TOKEN": "s3cret"}


def probe(cpus: int = 8, accelerators: int = 0) -> HostProbe:
    return HostProbe(
        hostname=lambda: "node-a",
        cpu_count=lambda: cpus,
        accelerator_count=lambda: accelerators,
        claim_name_number=lambda job: 0,  # the only agent on its host: test_node_names.py
    )


def parse(
    *argv: str, env: dict[str, str] | None = None, host: HostProbe | None = None
) -> AgentConfig:
    return parse_args(list(argv), {**BASE_ENV, **(env or {})}, host or probe())


def error(
    *argv: str, env: dict[str, str] | None = None, host: HostProbe | None = None
) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(*argv, env=env, host=host)
    return info.value


def test_defaults_are_torchruns() -> None:
    config = parse("train.py")
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 1)
    assert (config.max_restarts, config.monitor_interval_s) == (0, 0.1)
    assert (config.role, config.run_id) == ("default", "none")
    assert not config.module and not config.no_python
    assert config.log_dir is None
    assert config.redirects == StreamSpec() and config.tee == StreamSpec()
    assert (config.job_name, config.node_name) == ("job", "node-a")
    assert (config.master, config.token) == ("master.local:50051", "s3cret")
    assert (config.training_script, config.training_script_args) == ("train.py", ())


def test_every_flag_is_parsed(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("from-file\n")
    config = parse_args(
        [
            "--nnodes=2:4",
            "--nproc-per-node", "3",
            "--max-restarts", "5",
            "--monitor-interval", "0.5",
            "--role", "trainer",
            "--run-id", "exp-1",
            "--log-dir", str(tmp_path / "logs"),
            "-r", "2",
            "-t", "0:1,2:3",
            "--master", "10.0.0.1:6000",
            "--token-file", str(token),
            "--job-name", "resnet",
            "--node-name", "pod-7",
            "train.py", "--epochs", "3",
        ],
        {},
        probe(),
    )  # fmt: skip
    assert config == AgentConfig(
        training_script="train.py",
        training_script_args=("--epochs", "3"),
        master="10.0.0.1:6000",
        token="from-file",
        min_nodes=2,
        max_nodes=4,
        nnodes_given=True,
        nproc_per_node=3,
        max_restarts=5,
        monitor_interval_s=0.5,
        role="trainer",
        run_id="exp-1",
        log_dir=tmp_path / "logs",
        redirects=StreamSpec(default=Std.ERR),
        tee=StreamSpec(per_rank=((0, Std.OUT), (2, Std.ALL))),
        job_name="resnet",
        node_name="pod-7",
    )


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("--nproc_per_node", "nproc_per_node"),
        ("--max_restarts", "max_restarts"),
        ("--rdzv-id", "run_id"),
        ("--rdzv_id", "run_id"),
        ("--run_id", "run_id"),
    ],
)
def test_torchruns_underscore_and_rdzv_spellings_are_accepted(flag: str, field: str) -> None:
    assert str(getattr(parse(flag, "2", "train.py"), field)) == "2"


def test_module_flag_runs_the_script_as_a_module() -> None:
    config = parse("-m", "pkg.train", "--x")
    assert config.module and config.training_script == "pkg.train"
    assert config.training_script_args == ("--x",)
    assert parse("--no_python", "./run.sh").no_python


def test_a_single_nnodes_number_is_both_min_and_max() -> None:
    config = parse("--nnodes", "3", "train.py")
    assert (config.min_nodes, config.max_nodes) == (3, 3)


def test_nnodes_is_told_to_the_master_only_when_the_flag_or_pet_nnodes_gave_it() -> None:
    assert parse("--nnodes", "1", "train.py").nnodes_given
    assert parse("train.py", env={**BASE_ENV, "PET_NNODES": "2:3"}).nnodes_given
    assert not parse("train.py").nnodes_given


def test_everything_after_the_script_is_passed_through_untouched() -> None:
    config = parse(
        "--nproc-per-node", "2", "train.py", "--lr", "0.1", "-m", "x", "--nproc-per-node", "9"
    )
    assert config.training_script == "train.py"
    assert config.training_script_args == ("--lr", "0.1", "-m", "x", "--nproc-per-node", "9")
    assert config.nproc_per_node == 2 and not config.module


def test_a_double_dash_ends_the_agents_flags() -> None:
    assert parse("--", "train.py", "-r", "3").training_script_args == ("-r", "3")


def test_every_torchrun_flag_is_read_from_its_pet_variable(tmp_path: Path) -> None:
    config = parse(
        "train.py",
        env={
            "PET_NNODES": "1:3",
            "PET_NPROC_PER_NODE": "4",
            "PET_MAX_RESTARTS": "2",
            "PET_MONITOR_INTERVAL": "1.5",
            "PET_ROLE": "r",
            "PET_RUN_ID": "run-9",
            "PET_LOG_DIR": str(tmp_path),
            "PET_REDIRECTS": "3",
            "PET_TEE": "1",
            "PET_MODULE": "1",
        },
    )
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 3, 4)
    assert (config.max_restarts, config.monitor_interval_s) == (2, 1.5)
    assert (config.role, config.run_id, config.log_dir) == ("r", "run-9", tmp_path)
    assert config.redirects.for_rank(3) == Std.ALL and config.tee.for_rank(0) == Std.OUT
    assert config.module
    assert parse("./run", env={"PET_NO_PYTHON": "1"}).no_python


def test_torchruns_pet_rdzv_id_names_the_run() -> None:
    assert parse("train.py", env={"PET_RDZV_ID": "r-1"}).run_id == "r-1"
    assert parse("train.py", env={"PET_RDZV_ID": "r-1", "PET_RUN_ID": "r-2"}).run_id == "r-2"


def test_flags_beat_pet_variables() -> None:
    config = parse(
        "--nproc-per-node", "2", "--role", "flag", "--max-restarts", "1", "train.py",
        env={"PET_NPROC_PER_NODE": "8", "PET_ROLE": "env", "PET_MAX_RESTARTS": "7"},
    )  # fmt: skip
    assert (config.nproc_per_node, config.role, config.max_restarts) == (2, "flag", 1)


def test_a_pet_flag_variable_of_zero_is_off() -> None:
    assert not parse("train.py", env={"PET_MODULE": "0", "PET_NO_PYTHON": ""}).module


def test_dlfleets_own_settings_come_from_dlfleet_variables() -> None:
    config = parse(
        "train.py",
        env={"DLFLEET_MASTER": "[::1]:7000", "DLFLEET_JOB": "bert", "DLFLEET_NODE_NAME": "n-3"},
    )
    assert (config.master, config.job_name, config.node_name) == ("[::1]:7000", "bert", "n-3")
    assert parse("--master", "m:1", "train.py").master == "m:1"


def test_the_token_file_beats_the_token_variable(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("  file-token \n")
    assert parse("--token-file", str(tmp_path / "t"), "x.py").token == "file-token"


def test_the_token_is_not_shown_in_the_configs_repr() -> None:
    assert "s3cret" not in repr(parse("train.py"))


def test_nproc_cpu_is_the_usable_cpus_capped() -> None:
    assert parse("--nproc-per-node", "cpu", "t.py", host=probe(cpus=6)).nproc_per_node == 6
    big = probe(cpus=500)
    assert (
        parse("--nproc-per-node", "cpu", "t.py", host=big).nproc_per_node == MAX_AUTO_CPU_PROCESSES
    )
    assert parse("--nproc-per-node", "500", "t.py", host=big).nproc_per_node == 500


def test_nproc_auto_prefers_accelerators_and_falls_back_to_cpus() -> None:
    assert parse("--nproc-per-node", "auto", "t.py", host=probe(accelerators=4)).nproc_per_node == 4
    assert parse("--nproc-per-node", "auto", "t.py", host=probe(cpus=3)).nproc_per_node == 3
    assert parse("--nproc-per-node", "gpu", "t.py", host=probe(accelerators=2)).nproc_per_node == 2


def test_stream_specs_follow_torchruns_syntax() -> None:
    assert StreamSpec.parse("3").for_rank(7) == Std.ALL
    per_rank = StreamSpec.parse("0:1,1:2,12:3")
    assert [per_rank.for_rank(r) for r in (0, 1, 2, 12)] == [Std.OUT, Std.ERR, Std.NONE, Std.ALL]
    for bad in ("4", "0:4", "x", "0:1,", "1:1,1:2", ""):
        with pytest.raises(ValueError, match=r"0|twice|map"):
            StreamSpec.parse(bad)


def test_host_port_split_accepts_ipv6_in_brackets() -> None:
    assert split_host_port("[fe80::1]:50051") == ("fe80::1", 50051)
    assert split_host_port("master:80") == ("master", 80)
    for bad in ("master", "fe80::1:50", "m:0", "m:70000", ":80", "[::1]"):
        with pytest.raises(ValueError):
            split_host_port(bad)


@pytest.mark.parametrize(
    ("argv", "env", "flag", "words"),
    [
        (["--nnodes", "3:2", "t.py"], {}, "--nnodes", "MIN 3 is greater than MAX 2"),
        (["--nnodes", "0", "t.py"], {}, "--nnodes", "at least 1"),
        (["--nnodes", "1:2:3", "t.py"], {}, "--nnodes", "MIN:MAX"),
        (["t.py"], {"PET_NNODES": "4:1"}, "PET_NNODES", "greater than MAX"),
        (["--nproc-per-node", "0", "t.py"], {}, "--nproc-per-node", "at least 1 process"),
        (["--nproc-per-node", "many", "t.py"], {}, "--nproc-per-node", "cpu, gpu or auto"),
        (["--nproc-per-node", "gpu", "t.py"], {}, "--nproc-per-node", "no accelerator"),
        (["--max-restarts", "-1", "t.py"], {}, "--max-restarts", ">= 0, got -1"),
        (["--max-restarts", "x", "t.py"], {}, "--max-restarts", "integer"),
        (["--monitor-interval", "0", "t.py"], {}, "--monitor-interval", "> 0 seconds"),
        (["t.py"], {"PET_MONITOR_INTERVAL": "soon"}, "PET_MONITOR_INTERVAL", "seconds"),
        (["-r", "5", "t.py"], {}, "--redirects", "0..3"),
        (["--nproc-per-node", "2", "-t", "2:1", "t.py"], {}, "--tee", "local rank 2"),
        (["t.py"], {"PET_MODULE": "maybe"}, "PET_MODULE", "0 or 1"),
        (["-m", "--no-python", "t"], {}, "--no-python", "-m/--module"),
        ([], {}, "training_script", "missing"),
        (["--nnodes"], {}, "--nnodes", "expected one argument"),
        (["--rdzv-backend", "c10d", "t.py"], {}, "--rdzv-backend", "unknown flag"),
        (["--nproc", "2", "t.py"], {}, "--nproc", "unknown flag"),
        (["--master", "nowhere", "t.py"], {}, "--master", "HOST:PORT"),
        (["t.py"], {"DLFLEET_MASTER": "h:99999"}, "DLFLEET_MASTER", "1..65535"),
        (["--role", " ", "t.py"], {}, "--role", "empty"),
    ],
)
def test_bad_input_names_the_flag_and_the_problem(
    argv: list[str], env: dict[str, str], flag: str, words: str
) -> None:
    problem = error(*argv, env=env)
    assert problem.flag == flag
    assert words in str(problem)
    assert str(problem).startswith(f"{flag}: ")


def test_a_missing_master_address_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no master address") as info:
        parse_args(["t.py"], {"DLFLEET_TOKEN": "t"}, probe())
    assert info.value.flag == "--master"


def test_a_missing_token_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no job token") as info:
        parse_args(["t.py"], {"DLFLEET_MASTER": "m:1"}, probe())
    assert info.value.flag == "--token-file"


def test_an_unreadable_or_empty_token_file_is_an_error(tmp_path: Path) -> None:
    assert "No such file" in str(error("--token-file", str(tmp_path / "none"), "t.py"))
    (tmp_path / "empty").write_text("\n")
    assert "is empty" in str(error("--token-file", str(tmp_path / "empty"), "t.py"))


def test_config_errors_are_invalid_arguments() -> None:
    assert issubclass(ConfigError, InvalidArgument)


def test_a_config_built_directly_is_checked_too() -> None:
    with pytest.raises(ConfigError, match="--nnodes"):
        AgentConfig(training_script="t.py", master="m:1", token="t", min_nodes=2, max_nodes=1)
    with pytest.raises(ConfigError, match="--master"):
        AgentConfig(training_script="t.py", master="m", token="t")


def test_config_or_exit_prints_one_line_and_exits_2() -> None:
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as info:
        config_or_exit(["--nnodes", "2:1", "t.py"], BASE_ENV, stderr=stderr)
    assert info.value.code == 2
    assert stderr.getvalue() == "dlworker: error: --nnodes: MIN 2 is greater than MAX 1\n"


def test_config_or_exit_returns_the_config_for_good_input() -> None:
    assert config_or_exit(["t.py"], {**BASE_ENV, "DLFLEET_NODE_NAME": "n"}).node_name == "n"


def test_the_step_watchdog_is_off_unless_asked_for() -> None:
    assert parse("train.py").step_timeout_s == 0.0
    assert parse("--step-timeout", "30", "train.py").step_timeout_s == 30.0
    assert parse("train.py", env={"DLFLEET_STEP_TIMEOUT": "2.5"}).step_timeout_s == 2.5
    assert "--step-timeout" in str(error("--step-timeout", "soon", "train.py"))
    assert "must be > 0" in str(error("--step-timeout", "-1", "train.py"))


def test_a_learned_step_bound_takes_a_factor_and_floor_under_the_ceiling() -> None:
    assert parse("--step-timeout", "30", "train.py").step_bounds() == Bounds(30.0, 0.0, 2.0)
    learned = parse(
        "--step-timeout", "30", "--step-timeout-factor", "4", "--step-timeout-min", "1", "t.py"
    )
    assert learned.step_bounds() == Bounds(30.0, 4.0, 1.0)
    env = {"DLFLEET_STEP_TIMEOUT": "30", "DLFLEET_STEP_TIMEOUT_FACTOR": "3"}
    assert parse("train.py", env=env).step_bounds() == Bounds(30.0, 3.0, 2.0)
    assert parse("--step-timeout", "1", "t.py").step_bounds() == Bounds(1.0, 0.0, 1.0)
    assert parse("train.py").step_bounds() is None
    assert "needs --step-timeout" in str(error("--step-timeout-factor", "4", "train.py"))
    assert ">= 2" in str(error("--step-timeout", "9", "--step-timeout-factor", "1", "t.py"))
    assert "needs --step-timeout-factor" in str(
        error("--step-timeout", "9", "--step-timeout-min", "1", "t.py")
    )
    assert "expected a number" in str(
        error("--step-timeout", "9", "--step-timeout-factor", "x", "t.py")
    )
    too_high = error(
        "--step-timeout", "9", "--step-timeout-factor", "4", "--step-timeout-min", "10", "t.py"
    )
    assert "--step-timeout-min" in str(too_high) and "at most --step-timeout 9s" in str(too_high)


def test_diagnosis_is_on_by_default_and_takes_more_rules(tmp_path: Path) -> None:
    assert parse("train.py").diagnosis == default_table()
    assert parse("--diagnosis", "off", "train.py").diagnosis == restart_only_table()
    rule = "[{name: nfs, category: hardware, action: replace_node, when: {text: [NFS]}}]"
    inline = parse("--diagnosis-rules", rule, "train.py").diagnosis
    assert [r.name for r in inline.rules[:2]] == ["nfs", "hang-watchdog"]
    (tmp_path / "rules.yaml").write_text("rules:\n  - " + rule[1:-1] + "\n")
    from_file = parse("train.py", env={"DLFLEET_DIAGNOSIS_RULES": str(tmp_path / "rules.yaml")})
    assert from_file.diagnosis == inline


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--diagnosis", "maybe"], "invalid choice: 'maybe'"),
        (["--diagnosis-rules", "[{name: x}]"], "--diagnosis-rules: diagnosis rules: rule 0 (x)"),
        (["--diagnosis-rules", "/no/such/rules.yaml"], "/no/such/rules.yaml: No such file"),
        (
            ["--diagnosis", "off", "--diagnosis-rules", "[]"],
            "cannot add rules with --diagnosis off",
        ),
    ],
)
def test_bad_diagnosis_flags_are_refused(argv: list[str], message: str) -> None:
    try:
        error(*argv, "train.py")
    except SystemExit:
        assert "invalid choice" in message  # argparse's own refusal
        return
    assert message in str(error(*argv, "train.py"))
