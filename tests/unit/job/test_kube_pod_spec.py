"""The worker Pod the kubernetes platform asks for: the address its node
publishes, the master it dials, and the /dev/shm its in-memory checkpoint
images live in. (The Pods running: tests/kube.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.job.jobconfig import parse_job_config
from dlfleet.master.job.platform.kubernetes import KubernetesPlatform


class RecordingCore:
    """The one call `add_node` makes: it keeps the Pods asked for."""

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any], **_: Any) -> None:
        self.pods.append(body)


def worker_pod(tmp_path: Path, **kubernetes: Any) -> dict[str, Any]:
    config = parse_job_config(
        {"name": "demo", "command": "train.py", "platform": "kubernetes",
         "kubernetes": {"image": "x", "namespace": "ns", **kubernetes}},
        base_dir=tmp_path,
    )  # fmt: skip
    platform = KubernetesPlatform(config, master_port=50051, token="t", client=object())
    core = RecordingCore()
    platform.core = core
    platform.add_node()
    (pod,) = core.pods
    return pod


def container(pod: dict[str, Any]) -> dict[str, Any]:
    only: dict[str, Any]
    (only,) = pod["spec"]["containers"]
    return only


def test_a_worker_pod_publishes_its_pod_ip_and_dials_the_master_through_its_service(
    tmp_path: Path,
) -> None:
    pod = worker_pod(tmp_path)
    env = {var["name"]: var for var in container(pod)["env"]}
    assert env["PET_LOCAL_ADDR"] == {
        "name": "PET_LOCAL_ADDR",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    }
    command = container(pod)["command"]
    assert command[command.index("--master") + 1] == "demo-master.ns.svc:50051"
    assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == ("node-0", "demo-master")


def test_a_worker_pod_mounts_a_memory_backed_dev_shm_of_the_default_size(tmp_path: Path) -> None:
    pod = worker_pod(tmp_path)
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    (mount,) = [m for m in container(pod)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[mount["name"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}


def test_shm_size_sets_the_dev_shm_size_limit(tmp_path: Path) -> None:
    pod = worker_pod(tmp_path, shm_size="512Mi")
    (shm,) = [v for v in pod["spec"]["volumes"] if "emptyDir" in v]
    assert shm["emptyDir"]["sizeLimit"] == "512Mi"


def test_a_dev_shm_the_job_mounts_itself_is_kept_as_it_is(tmp_path: Path) -> None:
    own = {"name": "mine", "emptyDir": {"medium": "Memory"}}
    pod = worker_pod(
        tmp_path, volumes=[own], volume_mounts=[{"name": "mine", "mountPath": "/dev/shm/"}]
    )
    assert pod["spec"]["volumes"] == [own]
    assert container(pod)["volumeMounts"] == [{"name": "mine", "mountPath": "/dev/shm/"}]


@pytest.mark.parametrize(
    ("size", "reason"),
    [
        ("32Mi", "32Mi is less than the 64Mi a container's /dev/shm has without it"),
        ("lots", "'lots' is not a Kubernetes quantity"),
    ],
)
def test_a_shm_size_below_64Mi_or_not_a_quantity_is_refused_naming_the_setting(
    tmp_path: Path, size: str, reason: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        worker_pod(tmp_path, shm_size=size)
    assert f"kubernetes.shm_size: {reason}" in str(refused.value)
