"""What a master runs with: every default of its settings, written once.

`RunSettings` holds the settings a master takes from its command line (and a
job takes from job.yaml): lease, heartbeat, rendezvous and node-check timing,
the node range and the restart-loop breaker's. `add_arguments` builds
`dlmaster`'s flags from it, and `to_argv` gives the flags back, so a job
supervisor starts its master with exactly these values. The cores' settings (`LivenessSettings`,
`RendezvousSettings`, ...) take their defaults from `STANDALONE` and are built
from a `RunSettings` by `dlmaster` (`__main__`).

The checks of these settings (`check_heartbeat`, `check_nodes`,
`check_node_unit`) are here too, once: each edge (a flag, a job.yaml field, a
core's settings) calls them with its own names for the fields.

A job.yaml job's master and a standalone master differ in three defaults; the
difference is `JOB_DEFAULTS`, and why is said there.

Plain values and `argparse` only: the cores import this module.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dlfleet.api.errors import InvalidArgument


def check_heartbeat(
    interval_s: float,
    timeout_s: float,
    *,
    names: tuple[str, str] = ("heartbeat_interval_s", "heartbeat_timeout_s"),
) -> None:
    """A node is dropped only after it missed beats: the timeout is longer
    than the interval."""
    if timeout_s <= interval_s:
        interval, timeout = names
        raise InvalidArgument(
            f"{timeout} ({timeout_s}) must be longer than {interval} ({interval_s})"
        )


def check_nodes(
    min_nodes: int, max_nodes: int, *, names: tuple[str, str] = ("min_nodes", "max_nodes")
) -> None:
    low, high = names
    if min_nodes < 1:
        raise InvalidArgument(f"{low} must be at least 1, got {min_nodes}")
    if max_nodes < min_nodes:
        raise InvalidArgument(f"{high} ({max_nodes}) must be at least {low} ({min_nodes})")


def check_node_unit(
    node_unit: int, min_nodes: int, max_nodes: int, *, name: str = "node_unit"
) -> None:
    """Some world size in min..max nodes is a multiple of `node_unit`."""
    if node_unit < 1:
        raise InvalidArgument(f"{name} must be at least 1, got {node_unit}")
    if max_nodes // node_unit * node_unit < min_nodes:
        raise InvalidArgument(
            f"{name} {node_unit} leaves no world size in {min_nodes}..{max_nodes} nodes "
            f"(no multiple of node_unit {node_unit} lies there)"
        )


def _flag(name: str, text: str) -> dict[str, str]:
    """A field's flag and its help; `{default}` in `text` becomes the default."""
    return {"flag": name, "help": text}


@dataclass(frozen=True)
class RunSettings:
    lease_timeout_s: float = field(
        default=30.0, metadata=_flag("--lease-timeout", "seconds (default {default})")
    )
    heartbeat_interval_s: float = field(
        default=5.0,
        metadata=_flag("--heartbeat-interval", "agents beat every N s (default {default})"),
    )
    heartbeat_timeout_s: float = field(
        default=30.0,
        metadata=_flag(
            "--heartbeat-timeout", "a node silent this long is dropped, seconds (default {default})"
        ),
    )
    min_nodes: int = field(default=1, metadata=_flag("--min-nodes", "smallest world (default 1)"))
    # None: min_nodes (see `world_max`).
    max_nodes: int | None = field(
        default=None, metadata=_flag("--max-nodes", "largest world (default min)")
    )
    node_unit: int = field(
        default=1, metadata=_flag("--node-unit", "world size is a multiple of this")
    )
    last_call_timeout_s: float = field(
        default=3.0,
        metadata=_flag(
            "--last-call-timeout",
            "seconds to wait for more nodes once min-nodes joined (default {default})",
        ),
    )
    join_timeout_s: float = field(
        default=600.0,
        metadata=_flag(
            "--join-timeout",
            "seconds a node waits for a round to form before giving up (default {default})",
        ),
    )
    node_check_slow_factor: float = field(
        default=2.0,
        metadata=_flag(
            "--node-check-slow-factor",
            "pre-flight node check: a node slower than this x the median of the others is "
            "faulty (default {default})",
        ),
    )
    node_check_timeout_s: float = field(
        default=30.0,
        metadata=_flag(
            "--node-check-timeout",
            "pre-flight node check: seconds each step of a node's check may take before the "
            "node counts as hung (default {default})",
        ),
    )

    restart_loop_failures: int = field(
        default=3,
        metadata=_flag(
            "--restart-loop-failures",
            "rounds failing again after restoring the same step before restores take an "
            "older one; none older left fails the job (0: off; default {default})",
        ),
    )
    restart_loop_window: int = field(
        default=2,
        metadata=_flag(
            "--restart-loop-window",
            "steps past the restored one a round may commit and still count as failing "
            "at the same step (default {default})",
        ),
    )

    def __post_init__(self) -> None:
        for name in ("restart_loop_failures", "restart_loop_window"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lease_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
        check_heartbeat(self.heartbeat_interval_s, self.heartbeat_timeout_s)
        check_nodes(self.min_nodes, self.world_max)
        check_node_unit(self.node_unit, self.min_nodes, self.world_max)

    @classmethod
    def for_job(cls, **values: Any) -> RunSettings:
        """A job.yaml job's master: `JOB_DEFAULTS` where `values` say nothing."""
        return cls(**{**JOB_DEFAULTS, **values})

    @property
    def world_max(self) -> int:
        return self.max_nodes if self.max_nodes is not None else self.min_nodes

    @property
    def lease_timeout_ms(self) -> int:
        return _ms(self.lease_timeout_s)

    @property
    def heartbeat_interval_ms(self) -> int:
        return _ms(self.heartbeat_interval_s)

    @property
    def heartbeat_timeout_ms(self) -> int:
        return _ms(self.heartbeat_timeout_s)

    @property
    def last_call_timeout_ms(self) -> int:
        return _ms(self.last_call_timeout_s)

    @property
    def join_timeout_ms(self) -> int:
        return _ms(self.join_timeout_s)

    @property
    def node_check_timeout_ms(self) -> int:
        return _ms(self.node_check_timeout_s)

    def to_argv(self) -> list[str]:
        """The `dlmaster` flags that give a master these settings (every one,
        so that a default of the master never decides for a job)."""
        argv: list[str] = []
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if item.name == "max_nodes":
                value = self.world_max
            argv += [item.metadata["flag"], str(value)]
        return argv

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Its flags, with `STANDALONE`'s defaults; `from_args` reads them."""
        for item in dataclasses.fields(cls):
            default = getattr(STANDALONE, item.name)
            kind = int if item.name in _INTEGERS else float
            parser.add_argument(
                item.metadata["flag"],
                dest=item.name,
                metavar=item.metadata["flag"].lstrip("-").replace("-", "_").upper(),
                type=kind,
                default=default,
                help=item.metadata["help"].format(
                    default=f"{default:g}" if default is not None else ""
                ),
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunSettings:
        """From `add_arguments`' flags; InvalidArgument names what is wrong."""
        return cls(**{item.name: getattr(args, item.name) for item in dataclasses.fields(cls)})


_INTEGERS = frozenset(
    ("min_nodes", "max_nodes", "node_unit", "restart_loop_failures", "restart_loop_window")
)


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


# A job.yaml job's master differs from a standalone `dlmaster` here. Its
# supervisor launched every node itself and replaces a lost one: noticing a
# dead node in 10 s rather than 30 shortens every recovery, at the cost of a
# beat every 2 s from each of its nodes. Its nodes start together, so a round
# need not wait 3 s for late joiners. A standalone master serves agents
# started by hand or by another scheduler, which come and beat less promptly.
JOB_DEFAULTS: dict[str, Any] = {
    "heartbeat_interval_s": 2.0,
    "heartbeat_timeout_s": 10.0,
    "last_call_timeout_s": 1.0,
}

STANDALONE = RunSettings()
FOR_JOB = RunSettings.for_job()
