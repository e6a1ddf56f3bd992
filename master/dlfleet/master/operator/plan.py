"""What the DLFleetJob controller wants to exist for one resource: pure.

A DLFleetJob (`dlfleet.master.job.crd`) is job.yaml as a Kubernetes object. For each one the
controller keeps three objects, all owned by the resource (so `kubectl
delete` removes them, and with them everything the master made):

- a ConfigMap `<name>-job` holding the job.yaml the master runs: the spec,
  less the resource's own fields (`suspend`, `gang`), with the resource's
  name, `platform: kubernetes`, its namespace, the token file and the work
  folder (on the master Pod's volume); Kueue's queue label and the gang
  scheduler's labels and annotations are added to what the worker Pods carry;
- a Secret `<name>-token`, a random token made once and never rotated (a
  controller restarted mid-job adopts it: the running master and workers hold
  that token);
- a batch Job `<name>-master` running `dlmaster --job-config` on that
  job.yaml, as deploy/'s master Job does.

With `gang` set, a PodGroup `<name>` with `minMember: nodes.min` for the
chosen scheduler (scheduler-plugins or Volcano) joins them, and the worker
Pods name it and the scheduler.

`plan` compares what exists (found by the job's label) with what is wanted
and says what to create and what to delete, never anything twice: an object
that exists is adopted, not made again. A suspended resource wants nothing
(deleting the master Job stops the job: its Pod gets SIGTERM, the master
stops the workers and they persist their newest checkpoint). A spec that
job.yaml's rules refuse wants nothing either, and the plan says why (the
status condition names the field).

Pure: no I/O, no clock; the adapter (`controller.py`) lists, applies
and writes the status.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlfleet.api.env import RESOURCE_ENV
from dlfleet.api.errors import DlfleetError
from dlfleet.master.job import crd
from dlfleet.master.job.jobconfig import JobConfig, parse_job_config

LABEL_JOB = "dlfleet.io/job"
LABEL_ROLE = "dlfleet.io/role"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue's plain-Pod groups: the worker Pods of one job are admitted together.
POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
POD_GROUP_TOTAL = "kueue.x-k8s.io/pod-group-total-count"

# Where the master Pod mounts what the controller made: side by side, so that
# job.yaml names the token and the work folder by paths relative to itself
# (as job.yaml's paths are), which hold wherever the three are mounted.
MOUNT_ROOT = "/dlfleet"
JOB_YAML_DIR = f"{MOUNT_ROOT}/job"
TOKEN_DIR = f"{MOUNT_ROOT}/token"
STATE_DIR = f"{MOUNT_ROOT}/state"

# The gang schedulers: their PodGroup, the Pods' label or annotation naming
# it, and the scheduler's usual name.
GANG = {
    "scheduler-plugins": {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1",
        "pod_label": "scheduling.x-k8s.io/pod-group",
        "pod_annotation": None,
        "scheduler": "scheduler-plugins-scheduler",
    },
    "volcano": {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "pod_label": None,
        "pod_annotation": "scheduling.k8s.io/group-name",
        "scheduler": "volcano",
    },
}


@dataclass(frozen=True)
class Resource:
    """The parts of a DLFleetJob the controller reads."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> Resource:
        meta = obj["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta.get("namespace", "default"),
            uid=meta["uid"],
            generation=int(meta.get("generation", 1)),
            spec=obj.get("spec", {}),
            labels=meta.get("labels") or {},
        )

    @property
    def suspended(self) -> bool:
        return bool(self.spec.get("suspend", False))

    @property
    def owner(self) -> dict[str, Any]:
        """The owner reference everything made for it carries."""
        return {
            "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
            "kind": crd.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def object_name(self, kind: str) -> str:
        return {
            "ConfigMap": f"{self.name}-job",
            "Secret": f"{self.name}-token",
            "Job": f"{self.name}-master",
            "PodGroup": self.name,
        }[kind]


@dataclass(frozen=True)
class OperatorSettings:
    """What the controller puts in every master Job. `master_command` runs
    the master (its `--job-config` path follows); `master_env`,
    `master_volumes` and `master_volume_mounts` are added to the master's
    container (a proxy, a CA bundle, a kubeconfig where the Pod has no
    service account token)."""

    master_image: str
    service_account: str = "dlfleet-master"
    master_port: int = 50051
    http_port: int = 8080
    master_command: tuple[str, ...] = ("dlmaster",)
    master_env: Mapping[str, str] = field(default_factory=dict)
    master_volumes: tuple[Mapping[str, Any], ...] = ()
    master_volume_mounts: tuple[Mapping[str, Any], ...] = ()


def job_yaml(resource: Resource, master_port: int = 50051) -> dict[str, Any]:
    """The job.yaml the master of `resource` runs (not yet checked): it
    listens on `master_port` beyond its Pod's loopback, where the workers
    reach it through the Service the master makes."""
    spec = {k: v for k, v in resource.spec.items() if k not in crd.SPEC_EXTRAS}
    kube = dict(spec.get("kubernetes") or {})
    labels = dict(kube.get("labels") or {})
    annotations = dict(kube.get("annotations") or {})
    queue = resource.labels.get(QUEUE_LABEL)
    if queue:
        labels[QUEUE_LABEL] = queue
        labels[POD_GROUP_LABEL] = resource.name
        nodes = spec.get("nodes") or {}
        total = nodes.get("initial") or nodes.get("min") or 1
        annotations[POD_GROUP_TOTAL] = str(total)
    gang = resource.spec.get("gang")
    if gang:
        chosen = GANG[gang["scheduler"]]
        if chosen["pod_label"]:
            labels[str(chosen["pod_label"])] = resource.object_name("PodGroup")
        if chosen["pod_annotation"]:
            annotations[str(chosen["pod_annotation"])] = resource.object_name("PodGroup")
        kube["scheduler_name"] = gang.get("schedulerName") or chosen["scheduler"]
    kube.update(
        namespace=resource.namespace,
        labels=labels,
        annotations=annotations,
        # The workers read the token from the controller's Secret too: the
        # master makes none (its Role cannot).
        token_secret={"name": resource.object_name("Secret"), "key": "token"},
    )
    return {
        **spec,
        "name": resource.name,
        "platform": "kubernetes",
        "master": {"host": "0.0.0.0", "port": master_port},
        "kubernetes": kube,
        # Relative to job.yaml's folder, JOB_YAML_DIR.
        "token_file": f"../{Path(TOKEN_DIR).name}/token",
        "workdir": f"../{Path(STATE_DIR).name}/{resource.name}",
        "display": "plain",
    }


def check(resource: Resource) -> JobConfig | str:
    """The resource's job.yaml as JobConfig, or why job.yaml's rules refuse
    it (one line naming the field)."""
    document = job_yaml(resource)
    document.pop("token_file")  # the Secret is mounted in the master Pod, not here
    try:
        return parse_job_config(document, base_dir=Path(JOB_YAML_DIR))
    except DlfleetError as exc:
        return str(exc)


@dataclass(frozen=True)
class Plan:
    """What to create and delete, by (kind, name); `refused`: why the spec
    cannot run (then nothing is created)."""

    create: tuple[dict[str, Any], ...] = ()
    delete: tuple[tuple[str, str], ...] = ()
    refused: str | None = None


def plan(
    resource: Resource,
    found: Mapping[tuple[str, str], Mapping[str, Any]],
    settings: OperatorSettings,
    new_token: str,
) -> Plan:
    """What to do so that what exists for `resource` (`found`, by kind and
    name, the objects labelled with its job) is what it wants. `new_token`:
    the token a Secret made now holds (unused when one exists)."""
    if resource.suspended:
        return Plan(delete=tuple(sorted(found)))
    checked = check(resource)
    if isinstance(checked, str):
        return Plan(refused=checked)
    wanted = [
        config_map(resource, settings.master_port),
        token_secret(resource, new_token),
        master_job(resource, settings),
    ]
    if resource.spec.get("gang"):
        wanted.append(pod_group(resource, checked.nodes.min))
    create = tuple(m for m in wanted if (m["kind"], m["metadata"]["name"]) not in found)
    return Plan(create=create)


def _metadata(resource: Resource, kind: str, role: str) -> dict[str, Any]:
    labels = {LABEL_JOB: resource.name, LABEL_ROLE: role, "app.kubernetes.io/name": "dlfleet"}
    queue = resource.labels.get(QUEUE_LABEL)
    if queue:
        labels[QUEUE_LABEL] = queue
    return {
        "name": resource.object_name(kind),
        "namespace": resource.namespace,
        "labels": labels,
        "ownerReferences": [resource.owner],
    }


def config_map(resource: Resource, master_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(resource, "ConfigMap", "config"),
        # JSON is YAML: the master reads it as job.yaml.
        "data": {"job.yaml": json.dumps(job_yaml(resource, master_port), indent=1, sort_keys=True)},
    }


def token_secret(resource: Resource, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(resource, "Secret", "token"),
        "type": "Opaque",
        "stringData": {"token": token},
    }


def master_job(resource: Resource, settings: OperatorSettings) -> dict[str, Any]:
    metadata = _metadata(resource, "Job", "master")
    pod_labels = {LABEL_JOB: resource.name, LABEL_ROLE: "master"}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "backoffLimit": 6,
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "serviceAccountName": settings.service_account,
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "master",
                            "image": settings.master_image,
                            "command": [
                                *settings.master_command,
                                "--job-config",
                                f"{JOB_YAML_DIR}/job.yaml",
                            ],
                            "env": [
                                *({"name": k, "value": v} for k, v in settings.master_env.items()),
                                {"name": RESOURCE_ENV, "value": resource.name},
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                },
                                {
                                    "name": "POD_NAMESPACE",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                                },
                            ],
                            "ports": [
                                {"name": "grpc", "containerPort": settings.master_port},
                                {"name": "http", "containerPort": settings.http_port},
                            ],
                            "volumeMounts": [
                                {"name": "job", "mountPath": JOB_YAML_DIR, "readOnly": True},
                                {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
                                {"name": "state", "mountPath": STATE_DIR},
                                *settings.master_volume_mounts,
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "job", "configMap": {"name": resource.object_name("ConfigMap")}},
                        {"name": "token", "secret": {"secretName": resource.object_name("Secret")}},
                        {"name": "state", "emptyDir": {}},
                        *settings.master_volumes,
                    ],
                },
            },
        },
    }


def pod_group(resource: Resource, min_member: int) -> dict[str, Any]:
    chosen = GANG[resource.spec["gang"]["scheduler"]]
    return {
        "apiVersion": chosen["apiVersion"],
        "kind": "PodGroup",
        "metadata": _metadata(resource, "PodGroup", "gang"),
        "spec": {"minMember": min_member},
    }
