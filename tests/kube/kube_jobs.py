"""A ledger job on the kubernetes platform, and helpers to look at its Pods
(shared by the kube tests).

The master runs here, as a process of this machine (save where a test runs it
in a Pod): the worker Pods, each a machine of its own, reach it at the test
kubelet's host address on their network. The job's directory (the ledger,
the job.yaml) is a hostPath volume of the Pods, mounted where it lies here,
as a shared filesystem would be."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e.ledger import assert_exactly_once, read_ledger
from harness import JobProcess
from kubernetes import client as k8s

ROOT = Path(__file__).resolve().parents[2]
LEDGER_SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "ledger_train.py"
QUICKSTART = ROOT / "examples" / "quickstart"
SIZE, BATCH, EPOCHS = 203, 4, 2
AGENT = [sys.executable, "-u", "-m", "dlfleet.worker.agent.loop"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shared_volume(path: Path, name: str = "shared") -> tuple[dict[str, Any], dict[str, Any]]:
    """A hostPath volume of `path` and its mount at the same path."""
    return {"name": name, "hostPath": {"path": str(path)}}, {"name": name, "mountPath": str(path)}


def kube_settings(
    namespace: str, kubeconfig: Path, port: int, host: str, shared: Path, **extra: Any
) -> dict[str, Any]:
    volume, mount = shared_volume(shared)
    return {
        "platform": "kubernetes",
        "master": {"host": host, "port": port},
        "kubernetes": {
            "image": "dlfleet-train:test",  # the test kubelet runs the command here
            "namespace": namespace,
            "kubeconfig": str(kubeconfig),
            "worker_command": AGENT,
            "master_address": f"{host}:{port}",  # the master is not in a Pod
            "resources": {"requests": {"cpu": "100m", "memory": "512Mi"},
                          "limits": {"memory": "512Mi"}},
            "termination_grace_s": 5,
            "volumes": [volume],
            "volume_mounts": [mount],
            **extra,
        },
    }  # fmt: skip


class KubeJob(JobProcess):
    """A ledger job on the kubernetes platform, its master listening on
    `host` (the kubelet's `host_ip`)."""

    def __init__(
        self,
        root: Path,
        namespace: str,
        kubeconfig: Path,
        host: str,
        args: list[str],
        **settings: Any,
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.ledger = root / "ledger"
        self.namespace = namespace
        self.port = free_port()
        kube_extra = settings.pop("kube", {})
        super().__init__(
            root,
            {
                "name": "kjob",
                "command": str(LEDGER_SCRIPT),
                "args": ["--ledger-dir", str(self.ledger), "--size", str(SIZE),
                         "--batch-size", str(BATCH), "--epochs", str(EPOCHS), *args],
                "nodes": {"min": 1, "max": 3, "initial": 2},
                "display": "plain",
                "max_restarts": 3,
                "max_node_relaunches": 6,
                "relaunch_delay_s": 0.5,
                "rendezvous": {"last_call_timeout_s": 0.5},
                "heartbeat": {"interval_s": 0.5, "timeout_s": 10},
                # The data is small: a replacement that checks itself first
                # (seconds) could find the job done. One test turns it on.
                "node_check": {"enabled": False},
                **kube_settings(namespace, kubeconfig, self.port, host, root, **kube_extra),
                **settings,
            },
        )  # fmt: skip

    def steps_logged(self) -> int:
        entries, _, _ = read_ledger(self.ledger) if self.ledger.exists() else ([], [], [])
        return len(entries)

    def worlds(self) -> list[int]:
        entries, _, _ = read_ledger(self.ledger)
        by_attempt = {e.attempt: e.world for e in entries}
        return [by_attempt[a] for a in sorted(by_attempt)]

    def succeed(self, timeout: float = 200) -> str:
        code, out, err = self.finish(timeout=timeout)
        assert code == 0, f"job failed ({code}):\n{err[-5000:]}\n{out[-3000:]}"
        return out + err

    def check(self) -> Any:
        return assert_exactly_once(self.ledger, size=SIZE, epochs=EPOCHS)


def pods(api: Any, namespace: str) -> list[Any]:
    return list(
        k8s.CoreV1Api(api)
        .list_namespaced_pod(namespace, label_selector="dlfleet.io/job=kjob,dlfleet.io/role=worker")
        .items
    )


def running_pods(api: Any, namespace: str) -> dict[str, Any]:
    return {
        p.metadata.name: p
        for p in pods(api, namespace)
        if p.status.phase == "Running" and not p.metadata.deletion_timestamp
    }


def wait(predicate: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
