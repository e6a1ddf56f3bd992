"""A job run for a DLFleetJob keeps that resource told: the supervisor
(`JobRunner`) writes the live figures into its status, and follows a change
of its `spec.nodes`.

The controller (`dlfleet.master.operator.controller`) sets `$DLFLEET_RESOURCE` to the
resource's name in the master Pod. Every `every_s` the runner hands `publish`
its status; the fields the master owns are patched (phase Running or
Restarting, nodes ready/min/max, readyNodes, round, recordsDone, goodput),
only when they changed. `wanted_nodes` reads the spec back: the number of
nodes it asks for now (`nodes.initial`, else `nodes.min`), which the runner
scales to when it differs from the last one it saw. `event` records a
Kubernetes Event on the resource (a node lost, relaunched, replaced or
marked faulty; a worker failure; the job's end), so that `kubectl describe
dlfleetjob NAME` tells the job's story.

`fields` is pure (a JobStatus in, the status fields out); the link itself
is a thin adapter around the CustomObjectsApi (the kubernetes package is
imported only when a link is made: the runner imports this module on every
platform). Lives in the job supervisor
process (`dlmaster --job-config`), on the kubernetes platform only.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from collections.abc import Mapping
from typing import Any

from dlfleet.api.v1 import job_pb2
from dlfleet.master.job import crd
from dlfleet.master.job.platform import NodeState

_log = logging.getLogger(__name__)

# What the Events say made them.
COMPONENT = "dlfleet-master"
# Kubernetes caps an Event's message at 1 KiB.
EVENT_MESSAGE_MAX = 1024


def fields(
    status: job_pb2.JobStatus, min_nodes: int, max_nodes: int, last_round: int = 0
) -> dict[str, Any]:
    """The DLFleetJob status fields the master owns, from its JobStatus and
    the newest round the job formed so far (`last_round`; the status says 0
    while no round is formed): Running while a round trains, Restarting
    after the first one while the next forms (or the master is down)."""
    ready = sum(1 for node in status.nodes if node.state == NodeState.RUNNING.value)
    formed = status.master_up and status.round > 0 and status.world_size > 0
    last_round = max(last_round, status.round)
    phase = "Running" if formed else "Restarting" if last_round > 0 else None
    out: dict[str, Any] = {
        "nodes": f"{ready}/{min_nodes}/{max_nodes}",
        "readyNodes": ready,
        "round": int(last_round),
        "recordsDone": int(sum(ds.records_done for ds in status.datasets)),
    }
    if status.HasField("goodput") and status.goodput.window_seconds > 0:
        out["goodput"] = f"{status.goodput.ratio:.3f}"
    if phase is not None:
        out.update(phase=phase, reason=phase, message=status.reason or f"round {status.round}")
    return out


def wanted(spec: Mapping[str, Any]) -> int | None:
    """The number of nodes a DLFleetJob's spec asks for now."""
    nodes = spec.get("nodes") or {}
    value = nodes.get("initial") or nodes.get("min")
    return int(value) if value else None


class ResourceLink:
    def __init__(self, api: Any, namespace: str, name: str) -> None:
        # Imported here: the runner imports this module on every platform.
        from kubernetes import client as k8s
        from kubernetes.client.exceptions import ApiException

        self._errors = (ApiException, OSError)
        self.custom: Any = k8s.CustomObjectsApi(api)
        self.core: Any = k8s.CoreV1Api(api)
        self.uid: str | None = None  # the resource's, once read
        self.namespace = namespace
        self.name = name
        self._published: dict[str, Any] = {}

    def publish(self, status: Mapping[str, Any]) -> None:
        """Patch the resource's status with `status`, if it changed; best
        effort (a failure is logged, the job goes on)."""
        if dict(status) == self._published:
            return
        try:
            self.custom.patch_namespaced_custom_object_status(
                crd.GROUP, crd.VERSION, self.namespace, crd.PLURAL, self.name,
                {"status": dict(status)},
            )  # fmt: skip
            self._published = dict(status)
        except self._errors as exc:
            _log.warning("cannot write the status of %s %s: %s", crd.KIND, self.name, exc)

    def wanted_nodes(self) -> int | None:
        """What the resource's spec asks for now (None: unreadable)."""
        try:
            found = self.custom.get_namespaced_custom_object(
                crd.GROUP, crd.VERSION, self.namespace, crd.PLURAL, self.name
            )
        except self._errors as exc:
            _log.warning("cannot read %s %s: %s", crd.KIND, self.name, exc)
            return None
        self.uid = (found.get("metadata") or {}).get("uid") or self.uid
        return wanted(found.get("spec") or {})

    def event(self, warning: bool, reason: str, message: str) -> None:
        """Record an Event on the resource (best effort: a failure is logged)."""
        if self.uid is None:
            self.wanted_nodes()  # reads the uid
        if self.uid is None:
            return
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{self.name}.{secrets.token_hex(8)}"},
            "involvedObject": {
                "apiVersion": f"{crd.GROUP}/{crd.VERSION}",
                "kind": crd.KIND,
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
            },
            "type": "Warning" if warning else "Normal",
            "reason": reason,
            "message": message[:EVENT_MESSAGE_MAX],
            "source": {"component": COMPONENT},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(self.namespace, body)
        except self._errors as exc:
            _log.warning("cannot record an event on %s %s: %s", crd.KIND, self.name, exc)
