"""The ShardedDataLoader: a DataLoader fed by shards the dlfleet master leases
(see loader.py for the modes and their guarantees)."""

from dlfleet.worker.loader.environment import LoaderEnvironment, LoaderMode
from dlfleet.worker.loader.loader import ShardedDataLoader

__all__ = ["LoaderEnvironment", "LoaderMode", "ShardedDataLoader"]
