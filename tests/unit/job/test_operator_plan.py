"""The DLFleetJob controller's plan (pure): what it creates for a resource,
that it never creates an object twice (what exists is adopted), that a
suspended resource wants nothing, that a spec job.yaml's rules refuse is
named and creates nothing, and what Kueue and a gang scheduler get. The
objects are valid for a current Kubernetes (kubernetes-validate)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import kubernetes_validate
import yaml
from hypothesis import given

from dlfleet.master.job import crd
from dlfleet.master.job.jobconfig import JobConfig, load_job_config, parse_job_config
from dlfleet.master.job.runner import job_token
from dlfleet.master.operator.plan import (
    LABEL_JOB,
    POD_GROUP_LABEL,
    POD_GROUP_TOTAL,
    QUEUE_LABEL,
    OperatorSettings,
    Resource,
    check,
    job_yaml,
    master_job,
    plan,
)

ROOT = Path(__file__).resolve().parents[3]
SETTINGS = OperatorSettings(master_image="registry.example.com/dlfleet-master:0.1")
KINDS = (("ConfigMap", "demo-job"), ("Secret", "demo-token"), ("Job", "demo-master"))


def resource(labels: dict[str, str] | None = None, **spec: Any) -> Resource:
    return Resource.from_object(
        {
            "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
            "kind": crd.KIND,
            "metadata": {
                "name": "demo",
                "namespace": "team-a",
                "uid": "uid-1",
                "generation": 1,
                "labels": labels or {},
            },
            "spec": {
                "command": "train.py",
                "nodes": {"min": 2, "max": 4},
                "kubernetes": {"image": "example/train:1"},
                **spec,
            },
        }
    )


def keys(objects: tuple[dict[str, Any], ...]) -> list[tuple[str, str]]:
    return [(o["kind"], o["metadata"]["name"]) for o in objects]


def test_a_new_resource_gets_its_job_yaml_token_and_master_all_owned_by_it() -> None:
    done = plan(resource(), {}, SETTINGS, new_token="tok")
    assert done.refused is None and done.delete == ()
    assert keys(done.create) == list(KINDS)
    for made in done.create:
        meta = made["metadata"]
        assert meta["namespace"] == "team-a" and meta["labels"][LABEL_JOB] == "demo"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "dlfleet.io/v1alpha1",
                "kind": "DLFleetJob",
                "name": "demo",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        kubernetes_validate.validate(made, kubernetes_validate.latest_version(), strict=True)
    config_map, secret, job = done.create
    assert secret["stringData"] == {"token": "tok"}
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == SETTINGS.master_image
    assert pod["containers"][0]["command"] == [
        "dlmaster",
        "--job-config",
        "/dlfleet/job/job.yaml",
    ]
    # The master's job.yaml is job.yaml's rules' own, and names the mounted token.
    document = json.loads(config_map["data"]["job.yaml"])
    assert document["token_file"] == "../token/token"
    assert document["master"] == {"host": "0.0.0.0", "port": SETTINGS.master_port}
    document.pop("token_file")
    config = parse_job_config(document, base_dir=Path("/dlfleet/job"))
    assert (config.name, config.platform, config.nodes.min) == ("demo", "kubernetes", 2)
    assert config.kubernetes is not None and config.kubernetes.namespace == "team-a"
    assert config.work_dir == Path("/dlfleet/job/../state/demo")


def test_the_master_reads_its_token_beside_job_yaml_mounted_as_a_config_map_mounts_it(
    tmp_path: Path,
) -> None:
    """Laid out as in the master Pod: job.yaml in a ConfigMap volume (a link
    into a hidden timestamped folder, as the kubelet makes it), the token in
    a Secret volume beside it. Paths relative to job.yaml mean the folder it
    was mounted in, not the link's target."""
    config_map, _, job = plan(resource(), {}, SETTINGS, new_token="tok").create
    container = job["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: Path(str(tmp_path) + m["mountPath"]) for m in container["volumeMounts"]}
    data = mounts["job"] / "..2026_11_28_00_00_00.000000001"
    data.mkdir(parents=True)
    (data / "job.yaml").write_text(config_map["data"]["job.yaml"])
    (mounts["job"] / "..data").symlink_to(data.name)
    (mounts["job"] / "job.yaml").symlink_to("..data/job.yaml")
    mounts["token"].mkdir(parents=True)
    (mounts["token"] / "token").write_text("tok\n")
    config = load_job_config(Path(str(tmp_path) + container["command"][-1]))
    assert job_token(config) == "tok"
    assert config.work_dir.resolve() == mounts["state"] / "demo"


def test_the_master_job_carries_the_settings_extras() -> None:
    settings = OperatorSettings(
        master_image="m:1",
        master_command=("python", "-m", "dlfleet.master"),
        master_env={"HTTPS_PROXY": "http://proxy:3128"},
        master_volumes=({"name": "ca", "configMap": {"name": "ca-bundle"}},),
        master_volume_mounts=({"name": "ca", "mountPath": "/etc/ssl/extra"},),
    )
    job = master_job(resource(), settings)
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"][:3] == ["python", "-m", "dlfleet.master"]
    assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in container["env"]
    assert {"name": "ca", "mountPath": "/etc/ssl/extra"} in container["volumeMounts"]
    assert {"name": "ca", "configMap": {"name": "ca-bundle"}} in pod["volumes"]


@given(st.sets(st.sampled_from(KINDS)))
def test_what_exists_is_adopted_never_made_again(existing: set[tuple[str, str]]) -> None:
    found: dict[tuple[str, str], Any] = {key: {} for key in existing}
    done = plan(resource(), found, SETTINGS, new_token="tok")
    assert set(keys(done.create)) == set(KINDS) - existing
    assert done.delete == ()


def test_a_suspended_resource_wants_nothing_and_what_it_had_goes() -> None:
    found: dict[tuple[str, str], Any] = {key: {} for key in KINDS}
    done = plan(resource(suspend=True), found, SETTINGS, new_token="tok")
    assert done.create == () and set(done.delete) == set(KINDS)
    assert plan(resource(suspend=True), {}, SETTINGS, new_token="tok") == plan(
        resource(suspend=True), {}, SETTINGS, new_token="other"
    )


def test_a_spec_job_yaml_refuses_creates_nothing_and_says_why() -> None:
    # Within the CRD's schema (each field in bounds), refused by job.yaml's rules.
    done = plan(resource(step_timeout_min_s=3), {}, SETTINGS, new_token="tok")
    assert done.create == () and done.delete == ()
    assert done.refused is not None and "step_timeout_min_s" in done.refused


def test_kueue_s_queue_reaches_the_master_job_and_the_worker_pods_as_one_group() -> None:
    queued = resource(labels={QUEUE_LABEL: "team-a-queue"}, nodes={"min": 2, "max": 4})
    done = plan(queued, {}, SETTINGS, new_token="tok")
    for made in done.create:
        assert made["metadata"]["labels"][QUEUE_LABEL] == "team-a-queue"
    kube = job_yaml(queued)["kubernetes"]
    assert kube["labels"] == {QUEUE_LABEL: "team-a-queue", POD_GROUP_LABEL: "demo"}
    assert kube["annotations"] == {POD_GROUP_TOTAL: "2"}


def test_a_gang_gets_a_pod_group_of_nodes_min_and_the_pods_name_it() -> None:
    volcano = resource(gang={"scheduler": "volcano"}, nodes={"min": 3, "max": 6})
    done = plan(volcano, {}, SETTINGS, new_token="tok")
    (group,) = [o for o in done.create if o["kind"] == "PodGroup"]
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"] == {"minMember": 3}
    kube = job_yaml(volcano)["kubernetes"]
    assert kube["scheduler_name"] == "volcano"
    assert kube["annotations"]["scheduling.k8s.io/group-name"] == "demo"
    plugins = resource(gang={"scheduler": "scheduler-plugins", "schedulerName": "sp"})
    kube = job_yaml(plugins)["kubernetes"]
    assert kube["scheduler_name"] == "sp"
    assert kube["labels"]["scheduling.x-k8s.io/pod-group"] == "demo"
    group = next(o for o in plan(plugins, {}, SETTINGS, "t").create if o["kind"] == "PodGroup")
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"


def test_the_shipped_example_is_a_job_the_controller_runs() -> None:
    example = yaml.safe_load((ROOT / "examples" / "kubernetes" / "dlfleetjob.yaml").read_text())
    example["metadata"].update(namespace="team-a", uid="uid-9")
    made = Resource.from_object(example)
    config = check(made)
    assert isinstance(config, JobConfig), config
    assert (config.name, config.nodes.min, config.nodes.maximum) == ("quickstart", 2, 4)
    assert config.http is not None and config.http.port == SETTINGS.http_port
    made_kinds = [kind for kind, _ in keys(plan(made, {}, SETTINGS, new_token="t").create)]
    assert made_kinds == ["ConfigMap", "Secret", "Job"]
