"""How the job supervisor builds what it drives: the master process, the
client that asks it how the job stands, the platform that runs the nodes,
and the link to the brain.

`JobRunner` takes a `Wiring`; `PRODUCTION` builds the real ones, and the
tests hand it fakes (tests/fakes/job.py) that follow the protocols here.

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dlfleet.api.client import MasterClient, RetryPolicy
from dlfleet.api.env import RESOURCE_ENV
from dlfleet.api.v1 import job_pb2
from dlfleet.master.job.brain_link import BrainLink
from dlfleet.master.job.jobconfig import JobConfig
from dlfleet.master.job.platform import Platform
from dlfleet.master.job.platform.local import LocalPlatform
from dlfleet.master.job.supervised import SupervisedMaster
from dlfleet.master.job.tally import SupervisorTally

if TYPE_CHECKING:
    from dlfleet.master.job.platform.resource_link import ResourceLink

# The runner asks the master once per poll and, while it is down, keeps the
# last answer: one short attempt, no retries.
_NO_RETRY = RetryPolicy(attempts=1, max_backoff_s=0.1, total_budget_s=2.0)

OnLine = Callable[[str, str], None]  # a line of a child's output: (source, text)


class MasterProcess(Protocol):
    """The job's master as the runner drives it (`SupervisedMaster`)."""

    @property
    def address(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def pid(self) -> int: ...
    @property
    def restarts(self) -> int: ...
    @property
    def http_url(self) -> str: ...
    @property
    def log_dir(self) -> Path: ...
    @property
    def last_line(self) -> str: ...
    def start(self, forget_nodes: bool = False) -> None: ...
    def wait_listening(self, timeout_s: float) -> bool: ...
    def wait_exit(self, timeout_s: float) -> int | None: ...
    def poll(self) -> int | None: ...
    def stop(self, grace_s: float = 5.0) -> None: ...


class MasterStatusClient(Protocol):
    """The runner's one question to its master (`MasterClient`)."""

    def master_status(
        self,
        supervisor: job_pb2.SupervisorTotals | None = None,
        job: job_pb2.JobStatus | None = None,
    ) -> job_pb2.MasterStatus: ...
    def close(self) -> None: ...


def supervised_master(
    config: JobConfig, port: int, token: str, on_line: OnLine, http_port: int
) -> MasterProcess:
    return SupervisedMaster(config, port=port, token=token, on_line=on_line, http_port=http_port)


def master_client(address: str, token: str, tls_ca: bytes | None) -> MasterStatusClient:
    return MasterClient(address, token=token, timeout_s=2.0, retry=_NO_RETRY, tls_ca=tls_ca)


def make_platform(
    config: JobConfig, master: MasterProcess, token: str, on_line: OnLine
) -> Platform[Any]:
    if config.platform == "kubernetes":
        from dlfleet.master.job.platform.kubernetes import KubernetesPlatform

        return KubernetesPlatform(config, master_port=master.port, token=token)
    return LocalPlatform(config, master=master.address, token=token, on_line=on_line)


def resource_link(config: JobConfig, platform: Platform[Any]) -> ResourceLink | None:
    """The DLFleetJob this run is for, when the controller started it (on
    the kubernetes platform, `$DLFLEET_RESOURCE` names it)."""
    name = os.environ.get(RESOURCE_ENV)
    if not name or config.platform != "kubernetes":
        return None
    from dlfleet.master.job.platform.kubernetes import KubernetesPlatform
    from dlfleet.master.job.platform.resource_link import ResourceLink

    assert isinstance(platform, KubernetesPlatform)
    return ResourceLink(platform.api, platform.namespace, name)


@dataclass(frozen=True)
class Wiring:
    """How the runner builds its collaborators, once a run knows its port
    and token: the real ones by default, fakes in tests (tests/fakes/job.py)."""

    master: Callable[[JobConfig, int, str, OnLine, int], MasterProcess] = supervised_master
    client: Callable[[str, str, bytes | None], MasterStatusClient] = master_client
    platform: Callable[[JobConfig, MasterProcess, str, OnLine], Platform[Any]] = make_platform
    brain: Callable[[JobConfig, str, SupervisorTally], BrainLink] = BrainLink
    resource: Callable[[JobConfig, Platform[Any]], ResourceLink | None] = resource_link


PRODUCTION = Wiring()
