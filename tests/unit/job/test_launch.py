"""A node's launch is the same dlworker command line on every platform: each
adds only what is its own (its program, the local one its log flags), and the
agent reads it back as the job says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlfleet.api.env import TLS_CA_ENV
from dlfleet.master.job.jobconfig import parse_job_config
from dlfleet.master.job.platform.kubernetes import KubernetesPlatform
from dlfleet.master.job.platform.launch import node_launch
from dlfleet.master.job.platform.local import LocalNode, LocalPlatform
from dlfleet.worker.agent import config as agent_config

JOB = {"name": "demo", "command": "train.py", "args": ["--epochs", "2"],
       "nodes": {"min": 1, "max": 2}, "step_timeout_s": 30}  # fmt: skip


class RecordingCore:
    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any], **_: Any) -> None:
        self.pods.append(body)


def test_local_and_kubernetes_nodes_run_the_same_dlworker_command_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    local = LocalPlatform(
        parse_job_config(JOB, base_dir=tmp_path), master="m:1", token="t", python="py"
    )
    local_argv = local.launch(LocalNode(name="node-0", index=0)).argv
    kube_config = parse_job_config(
        {**JOB, "platform": "kubernetes", "kubernetes": {"image": "x", "namespace": "ns"}},
        base_dir=tmp_path,
    )
    kube = KubernetesPlatform(kube_config, master_port=1, token="t", client=object())
    core = RecordingCore()
    kube.core = core
    kube.add_node()
    (pod,) = core.pods
    kube_argv: list[str] = pod["spec"]["containers"][0]["command"]

    assert local_argv[:4] == ["py", "-u", "-m", "dlfleet.worker.agent.loop"]
    assert kube_argv[0] == "dlworker"
    log_flags = local_argv.index("--log-dir")
    local_rest = local_argv[4:log_flags] + local_argv[log_flags + 4 :]
    master = kube_argv.index("--master") + 1
    local_rest[1] = kube_argv[master]  # each dials the master its own way
    assert local_rest[:-3] == kube_argv[1:-3]
    assert local_argv[-3:] == [str(tmp_path / "train.py"), "--epochs", "2"]
    assert kube_argv[-3:] == ["train.py", "--epochs", "2"]


def test_the_agent_reads_the_launch_as_the_job_says(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    config = parse_job_config(JOB, base_dir=tmp_path)
    launch = node_launch(config, "node-1", program=["dlworker"], master="m:1", ca_file="ca.pem")
    assert launch.env == {"PYTHONUNBUFFERED": "1", TLS_CA_ENV: "ca.pem"}
    agent = agent_config.parse_args(launch.argv[1:], {"DLFLEET_TOKEN": "t"})
    assert (agent.master, agent.node_name, agent.nproc_per_node) == ("m:1", "node-1", 1)
    assert agent.node_check  # two nodes: the job's node check is on
