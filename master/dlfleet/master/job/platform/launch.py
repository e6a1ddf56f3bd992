"""A node as the command that starts it: the `dlworker` command line and the
environment its agent needs, the same on every platform.

A platform adds only what is its own: the local one the interpreter that runs
the agent, its log directory and the token's value; Kubernetes the image's
`worker_command` and the environment it takes from the API (the token's
Secret, the Pod's IP).

Lives in the job supervisor process (`dlmaster --job-config`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dlfleet.api.env import TLS_CA_ENV
from dlfleet.master.job.jobconfig import JobConfig


@dataclass(frozen=True)
class NodeLaunch:
    argv: list[str]
    # What dlfleet sets; it goes after (wins over) the job's own `env`.
    env: dict[str, str]


def node_launch(
    config: JobConfig,
    node_name: str,
    *,
    program: Sequence[str],
    master: str,
    ca_file: str | None,
    flags: Sequence[str] = (),
) -> NodeLaunch:
    """How to start node `node_name`: `program` (what runs `dlworker`) with
    the job's flags, then the platform's `flags`; `ca_file` is where the node
    finds the certificate to verify the master with (None: no TLS)."""
    argv = [
        *program,
        "--master", master,
        "--job-name", config.name,
        "--node-name", node_name,
        "--nnodes", f"{config.nodes.min}:{config.nodes.maximum}",
        "--nproc-per-node", str(config.nproc_per_node),
        "--max-restarts", str(config.max_restarts),
        *flags,
        *config.agent_step_timeout_flags(),
        *config.diagnosis.agent_flags(),
        *config.agent_node_check_flags(),
    ]  # fmt: skip
    if config.module:
        argv.append("--module")
    argv += [config.script, *config.args]
    env = {"PYTHONUNBUFFERED": "1"}
    if ca_file is not None:
        env[TLS_CA_ENV] = ca_file
    return NodeLaunch(argv, env)
