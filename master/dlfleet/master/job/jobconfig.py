"""job.yaml: everything `dlmaster --job-config` needs to run a job.

    name: quickstart            # job name; nodes of other jobs are refused
    platform: local             # local (default): dlworker processes on this machine;
                                # kubernetes: one Pod per node (see `kubernetes:`)
    nodes: {min: 1, max: 2}     # elastic range; `initial` (default max) start
    nproc_per_node: 1           # training processes per node
    command: train.py           # a script, relative to this file's directory
    args: ["--epochs", "2"]
    module: false               # true: `command` is a module (python -m)
    env: {}                     # extra environment for the training processes
    max_restarts: 3             # worker-group restarts per node before it fails
    step_timeout_s: 300         # watchdog: a rank that stops stepping this long is
                                # restarted (a hang); default off
    step_timeout_factor: 4      # learn each rank's bound under step_timeout_s: 4 x the
    step_timeout_min_s: 2       # longest gap between its step reports in the round, at
                                # least step_timeout_min_s (2); default off (fixed bound)
    diagnosis:                  # what a worker failure's cause decides (see
      enabled: true             # dlfleet/api/diagnosis_rules.yaml): a user error fails
      rules: []                 # the job at once, a hardware fault replaces the node,
                                # ...; `rules` (same form) are tried first; enabled:
                                # false restarts in place whatever happened
    node_check:                 # the pre-flight node check: before a node first trains,
      enabled: auto             # it times a matmul and all-reduces in pairs with other
      slow_factor: 2.0          # nodes (re-paired so a bad node is isolated, not its
      timeout_s: 30             # partner); a node slower than slow_factor x the median of
                                # the others, broken, or silent past timeout_s in a step
                                # (its matmul, one pair; its start-up gets 4x) is faulty and
                                # replaced before training. auto: on when nodes.max > 1. Two
                                # nodes are judged by their matmuls and timeouts only (one
                                # pair isolates neither)
    restart_loop:               # the restart-loop breaker: `failures` rounds failing
      failures: 3               # after restoring the same step, each having committed
      window: 2                 # at most `window` steps past it, make restores take an
                                # older step; with none older left the job fails with a
                                # diagnosis (the step, its leases, the last error).
                                # failures: 0 turns it off
    max_node_relaunches: 3      # replacements of dead nodes, for the whole job
    relaunch_delay_s: 2.0       # pause before a dead node is replaced
    rendezvous: {last_call_timeout_s: 1.0, join_timeout_s: 600, node_unit: 1}
    heartbeat: {interval_s: 2.0, timeout_s: 10.0}
    lease_timeout_s: 30.0       # a shard lease not renewed for this long is requeued
    workdir: .dlfleet/quickstart  # default .dlfleet/<name>, next to this file
    state_store: sqlite:///...  # default: sqlite file state.db in the workdir
    token_file: token.txt       # or `token:`; default: a fresh random token
    master: {host: 127.0.0.1, port: 0}
    http: {host: 127.0.0.1, port: 0, open_metrics: false}  # the master's /metrics and
                                # /api/v1/status (port 0: a free one); `http: null` turns it off;
                                # on kubernetes, a host beyond loopback (0.0.0.0) needs a fixed
                                # port, which the master's Service names for Prometheus
    tls: {cert_file: master.crt, key_file: master.key}  # serve TLS only; nodes
                                # verify with ca_file (default: cert_file)
    display: auto               # auto | live | plain | off
    brain:                      # job metrics and resource plans (dlfleet.brain)
      mode: advise              # off | advise: store metrics, show plans | auto: carry
                                # them out (initial size, scaling, OOM memory, stragglers)
      address: null             # host:port of a dlbrain service; default: in-process
      db: null                  # the in-process brain's database; default
                                # sqlite:///.dlfleet/brain.db next to this file (shared by
                                # the jobs there: past runs seed a new run's plan)
      token_file: null          # the dlbrain service's token; default: the job's token
      signature: null           # "the same kind of job"; default: name + hash of command
      plan_interval_s: 10       # how often the master asks for a plan
      min_round_s: 60           # measuring time at a size before a scaling decision
      grow_share: 0.5           # grow while one more node adds this share of a node
    kubernetes:                 # platform: kubernetes only
      image: registry.example.com/train:1.0   # the training image (has dlworker)
      namespace: null           # default: the master Pod's own, else "default"
      kubeconfig: null          # default: in-cluster, else ~/.kube/config
      worker_command: [dlworker]
      working_dir: null         # the container's working directory
      resources: {requests: {cpu: "4", memory: 8Gi}, limits: {memory: 8Gi}}
      env: [{name: NCCL_DEBUG, value: WARN}]   # Kubernetes EnvVar objects
      volumes: []               # Kubernetes Volume objects
      volume_mounts: []         # Kubernetes VolumeMount objects
      node_selector: {}
      tolerations: []
      priority_class: null
      scheduler_name: null      # the worker Pods' schedulerName (a gang scheduler)
      service_account: null
      labels: {}
      annotations: {}
      image_pull_secrets: []
      master_service: null      # headless Service for the master; default <name>-master
      master_address: null      # what the Pods dial; default <service>.<namespace>.svc:<port>
      token_secret: null        # {name, key}: a Secret holding the token; default: the
                                # master creates <name>-dlfleet from the job's token
      pending_timeout_s: 600    # a Pod that cannot be scheduled this long, with fewer
                                # than nodes.min running, fails the job
      oom: {memory_factor: 1.5, memory_cap: 64Gi}  # a node OOMKilled is relaunched
                                # with its memory limit times the factor, capped
      shm_size: 8Gi             # the worker Pods' /dev/shm (a memory-backed emptyDir):
                                # in-memory checkpoint images live there (a node's own
                                # and a peer's replicas); a container's is 64Mi without it.
                                # Its pages count against the Pod's memory limit

Unknown keys are errors (a typo must not silently mean "default"). Relative
paths are relative to the directory of the job.yaml. Every error names the
field and the reason; `dlmaster` turns them into exit code 2 before anything
starts.

Read in the job supervisor process, and by `dlmaster status` / `dlmaster scale`
(`control.py`) to find a running job.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dlfleet.api.diagnosis import RuleError, parse_rules
from dlfleet.api.errors import InvalidArgument
from dlfleet.master.settings import (
    FOR_JOB,
    RunSettings,
    check_heartbeat,
    check_node_unit,
    check_nodes,
)

_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
Seconds = Annotated[float, Field(gt=0, le=86_400)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodesConfig(_Strict):
    min: int = Field(default=1, ge=1, le=10_000)
    max: int | None = Field(default=None, ge=1, le=10_000)
    initial: int | None = Field(default=None, ge=1, le=10_000)

    @model_validator(mode="after")
    def _ordered(self) -> NodesConfig:
        with _as_value_error():
            check_nodes(self.min, self.maximum, names=("min", "max"))
        if self.initial is not None and not self.min <= self.initial <= self.maximum:
            raise ValueError(f"initial ({self.initial}) must lie in {self.min}..{self.maximum}")
        return self

    @property
    def maximum(self) -> int:
        return self.max if self.max is not None else self.min

    @property
    def start(self) -> int:
        return self.initial if self.initial is not None else self.maximum


@contextlib.contextmanager
def _as_value_error() -> Iterator[None]:
    """A check of `dlfleet.master.settings` inside a validator: pydantic
    reports a ValueError at the field it validates."""
    try:
        yield
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None


class RendezvousConfig(_Strict):
    last_call_timeout_s: float = Field(default=FOR_JOB.last_call_timeout_s, ge=0, le=3_600)
    join_timeout_s: Seconds = FOR_JOB.join_timeout_s
    node_unit: int = Field(default=FOR_JOB.node_unit, ge=1)


class RestartLoopConfig(_Strict):
    failures: int = Field(default=FOR_JOB.restart_loop_failures, ge=0, le=1_000)
    window: int = Field(default=FOR_JOB.restart_loop_window, ge=0, le=1_000_000)


class HeartbeatConfig(_Strict):
    interval_s: Seconds = FOR_JOB.heartbeat_interval_s
    timeout_s: Seconds = FOR_JOB.heartbeat_timeout_s

    @model_validator(mode="after")
    def _timeout_longer(self) -> HeartbeatConfig:
        with _as_value_error():
            check_heartbeat(self.interval_s, self.timeout_s, names=("interval_s", "timeout_s"))
        return self


class MasterAddress(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65_535)


class HttpConfig(_Strict):
    """The master's HTTP endpoint; `open_metrics` serves /metrics without the
    job token (for a scraper), everything else always needs it."""

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65_535)
    open_metrics: bool = False

    def beyond_loopback(self) -> bool:
        """Whether the endpoint listens where others can reach it."""
        if self.host == "localhost":
            return False
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return True  # a host name: some interface of this machine


class TlsConfig(_Strict):
    cert_file: Path
    key_file: Path
    ca_file: Path | None = None


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|K|M|G|T|P|E|m)?$")
_SUFFIX = {
    None: 1, "m": 1e-3, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip


def parse_quantity(value: str | int | float) -> float:
    """A Kubernetes quantity ("8Gi", "500m", "1.5G", 1024) as a number."""
    if isinstance(value, int | float):
        return float(value)
    match = _QUANTITY.match(value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (like 8Gi, 512Mi, 500m, 2)")
    return float(match.group(1)) * _SUFFIX[match.group(2)]


def format_bytes_quantity(value: int) -> str:
    """Bytes as a Kubernetes quantity, in whole MiB."""
    return f"{max(1, -(-value // 2**20))}Mi"


# The worker Pods' /dev/shm, where in-memory checkpoint images live: room for
# a node's own images and a peer's replicas of a model of a few GB.
DEFAULT_SHM_SIZE = "8Gi"
MIN_SHM_BYTES = 64 * 2**20  # what a container's /dev/shm has without a volume


class TokenSecret(_Strict):
    name: str = Field(min_length=1)
    key: str = "token"


class OomPolicy(_Strict):
    memory_factor: float = Field(default=1.5, ge=1.0, le=16.0)
    memory_cap: str = "64Gi"

    @field_validator("memory_cap")
    @classmethod
    def _quantity(cls, value: str) -> str:
        parse_quantity(value)
        return value

    @property
    def memory_cap_bytes(self) -> int:
        return int(parse_quantity(self.memory_cap))


class KubernetesConfig(_Strict):
    image: str = Field(min_length=1)
    namespace: str | None = None
    kubeconfig: Path | None = None
    worker_command: list[str] = Field(default_factory=lambda: ["dlworker"], min_length=1)
    working_dir: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    resources: dict[str, dict[str, str]] = Field(default_factory=dict)
    env: list[dict[str, Any]] = Field(default_factory=list)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    priority_class: str | None = None
    # The scheduler the worker Pods ask for (a gang scheduler's, say); None:
    # the cluster's default.
    scheduler_name: str | None = None
    service_account: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    image_pull_secrets: list[str] = Field(default_factory=list)
    master_service: str | None = None
    master_address: str | None = None
    token_secret: TokenSecret | None = None
    pending_timeout_s: Seconds = 600.0
    termination_grace_s: int = Field(default=30, ge=0, le=3_600)
    oom: OomPolicy = OomPolicy()
    shm_size: str = DEFAULT_SHM_SIZE

    @field_validator("shm_size")
    @classmethod
    def _shm_size(cls, value: str) -> str:
        if parse_quantity(value) < MIN_SHM_BYTES:
            raise ValueError(f"{value} is less than the 64Mi a container's /dev/shm has without it")
        return value

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        for kind, amounts in value.items():
            if kind not in ("requests", "limits"):
                raise ValueError(f"{kind!r}: expected requests or limits")
            for name, amount in amounts.items():
                try:
                    parse_quantity(amount)
                except ValueError as exc:
                    raise ValueError(f"{kind}.{name}: {exc}") from None
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for item in value:
            if not isinstance(item.get("name"), str):
                raise ValueError(f"{item!r}: every entry needs a name (a Kubernetes EnvVar)")
        return value

    @property
    def memory_bytes(self) -> int | None:
        """The worker container's memory limit (else request), if set."""
        for kind in ("limits", "requests"):
            amount = self.resources.get(kind, {}).get("memory")
            if amount is not None:
                return int(parse_quantity(amount))
        return None


class BrainConfig(_Strict):
    mode: Literal["off", "advise", "auto"] = "advise"
    address: str | None = None
    db: str | None = None
    token_file: Path | None = None
    signature: str | None = Field(default=None, min_length=1, max_length=200)
    plan_interval_s: Seconds = 10.0
    min_round_s: float = Field(default=60.0, ge=0, le=86_400)
    grow_share: float = Field(default=0.5, ge=0.4, le=0.7)


class DiagnosisConfig(_Strict):
    enabled: bool = True
    rules: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("rules")
    @classmethod
    def _rules(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        try:
            parse_rules(value, source="diagnosis.rules")
        except RuleError as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> DiagnosisConfig:
        if self.rules and not self.enabled:
            raise ValueError("rules are given but diagnosis is off (enabled: false)")
        return self

    def agent_flags(self) -> list[str]:
        """The `dlworker` flags that carry this section."""
        if not self.enabled:
            return ["--diagnosis", "off"]
        if self.rules:
            return ["--diagnosis-rules", json.dumps(self.rules, separators=(",", ":"))]
        return []


class NodeCheckConfig(_Strict):
    enabled: Literal["auto"] | bool = "auto"
    slow_factor: float = Field(default=FOR_JOB.node_check_slow_factor, gt=1.0, le=100.0)
    timeout_s: float = Field(default=FOR_JOB.node_check_timeout_s, ge=0.1, le=3_600)

    def active(self, nodes: NodesConfig) -> bool:
        """Whether the job's nodes check: `auto` means when it can have several."""
        return nodes.maximum > 1 if self.enabled == "auto" else bool(self.enabled)


class JobConfig(_Strict):
    name: str
    platform: Literal["local", "kubernetes"] = "local"
    nodes: NodesConfig = NodesConfig()
    nproc_per_node: int = Field(default=1, ge=1, le=1_024)
    command: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)
    module: bool = False
    env: dict[str, str] = Field(default_factory=dict)
    max_restarts: int = Field(default=3, ge=0, le=1_000)
    step_timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    step_timeout_factor: float | None = Field(default=None, ge=2, le=1_000)
    step_timeout_min_s: float | None = Field(default=None, gt=0, le=86_400)
    diagnosis: DiagnosisConfig = DiagnosisConfig()
    node_check: NodeCheckConfig = NodeCheckConfig()
    restart_loop: RestartLoopConfig = RestartLoopConfig()
    max_node_relaunches: int = Field(default=3, ge=0, le=1_000)
    relaunch_delay_s: float = Field(default=2.0, ge=0, le=3_600)
    rendezvous: RendezvousConfig = RendezvousConfig()
    heartbeat: HeartbeatConfig = HeartbeatConfig()
    lease_timeout_s: Seconds = FOR_JOB.lease_timeout_s
    workdir: Path | None = None
    state_store: str | None = None
    token: str | None = Field(default=None, min_length=1)
    token_file: Path | None = None
    master: MasterAddress = MasterAddress()
    http: HttpConfig | None = HttpConfig()
    tls: TlsConfig | None = None
    display: Literal["auto", "live", "plain", "off"] = "auto"
    brain: BrainConfig = BrainConfig()
    kubernetes: KubernetesConfig | None = None
    # Where the job.yaml lies; set by `load_job_config`, not by the file.
    base_dir: Path = Field(default_factory=Path.cwd, exclude=True)

    @field_validator("name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                f"{value!r} is not a valid job name: lowercase letters, digits and '-', "
                "at most 63 characters, starting and ending with a letter or digit"
            )
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise ValueError(f"{key!r} is not an environment variable name")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> JobConfig:
        if self.token is not None and self.token_file is not None:
            raise ValueError("give either token or token_file, not both")
        if self.platform == "kubernetes" and self.kubernetes is None:
            raise ValueError("platform kubernetes needs a kubernetes: section (at least image)")
        if self.platform != "kubernetes" and self.kubernetes is not None:
            raise ValueError("a kubernetes: section needs platform: kubernetes")
        http = self.http
        kube = self.platform == "kubernetes"
        if kube and http is not None and http.beyond_loopback() and http.port == 0:
            raise ValueError(
                f"http.port: on kubernetes an endpoint on {http.host} needs a fixed port "
                "(the master Pod's containerPort and its Service's scrape annotations name it)"
            )
        learned = self.step_timeout_factor is not None or self.step_timeout_min_s is not None
        if learned and self.step_timeout_s is None:
            raise ValueError(
                "step_timeout_factor and step_timeout_min_s need step_timeout_s (the ceiling)"
            )
        if self.step_timeout_min_s is not None and self.step_timeout_factor is None:
            raise ValueError("step_timeout_min_s needs step_timeout_factor (a learned bound)")
        if (
            self.step_timeout_min_s is not None
            and self.step_timeout_s is not None
            and self.step_timeout_min_s > self.step_timeout_s
        ):
            raise ValueError(
                f"step_timeout_min_s {self.step_timeout_min_s:g} is over "
                f"step_timeout_s {self.step_timeout_s:g}"
            )
        with _as_value_error():
            check_node_unit(
                self.rendezvous.node_unit,
                self.nodes.min,
                self.nodes.maximum,
                name="rendezvous.node_unit",
            )
        return self

    # ------------------------------------------------------------ resolved

    @property
    def master_settings(self) -> RunSettings:
        """What this job's master runs with (`RunSettings.to_argv` starts it)."""
        return RunSettings.for_job(
            lease_timeout_s=self.lease_timeout_s,
            heartbeat_interval_s=self.heartbeat.interval_s,
            heartbeat_timeout_s=self.heartbeat.timeout_s,
            min_nodes=self.nodes.min,
            max_nodes=self.nodes.maximum,
            node_unit=self.rendezvous.node_unit,
            last_call_timeout_s=self.rendezvous.last_call_timeout_s,
            join_timeout_s=self.rendezvous.join_timeout_s,
            node_check_slow_factor=self.node_check.slow_factor,
            node_check_timeout_s=self.node_check.timeout_s,
            restart_loop_failures=self.restart_loop.failures,
            restart_loop_window=self.restart_loop.window,
        )

    def agent_step_timeout_flags(self) -> list[str]:
        """The watchdog's flags for dlworker."""
        flags: list[str] = []
        if self.step_timeout_s is not None:
            flags += ["--step-timeout", str(self.step_timeout_s)]
        if self.step_timeout_factor is not None:
            flags += ["--step-timeout-factor", str(self.step_timeout_factor)]
        if self.step_timeout_min_s is not None:
            flags += ["--step-timeout-min", str(self.step_timeout_min_s)]
        return flags

    def path(self, value: Path) -> Path:
        return value if value.is_absolute() else (self.base_dir / value)

    @property
    def work_dir(self) -> Path:
        return self.path(self.workdir or Path(".dlfleet") / self.name)

    @property
    def store_url(self) -> str:
        return self.state_store or f"sqlite:///{self.work_dir / 'state.db'}"

    @property
    def brain_db_url(self) -> str:
        return self.brain.db or f"sqlite:///{self.path(Path('.dlfleet') / 'brain.db')}"

    @property
    def tls_ca_file(self) -> Path | None:
        """The PEM file clients verify the master with."""
        if self.tls is None:
            return None
        return self.path(self.tls.ca_file or self.tls.cert_file)

    def agent_node_check_flags(self) -> list[str]:
        """The `dlworker` flag that turns the node check on, if it is."""
        return ["--node-check"] if self.node_check.active(self.nodes) else []

    @property
    def script(self) -> str:
        """The training script as dlworker gets it: a module name stays as is;
        a relative script path is made absolute against the job.yaml, except
        on Kubernetes, where it is a path in the training image."""
        if self.module or self.platform == "kubernetes":
            return self.command
        return str(self.path(Path(self.command)))


def load_job_config(path: Path) -> JobConfig:
    """Read and validate a job.yaml; `InvalidArgument` names what is wrong."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"{path}: {exc.strerror}") from None
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path}: expected a mapping of settings at the top level")
    # The folder the path names, its links not followed: a ConfigMap volume
    # makes job.yaml a link into a hidden folder (..data), and the paths
    # job.yaml names relative to itself mean the folder it was mounted in.
    base_dir = Path(os.path.abspath(path)).parent
    return parse_job_config(data, base_dir=base_dir, source=str(path))


def parse_job_config(
    data: dict[str, Any], *, base_dir: Path, source: str = "job.yaml"
) -> JobConfig:
    if "base_dir" in data:
        raise InvalidArgument(f"{source}: base_dir: not a setting (paths are relative to the file)")
    try:
        config = JobConfig.model_validate({**data, "base_dir": base_dir})
    except ValidationError as exc:
        raise InvalidArgument(f"{source}: {_describe(exc)}") from None
    local_script = not config.module and config.platform == "local"
    if local_script and not Path(config.script).is_file():
        raise InvalidArgument(f"{source}: command: no such script {config.script}")
    if config.token_file is not None:
        token_path = config.path(config.token_file)
        try:
            token = token_path.read_text().strip()
        except OSError as exc:
            raise InvalidArgument(f"{source}: token_file: {token_path}: {exc.strerror}") from None
        if not token:
            raise InvalidArgument(f"{source}: token_file: {token_path} is empty")
    if config.tls is not None:
        for name in ("cert_file", "key_file", "ca_file"):
            value = getattr(config.tls, name)
            if value is not None and not config.path(value).is_file():
                raise InvalidArgument(f"{source}: tls.{name}: no such file {config.path(value)}")
    return config


def _describe(exc: ValidationError) -> str:
    """One line per problem: `field.sub: reason`."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown setting"
        elif error["type"] == "missing":
            message = "required"
        lines.append(f"{where}: {message}")
    return "; ".join(lines)
