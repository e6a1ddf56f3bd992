"""`dlworker`'s settings: torchrun's flags plus dlfleet's own, as one frozen value.

A user moves a job from `torchrun` to `dlworker` by changing the command name
and adding the master's address, so the flags keep torchrun's spellings (both
`--nproc-per-node` and `--nproc_per_node`), its defaults and its `PET_*`
environment variables. dlfleet's own settings come from `--master`,
`--token-file`, `--job-name`, `--node-name` or the `DLFLEET_*` variables.

Invariants:
- A flag always beats its environment variable, which beats the default.
- Everything after the training script is passed to it untouched, even when
  it looks like one of our flags (`train.py --lr 0.1 -m x`).
- Bad input raises `ConfigError` naming the flag (or the variable the value
  came from) and the problem; `config_or_exit` turns that into one line on
  stderr and exit code 2. Parsing reads the token file; for
  `--nproc-per-node auto|gpu`, asks torch how many accelerators there are;
  and without `--node-name`, once all else is good, takes a number for the
  default name that this process holds until it ends (`node_names`). Nothing
  else touches the machine, and the environment is an argument.

Deliberate differences from torchrun: abbreviated flags are not accepted (a
new flag can never change what an abbreviation means); per-rank maps in
`--redirects`/`--tee` may name local ranks above 9 but none beyond
`--nproc-per-node`; `cpu`/`auto` (without accelerators) are capped at
`MAX_AUTO_CPU_PROCESSES`; the run id is `--run-id` (torchrun's `--rdzv-id`
spelling is accepted too). torchrun's rendezvous flags (`--rdzv-*`,
`--standalone`, `--master-addr`...) are not accepted: the dlfleet master is
the rendezvous.
"""

from __future__ import annotations

import argparse
import enum
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NoReturn, TextIO

import yaml

from dlfleet.api.addresses import split_host_port
from dlfleet.api.diagnosis import (
    RuleError,
    RuleTable,
    default_table,
    parse_rules,
    restart_only_table,
)
from dlfleet.api.env import (
    DIAGNOSIS_ENV,
    DIAGNOSIS_RULES_ENV,
    JOB_ENV,
    MASTER_ENV,
    NODE_CHECK_ENV,
    NODE_NAME_ENV,
    SPARES_ENV,
    STEP_TIMEOUT_ENV,
    STEP_TIMEOUT_FACTOR_ENV,
    STEP_TIMEOUT_MIN_ENV,
    TOKEN_ENV,
)
from dlfleet.api.errors import InvalidArgument
from dlfleet.worker.address import LOCAL_ADDR_ENVS
from dlfleet.worker.agent.node_names import SEPARATOR, claim_number, numbered
from dlfleet.worker.agent.watchdog import DEFAULT_FLOOR_S, Bounds

# `--nproc-per-node cpu` on a 192-core host should not start 192 gloo ranks;
# an explicit integer is never capped.
MAX_AUTO_CPU_PROCESSES = 32


class ConfigError(InvalidArgument):
    """A flag or environment variable has a value `dlworker` cannot use."""

    def __init__(self, flag: str, problem: str) -> None:
        super().__init__(f"{flag}: {problem}")
        self.flag = flag
        self.problem = problem


class Std(enum.IntFlag):
    """Which standard streams of a worker go to a log file (torchrun's `Std`)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


_STD_VALUE = re.compile(r"^[0-3]$")
_STD_MAP = re.compile(r"^\d+:[0-3](,\d+:[0-3])*$")


@dataclass(frozen=True)
class StreamSpec:
    """torchrun's `--redirects`/`--tee` value: `"3"` applies to every local
    rank; `"0:1,1:2"` names ranks and leaves the others at `Std.NONE`."""

    default: Std = Std.NONE
    per_rank: tuple[tuple[int, Std], ...] = ()

    @classmethod
    def parse(cls, text: str) -> StreamSpec:
        """Raises ValueError for anything but torchrun's two forms."""
        text = text.strip()
        if _STD_VALUE.match(text):
            return cls(default=Std(int(text)))
        if _STD_MAP.match(text):
            pairs: dict[int, Std] = {}
            for item in text.split(","):
                rank, value = item.split(":")
                if int(rank) in pairs:
                    raise ValueError(f"local rank {int(rank)} is given twice in {text!r}")
                pairs[int(rank)] = Std(int(value))
            return cls(per_rank=tuple(sorted(pairs.items())))
        raise ValueError(
            f"{text!r} is neither 0..3 (1=stdout, 2=stderr, 3=both) nor a map like '0:1,1:2'"
        )

    def for_rank(self, local_rank: int) -> Std:
        for rank, value in self.per_rank:
            if rank == local_rank:
                return value
        return self.default

    def highest_rank(self) -> int:
        """The highest local rank named in a per-rank map, -1 if none."""
        return max((rank for rank, _ in self.per_rank), default=-1)


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _accelerator_count() -> int:
    # Imported here: only `--nproc-per-node auto|gpu` pays for importing torch.
    import torch

    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


@dataclass(frozen=True)
class HostProbe:
    """What parsing needs to know about this machine; tests pass their own."""

    hostname: Callable[[], str] = socket.gethostname
    cpu_count: Callable[[], int] = _usable_cpus
    accelerator_count: Callable[[], int] = _accelerator_count
    # job name -> the number this agent's default name takes among the agents
    # of the job on this host, held from now on (0: the hostname alone).
    claim_name_number: Callable[[str], int] = claim_number


@dataclass(frozen=True)
class AgentConfig:
    """Everything one `dlworker` needs to know before it talks to the master."""

    training_script: str
    master: str
    token: str = field(repr=False)
    training_script_args: tuple[str, ...] = ()
    min_nodes: int = 1
    max_nodes: int = 1
    # Whether --nnodes (or PET_NNODES) was given: only then is the range told
    # to the master, whose own range decides (it warns where they differ).
    nnodes_given: bool = False
    nproc_per_node: int = 1
    max_restarts: int = 0
    monitor_interval_s: float = 0.1
    role: str = "default"
    run_id: str = "none"
    module: bool = False
    no_python: bool = False
    log_dir: Path | None = None
    redirects: StreamSpec = StreamSpec()
    tee: StreamSpec = StreamSpec()
    job_name: str = "job"
    node_name: str = "localhost"
    # The address this node publishes (store, keeper, collectives); None:
    # chosen from the route to the master (dlfleet.worker.address).
    local_addr: str | None = None
    step_timeout_s: float = 0.0  # 0: no watchdog
    # A learned watchdog bound under step_timeout_s (dlfleet.worker.agent.watchdog):
    # factor x a rank's longest gap between step reports, at least the floor.
    step_timeout_factor: float = 0.0  # 0: the fixed bound only
    step_timeout_min_s: float | None = None  # None: DEFAULT_FLOOR_S, at most the ceiling
    # Processes started ahead (interpreter and the script's imports done),
    # each ready to take over a failed rank at once; only for scripts that
    # run their training through `dlfleet.elastic.run`.
    spares: int = 1
    # What a worker failure's cause decides (dlfleet.api.diagnosis); the
    # restart-only table is torchrun's policy: restart in place, whatever it was.
    diagnosis: RuleTable = field(default_factory=default_table)
    # The pre-flight node check before the node first trains (see
    # `dlfleet.worker.agent.node_check`); the master judges and pairs the nodes.
    node_check: bool = False

    def step_bounds(self) -> Bounds | None:
        """The watchdog's bounds; None when it is off."""
        if not self.step_timeout_s:
            return None
        floor = self.step_timeout_min_s or min(DEFAULT_FLOOR_S, self.step_timeout_s)
        return Bounds(self.step_timeout_s, self.step_timeout_factor, floor)

    def __post_init__(self) -> None:
        if not self.training_script:
            raise ConfigError("training_script", "missing: give the script to run after the flags")
        if not 0 < self.min_nodes <= self.max_nodes:
            raise ConfigError(
                "--nnodes", f"need 0 < MIN <= MAX, got MIN={self.min_nodes} MAX={self.max_nodes}"
            )
        if self.nproc_per_node < 1:
            raise ConfigError("--nproc-per-node", f"must be at least 1, got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ConfigError("--max-restarts", f"must be >= 0, got {self.max_restarts}")
        if not self.monitor_interval_s > 0:
            raise ConfigError(
                "--monitor-interval", f"must be > 0 seconds, got {self.monitor_interval_s}"
            )
        if self.module and self.no_python:
            raise ConfigError("--no-python", "cannot be combined with -m/--module")
        if self.step_timeout_s < 0:
            raise ConfigError("--step-timeout", f"must be >= 0 seconds, got {self.step_timeout_s}")
        if self.step_timeout_factor and not self.step_timeout_s:
            raise ConfigError(
                "--step-timeout-factor", "needs --step-timeout (the bound's ceiling) as well"
            )
        if self.step_timeout_factor != 0 and not self.step_timeout_factor >= 2:
            raise ConfigError(
                "--step-timeout-factor", f"must be 0 (off) or >= 2, got {self.step_timeout_factor}"
            )
        floor = self.step_timeout_min_s
        if floor is not None and not self.step_timeout_factor:
            raise ConfigError("--step-timeout-min", "needs --step-timeout-factor as well")
        if floor is not None and not 0 < floor <= self.step_timeout_s:
            raise ConfigError(
                "--step-timeout-min",
                f"must be > 0 and at most --step-timeout {self.step_timeout_s:g}s, got {floor:g}",
            )
        if not 0 <= self.spares <= 64:
            raise ConfigError("--spares", f"must be in 0..64, got {self.spares}")
        for name, spec in (("--redirects", self.redirects), ("--tee", self.tee)):
            if spec.highest_rank() >= self.nproc_per_node:
                raise ConfigError(
                    name,
                    f"names local rank {spec.highest_rank()} but --nproc-per-node is "
                    f"{self.nproc_per_node}",
                )
        try:
            split_host_port(self.master)
        except ValueError as exc:
            raise ConfigError("--master", str(exc)) from None
        for name, value in (
            ("--role", self.role),
            ("--run-id", self.run_id),
            ("--job-name", self.job_name),
            ("--node-name", self.node_name),
        ):
            if not value.strip():
                raise ConfigError(name, "must not be empty")
        if not self.token:
            raise ConfigError("--token-file", f"the job token is empty (or set ${TOKEN_ENV})")


class _Parser(argparse.ArgumentParser):
    """Raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        if "training_script" in message:
            raise ConfigError("training_script", "missing: give the script to run after the flags")
        bad_value = re.match(r"argument (\S+): (.*)", message)
        if bad_value:
            raise ConfigError(bad_value.group(1).split("/")[0], bad_value.group(2))
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            raise ConfigError(
                unknown.group(1),
                "unknown flag (dlworker takes torchrun's worker flags; the dlfleet master is "
                "the rendezvous)",
            )
        raise ConfigError("arguments", message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="dlworker",
        description="dlfleet's node agent: torchrun's flags, with the dlfleet master as the "
        "rendezvous.",
        allow_abbrev=False,
    )
    add = p.add_argument
    add(
        "--nnodes",
        help="number of nodes, N or MIN:MAX (env PET_NNODES): the master's --min-nodes and "
        "--max-nodes decide the world size; a range that differs is warned about, one that "
        "cannot overlap it is refused",
    )
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        help="workers per node: N, cpu, gpu or auto (default 1; env PET_NPROC_PER_NODE)",
    )
    add(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        help="worker group restarts before failing (default 0; env PET_MAX_RESTARTS)",
    )
    add(
        "--monitor-interval",
        "--monitor_interval",
        dest="monitor_interval",
        help="seconds between checks of the workers (default 0.1; env PET_MONITOR_INTERVAL)",
    )
    add("--role", help="role of the workers (default 'default'; env PET_ROLE)")
    add(
        "--run-id",
        "--run_id",
        "--rdzv-id",
        "--rdzv_id",
        dest="run_id",
        help="user-defined run id (default 'none'; env PET_RUN_ID)",
    )
    add(
        "-m",
        "--module",
        action="store_const",
        const=True,
        help="run the script as a module, like 'python -m' (env PET_MODULE)",
    )
    add(
        "--no-python",
        "--no_python",
        dest="no_python",
        action="store_const",
        const=True,
        help="run the script directly, not with python (env PET_NO_PYTHON)",
    )
    add("--log-dir", "--log_dir", dest="log_dir", help="base folder for logs (env PET_LOG_DIR)")
    add(
        "-r",
        "--redirects",
        help="streams to redirect into log files: 0..3 or '0:1,1:2' (env PET_REDIRECTS)",
    )
    add("-t", "--tee", help="streams to copy into log files: like --redirects (env PET_TEE)")
    add("--master", help=f"the dlfleet master, HOST:PORT (env {MASTER_ENV})")
    add(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        help=(
            "the address the other nodes reach this node at (default: the source address of "
            f"this host's route to the master; env {' or '.join(LOCAL_ADDR_ENVS)})"
        ),
    )
    add("--token-file", dest="token_file", help=f"file holding the job token (or ${TOKEN_ENV})")
    add("--job-name", dest="job_name", help=f"the job to join (default 'job'; env {JOB_ENV})")
    add(
        "--node-name",
        dest="node_name",
        help=(
            f"this node's name (env {NODE_NAME_ENV}); default: the hostname, and for each "
            f"further dlworker of the job running on this host HOSTNAME{SEPARATOR}1, "
            f"HOSTNAME{SEPARATOR}2, ... (the lowest number none of them holds: a dlworker "
            "started again after its predecessor ended takes its name back, and so replaces "
            "it at the master at once)"
        ),
    )
    add(
        "--step-timeout",
        dest="step_timeout",
        help=(
            "restart the workers when a rank that has trained makes no step for this many "
            f"seconds, a hang (default off; env {STEP_TIMEOUT_ENV})"
        ),
    )
    add(
        "--step-timeout-factor",
        dest="step_timeout_factor",
        help=(
            "learn each rank's bound instead: once it has reported steps a while in a round, "
            "FACTOR x the longest gap between its reports, at least --step-timeout-min and at "
            f"most --step-timeout (default 0: off; >= 2; env {STEP_TIMEOUT_FACTOR_ENV})"
        ),
    )
    add(
        "--step-timeout-min",
        dest="step_timeout_min",
        help=(
            f"the least learned bound, seconds (default {DEFAULT_FLOOR_S:g}; "
            f"env {STEP_TIMEOUT_MIN_ENV})"
        ),
    )
    add(
        "--spares",
        help=(
            "spare worker processes kept started for in-process restarts (scripts that use "
            f"dlfleet.elastic.run; default 1; env {SPARES_ENV})"
        ),
    )
    add(
        "--diagnosis",
        choices=("on", "off"),
        help=(
            "on (default): act on a failure's cause (fail the job at once for a user error, "
            "replace the node for a hardware one...); off: always restart in place "
            f"(env {DIAGNOSIS_ENV})"
        ),
    )
    add(
        "--diagnosis-rules",
        dest="diagnosis_rules",
        help=(
            "more diagnosis rules, tried before the shipped ones: a YAML/JSON list inline, "
            f"or a file holding one (env {DIAGNOSIS_RULES_ENV})"
        ),
    )
    add(
        "--node-check",
        dest="node_check",
        action="store_const",
        const=True,
        help=(
            "before this node first trains, time a matmul on its device and all-reduces in "
            "pairs with other nodes, as the master orders; a node the master finds slow "
            "(slower than its slow factor x the median) or broken exits with code 6, to be "
            f"replaced (env {NODE_CHECK_ENV}=1; dlmaster --job-config sets it by job.yaml "
            "node_check)"
        ),
    )
    add("training_script", help="the training script (or module, with -m), then its arguments")
    add("training_script_args", nargs=argparse.REMAINDER)
    return p


@dataclass(frozen=True)
class _Value:
    text: str
    source: str  # the flag or variable it came from, for error messages


class _Sources:
    """Picks each setting from its flag, then its environment variables."""

    def __init__(self, args: argparse.Namespace, environ: Mapping[str, str]) -> None:
        self._args = args
        self._environ = environ

    def get(self, dest: str, flag: str, *env_names: str) -> _Value | None:
        value = getattr(self._args, dest)
        if value is not None:
            return _Value(str(value), flag)
        for name in env_names:
            text = self._environ.get(name, "")
            if text.strip():
                return _Value(text, name)
        return None

    def flag(self, dest: str, flag: str, env_name: str) -> bool:
        if getattr(self._args, dest) is not None:
            return True
        text = self._environ.get(env_name, "").strip().lower()
        if text in ("", "0", "false", "no", "off"):
            return False
        if text in ("1", "true", "yes", "on"):
            return True
        raise ConfigError(env_name, f"expected 0 or 1, got {text!r}")


def _int(value: _Value, minimum: int) -> int:
    try:
        number = int(value.text)
    except ValueError:
        raise ConfigError(value.source, f"expected an integer, got {value.text!r}") from None
    if number < minimum:
        raise ConfigError(value.source, f"must be >= {minimum}, got {number}")
    return number


def _nnodes(value: _Value) -> tuple[int, int]:
    parts = value.text.split(":")
    if len(parts) > 2:
        raise ConfigError(value.source, f"expected N or MIN:MAX, got {value.text!r}")
    try:
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise ConfigError(value.source, f"expected N or MIN:MAX, got {value.text!r}") from None
    if low < 1:
        raise ConfigError(value.source, f"MIN must be at least 1, got {low}")
    if low > high:
        raise ConfigError(value.source, f"MIN {low} is greater than MAX {high}")
    return low, high


def _nproc(value: _Value, probe: HostProbe) -> int:
    text = value.text.strip().lower()
    if text == "cpu":
        return max(1, min(probe.cpu_count(), MAX_AUTO_CPU_PROCESSES))
    if text in ("gpu", "auto"):
        accelerators = probe.accelerator_count()
        if accelerators > 0:
            return accelerators
        if text == "gpu":
            raise ConfigError(value.source, "'gpu' was asked for but no accelerator is available")
        return max(1, min(probe.cpu_count(), MAX_AUTO_CPU_PROCESSES))
    try:
        number = int(text)
    except ValueError:
        raise ConfigError(
            value.source, f"expected an integer, cpu, gpu or auto, got {value.text!r}"
        ) from None
    if number < 1:
        raise ConfigError(value.source, f"must be at least 1 process, got {number}")
    return number


def _number(value: _Value) -> float:
    try:
        number = float(value.text)
    except ValueError:
        raise ConfigError(value.source, f"expected a number, got {value.text!r}") from None
    if not 0 <= number < float("inf"):
        raise ConfigError(value.source, f"must be a finite number >= 0, got {value.text}")
    return number


def _seconds(value: _Value) -> float:
    try:
        seconds = float(value.text)
    except ValueError:
        raise ConfigError(value.source, f"expected seconds, got {value.text!r}") from None
    if not 0 < seconds < float("inf"):
        raise ConfigError(value.source, f"must be > 0 seconds, got {value.text}")
    return seconds


def _streams(value: _Value | None, nproc: int) -> StreamSpec:
    if value is None:
        return StreamSpec()
    try:
        spec = StreamSpec.parse(value.text)
    except ValueError as exc:
        raise ConfigError(value.source, str(exc)) from None
    if spec.highest_rank() >= nproc:
        raise ConfigError(
            value.source,
            f"names local rank {spec.highest_rank()} but there are only {nproc} processes",
        )
    return spec


def _token(sources: _Sources, environ: Mapping[str, str]) -> str:
    path = sources.get("token_file", "--token-file")
    if path is not None:
        try:
            token = Path(path.text).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError("--token-file", f"{path.text}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError("--token-file", f"{path.text}: not a UTF-8 text file") from None
        if not token:
            raise ConfigError("--token-file", f"{path.text} is empty")
        return token
    token = environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ConfigError("--token-file", f"no job token: pass --token-file or set ${TOKEN_ENV}")
    return token


def parse_args(
    argv: Sequence[str], environ: Mapping[str, str], probe: HostProbe | None = None
) -> AgentConfig:
    """`dlworker`'s command line and environment -> its settings.

    Raises ConfigError naming the offending flag or variable. `-h` prints the
    usage and raises SystemExit(0), as argparse does.
    """
    probe = probe or HostProbe()
    args = _parser().parse_args(list(argv))
    src = _Sources(args, environ)

    nnodes = src.get("nnodes", "--nnodes", "PET_NNODES")
    min_nodes, max_nodes = _nnodes(nnodes) if nnodes else (1, 1)
    nproc_value = src.get("nproc_per_node", "--nproc-per-node", "PET_NPROC_PER_NODE")
    nproc = _nproc(nproc_value, probe) if nproc_value else 1
    restarts = src.get("max_restarts", "--max-restarts", "PET_MAX_RESTARTS")
    interval = src.get("monitor_interval", "--monitor-interval", "PET_MONITOR_INTERVAL")
    role = src.get("role", "--role", "PET_ROLE")
    run_id = src.get("run_id", "--run-id", "PET_RUN_ID", "PET_RDZV_ID")
    log_dir = src.get("log_dir", "--log-dir", "PET_LOG_DIR")
    module = src.flag("module", "--module", "PET_MODULE")
    no_python = src.flag("no_python", "--no-python", "PET_NO_PYTHON")
    if module and no_python:
        raise ConfigError("--no-python", "cannot be combined with -m/--module")

    master = src.get("master", "--master", MASTER_ENV)
    if master is None:
        raise ConfigError(
            "--master", f"no master address: pass --master HOST:PORT or set ${MASTER_ENV}"
        )
    try:
        split_host_port(master.text)
    except ValueError as exc:
        raise ConfigError(master.source, str(exc)) from None
    job = src.get("job_name", "--job-name", JOB_ENV)
    node = src.get("node_name", "--node-name", NODE_NAME_ENV)
    local_addr = src.get("local_addr", "--local-addr", *LOCAL_ADDR_ENVS)
    step_timeout = src.get("step_timeout", "--step-timeout", STEP_TIMEOUT_ENV)
    step_factor = src.get("step_timeout_factor", "--step-timeout-factor", STEP_TIMEOUT_FACTOR_ENV)
    step_min = src.get("step_timeout_min", "--step-timeout-min", STEP_TIMEOUT_MIN_ENV)
    spares = src.get("spares", "--spares", SPARES_ENV)
    node_check = src.flag("node_check", "--node-check", NODE_CHECK_ENV)
    diagnosis = _diagnosis(
        src.get("diagnosis", "--diagnosis", DIAGNOSIS_ENV),
        src.get("diagnosis_rules", "--diagnosis-rules", DIAGNOSIS_RULES_ENV),
    )

    config = AgentConfig(
        training_script=str(args.training_script),
        training_script_args=tuple(str(a) for a in args.training_script_args),
        master=master.text.strip(),
        token=_token(src, environ),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nnodes_given=nnodes is not None,
        nproc_per_node=nproc,
        max_restarts=_int(restarts, 0) if restarts else 0,
        monitor_interval_s=_seconds(interval) if interval else 0.1,
        role=role.text if role else "default",
        run_id=run_id.text if run_id else "none",
        module=module,
        no_python=no_python,
        log_dir=Path(log_dir.text) if log_dir else None,
        redirects=_streams(src.get("redirects", "--redirects", "PET_REDIRECTS"), nproc),
        tee=_streams(src.get("tee", "--tee", "PET_TEE"), nproc),
        job_name=job.text if job else "job",
        node_name=node.text if node else probe.hostname(),
        local_addr=local_addr.text.strip().strip("[]") if local_addr else None,
        step_timeout_s=_seconds(step_timeout) if step_timeout else 0.0,
        step_timeout_factor=_number(step_factor) if step_factor else 0.0,
        step_timeout_min_s=_seconds(step_min) if step_min else None,
        spares=_int(spares, 0) if spares else 1,
        diagnosis=diagnosis,
        node_check=node_check,
    )
    if node is None:
        # Taken last, once every setting is good: a number is held until the
        # process ends.
        number = probe.claim_name_number(config.job_name)
        if number:
            config = replace(config, node_name=numbered(config.node_name, number))
    return config


def _diagnosis(switch: _Value | None, rules: _Value | None) -> RuleTable:
    if switch is not None and switch.text not in ("on", "off"):
        raise ConfigError(switch.source, f"must be on or off, got {switch.text!r}")
    if switch is not None and switch.text == "off":
        if rules is not None:
            raise ConfigError(rules.source, "cannot add rules with --diagnosis off")
        return restart_only_table()
    if rules is None:
        return default_table()
    text = rules.text.strip()
    if not text.startswith(("[", "{", "-")):
        try:
            text = Path(text).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(rules.source, f"{rules.text}: {exc.strerror}") from None
    try:
        document = yaml.safe_load(text)
        items = document.get("rules") if isinstance(document, dict) else document
        return default_table().with_rules_first(parse_rules(items, source="diagnosis rules"))
    except yaml.YAMLError as exc:
        raise ConfigError(rules.source, f"not YAML or JSON: {exc}") from None
    except RuleError as exc:
        raise ConfigError(rules.source, str(exc)) from None


def config_or_exit(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    stderr: TextIO | None = None,
) -> AgentConfig:
    """`parse_args` for a `main`: bad input prints `dlworker: error: <flag>:
    <problem>` on one line and exits with code 2, like argparse."""
    try:
        return parse_args(
            sys.argv[1:] if argv is None else argv, os.environ if environ is None else environ
        )
    except ConfigError as exc:
        print(f"dlworker: error: {exc}", file=stderr or sys.stderr)
        raise SystemExit(2) from None
