"""job.yaml validation: every bad config names its field and the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.job.jobconfig import load_job_config, parse_job_config
from dlfleet.worker.agent import config as agent_config

RULE = {"name": "nfs", "category": "hardware", "action": "replace_node", "when": {"text": ["NFS"]}}


@pytest.fixture
def base(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


def parse(base: Path, **fields: Any) -> Any:
    return parse_job_config({"name": "demo", "command": "train.py", **fields}, base_dir=base)


def test_a_minimal_config_gets_documented_defaults(base: Path) -> None:
    config = parse(base)
    assert config.platform == "local"
    assert (config.nodes.min, config.nodes.maximum, config.nodes.start) == (1, 1, 1)
    assert config.nproc_per_node == 1 and config.max_restarts == 3
    assert config.work_dir == base / ".dlfleet" / "demo"
    assert config.store_url == f"sqlite:///{base / '.dlfleet' / 'demo' / 'state.db'}"
    assert config.script == str(base / "train.py")


def test_the_http_endpoint_is_on_by_default_on_localhost_and_can_be_turned_off(
    base: Path,
) -> None:
    http = parse(base).http
    assert http is not None
    assert (http.host, http.port, http.open_metrics) == ("127.0.0.1", 0, False)
    assert parse(base, http={"host": "0.0.0.0", "port": 9100}).http.port == 9100
    assert parse(base, http=None).http is None


def test_the_job_starts_max_nodes_unless_initial_says_otherwise(base: Path) -> None:
    assert parse(base, nodes={"min": 1, "max": 3}).nodes.start == 3
    assert parse(base, nodes={"min": 1, "max": 3, "initial": 2}).nodes.start == 2


def test_a_module_command_is_not_a_path(base: Path) -> None:
    config = parse(base, command="pkg.train", module=True)
    assert config.script == "pkg.train"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nodes": {"min": 3, "max": 2}}, "nodes: max (2) must be at least min (3)"),
        ({"nodes": {"min": 0}}, "nodes.min: Input should be greater than or equal to 1"),
        ({"nodes": {"min": 1, "max": 2, "initial": 5}}, "initial (5) must lie in 1..2"),
        ({"nproc_per_node": 0}, "nproc_per_node: Input should be greater than or equal to 1"),
        ({"nproc_per_node": "two"}, "nproc_per_node: Input should be a valid integer"),
        ({"max_restarts": -1}, "max_restarts: Input should be greater than or equal to 0"),
        ({"heartbeat": {"interval_s": 5, "timeout_s": 2}}, "heartbeat: timeout_s (2.0) must be"),
        ({"heartbeat": {"interval_s": 0}}, "heartbeat.interval_s: Input should be greater than 0"),
        ({"platform": "slurm"}, "platform: Input should be 'local'"),
        ({"nodez": 2}, "nodez: unknown setting"),
        ({"rendezvous": {"last_call": 1}}, "rendezvous.last_call: unknown setting"),
        ({"master": {"port": 70000}}, "master.port: Input should be less than or equal to 65535"),
        ({"http": {"port": -1}}, "http.port: Input should be greater than or equal to 0"),
        ({"http": {"path": "/"}}, "http.path: unknown setting"),
        ({"env": {"1BAD": "x"}}, "env: Value error, '1BAD' is not an environment variable name"),
        ({"name": "Bad_Name"}, "name: 'Bad_Name' is not a valid job name"),
        ({"token": "a", "token_file": "t"}, "give either token or token_file, not both"),
        ({"command": "missing.py"}, "command: no such script"),
        ({"token_file": "nope.txt"}, "token_file: "),
        ({"nodes": {"min": 2, "max": 3}, "rendezvous": {"node_unit": 4}}, "node_unit 4 leaves"),
        (
            {"diagnosis": {"rules": [{"name": "x", "category": "bad", "action": "restart"}]}},
            "diagnosis.rules: diagnosis.rules: rule 0 (x): category 'bad' is not one of",
        ),
        (
            {"diagnosis": {"enabled": False, "rules": [RULE]}},
            "rules are given but diagnosis is off",
        ),
    ],
)
def test_bad_configs_name_the_field_and_the_reason(
    base: Path, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse(base, **fields)
    assert message.replace("Value error, ", "") in str(caught.value)


def test_diagnosis_reaches_the_agents_as_flags(base: Path) -> None:
    assert parse(base).diagnosis.agent_flags() == []
    assert parse(base, diagnosis={"enabled": False}).diagnosis.agent_flags() == [
        "--diagnosis",
        "off",
    ]
    flags = parse(base, diagnosis={"rules": [RULE]}).diagnosis.agent_flags()
    assert flags[0] == "--diagnosis-rules"
    config = agent_config.parse_args(
        [*flags, "train.py"], {"DLFLEET_MASTER": "m:1", "DLFLEET_TOKEN": "t"}
    )
    assert config.diagnosis.rules[0].name == "nfs"
    assert config.diagnosis.rules[-1].name == "anything-else"


def test_the_step_watchdog_reaches_the_agents_as_flags(base: Path) -> None:
    assert parse(base).agent_step_timeout_flags() == []
    job = parse(base, step_timeout_s=60, step_timeout_factor=4, step_timeout_min_s=1.5)
    flags = job.agent_step_timeout_flags()
    env = {"DLFLEET_MASTER": "m:1", "DLFLEET_TOKEN": "t"}
    config = agent_config.parse_args([*flags, "train.py"], env)
    assert (config.step_timeout_s, config.step_timeout_factor, config.step_timeout_min_s) == (
        60.0,
        4.0,
        1.5,
    )
    for fields, words in [
        ({"step_timeout_factor": 4}, "need step_timeout_s"),
        ({"step_timeout_s": 10, "step_timeout_factor": 1}, "step_timeout_factor"),
        ({"step_timeout_s": 10, "step_timeout_min_s": 1}, "needs step_timeout_factor"),
        ({"step_timeout_s": 10, "step_timeout_factor": 4, "step_timeout_min_s": 20}, "is over"),
    ]:
        with pytest.raises(InvalidArgument, match=words):
            parse(base, **fields)


def test_the_node_check_is_on_by_default_for_jobs_of_several_nodes(base: Path) -> None:
    assert parse(base).agent_node_check_flags() == []  # one node: nothing to compare with
    several = parse(base, nodes={"min": 1, "max": 2})
    assert several.agent_node_check_flags() == ["--node-check"]
    assert several.master_settings.node_check_slow_factor == 2
    assert several.master_settings.node_check_timeout_s == 30
    off = parse(base, nodes={"max": 4}, node_check={"enabled": False})
    assert off.agent_node_check_flags() == []
    forced = parse(base, node_check={"enabled": True, "slow_factor": 1.5, "timeout_s": 10})
    assert forced.agent_node_check_flags() == ["--node-check"]
    assert forced.master_settings.node_check_slow_factor == 1.5
    assert forced.master_settings.node_check_timeout_s == 10
    config = agent_config.parse_args(
        ["--node-check", "train.py"], {"DLFLEET_MASTER": "m:1", "DLFLEET_TOKEN": "t"}
    )
    assert config.node_check
    environ = {"DLFLEET_MASTER": "m:1", "DLFLEET_TOKEN": "t", "DLFLEET_NODE_CHECK": "1"}
    assert agent_config.parse_args(["train.py"], environ).node_check
    assert not agent_config.parse_args(
        ["train.py"], {**environ, "DLFLEET_NODE_CHECK": ""}
    ).node_check


@pytest.mark.parametrize(
    ("check", "message"),
    [
        ({"slow_factor": 1.0}, "node_check.slow_factor: Input should be greater than 1"),
        ({"enabled": "sometimes"}, "node_check.enabled"),
        ({"timeout_s": 0}, "node_check.timeout_s: Input should be greater than or equal to 0.1"),
        ({"pairs": 3}, "node_check.pairs: unknown setting"),
    ],
)
def test_bad_node_check_settings_name_the_field(
    base: Path, check: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse(base, node_check=check)


def test_a_missing_required_field_is_named(base: Path) -> None:
    with pytest.raises(InvalidArgument, match="command: required"):
        parse_job_config({"name": "demo"}, base_dir=base)


def test_files_that_are_not_a_mapping_of_yaml_are_refused(base: Path) -> None:
    bad_yaml = base / "a.yaml"
    bad_yaml.write_text("name: [unclosed\n")
    with pytest.raises(InvalidArgument, match="not valid YAML"):
        load_job_config(bad_yaml)
    a_list = base / "b.yaml"
    a_list.write_text("- name\n")
    with pytest.raises(InvalidArgument, match="expected a mapping"):
        load_job_config(a_list)
    with pytest.raises(InvalidArgument, match="No such file"):
        load_job_config(base / "absent.yaml")


def test_paths_are_relative_to_the_job_yaml(base: Path, tmp_path: Path) -> None:
    sub = base / "jobs"
    sub.mkdir()
    (sub / "train.py").write_text("")
    (sub / "job.yaml").write_text("name: demo\ncommand: train.py\nworkdir: out\n")
    config = load_job_config(sub / "job.yaml")
    assert config.script == str(sub / "train.py")
    assert config.work_dir == sub / "out"


# ------------------------------------------------------------ kubernetes


def test_a_kubernetes_job_keeps_its_script_as_an_image_path(base: Path) -> None:
    config = parse(
        base,
        command="/workspace/train.py",  # not on this machine: it is in the image
        platform="kubernetes",
        kubernetes={
            "image": "registry.example.com/train:1",
            "resources": {"limits": {"memory": "8Gi", "cpu": "500m"}},
        },
    )
    assert config.script == "/workspace/train.py"
    assert config.kubernetes is not None
    assert config.kubernetes.memory_bytes == 8 << 30
    assert config.kubernetes.worker_command == ["dlworker"]
    assert config.kubernetes.oom.memory_factor == 1.5
    assert config.kubernetes.oom.memory_cap_bytes == 64 << 30


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"platform": "kubernetes"}, "platform kubernetes needs a kubernetes: section"),
        ({"kubernetes": {"image": "x"}}, "a kubernetes: section needs platform: kubernetes"),
        (
            {"platform": "kubernetes", "kubernetes": {}},
            "kubernetes.image: required",
        ),
        (
            {"platform": "kubernetes",
             "kubernetes": {"image": "x", "resources": {"limits": {"memory": "8 gigs"}}}},
            "kubernetes.resources: limits.memory: '8 gigs' is not a Kubernetes quantity",
        ),
        (
            {"platform": "kubernetes", "kubernetes": {"image": "x", "resources": {"limit": {}}}},
            "'limit': expected requests or limits",
        ),
        (
            {"platform": "kubernetes", "kubernetes": {"image": "x", "env": [{"value": "1"}]}},
            "every entry needs a name",
        ),
        (
            {"platform": "kubernetes", "kubernetes": {"image": "x", "oom": {"memory_cap": "lots"}}},
            "kubernetes.oom.memory_cap",
        ),
        (
            {"platform": "kubernetes", "kubernetes": {"image": "x", "imagee": "y"}},
            "kubernetes.imagee: unknown setting",
        ),
        (
            {"platform": "kubernetes", "kubernetes": {"image": "x"},
             "http": {"host": "0.0.0.0", "port": 0}},
            "http.port: on kubernetes an endpoint on 0.0.0.0 needs a fixed port",
        ),
    ],
)  # fmt: skip
def test_bad_kubernetes_sections_name_the_field(
    base: Path, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse(base, **fields)
    assert message in str(caught.value), caught.value


@pytest.mark.parametrize(
    ("text", "value"),
    [("8Gi", 8 << 30), ("512Mi", 512 << 20), ("1.5G", 1.5e9), ("500m", 0.5), ("2", 2.0), (3, 3.0)],
)
def test_quantities_parse_like_kubernetes(text: str | int, value: float) -> None:
    from dlfleet.master.job.jobconfig import format_bytes_quantity, parse_quantity

    assert parse_quantity(text) == value
    assert parse_quantity(format_bytes_quantity(int(value) or 1)) >= value


def test_only_an_endpoint_beyond_loopback_needs_a_fixed_port_on_kubernetes(base: Path) -> None:
    kube = {"platform": "kubernetes", "kubernetes": {"image": "x"}}
    local = parse(base, **kube)  # the default: 127.0.0.1, any free port
    assert local.http is not None and not local.http.beyond_loopback()
    fixed = parse(base, **kube, http={"host": "0.0.0.0", "port": 8080})
    assert fixed.http is not None and fixed.http.beyond_loopback()
    for host, beyond in (("localhost", False), ("::1", False), ("127.0.0.2", False),
                         ("::", True), ("10.0.0.7", True), ("master.example", True)):  # fmt: skip
        assert parse(base, http={"host": host}).http.beyond_loopback() is beyond, host
