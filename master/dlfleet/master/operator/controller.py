"""The DLFleetJob controller: `dlmaster operator`.

Level-triggered: every `period_s` (and at once on start) it lists the
DLFleetJobs it watches (one namespace, or all), and for each one lists what
carries its job label and its owner reference (ConfigMaps, Secrets, Jobs,
and PodGroups when the resource asks for a gang), asks `plan.plan` what
is missing or unwanted, creates and deletes that, and writes the resource's
status. An object that another pass (or a controller before a restart)
already made answers 409 and is adopted: nothing is made twice. A
controller restarted mid-job finds everything in place and creates nothing.

The status it writes (the master writes the live figures itself, see
`supervised.py`'s resource status): the phase while the master is not
reporting (Pending, Created, Suspended) and at the end (Succeeded, Failed,
read from the master Job), conditions Created / Suspended / Succeeded /
Failed with reasons (InvalidSpec names the field job.yaml's rules refuse),
and `observedGeneration`.

The calls it makes (dlfleetjobs: list; dlfleetjobs/status: patch;
configmaps: list, create, delete; secrets: create; jobs: list, create,
delete; podgroups of the gang schedulers: list, create, delete) are
deploy/operator's ClusterRole, and nothing else.

Lives in its own process (`dlmaster operator`), usually a Deployment.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from dlfleet.master.job import crd
from dlfleet.master.operator.plan import (
    GANG,
    LABEL_JOB,
    OperatorSettings,
    Plan,
    Resource,
    plan,
)

_log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
# What the master writes into the status while it runs; the controller
# leaves these phases alone.
MASTER_PHASES = ("Running", "Restarting")


def _message(exc: ApiException) -> str:
    """The API server's own words for a refusal, else its HTTP reason."""
    try:
        return str(json.loads(exc.body or "")["message"])
    except (ValueError, KeyError, TypeError):
        return f"{exc.status} {exc.reason}"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Operator:
    def __init__(
        self,
        api: Any,
        settings: OperatorSettings,
        namespace: str | None = None,
    ) -> None:
        """`namespace`: the one to watch; None: every namespace."""
        self.settings = settings
        self.namespace = namespace
        self.api = api
        self.core: Any = k8s.CoreV1Api(api)
        self.batch: Any = k8s.BatchV1Api(api)
        self.custom: Any = k8s.CustomObjectsApi(api)

    # ------------------------------------------------------------- loop

    def run(self, stop: threading.Event, period_s: float = 2.0) -> None:
        while not stop.is_set():
            try:
                self.reconcile_all()
            except ApiException as exc:
                _log.warning("reconciling: %s", _message(exc))
            stop.wait(period_s)

    def reconcile_all(self) -> None:
        for obj in self._resources():
            resource = Resource.from_object(obj)
            try:
                self.reconcile(resource, obj.get("status") or {})
            except ApiException as exc:
                _log.warning("%s/%s: %s", resource.namespace, resource.name, _message(exc))

    def reconcile(self, resource: Resource, status: Mapping[str, Any]) -> Plan:
        found = self._owned(resource)
        done = plan(resource, found, self.settings, new_token=secrets.token_hex(32))
        for manifest in done.create:
            self._create(manifest)
        for kind, name in done.delete:
            self._delete(resource.namespace, kind, name, found[(kind, name)])
        # What exists now, for the status: what was found, made, not deleted.
        now = {**found, **{(m["kind"], m["metadata"]["name"]): m for m in done.create}}
        for key in done.delete:
            now.pop(key, None)
        self._write_status(resource, status, done, now)
        return done

    # ------------------------------------------------------------ reading

    def _resources(self) -> list[dict[str, Any]]:
        if self.namespace is None:
            listed = self.custom.list_cluster_custom_object(crd.GROUP, crd.VERSION, crd.PLURAL)
        else:
            listed = self.custom.list_namespaced_custom_object(
                crd.GROUP, crd.VERSION, self.namespace, crd.PLURAL
            )
        items: list[dict[str, Any]] = listed.get("items", [])
        return items

    def _owned(self, resource: Resource) -> dict[tuple[str, str], dict[str, Any]]:
        """What carries the job's label and is owned by this very resource
        (not by an earlier one of the same name). Not Secrets: listing them
        would let the controller read every Secret of the cluster; the token
        Secret is created on every pass instead (409: it exists, adopted),
        and stays while the job is suspended (the garbage collector removes
        it with the resource)."""
        selector = f"{LABEL_JOB}={resource.name}"
        ns = resource.namespace
        found: dict[tuple[str, str], dict[str, Any]] = {}
        listings = [
            ("ConfigMap", self.core.list_namespaced_config_map(ns, label_selector=selector)),
            ("Job", self.batch.list_namespaced_job(ns, label_selector=selector)),
        ]
        for kind, listed in listings:
            for item in listed.items:
                owners = item.metadata.owner_references or []
                if any(owner.uid == resource.uid for owner in owners):
                    found[(kind, item.metadata.name)] = self.api.sanitize_for_serialization(item)
        gang = resource.spec.get("gang")
        if gang:
            group, version = str(GANG[gang["scheduler"]]["apiVersion"]).split("/")
            try:
                listed = self.custom.list_namespaced_custom_object(
                    group, version, ns, "podgroups", label_selector=selector
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                listed = {"items": []}  # the scheduler is not installed: made below, refused
            for item in listed.get("items", []):
                owners = item["metadata"].get("ownerReferences") or []
                if any(owner.get("uid") == resource.uid for owner in owners):
                    found[("PodGroup", item["metadata"]["name"])] = item
        return found

    # ------------------------------------------------------------ writing

    def _create(self, manifest: dict[str, Any]) -> None:
        kind, ns = manifest["kind"], manifest["metadata"]["namespace"]
        name = manifest["metadata"]["name"]
        try:
            if kind == "ConfigMap":
                self.core.create_namespaced_config_map(ns, manifest)
            elif kind == "Secret":
                self.core.create_namespaced_secret(ns, manifest)
            elif kind == "Job":
                self.batch.create_namespaced_job(ns, manifest)
            else:
                group, version = manifest["apiVersion"].split("/")
                self.custom.create_namespaced_custom_object(
                    group, version, ns, "podgroups", manifest
                )
        except ApiException as exc:
            if exc.status != 409:  # made by an earlier pass: adopted
                raise
            return
        _log.info("created %s %s/%s", kind, ns, name)

    def _delete(self, ns: str, kind: str, name: str, found: Mapping[str, Any]) -> None:
        # Foreground: the master Job's Pod goes too (and with it the workers).
        options = {"propagationPolicy": "Foreground"}
        try:
            if kind == "ConfigMap":
                self.core.delete_namespaced_config_map(name, ns, body=options)
            elif kind == "Secret":
                self.core.delete_namespaced_secret(name, ns, body=options)
            elif kind == "Job":
                self.batch.delete_namespaced_job(name, ns, body=options)
            else:
                group, version = found["apiVersion"].split("/")
                self.custom.delete_namespaced_custom_object(
                    group, version, ns, "podgroups", name, body=options
                )
        except ApiException as exc:
            if exc.status != 404:
                raise
            return
        _log.info("deleted %s %s/%s", kind, ns, name)

    def _write_status(
        self,
        resource: Resource,
        status: Mapping[str, Any],
        done: Plan,
        found: Mapping[tuple[str, str], Mapping[str, Any]],
    ) -> None:
        phase, reason, message = self._phase(resource, status, done, found)
        if phase is None:  # the master's phase stands: the conditions follow it
            shown = (status.get("phase"), status.get("reason") or "", status.get("message") or "")
        else:
            shown = (phase, reason, message)
        conditions = _conditions(status.get("conditions") or [], *shown)
        patch: dict[str, Any] = {
            "status": {"observedGeneration": resource.generation, "conditions": conditions}
        }
        if phase is not None:
            patch["status"].update(phase=phase, reason=reason, message=message)
        if phase in ("Succeeded", "Failed") and not status.get("completionTime"):
            patch["status"]["completionTime"] = _now()
        if phase == "Created" and not status.get("startTime"):
            patch["status"]["startTime"] = _now()
        if _unchanged(status, patch["status"]):
            return
        self.custom.patch_namespaced_custom_object_status(
            crd.GROUP, crd.VERSION, resource.namespace, crd.PLURAL, resource.name, patch
        )

    def _phase(
        self,
        resource: Resource,
        status: Mapping[str, Any],
        done: Plan,
        found: Mapping[tuple[str, str], Mapping[str, Any]],
    ) -> tuple[str | None, str, str]:
        """(phase, reason, message) as the controller sees it; phase None:
        the master's own (Running, Restarting) stands."""
        if done.refused is not None:
            return "Failed", "InvalidSpec", done.refused
        if resource.suspended:
            return "Suspended", "Suspended", "spec.suspend is true: nothing runs"
        job = found.get(("Job", resource.object_name("Job")))
        if job is not None:
            for condition in (job.get("status") or {}).get("conditions") or []:
                if condition.get("status") != "True":
                    continue
                if condition.get("type") == "Complete":
                    return "Succeeded", "JobSucceeded", "the master finished the job"
                if condition.get("type") == "Failed":
                    why = condition.get("message") or condition.get("reason") or "failed"
                    return "Failed", "MasterFailed", f"the master Job failed: {why}"
        if status.get("phase") in MASTER_PHASES:
            return None, "", ""
        if job is None:
            return "Pending", "Creating", "creating the master"
        return "Created", "MasterCreated", "the master Job is created"


def _conditions(
    before: list[Mapping[str, Any]], phase: str | None, reason: str, message: str
) -> list[dict[str, Any]]:
    """Created, Running, Restarting, Suspended, Succeeded, Failed: each True
    when the phase says so (Created once the master exists), keeping its
    transition time while it does not change."""
    now = _now()
    truths = {
        "Created": phase in ("Created", "Running", "Restarting", "Succeeded"),
        "Running": phase == "Running",
        "Restarting": phase == "Restarting",
        "Suspended": phase == "Suspended",
        "Succeeded": phase == "Succeeded",
        "Failed": phase == "Failed",
    }
    previous = {c.get("type"): c for c in before}
    out = []
    for kind, truth in truths.items():
        value = "True" if truth else "False"
        old: Mapping[str, Any] = previous.get(kind) or {}
        changed = old.get("status") != value
        condition = {
            "type": kind,
            "status": value,
            "reason": reason if truth and reason else old.get("reason") or kind,
            "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),
        }
        # No empty message: the API server reads "" in a status patch as null.
        said = message if truth and message else old.get("message")
        if said:
            condition["message"] = said
        out.append(condition)
    return out


def _unchanged(status: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Whether writing `patch` would change nothing (transition times aside)."""
    for key, value in patch.items():
        if key == "conditions":
            strip = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in value]
            had = [
                {k: v for k, v in c.items() if k != "lastTransitionTime"}
                for c in status.get("conditions") or []
            ]
            if strip != had:
                return False
        elif status.get(key) != value:
            return False
    return True
