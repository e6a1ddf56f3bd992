"""The DLFleetJob custom resource: its definition, generated from `JobConfig`.

A DLFleetJob is job.yaml as a Kubernetes object: `metadata.name` is the
job's name, `spec` holds what job.yaml holds (less what the cluster decides:
the platform, the master's address, the token, the work folder), and
`status` what the job is doing. The spec's schema is made here from
`JobConfig`'s own JSON schema (pydantic), so the resource and job.yaml never
disagree on a field, a bound or an enum: a malformed resource is refused by
the API server naming the field, before anything is created.

Kubernetes wants a *structural* schema (apiextensions v1): every node
typed, no `$ref`, unions only in the forms it knows. The translation:

- `$ref` is inlined; `anyOf [X, null]` is X with `nullable: true`;
- a union of other types is `x-kubernetes-int-or-string` where it is an
  integer or a string, else left open (`x-kubernetes-preserve-unknown-fields`)
  and checked by `JobConfig` when the job starts (one field today:
  `node_check.enabled`, `auto` or a boolean);
- a free-form object (`dict[str, Any]`: env entries, volumes, tolerations)
  keeps its unknown fields; `const` is a one-value enum; JSON Schema's numeric
  `exclusiveMinimum: n` is OpenAPI 3.0's `minimum: n, exclusiveMinimum: true`;
- titles, defaults and formats are dropped: `JobConfig` applies its own
  defaults (one place for them), and Kubernetes knows no `path` format.

Pure: no I/O. `dlmaster crd` prints `definition()` as YAML;
deploy/crd/dlfleetjob.yaml is that output, checked in (a test keeps it so).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from dlfleet.master.job.jobconfig import JobConfig

GROUP = "dlfleet.io"
VERSION = "v1alpha1"
KIND = "DLFleetJob"
PLURAL = "dlfleetjobs"
SINGULAR = "dlfleetjob"
SHORT_NAMES = ["dlfj"]

# JobConfig's fields that the cluster decides for a DLFleetJob, not its spec.
NOT_IN_SPEC = frozenset(
    {"name", "platform", "token", "token_file", "workdir", "master", "base_dir"}
)

# And of its kubernetes section: the resource's namespace is the job's, and
# the controller reaches the cluster and its master itself.
NOT_IN_KUBERNETES = frozenset({"namespace", "kubeconfig", "master_address"})

# The spec's own fields, beside job.yaml's.
SPEC_EXTRAS: dict[str, dict[str, Any]] = {
    "suspend": {
        "type": "boolean",
        "description": "true: nothing is created (a queue holds the job); set on a running "
        "job, its checkpoint is persisted and everything it created is removed.",
    },
    "gang": {
        "type": "object",
        "description": "Create the first nodes.min worker Pods as one group for the "
        "scheduler, so that a half-placed job holds no GPUs while it waits.",
        "properties": {
            "scheduler": {
                "type": "string",
                "enum": ["scheduler-plugins", "volcano"],
                "description": "Whose PodGroup: scheduler-plugins "
                "(scheduling.x-k8s.io/v1alpha1) or Volcano (scheduling.volcano.sh/v1beta1).",
            },
            "schedulerName": {
                "type": "string",
                "description": "The Pods' schedulerName (default: the scheduler's usual name).",
            },
        },
        "required": ["scheduler"],
    },
}

PHASES = ("Pending", "Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed")

STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "phase": {"type": "string", "enum": list(PHASES)},
        "reason": {"type": "string"},
        "message": {"type": "string"},
        "nodes": {"type": "string", "description": "ready/min/max"},
        "readyNodes": {"type": "integer"},
        "round": {"type": "integer"},
        "recordsDone": {"type": "integer"},
        "goodput": {"type": "string", "description": "the job's goodput ratio, 0.000-1.000"},
        "observedGeneration": {"type": "integer"},
        "startTime": {"type": "string", "format": "date-time"},
        "completionTime": {"type": "string", "format": "date-time"},
        "conditions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                },
            },
        },
    },
}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {
        "name": "Nodes",
        "type": "string",
        "jsonPath": ".status.nodes",
        "description": "ready/min/max",
    },
    {"name": "Round", "type": "integer", "jsonPath": ".status.round"},
    {"name": "Records", "type": "integer", "jsonPath": ".status.recordsDone"},
    {"name": "Goodput", "type": "string", "jsonPath": ".status.goodput"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# JSON Schema keywords carried over as they are.
_KEPT = (
    "type",
    "enum",
    "description",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "pattern",
    "required",
)


def spec_schema() -> dict[str, Any]:
    """The DLFleetJob spec's structural schema, from JobConfig's."""
    source = JobConfig.model_json_schema()
    defs = source.get("$defs", {})
    spec = structural(source, defs)
    properties = {
        name: value for name, value in spec["properties"].items() if name not in NOT_IN_SPEC
    }
    kube = properties["kubernetes"]
    kube["properties"] = {
        name: value for name, value in kube["properties"].items() if name not in NOT_IN_KUBERNETES
    }
    kube.pop("nullable", None)
    properties.update(copy.deepcopy(SPEC_EXTRAS))
    required = [name for name in spec.get("required", []) if name not in NOT_IN_SPEC]
    # On a cluster the kubernetes section (its image, at least) is the job's.
    required.append("kubernetes")
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    return schema


def structural(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    """One JSON Schema node (pydantic's) as a structural OpenAPI v3 schema."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return structural(merged, defs)
    if "anyOf" in node:
        return _union(node, defs)
    out: dict[str, Any] = {key: copy.deepcopy(node[key]) for key in _KEPT if key in node}
    if "const" in node:
        out["enum"] = [node["const"]]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node.get(bound), bool):
            out[plain] = node[bound]
            out[bound] = True
    kind = node.get("type")
    if kind == "object":
        properties = node.get("properties")
        extra = node.get("additionalProperties")
        if properties:
            out["properties"] = {
                name: structural(value, defs) for name, value in properties.items()
            }
        elif isinstance(extra, Mapping):
            out["additionalProperties"] = structural(extra, defs)
        elif extra is not False:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif kind == "array" and "items" in node:
        out["items"] = structural(node["items"], defs)
    if "type" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _union(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    choices = [choice for choice in node["anyOf"] if choice.get("type") != "null"]
    nullable = len(choices) < len(node["anyOf"])
    if len(choices) == 1:
        out = structural({**choices[0], **_described(node)}, defs)
    else:
        kinds = {choice.get("type") for choice in choices}
        out = _described(node)
        if kinds <= {"integer", "string"}:
            out["x-kubernetes-int-or-string"] = True
        else:
            forms = " or ".join(_form(choice) for choice in choices)
            out["description"] = (out.get("description", "") + f" ({forms})").strip()
            out["x-kubernetes-preserve-unknown-fields"] = True
    if nullable:
        out["nullable"] = True
    return out


def _described(node: Mapping[str, Any]) -> dict[str, Any]:
    return {"description": node["description"]} if "description" in node else {}


def _form(choice: Mapping[str, Any]) -> str:
    if "const" in choice:
        return repr(choice["const"])
    return str(choice.get("type", "any"))


def definition() -> dict[str, Any]:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An elastic, fault-tolerant data-parallel "
                            "PyTorch training job run by dlfleet.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": copy.deepcopy(STATUS_SCHEMA),
                            },
                        }
                    },
                }
            ],
        },
    }


def not_structural(schema: Mapping[str, Any], path: str = "") -> list[str]:
    """Where `schema` breaks Kubernetes' structural rules (none: an empty
    list): a node without a type (unless open or int-or-string), `$ref`,
    `anyOf` / `oneOf` / `allOf` / `not`, both `properties` and
    `additionalProperties`, or a default."""
    problems: list[str] = []
    here = path or "<root>"
    for key in ("$ref", "anyOf", "oneOf", "allOf", "not", "default", "$defs"):
        if key in schema:
            problems.append(f"{here}: {key}")
    open_ = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
        "x-kubernetes-int-or-string"
    )
    if "type" not in schema and not open_:
        problems.append(f"{here}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{here}: both properties and additionalProperties")
    for name, value in schema.get("properties", {}).items():
        problems += not_structural(value, f"{path}.{name}")
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping):
        problems += not_structural(extra, f"{path}.*")
    if "items" in schema:
        problems += not_structural(schema["items"], f"{path}[]")
    return problems
