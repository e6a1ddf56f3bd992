"""The client agents and loaders use to talk to the master.

Every call has a deadline and rides out a master that restarts under a
bounded retry budget (`channel`); leases go shard after shard on one stream
(`leases`); a node's heartbeats, pushes and joins share its session
(`session`); `MasterClient` (`master`) has one method per call. All of it runs
on one I/O loop per process (`loop`). Callers that branch on what the master
answered get it as a type (`answers`), never as a oneof to decode.

The client is thread-safe (one channel, many threads), except a
`LeaseSession`, which belongs to one consumer thread.
"""

from dlfleet.api.client.answers import (
    CheckCompute,
    CheckOrder,
    CheckPair,
    CheckPoll,
    CheckVerdict,
    EndOfDataset,
    EndOfEpoch,
    LeaseAnswer,
    Leased,
    ReRendezvous,
    UnexpectedAnswer,
    Wait,
)
from dlfleet.api.client.channel import MAX_DETAILS_LOGGED, RetryPolicy, channel_credentials
from dlfleet.api.client.leases import LeaseSession, rank_lease_request, round_lease_request
from dlfleet.api.client.master import MasterClient
from dlfleet.api.client.session import AgentSession, join_request

__all__ = [
    "MAX_DETAILS_LOGGED",
    "AgentSession",
    "CheckCompute",
    "CheckOrder",
    "CheckPair",
    "CheckPoll",
    "CheckVerdict",
    "EndOfDataset",
    "EndOfEpoch",
    "LeaseAnswer",
    "LeaseSession",
    "Leased",
    "MasterClient",
    "ReRendezvous",
    "RetryPolicy",
    "UnexpectedAnswer",
    "Wait",
    "channel_credentials",
    "join_request",
    "rank_lease_request",
    "round_lease_request",
]
