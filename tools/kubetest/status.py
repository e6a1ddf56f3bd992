"""The Node and Pod status documents the test kubelet reports, as a kubelet
with a real container runtime would. Pure functions over JSON dicts (camelCase
keys, as the API serves them); the kubelet sends them as JSON merge patches,
so every list here is complete (a merge patch replaces lists whole) and a None
removes a field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

Json = dict[str, Any]


def now() -> str:
    """metav1.Time: RFC 3339, seconds."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    """metav1.MicroTime (a Lease's renewTime)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def exit_code(returncode: int) -> int:
    """The exit code a container runtime reports (Popen's returncode is -N
    for death by signal N; a runtime reports 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def phase_after_exit(restart_policy: str, code: int) -> str:
    """The Pod's phase once its only container exited with `code`."""
    if restart_policy == "Never":
        return "Succeeded" if code == 0 else "Failed"
    if restart_policy == "OnFailure" and code == 0:
        return "Succeeded"
    return "Running"  # a restart is due


def terminated(code: int, oom_killed: bool, started_at: str, container_id: str) -> Json:
    """A container's `state.terminated`."""
    if oom_killed:
        code, reason = 137, "OOMKilled"
    else:
        reason = "Completed" if code == 0 else "Error"
    return {
        "exitCode": code,
        "reason": reason,
        "startedAt": started_at or None,
        "finishedAt": now(),
        "containerID": container_id,
    }


@dataclass(frozen=True)
class ContainerRun:
    """What the status of a Pod's (first) container is made of."""

    container: Json
    container_id: str
    restart_count: int
    state: Json | None  # {"running"|"waiting"|"terminated": {...}}; None: leave as is
    last_terminated: Json | None


def pod_status(
    phase: str,
    start_time: str,
    run: ContainerRun,
    *,
    pod_ip: str | None,
    host_ip: str,
    ready: bool = False,
    eviction: str | None = None,
) -> Json:
    """A Pod's status with its one container in `run.state`; `eviction` is the
    message of a kubelet eviction (reason Evicted); `pod_ip` None: it has none
    yet."""
    at = now()

    def condition(kind: str, ok: bool) -> Json:
        reason = None if ok else ("ContainersNotReady" if phase == "Running" else "PodCompleted")
        return {"type": kind, "status": str(ok), "reason": reason,
                "lastProbeTime": None, "lastTransitionTime": at}  # fmt: skip

    status: Json = {
        "phase": phase,
        "reason": "Evicted" if eviction is not None else None,
        "message": eviction,
        "hostIP": host_ip,
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}] if pod_ip else None,
        "startTime": start_time,
        "conditions": [
            condition("Initialized", True),
            condition("Ready", ready),
            condition("ContainersReady", ready),
            condition("PodScheduled", True),
        ],
    }
    if run.state is not None:
        last = {"terminated": run.last_terminated} if run.last_terminated else {}
        status["containerStatuses"] = [
            {
                "name": run.container["name"],
                "image": run.container.get("image", ""),
                "imageID": "",
                "containerID": run.container_id,
                "ready": ready,
                "started": "running" in run.state,
                "restartCount": run.restart_count,
                "state": run.state,
                "lastState": last,
            }
        ]
    return status


def node_status(
    node_name: str,
    capacity: Mapping[str, str],
    registered_at: str,
    kubelet_version: str,
    host_ip: str,
) -> Json:
    """A Ready node with no pressure, reachable at `host_ip`."""
    heartbeat = now()

    def condition(kind: str, status: str, reason: str) -> Json:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": f"kubetest: {reason}",
            "lastHeartbeatTime": heartbeat,
            "lastTransitionTime": registered_at,
        }

    return {
        "capacity": dict(capacity),
        "allocatable": dict(capacity),
        "conditions": [
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID"),
            condition("Ready", "True", "KubeletReady"),
        ],
        "addresses": [
            {"type": "InternalIP", "address": host_ip},
            {"type": "Hostname", "address": node_name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        "nodeInfo": {
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
            "kernelVersion": "",
            "osImage": "kubetest",
            "containerRuntimeVersion": "kubetest://0",
            "kubeletVersion": kubelet_version,
            "kubeProxyVersion": kubelet_version,
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }
