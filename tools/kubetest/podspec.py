"""How the test kubelet turns a Pod's first container into a local process:
its argv, environment and working directory, and its volumes as files.

There is no container filesystem, so a volume's mountPath does not exist on
this host. Convention: each volume is materialized under
`<pod_dir>/volumes/<volume name>/`, and every command/args element, env value
and workingDir that *starts with* a volumeMount's mountPath (the path itself or
anything below it) is rewritten to the local directory; the longest mountPath
wins. Nothing else is rewritten (`--config=/etc/app/x` stays as is: pass the
path as its own argument). A workingDir that is neither under a mount nor an
existing directory is created under `<pod_dir>/rootfs/`. The process also gets
`KUBETEST_POD_DIR=<pod_dir>`.

The exception is /dev/shm: a memory-backed emptyDir mounted there is the
size of the tmpfs the Pod gets at /dev/shm (`Launch.shm_bytes`; see
`kubetest.sandbox`), not a directory. The Pod's own directory and its
hostPath volumes are the host paths it needs to see (`Launch.host_paths`).

Pods are JSON dicts as the API serves them (camelCase keys).
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kubernetes.utils.quantity import parse_quantity

Json = dict[str, Any]
V = TypeVar("V")

# (namespace, name) -> data, or None when the object does not exist.
ConfigMapLookup = Callable[[str, str], Mapping[str, str] | None]
SecretLookup = Callable[[str, str], Mapping[str, bytes] | None]
SHM_PATH = "/dev/shm"
DEFAULT_SHM_BYTES = 64 * 2**20  # a container's /dev/shm


class ContainerConfigError(Exception):
    """The container cannot be started as specified (a real kubelet reports
    CreateContainerConfigError and retries)."""


@dataclass(frozen=True)
class Addresses:
    """Where the Pod is: the downward API's status.podIP and status.hostIP."""

    pod_ip: str
    host_ip: str


@dataclass(frozen=True)
class Launch:
    """Everything needed to start the container's process."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    shm_bytes: int | None = DEFAULT_SHM_BYTES  # None: a tmpfs's default size
    host_paths: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Sources:
    """Where configMap and secret contents come from."""

    config_map: ConfigMapLookup
    secret: SecretLookup


def pod_hostname(pod: Json) -> str:
    """The Pod's hostname: spec.hostname, else its name."""
    name: str = pod["spec"].get("hostname") or pod["metadata"]["name"]
    return name


def first_container(pod: Json) -> Json:
    containers: list[Json] = pod["spec"]["containers"]
    return containers[0]


def build_launch(
    pod: Json, pod_dir: Path, sources: Sources, base_env: Mapping[str, str], addresses: Addresses
) -> Launch:
    """Materialize the volumes under `pod_dir` and translate the first
    container. Raises ContainerConfigError."""
    container = first_container(pod)
    shm = _memory_shm(pod)
    mounts = _materialize_volumes(pod, pod_dir, sources)
    if shm is not None:  # a tmpfs there, not a directory
        mounts = {path: local for path, local in mounts.items() if path.rstrip("/") != SHM_PATH}
    pod_env = _container_env(pod, container, sources, mounts, addresses)
    env = {
        **base_env,
        "KUBETEST_POD_DIR": str(pod_dir),
        "HOSTNAME": pod_hostname(pod),
        **pod_env,
    }
    argv = [*(container.get("command") or []), *(container.get("args") or [])]
    if not argv:
        raise ContainerConfigError("kubetest needs an explicit command (images are not run)")
    argv = [rewrite_path(_expand(arg, pod_env), mounts) for arg in argv]
    host_paths = [
        Path(volume["hostPath"]["path"])
        for volume in pod["spec"].get("volumes") or []
        if "hostPath" in volume
    ]
    return Launch(
        argv=argv,
        env=env,
        cwd=_working_dir(container, pod_dir, mounts),
        shm_bytes=DEFAULT_SHM_BYTES if shm is None else shm.size_bytes,
        host_paths=(pod_dir, *host_paths),
    )


@dataclass(frozen=True)
class _MemoryShm:
    size_bytes: int | None  # None: no sizeLimit


def _memory_shm(pod: Json) -> _MemoryShm | None:
    """The memory-backed emptyDir the first container mounts at /dev/shm."""
    volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes") or []}
    for mount in first_container(pod).get("volumeMounts") or []:
        empty_dir = volumes.get(mount["name"], {}).get("emptyDir")
        at_shm = mount["mountPath"].rstrip("/") == SHM_PATH
        if at_shm and empty_dir is not None and empty_dir.get("medium") == "Memory":
            limit = empty_dir.get("sizeLimit")
            return _MemoryShm(None if limit is None else _bytes(limit))
    return None


def _bytes(quantity: str) -> int:
    try:
        return int(parse_quantity(quantity))  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ContainerConfigError(f"sizeLimit {quantity!r}: {exc}") from None


def rewrite_path(value: str, mounts: Mapping[str, Path]) -> str:
    """`value` with a leading mountPath replaced by its local directory."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        prefix = mount_path.rstrip("/")
        if value == prefix or value.startswith(prefix + "/"):
            return str(mounts[mount_path]) + value[len(prefix) :]
    return value


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def _expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables are substituted,
    undefined references stay as written, `$$` is a literal `$`."""

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        return env.get(name, match.group(0))

    return _REFERENCE.sub(substitute, value)


def _container_env(
    pod: Json,
    container: Json,
    sources: Sources,
    mounts: Mapping[str, Path],
    addresses: Addresses,
) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            ref = source["configMapRef"]
            data = _required(sources.config_map(namespace, ref["name"]), "configmap", ref)
            env.update({prefix + key: value for key, value in data.items()})
        elif "secretRef" in source:
            ref = source["secretRef"]
            secret = _required(sources.secret(namespace, ref["name"]), "secret", ref)
            env.update({prefix + key: value.decode() for key, value in secret.items()})
    for var in container.get("env") or []:
        value = _env_value(pod, var, sources, env, addresses)
        if value is not None:
            env[var["name"]] = rewrite_path(value, mounts)
    return env


def _env_value(
    pod: Json, var: Json, sources: Sources, defined: Mapping[str, str], addresses: Addresses
) -> str | None:
    if "valueFrom" not in var:
        return _expand(var.get("value", ""), defined)
    source = var["valueFrom"]
    namespace = pod["metadata"]["namespace"]
    if "fieldRef" in source:
        return field_value(pod, source["fieldRef"]["fieldPath"], addresses)
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        data = _required(sources.config_map(namespace, ref["name"]), "configmap", ref)
        return _key(data, ref, "configmap")
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        secret = _required(sources.secret(namespace, ref["name"]), "secret", ref)
        raw = _key(secret, ref, "secret")
        return None if raw is None else raw.decode()
    raise ContainerConfigError(f"env {var['name']}: unsupported valueFrom {sorted(source)}")


def field_value(pod: Json, field_path: str, addresses: Addresses) -> str:
    """The downward API's value of `field_path` for `pod`."""
    meta = pod["metadata"]
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": pod["spec"].get("nodeName"),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName"),
        "status.podIP": addresses.pod_ip,
        "status.hostIP": addresses.host_ip,
    }
    if field_path in simple:
        return str(simple[field_path] or "")
    labelled = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", field_path)
    if labelled:
        return str((meta.get(labelled.group(1)) or {}).get(labelled.group(2), ""))
    raise ContainerConfigError(f"unsupported fieldRef {field_path!r}")


def _required(data: Mapping[str, V] | None, kind: str, ref: Json) -> Mapping[str, V]:
    if data is None:
        if ref.get("optional"):
            return {}
        raise ContainerConfigError(f'{kind} "{ref["name"]}" not found')
    return data


def _key(data: Mapping[str, V], ref: Json, kind: str) -> V | None:
    if ref["key"] in data:
        return data[ref["key"]]
    if ref.get("optional"):
        return None
    raise ContainerConfigError(f'couldn\'t find key {ref["key"]} in {kind} "{ref["name"]}"')


def _materialize_volumes(pod: Json, pod_dir: Path, sources: Sources) -> dict[str, Path]:
    """Write each volume of the pod under pod_dir/volumes; return the first
    container's mountPath -> local path."""
    namespace = pod["metadata"]["namespace"]
    local: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        local[volume["name"]] = _materialize(volume, pod_dir / "volumes", namespace, sources)
    mounts: dict[str, Path] = {}
    for mount in first_container(pod).get("volumeMounts") or []:
        if mount["name"] not in local:
            raise ContainerConfigError(f"volumeMount {mount['name']!r} has no volume")
        path = local[mount["name"]]
        if mount.get("subPath"):
            path = path / mount["subPath"]
        mounts[mount["mountPath"]] = path
    return mounts


def _materialize(volume: Json, root: Path, namespace: str, sources: Sources) -> Path:
    name: str = volume["name"]
    target = root / name
    if "hostPath" in volume:
        return Path(volume["hostPath"]["path"])
    target.mkdir(parents=True, exist_ok=True)
    if "emptyDir" in volume:
        return target
    if "configMap" in volume:
        ref = volume["configMap"]
        data = _required(sources.config_map(namespace, ref["name"]), "configmap", ref)
        files = {key: value.encode() for key, value in data.items()}
    elif "secret" in volume:
        ref = {"name": volume["secret"]["secretName"], **volume["secret"]}
        files = dict(_required(sources.secret(namespace, ref["name"]), "secret", ref))
    else:
        kinds = sorted(set(volume) - {"name"})
        raise ContainerConfigError(f"volume {name!r}: unsupported type {kinds}")
    _write_files(target, files, ref)
    return target


def _write_files(target: Path, files: Mapping[str, bytes], ref: Json) -> None:
    mode = ref.get("defaultMode", 0o644)
    items = ref.get("items") or [{"key": key, "path": key} for key in files]
    for item in items:
        if item["key"] not in files:
            if ref.get("optional"):
                continue
            raise ContainerConfigError(f"key {item['key']!r} not found in {ref['name']!r}")
        path = target / item["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(files[item["key"]])
        path.chmod(item.get("mode", mode))


def _working_dir(container: Json, pod_dir: Path, mounts: Mapping[str, Path]) -> Path:
    working_dir: str | None = container.get("workingDir")
    if not working_dir:
        return pod_dir
    rewritten = Path(rewrite_path(working_dir, mounts))
    if rewritten != Path(working_dir) or rewritten.is_dir():
        rewritten.mkdir(parents=True, exist_ok=True)
        return rewritten
    local = pod_dir / "rootfs" / working_dir.lstrip("/")
    local.mkdir(parents=True, exist_ok=True)
    return local


def decode_secret(data: Mapping[str, str] | None) -> dict[str, bytes]:
    """A Secret's `data` (base64 values, as served) decoded."""
    return {key: base64.b64decode(value) for key, value in (data or {}).items()}


def inherited_env() -> dict[str, str]:
    """The host environment a pod's process starts from (it has no image):
    the kubelet's own, less the variables that would point it at this host's
    Kubernetes client configuration."""
    return {key: value for key, value in os.environ.items() if key not in {"KUBECONFIG"}}
